"""Memory of a large training manifest: Arrow table vs `ManifestArrays` vs one Python dict per row.

What it does:
1. Builds a synthetic manifest of `--rows` rows (default 10,000,000) in `MANIFEST_SCHEMA`, fully
   vectorised: ids ``seg_000000001``..., 6 languages (en, hi, bn, mr, ta, te; skewed weights),
   durations log-normal around 4 s clipped to [0.5, 20] s, absolute audio paths
   ``/data/shards/<lang>_<k>/audio/<id>.flac`` (5,000 rows per shard), and texts in each
   language's script of about 12 characters per second of audio, taken from a pool of 20,000
   sentences per language (every row still owns its own copy of the bytes, as after a real build).
   It writes the table to parquet (zstd) in a temporary folder.
2. In a fresh child process, loads that parquet with `load_source` and measures the resident set
   (psutil RSS, after gc) before and after, then the extra RSS of `manifest_arrays`, then the RSS
   left once the table is dropped and only the arrays are kept. The Arrow figures are also given as
   `table.nbytes` and Arrow's allocated bytes, which do not depend on the allocator's caching.
   RSS is read after gc, once Arrow's allocation total is steady (parquet reader threads free their
   buffers a moment after `read_table` returns) and after glibc's malloc_trim; Arrow uses the system
   allocator in the children.
3. In another child, turns the first `--dict-rows` rows (default 1,000,000) into a list of per-row
   Python dicts (``table.to_pylist()``, what a naive reader would hold) and measures the RSS
   delta; the 10M figure for dicts is that delta times rows / dict-rows (linear extrapolation:
   every row owns the same kinds of objects, so the cost per row does not depend on the count).

Run: ``python benchmarks/bench_manifest_memory.py [--rows N] [--dict-rows M] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speechlm.data.manifest import MANIFEST_SCHEMA, build_manifest_table, manifest_arrays
from speechlm.data.sources.detect import load_source

LANGS = ("bn", "en", "hi", "mr", "ta", "te")
WEIGHTS = (0.12, 0.35, 0.25, 0.1, 0.1, 0.08)
# letters (consonants) and vowel signs of each script; en uses plain lowercase Latin
SCRIPTS = {
    "bn": (range(0x0995, 0x09B9), range(0x09BE, 0x09C4)),
    "hi": (range(0x0915, 0x0939), range(0x093E, 0x094C)),
    "mr": (range(0x0915, 0x0939), range(0x093E, 0x094C)),
    "ta": (range(0x0B95, 0x0BB9), range(0x0BBE, 0x0BC2)),
    "te": (range(0x0C15, 0x0C39), range(0x0C3E, 0x0C4C)),
}
CHARS_PER_SECOND = 12
ROWS_PER_SHARD = 5000
POOL = 20000


def rss() -> int:
    """Resident bytes once Arrow's background reader threads have let go of their buffers (the
    allocated total is steady for 0.5 s), after gc and, with glibc, malloc_trim."""
    gc.collect()
    deadline, last, steady_since = time.monotonic() + 10, -1, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - steady_since < 0.5:
        now = pa.total_allocated_bytes()
        if now != last:
            last, steady_since = now, time.monotonic()
        time.sleep(0.05)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss


def make_sentence_pool(lang: str, rng: np.random.Generator) -> list[str]:
    """POOL tagged sentences of 5..260 characters in `lang`'s script, sorted by length (vectorised:
    one array of code points, a space at 1 in 5 positions, cut into sentences)."""
    lengths = np.sort(rng.integers(5, 260, POOL))
    total = int(lengths.sum())
    if lang == "en":
        chars = rng.integers(ord("a"), ord("z") + 1, total)
    else:  # consonant, vowel sign, consonant, vowel sign, ...
        consonants, signs = (np.asarray(r) for r in SCRIPTS[lang])
        chars = np.where(np.arange(total) % 2 == 0, rng.choice(consonants, total), rng.choice(signs, total))
    chars[rng.random(total) < 0.2] = ord(" ")
    text = chars.astype("<u4").tobytes().decode("utf-32-le")
    ends = np.cumsum(lengths)
    return [f"<|{lang}|> " + " ".join(text[e - n : e].split()) for n, e in zip(lengths, ends)]


def build_synthetic_manifest(n: int, seed: int = 0) -> pa.Table:
    """A manifest table of `n` rows in `MANIFEST_SCHEMA` (see the module docstring), vectorised."""
    rng = np.random.default_rng(seed)
    lang = rng.choice(len(LANGS), size=n, p=WEIGHTS).astype(np.int64)
    durations = np.clip(rng.lognormal(np.log(4.0), 0.6, n), 0.5, 20.0).astype(np.float32)
    ids = pc.binary_join_element_wise(
        "seg_", pc.utf8_lpad(pa.array(np.arange(1, n + 1)).cast(pa.string()), width=9, padding="0"), ""
    )
    shard = np.arange(n) // ROWS_PER_SHARD
    shard_lang = lang[shard * ROWS_PER_SHARD]  # a shard is named after its first row's language
    num_shards = int(shard[-1]) + 1 if n else 0
    shard_names = [f"{LANGS[shard_lang[k * ROWS_PER_SHARD]]}_{k:05d}" for k in range(num_shards)]
    shard_ids = pa.DictionaryArray.from_arrays(pa.array(shard.astype(np.int32)), pa.array(shard_names))
    prefixes = pa.array([f"/data/shards/{name}/audio/" for name in shard_names])
    paths = pc.binary_join_element_wise(pc.take(prefixes, pa.array(shard)), ids, ".flac", "")

    pools = [make_sentence_pool(code, rng) for code in LANGS]
    pool_lengths = [np.array([len(s) for s in p]) for p in pools]
    target = (durations * CHARS_PER_SECOND * rng.uniform(0.8, 1.2, n)).astype(np.int64)
    pick = np.empty(n, np.int64)
    for i in range(len(LANGS)):
        rows = np.flatnonzero(lang == i)
        pick[rows] = i * POOL + np.minimum(np.searchsorted(pool_lengths[i], target[rows]), POOL - 1)
    texts = pc.take(pa.array([s for p in pools for s in p], pa.string()), pa.array(pick))
    langs = pa.DictionaryArray.from_arrays(pa.array(lang.astype(np.int8)), pa.array(LANGS))
    return build_manifest_table(ids, paths, durations, texts, langs, shard_ids=shard_ids, source="shards")


def child_measure_table(path: str) -> dict[str, float]:
    base = rss()
    t0 = time.perf_counter()
    table = load_source(path)
    load_s = time.perf_counter() - t0
    with_table = rss()
    arrow_bytes = pa.total_allocated_bytes()
    per_column = {name: table.column(name).nbytes for name in table.column_names}
    t0 = time.perf_counter()
    arrays = manifest_arrays(table)
    arrays_s = time.perf_counter() - t0
    with_arrays = rss()
    arrays_bytes = arrays.durations.nbytes + arrays.lang_codes.nbytes + arrays.text_lengths.nbytes
    nbytes = table.nbytes
    del table
    only_arrays = rss()
    return {
        "rows": len(arrays),
        "load_s": load_s,
        "table_rss": with_table - base,
        "table_nbytes": nbytes,
        "arrow_allocated": arrow_bytes,
        "arrays_s": arrays_s,
        "arrays_rss": with_arrays - with_table,
        "arrays_nbytes": arrays_bytes,
        "only_arrays_rss": only_arrays - base,
        "per_column": per_column,
    }


def child_measure_dicts(path: str, rows: int) -> dict[str, float]:
    head = pq.ParquetFile(path).iter_batches(batch_size=rows, columns=MANIFEST_SCHEMA.names)
    batch = pa.Table.from_batches([next(head)])
    del head
    base = rss()
    records = batch.to_pylist()
    delta = rss() - base
    return {"rows": len(records), "dicts_rss": delta}


def run_child(*args: str) -> dict[str, float]:
    # the system allocator returns freed blocks to the OS, so RSS shows what is held, not cached
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dict-rows", type=int, default=1_000_000)
    parser.add_argument("--keep", help="write the parquet here instead of a temporary folder")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, *rest = args.child
        result = child_measure_table(path) if mode == "table" else child_measure_dicts(path, int(rest[0]))
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "synthetic_manifest.parquet"
        t0 = time.perf_counter()
        table = build_synthetic_manifest(args.rows)
        build_s = time.perf_counter() - t0
        hours = float(pc.sum(table.column("duration")).as_py()) / 3600
        pq.write_table(table, path, compression="zstd")
        del table
        gc.collect()
        table_stats = run_child("table", str(path))
        dict_stats = run_child("dicts", str(path), str(args.dict_rows))

    n = table_stats["rows"]
    per_row_dict = dict_stats["dicts_rss"] / dict_stats["rows"]
    print(
        f"synthetic manifest: {n:,} rows, {hours:,.0f} h, {len(LANGS)} languages; built in {build_s:.1f} s; "
        f"load_manifest {table_stats['load_s']:.1f} s, "
        f"manifest_arrays {table_stats['arrays_s']:.2f} s"
    )
    columns = ", ".join(f"{k} {v / n:.1f}" for k, v in table_stats["per_column"].items())
    print(f"Arrow bytes per row by column: {columns}")
    print("RSS deltas measured with psutil after gc, in fresh processes, Arrow on the system allocator")
    print()
    rows = [
        (
            "Arrow table (load_manifest)",
            table_stats["table_rss"],
            f"nbytes {mib(table_stats['table_nbytes'])}, Arrow allocated {mib(table_stats['arrow_allocated'])}",
        ),
        (
            "manifest_arrays (on top of the table)",
            table_stats["arrays_rss"],
            f"nbytes {mib(table_stats['arrays_nbytes'])}",
        ),
        ("manifest_arrays alone (table dropped)", table_stats["only_arrays_rss"], ""),
        (f"list of dicts, {dict_stats['rows']:,} rows (measured)", dict_stats["dicts_rss"], ""),
        (f"list of dicts, {n:,} rows (x{n / dict_stats['rows']:g}, extrapolated)", per_row_dict * n, ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'RSS':>11}  {'bytes/row':>9}  note")
    for name, size, note in rows:
        count = dict_stats["rows"] if "measured" in name else n
        print(f"{name:<{width}}  {mib(size):>11}  {size / count:>9.1f}  {note}")


if __name__ == "__main__":
    main()
