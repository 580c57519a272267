"""Peak memory of `speechlm plan` on a large parquet manifest: whole columns vs batch by batch.

What it does:
1. Builds the synthetic manifest of `bench_manifest_memory` (default 10,000,000 rows: ids, absolute
   paths, native-script texts, 6 languages, log-normal durations) and writes it to parquet.
2. Runs `speechlm plan --manifest FILE --dp-size 8` in fresh processes and reads each one's own peak
   RSS (`VmHWM` from /proc, which unlike `ru_maxrss` does not carry the parent's over fork):
   - `columns`: the reader before 2026-11-23, `pq.read_table` of duration, lang and text, then the
     text lengths (kept here as the baseline, patched in for the run);
   - `batches`: today's `read_plan_inputs`, which reads row groups in batches of 256k rows and keeps
     only each text's length.
   The plan, its summary and the padding figures are computed the same way in both; Arrow uses its
   default memory pool, as in a user's run.

Run: ``speechlm bench plan-memory [--rows N]`` (= ``python benchmarks/bench_plan_memory.py``).
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


def child(mode: str, path: str) -> dict[str, float]:
    import speechlm.data.plan as plan
    from speechlm.cli import main

    if mode == "columns":
        plan.read_plan_inputs = _columns_reader  # type: ignore[assignment]
    t0 = time.perf_counter()
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            rc = main(["plan", "--manifest", path, "--dp-size", "8"])
        finally:
            sys.stdout = stdout
    hwm = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM"))
    return {"rc": rc, "seconds": time.perf_counter() - t0, "peak_rss": int(hwm.split()[1]) * 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "manifest.parquet"
        pq.write_table(build_synthetic_manifest(args.rows), path, compression="zstd")
        print(f"synthetic manifest: {args.rows:,} rows, {path.stat().st_size / 2**20:,.0f} MiB", flush=True)
        results = {}
        for mode in ("columns", "batches"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, str(path)], capture_output=True, text=True
            )
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode] = r
            print(f"{mode:>8}: peak RSS {r['peak_rss'] / 2**20:,.0f} MiB, {r['seconds']:.1f} s", flush=True)
    ratio = results["columns"]["peak_rss"] / results["batches"]["peak_rss"]
    print(f"batch by batch: {ratio:.2f}x less peak memory")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
