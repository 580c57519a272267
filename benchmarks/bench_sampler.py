"""Benchmark: vectorised epoch planning (`build_epoch_plan`) against the per-row Python design.

    speechlm bench sampler [--rows 10000000] [--reference-rows 1000000] [--repeats 3] [--json FILE]
    speechlm bench sampler --lhotse [--lhotse-rows 100000] [--json FILE]
    python benchmarks/bench_sampler.py --rows 1000000

A synthetic manifest (6 languages with skewed shares, durations 0.5-20 s) is planned for 8 dp
ranks with grad_accum 4 in both modes. We report the wall and CPU time of each plan (best of
`--repeats`), the peak extra memory (tracemalloc, which sees numpy's buffers, and the RSS
sampled every 10 ms), and the same for `reference_epoch_plan`: a faithful row-at-a-time Python version of the inherited exhaustive
algorithm (steps 1-7 of speechlm/data/sampler/epoch_plan.py, one dict per row), which the tests also use as
the oracle for the vectorised exhaustive mode. Its memory is measured by sampling the process RSS,
since tracemalloc would slow its millions of small allocations several times over.

`--lhotse` runs instead the side-by-side with Lhotse's `DynamicBucketingSampler` (bench_sampler_lhotse.py:
time, memory, micro-batches and padded efficiency of one epoch, each sampler in its own process).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import psutil

from speechlm.data.sampler import DEFAULT_BUCKET_BOUNDARIES, SECOND_UNITS, SamplerSettings, build_epoch_plan

LANG_SHARES = (0.55, 0.25, 0.10, 0.06, 0.03, 0.01)
LANG_NAMES = ("en", "de", "fr", "es", "sw", "yo")


def make_synthetic_manifest(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Durations (float32, 0.5-20 s, log-normal around 5 s) and skewed language codes (int8)."""
    rng = np.random.default_rng(seed)
    lang_codes = rng.choice(len(LANG_SHARES), size=rows, p=np.asarray(LANG_SHARES)).astype(np.int8)
    durations = np.clip(rng.lognormal(math.log(5.0), 0.6, rows), 0.5, 20.0).astype(np.float32)
    return durations, lang_codes, list(LANG_NAMES)


def reference_epoch_plan(
    durations: Sequence[float],
    lang_codes: Sequence[int],
    *,
    dp_size: int,
    grad_accum: int,
    temperature: float = 0.3,
    max_batch_duration: float = 90.0,
    bucket_boundaries: Sequence[float] = DEFAULT_BUCKET_BOUNDARIES,
    seed: int = 0,
    epoch: int = 0,
    uniforms: Sequence[float] | None = None,
    rank_permutation: Sequence[int] | None = None,
) -> list[list[list[int]]]:
    """The inherited exhaustive algorithm, one row at a time. Returns ranks -> batches -> rows.

    `uniforms` (U per row) and `rank_permutation` (step 6) let a test feed the draws of the
    vectorised version; by default they come from Python's `random`. Durations are compared in
    integer microseconds, as the vectorised version does, so both agree exactly.
    """
    rnd = random.Random(seed * 1_000_003 + epoch)
    rows = [
        {"index": i, "duration": float(d), "lang": int(c)}
        for i, (d, c) in enumerate(zip(durations, lang_codes))
    ]
    # 1. buckets
    buckets: list[list[dict[str, Any]]] = [[] for _ in range(len(bucket_boundaries) + 1)]
    for row in rows:
        buckets[bisect.bisect_right(bucket_boundaries, row["duration"])].append(row)
    # 2. temperature weights: target / actual
    counts = Counter(row["lang"] for row in rows)
    if temperature <= 0:
        target = {lang: 1.0 / len(counts) for lang in counts}
    else:
        norm = sum(c**temperature for c in counts.values())
        target = {lang: c**temperature / norm for lang, c in counts.items()}
    weight = {lang: target[lang] / (counts[lang] / len(rows)) for lang in counts}
    # 3. order inside each bucket by U^(1/w), descending
    for row in rows:
        u = uniforms[row["index"]] if uniforms is not None else rnd.random()
        row["key"] = u ** (1.0 / weight[row["lang"]])
    for bucket in buckets:
        bucket.sort(key=lambda r: r["key"], reverse=True)
    # 4. greedy packing to the duration budget
    budget = math.floor(max_batch_duration * SECOND_UNITS)
    batches: list[list[dict[str, Any]]] = []
    for bucket in buckets:
        current: list[dict[str, Any]] = []
        total = 0
        for row in bucket:
            cost = math.ceil(row["duration"] * SECOND_UNITS)
            if current and total + cost > budget:
                batches.append(current)
                current, total = [], 0
            current.append(row)
            total += cost
        if current:
            batches.append(current)
    # 5. cost sort, drop the tail, round-robin over ranks
    batches.sort(key=lambda b: len(b) * max(r["duration"] for r in b), reverse=True)
    keep = len(batches) // dp_size * dp_size
    ranks = [batches[r:keep:dp_size] for r in range(dp_size)]
    # 6. trim to a multiple of grad_accum, shuffle (one permutation for all ranks)
    per_rank = len(ranks[0]) // grad_accum * grad_accum
    if rank_permutation is None:
        perm = list(range(per_rank))
        rnd.shuffle(perm)
    else:
        perm = list(rank_permutation)
    return [[[row["index"] for row in rank[j]] for j in perm] for rank in ranks]


class PeakRss:
    """Samples this process's RSS in a thread; `peak_extra` is the peak above the starting value."""

    def __init__(self, interval: float = 0.01) -> None:
        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.base = self.peak = 0

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def peak_extra(self) -> int:
        return self.peak - self.base


def time_call(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Best wall and best CPU seconds over `repeats` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def measure_vectorised(
    durations: np.ndarray, lang_codes: np.ndarray, mode: str, repeats: int, dp_size: int, grad_accum: int
) -> dict[str, Any]:
    def plan() -> Any:
        settings = SamplerSettings(dp_size=dp_size, grad_accum=grad_accum, mode=mode)
        return build_epoch_plan(durations, lang_codes, settings)

    wall, cpu = time_call(plan, repeats)
    with PeakRss() as rss:
        plan()
    tracemalloc.start()
    result = plan()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "impl": f"vectorised {mode}",
        "rows": len(durations),
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_extra_mb": peak / 1e6,
        "peak_rss_extra_mb": rss.peak_extra / 1e6,
        "batches_per_rank": result.batches_per_rank,
    }


def measure_reference(
    durations: np.ndarray, lang_codes: np.ndarray, dp_size: int, grad_accum: int
) -> dict[str, Any]:
    dur_list, lang_list = durations.tolist(), lang_codes.tolist()
    with PeakRss() as rss:
        w, c = time.perf_counter(), time.process_time()
        ranks = reference_epoch_plan(dur_list, lang_list, dp_size=dp_size, grad_accum=grad_accum)
        wall, cpu = time.perf_counter() - w, time.process_time() - c
    return {
        "impl": "per-row Python exhaustive",
        "rows": len(durations),
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_extra_mb": None,  # tracemalloc would slow millions of small allocations several fold
        "peak_rss_extra_mb": rss.peak_extra / 1e6,
        "batches_per_rank": len(ranks[0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speechlm bench sampler", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="manifest rows for the vectorised plans")
    parser.add_argument(
        "--reference-rows",
        type=int,
        default=1_000_000,
        help="manifest rows for the per-row Python reference (0 skips it)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per vectorised plan (best is kept)"
    )
    parser.add_argument("--dp-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--lhotse",
        action="store_true",
        help="instead: side by side with Lhotse's DynamicBucketingSampler (bench_sampler_lhotse.py)",
    )
    parser.add_argument("--lhotse-rows", type=int, default=100_000, help="utterances for --lhotse")
    args = parser.parse_args(argv)
    if args.lhotse:
        from bench_sampler_lhotse import compare

        return compare(args.lhotse_rows, args.json)

    print(
        f"machine: {psutil.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in psutil.getloadavg())}"
    )
    results = []
    durations, lang_codes, _ = make_synthetic_manifest(args.rows)
    for mode in ("temperature", "exhaustive"):
        results.append(
            measure_vectorised(durations, lang_codes, mode, args.repeats, args.dp_size, args.grad_accum)
        )
    if args.reference_rows:
        if args.reference_rows != args.rows:
            durations, lang_codes, _ = make_synthetic_manifest(args.reference_rows)
            results.append(
                measure_vectorised(
                    durations, lang_codes, "exhaustive", args.repeats, args.dp_size, args.grad_accum
                )
            )
        results.append(measure_reference(durations, lang_codes, args.dp_size, args.grad_accum))

    print(
        f"{'implementation':<28}{'rows':>12}{'wall s':>9}{'cpu s':>9}{'traced MB':>11}{'RSS MB':>9}{'mb/rank':>9}"
    )
    for r in results:
        traced = "-" if r["peak_extra_mb"] is None else f"{r['peak_extra_mb']:.0f}"
        print(
            f"{r['impl']:<28}{r['rows']:>12,}{r['wall_s']:>9.2f}{r['cpu_s']:>9.2f}{traced:>11}"
            f"{r['peak_rss_extra_mb']:>9.0f}{r['batches_per_rank']:>9,}"
        )
    ref = next((r for r in results if r["impl"].startswith("per-row")), None)
    vec = next(
        (r for r in results if r["impl"] == "vectorised exhaustive" and ref and r["rows"] == ref["rows"]),
        None,
    )
    if ref and vec:
        print(
            f"per-row / vectorised exhaustive at {ref['rows']:,} rows: wall x{ref['wall_s'] / vec['wall_s']:.0f}, "
            f"cpu x{ref['cpu_s'] / vec['cpu_s']:.0f}, "
            f"peak RSS x{ref['peak_rss_extra_mb'] / max(vec['peak_rss_extra_mb'], 1.0):.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
