"""Dynamic CP placement on a synthetic speech manifest: padding, balance and ring traffic per cp.

Writes a manifest of ``--rows`` utterances with log-normal durations (median 5 s, sigma 0.8, clipped to
0.5 s and ``--max-seconds``) and ~12 characters of transcript per second, then runs ``speechlm plan``
on it (the trainer's own sampler, ``--max-batch-duration`` seconds per micro-batch) for every cp in
``--cp``, once with ``parallel.cp_split_threshold=auto`` and once with 0 (split every utterance, the
layout before dynamic CP), and prints, side by side:

- THD real/computed tokens (``padding.thd_efficiency``) for both;
- the busiest CP rank's modelled cost over the mean (``padding.cp_max_over_mean``);
- the tokens whose K/V travel on the ring, as a share of all computed tokens, and the ratio of K/V
  bytes sent per layer against splitting everything (ring bytes are proportional to those tokens:
  ``(cp - 1) * tokens * 2 * kv_heads * head_dim * bytes`` over the group, for either layout);
- the same three for hybrid CP degrees (`parallel.cp_placement.place_hybrid`: each utterance whole or
  split over an aligned sub-group of 2, 4, ..., cp ranks; ``THD hyb``, ``(hyb)``), which training does not
  run yet;
- the training path's placement cost: the mean wall time of one `place_sequences` call (what
  `DynamicCPLayout.place` runs on every rank for every micro-batch) over the plan's micro-batches,
  with ``auto``, in microseconds, and the most sequences one micro-batch holds (``--time-placement``;
  in ``--json`` always).

Usage: ``speechlm bench cp-placement [--rows N] [--max-seconds S] [--cp 2,4,8] [--time-placement]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def write_manifest(path: Path, rows: int, max_seconds: float, seed: int = 0) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    dur = np.clip(rng.lognormal(np.log(5.0), 0.8, rows), 0.5, max_seconds)
    langs = rng.choice(["en", "hi", "ta"], rows)
    text = ["x" * int(12 * d) for d in dur]
    table = pa.table(
        {
            "id": [f"u{i:07d}" for i in range(rows)],
            "audio_path": [f"/nonexistent/{i}.flac" for i in range(rows)],
            "duration": dur.astype(np.float32),
            "lang": langs,
            "text": text,
        }
    )
    pq.write_table(table, path)


class PlacementTimer:
    """Wraps `speechlm.data.plan.figures.place_sequences` (the function training's `DynamicCPLayout.place`
    calls) while a plan runs: calls, their total wall time, and the longest micro-batch placed."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.most_sequences = 0

    def __enter__(self) -> PlacementTimer:
        import speechlm.data.plan.figures as plan_module

        self._module, self._original = plan_module, plan_module.place_sequences

        def timed(lengths: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            placement = self._original(lengths, *args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            self.most_sequences = max(self.most_sequences, len(lengths))
            return placement

        plan_module.place_sequences = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        self._module.place_sequences = self._original  # type: ignore[assignment]

    @property
    def microseconds_per_call(self) -> float:
        return 1e6 * self.seconds / max(self.calls, 1)


def plan(manifest: Path, cp: int, threshold: str, budget_s: float, out: Path) -> dict[str, Any]:
    from speechlm.cli import main

    argv = ["plan", "--manifest", str(manifest), "--cp-size", str(cp), "--cp-split-threshold", threshold,
            "--max-batch-duration", str(budget_s), "--json", str(out)]  # fmt: skip
    if main(argv) != 0:
        raise RuntimeError(f"speechlm {' '.join(argv)} failed")
    summary = json.loads(out.read_text())
    return {**summary["padding"], "hybrid": summary["cp_layouts"]["hybrid"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench cp-placement", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument(
        "--max-seconds", type=float, default=20.0, help="clip the durations here (600: long tail)"
    )
    ap.add_argument("--max-batch-duration", type=float, default=90.0, help="seconds of audio per micro-batch")
    ap.add_argument(
        "--per-rank",
        action="store_true",
        help="scale the micro-batch with cp: cp x --max-batch-duration seconds",
    )
    ap.add_argument("--cp", default="2,4,8")
    ap.add_argument(
        "--time-placement",
        action="store_true",
        help="also print the mean wall time of one micro-batch's placement (training's per-step cost)",
    )
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    import contextlib
    import io

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "train.parquet"
        write_manifest(manifest, args.rows, args.max_seconds)
        for cp in [int(x) for x in args.cp.split(",")]:
            budget = args.max_batch_duration * (cp if args.per_rank else 1)
            with contextlib.redirect_stdout(io.StringIO()), PlacementTimer() as timer:
                dyn = plan(manifest, cp, "auto", budget, Path(tmp) / "a.json")
            with contextlib.redirect_stdout(io.StringIO()):
                old = plan(manifest, cp, "0", budget, Path(tmp) / "b.json")
            ring_dyn = dyn["cp_ring_token_share"] * dyn["thd_computed_tokens"]
            ring_old = old["cp_ring_token_share"] * old["thd_computed_tokens"]
            rows.append(
                {
                    "cp": cp,
                    "micro_batch_seconds": budget,
                    "threshold_tokens": dyn["cp_split_threshold"],
                    "thd_efficiency": dyn["thd_efficiency"],
                    "thd_efficiency_split_all": old["thd_efficiency"],
                    "bshd_efficiency": dyn["bshd_efficiency"],
                    "cp_max_over_mean": dyn["cp_max_over_mean"],
                    "cp_max_over_mean_split_all": old["cp_max_over_mean"],
                    "ring_token_share": dyn["cp_ring_token_share"],
                    "thd_efficiency_hybrid": dyn["hybrid"]["efficiency"],
                    "cp_max_over_mean_hybrid": dyn["hybrid"]["max_over_mean"],
                    "ring_token_share_hybrid": dyn["hybrid"]["ring_token_share"],
                    "kv_bytes_vs_split_all": ring_dyn / max(ring_old, 1.0),
                    "place_us_per_micro_batch": timer.microseconds_per_call,
                    "placed_micro_batches": timer.calls,
                    "most_sequences_per_micro_batch": timer.most_sequences,
                }
            )
            print(f"cp={cp} done", flush=True)
    print(
        f"\n{args.rows:,} utterances, log-normal median 5 s clipped to 0.5-{args.max_seconds:g} s, "
        f"{args.max_batch_duration:g} s micro-batches" + (" per CP rank" if args.per_rank else "")
    )
    print(f"{'cp':>3} {'split >':>8} {'THD dyn':>8} {'THD all':>8} {'THD hyb':>8} {'BSHD':>6} {'max/mean':>9} "
          f"{'(all)':>6} {'(hyb)':>6} {'ring tok':>9} {'(hyb)':>6} {'K/V vs all':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['cp']:>3} {r['threshold_tokens']:>8} {100 * r['thd_efficiency']:>7.1f}% "
            f"{100 * r['thd_efficiency_split_all']:>7.1f}% {100 * r['thd_efficiency_hybrid']:>7.1f}% "
            f"{100 * r['bshd_efficiency']:>5.1f}% {r['cp_max_over_mean']:>9.3f} "
            f"{r['cp_max_over_mean_split_all']:>6.3f} {r['cp_max_over_mean_hybrid']:>6.3f} "
            f"{100 * r['ring_token_share']:>8.1f}% {100 * r['ring_token_share_hybrid']:>5.1f}% "
            f"{r['kv_bytes_vs_split_all']:>10.3f}x"
        )
    if args.time_placement:  # a measurement, so not in the table above (docs/benchmarks.md checks that)
        print("\nplacement per micro-batch (`place_sequences`, auto), as training runs it on every rank:")
        print(f"{'cp':>3} {'micro-batches':>14} {'most seqs':>10} {'us each':>8}")
        for r in rows:
            print(
                f"{r['cp']:>3} {r['placed_micro_batches']:>14,} {r['most_sequences_per_micro_batch']:>10} "
                f"{r['place_us_per_micro_batch']:>8.0f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
