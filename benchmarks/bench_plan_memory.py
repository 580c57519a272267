"""Time and peak memory of `speechlm plan` on a large parquet manifest, against two earlier designs.

What it does:
1. Builds the synthetic manifest of `bench_manifest_memory` (default 10,000,000 rows: ids, absolute
   paths, native-script texts, 6 languages, log-normal durations) and writes it to parquet.
2. Runs `speechlm plan --manifest FILE --dp-size 8` in fresh processes and reads each one's own peak
   RSS (`VmHWM` from /proc, which unlike `ru_maxrss` does not carry the parent's over fork):
   - `columns`: the reader before 2026-11-23, `pq.read_table` of duration, lang and text, then the
     text lengths (kept here as the baseline, patched in for the run);
   - `per-batch-cp`: today's reader, but the padding summary places every micro-batch's sequences
     with `place_sequences` one micro-batch at a time, even at cp = 1 (`per_batch_cp_padding`, the
     summary before 2026-11-27, patched in for the run);
   - `now`: today's reader (`speechlm.data.plan.inputs`: row groups in batches, only each text's length
     kept, read on a second thread while the epoch plan is built) and the vectorised `cp_padding`.
   Arrow uses its default memory pool, as in a user's run. Each mode's wall time is that of
   `speechlm.cli.main(["plan", ...])` inside the child (imports excluded), with its CPU time (all
   threads: `speechlm plan` reads the texts on a second one). Each child starts with an
   empty cache folder (`SPEECHLM_CACHE`), so its first plan reads the texts ("cold"); with
   ``--repeats`` > 1 the best of the later plans, which read the text lengths `speechlm plan` kept
   (`speechlm.data.plan.inputs.text_chars_cache`), is reported as "warm" (the `columns` reader keeps none).
3. Prints time and peak RSS per mode, the ratios against `now`, and whether `now` met ``--budget-s``
   (a stated target, not a test: timings depend on the machine's load).

Run: ``speechlm bench plan-memory [--rows N] [--modes now,per-batch-cp,columns] [--budget-s S]``
(= ``python benchmarks/bench_plan_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manifest_memory import build_synthetic_manifest  # noqa: E402


def _columns_reader(path: str) -> object:
    """The pre-2026-11-23 reader: three whole columns in memory, then the lengths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from speechlm.data.sampler.build import SamplerInputs

    table = pq.read_table(path, columns=["duration", "lang", "text"])
    lang = table.column("lang")
    if pa.types.is_dictionary(lang.type):
        lang = lang.cast(lang.type.value_type)
    names = sorted(pc.unique(lang).to_pylist())
    codes = pc.index_in(lang, value_set=pa.array(names, type=lang.type)).to_numpy()
    return SamplerInputs(
        durations=table.column("duration").cast(pa.float32()).to_numpy(),
        lang_codes=codes.astype(np.int32),
        lang_names=names,
        text_chars=pc.utf8_length(table.column("text")).to_numpy().astype(np.int64),
    )


def per_batch_cp_padding(
    lengths: Any, batch_offsets: Any, cp: int, tp: int, threshold: int | str, pair_cost: float
) -> dict[str, Any]:
    """The padding summary before 2026-11-27: `place_sequences` on every micro-batch, at every cp (twice
    at cp > 1: with the threshold and with 0). Kept as the baseline, and as the oracle of
    tests/data/test_plan.py for the vectorised `speechlm.data.plan.figures.cp_padding`."""
    from parallel.cp_placement import place_sequences

    computed = computed_all = ring = 0
    worst = mean = 0.0
    for lo, hi in zip(batch_offsets[:-1], batch_offsets[1:]):
        seqs = [int(n) for n in lengths[lo:hi]]
        if not seqs:
            continue
        p = place_sequences(seqs, cp, threshold=threshold, tp=tp, pair_cost=pair_cost)
        computed += p.computed_tokens()
        ring += p.ring_tokens()
        worst += max(p.loads)
        mean += sum(p.loads) / cp
        computed_all += (
            place_sequences(seqs, cp, threshold=0, tp=tp).computed_tokens() if cp > 1 else p.computed_tokens()
        )
    return {
        "computed": computed,
        "computed_split_all": computed_all,
        "max_over_mean": worst / mean if mean else 1.0,
        "ring_tokens": ring,
    }


MODES = ("now", "per-batch-cp", "columns")


def child(mode: str, path: str, repeats: int = 1) -> dict[str, float]:
    import speechlm.data.plan.figures as plan
    import speechlm.data.plan.inputs as plan_inputs
    from speechlm.cli import main

    if mode == "columns":
        plan_inputs.read_plan_columns = lambda path: (_columns_reader(path), None)  # type: ignore[assignment]
    elif mode == "per-batch-cp":
        plan.cp_padding = per_batch_cp_padding  # type: ignore[assignment]
    # what `plan` imports lazily, imported before the clock starts (imports are not the plan's time)
    import pyarrow.compute  # noqa: F401

    import speechlm.config  # noqa: F401
    import speechlm.data.manifest.schema  # noqa: F401
    import speechlm.data.sampler.build  # noqa: F401
    import speechlm.data.sources.detect  # noqa: F401
    import speechlm.data.sources.mmap_cache  # noqa: F401

    seconds, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()  # CPU time of every thread of the process
        with open(os.devnull, "w") as devnull:
            stdout, sys.stdout = sys.stdout, devnull
            try:
                rc = main(["plan", "--manifest", path, "--dp-size", "8", "--mode", "exhaustive"])
            finally:
                sys.stdout = stdout
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    hwm = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM"))
    return {
        "rc": rc,
        "seconds": seconds[0],
        "cpu_seconds": cpu[0],
        "seconds_warm": min(seconds[1:]) if len(seconds) > 1 else None,
        "cpu_seconds_warm": cpu[1 + seconds[1:].index(min(seconds[1:]))] if len(seconds) > 1 else None,
        "peak_rss": int(hwm.split()[1]) * 1024,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="speechlm bench plan-memory",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows of the synthetic manifest")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument(
        "--repeats", type=int, default=1, help="plans per child: the first is cold, the best of the rest warm"
    )
    parser.add_argument("--budget-s", type=float, help="target wall time of `now` (reported, not enforced)")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, path, repeats = args.child
        print(json.dumps(child(mode, path, int(repeats))))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "manifest.parquet"
        pq.write_table(build_synthetic_manifest(args.rows), path, compression="zstd")
        print(f"synthetic manifest: {args.rows:,} rows, {path.stat().st_size / 2**20:,.0f} MiB", flush=True)
        results = {}
        for mode in modes:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, str(path), str(args.repeats)],
                capture_output=True,
                text=True,
                env={**os.environ, "SPEECHLM_CACHE": str(Path(tmp) / f"cache-{mode}")},  # cold
            )
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode] = r
            warm = (
                f", warm {r['seconds_warm']:.2f} s ({r['cpu_seconds_warm']:.2f} s CPU)"
                if r["seconds_warm"] is not None
                else ""
            )
            print(
                f"{mode:>12}: peak RSS {r['peak_rss'] / 2**20:,.0f} MiB, {r['seconds']:.2f} s "
                f"({r['cpu_seconds']:.2f} s CPU){warm}",
                flush=True,
            )
    if "now" in results:
        now = results["now"]
        for mode in (m for m in modes if m != "now"):
            r = results[mode]
            print(
                f"now vs {mode}: {r['seconds'] / now['seconds']:.1f}x faster, "
                f"{r['peak_rss'] / now['peak_rss']:.2f}x less peak memory"
            )
        if args.budget_s is not None:
            met = "met" if now["seconds"] <= args.budget_s else "NOT met"
            print(f"budget {args.budget_s:g} s for {args.rows:,} rows: {met} ({now['seconds']:.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
