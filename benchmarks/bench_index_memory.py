"""Index memory of a training rank, indexed mode: the whole manifest in RAM vs the memory-mapped index.

What it does:
1. Builds the synthetic manifest of `bench_manifest_memory` (default 10,000,000 rows: 6 languages,
   log-normal durations, native-script texts) as if it came from `speechlm shards write`: each row
   is a member of one of `rows / 1000` tars (``tar_path``, ``offset``, ``nbytes``, ``header_bytes``;
   ``audio_filepath`` is the member name). Writes it to parquet.
2. Child "cache": builds the memory-mapped index cache (`open_index`) once; its peak RSS is the
   cost of building it (batch by batch).
3. Child "memory" (today's path) and child "mmap" (the new one), each in a fresh process, measure RSS
   (psutil, after gc and malloc_trim, Arrow on the system allocator):
   - index: the training table plus `SpeechDataset` over it (everything a rank needs to load any
     clip by position), minus the RSS before;
   - sampler: `manifest_arrays` plus the rank's `DurationBucketBatchSampler` epoch plan (dp 8), on top;
   - touched: after looking up 20,000 random rows' text, id and locator, as loading clips does.
   Figures are bytes per utterance. Memory-mapped pages the process has touched count in its RSS
   (they are shared with every other process mapping the file, and the kernel may drop them).

Run: ``speechlm bench index-memory [--rows N]`` (= ``python benchmarks/bench_index_memory.py``).
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manifest_memory import build_synthetic_manifest, rss  # noqa: E402

PER_TAR = 1000


def synthetic_shard_index(n: int) -> pa.Table:
    table = build_synthetic_manifest(n)
    ids = table.column("segment_id")
    members = pa.compute.binary_join_element_wise(ids, ".flac", "")
    rng = np.random.default_rng(1)
    sizes = (table.column("duration").to_numpy() * 16000 * 2 * 0.6 * rng.uniform(0.9, 1.1, n)).astype(
        np.int64
    )
    tar = np.arange(n) // PER_TAR
    blocks = 512 + (sizes + 511) // 512 * 512
    starts = np.cumsum(blocks) - blocks
    first = starts[tar * PER_TAR]
    offsets = starts - first + 512
    names = pa.array([f"/data/tars/shard-{k:06d}.tar" for k in range(int(tar[-1]) + 1)])
    return (
        table.set_column(2, "audio_filepath", members)
        .append_column("tar_path", pa.DictionaryArray.from_arrays(pa.array(tar.astype(np.int32)), names))
        .append_column("offset", pa.array(offsets, pa.int64()))
        .append_column("nbytes", pa.array(sizes, pa.int64()))
        .append_column("header_bytes", pa.array(np.full(n, 512, np.uint16), pa.uint16()))
    )


class _Tok:
    pad_id = 0
    langs = ("bn", "en", "hi", "mr", "ta", "te")


def child(mode: str, path: str, cache: str) -> dict[str, float]:
    from speechlm.data.dataset import SpeechDataset
    from speechlm.data.manifest import manifest_arrays
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings
    from speechlm.data.sources.detect import load_source
    from speechlm.data.sources.mmap_cache import open_index

    if mode == "cache":
        t0 = time.perf_counter()
        open_index(path, cache_dir=cache)
        # VmHWM: this process's own peak (ru_maxrss would carry the parent's RSS over fork and exec)
        hwm = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM"))
        return {"build_s": time.perf_counter() - t0, "peak_rss": int(hwm.split()[1]) * 1024}
    base = rss()
    t0 = time.perf_counter()
    table = load_source(path) if mode == "memory" else open_index(path, cache_dir=cache)
    ds = SpeechDataset(table, _Tok())  # type: ignore[arg-type]
    open_s = time.perf_counter() - t0
    index = rss()
    arr = manifest_arrays(table)
    sampler = DurationBucketBatchSampler(
        arr.durations,
        arr.lang_codes,
        arr.lang_names,
        SamplerSettings(dp_size=8, mode="temperature"),
        dp_rank=0,
    )
    n_batches = len(sampler)
    with_sampler = rss()
    rng = np.random.default_rng(0)
    for i in rng.integers(0, len(ds), 20_000).tolist():
        ds._texts[i].as_py(), ds._describe(i), ds.resolve_path(i), ds._locators.sort_key(i)
    touched = rss()
    import psutil

    info = psutil.Process().memory_info()
    return {
        "shared_rss": info.shared,  # file-backed pages mapped and touched (the index cache, libraries)
        "rows": len(ds),
        "open_s": open_s,
        "index_rss": index - base,
        "sampler_rss": with_sampler - index,
        "touched_rss": touched - with_sampler,
        "batches": n_batches,
    }


def run_child(*args: str) -> dict[str, float]:
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard_manifest.parquet"
        t0 = time.perf_counter()
        pq.write_table(synthetic_shard_index(args.rows), path, compression="zstd")
        print(f"synthetic shard index: {args.rows:,} rows, {path.stat().st_size / 2**20:,.0f} MiB parquet "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        cache = str(Path(tmp) / "cache")
        built = run_child("cache", str(path), cache)
        print(
            f"index cache built in {built['build_s']:.0f} s, peak RSS {built['peak_rss'] / 2**20:,.0f} MiB",
            flush=True,
        )
        results = {"cache": built}
        for mode in ("memory", "mmap"):
            r = run_child(mode, str(path), cache)
            results[mode] = r
            n = r["rows"]
            print(
                f"{mode:>6}: index {r['index_rss'] / n:6.1f} B/utt, sampler {r['sampler_rss'] / n:5.1f} B/utt, "
                f"20k lookups +{r['touched_rss'] / 2**20:.0f} MiB (shared pages in all: "
                f"{r['shared_rss'] / 2**20:.0f} MiB), open {r['open_s']:.1f} s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
