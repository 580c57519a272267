"""`speechlm bench sampler --lhotse`: our epoch plan side by side with Lhotse's `DynamicBucketingSampler`.

The manifest: `--lhotse-rows` utterances (default 100,000), log-normal durations around 5 s clipped to
0.5-20 s, 12 languages with skewed shares; written once as a parquet manifest (what `speechlm plan`
reads) and as a Lhotse cut manifest (`cuts.jsonl.gz`, MonoCuts with one supervision, no audio: a
sampler reads durations only). Each sampler runs in a fresh process, one epoch, for 8 data-parallel
ranks with a 90-s budget per micro-batch:

- **ours**: what `speechlm plan` computes (read the parquet, `make_sampler` with the default config,
  `summarize_plan`; printing and imports excluded), once with the buckets estimated from the data (the
  default, 30) and once with the six fixed buckets of before (3, 5, 8, 12, 16 s). One process plans
  every rank.
- **Lhotse**: `CutSet.from_jsonl_lazy` then `DynamicBucketingSampler(max_duration=90, num_buckets=30,
  shuffle=True, world_size=8, rank=0)` (the sampler NeMo trains with; 30 buckets estimated from the
  first 10,000 cuts, its default), iterated to the end of the epoch. Each rank's process reads the
  whole cut manifest, so rank 0's time and memory are every rank's.

Reported per sampler: wall time of the epoch (reading included), peak RSS of the process (`VmHWM`)
and its RSS after the imports, micro-batches per rank, and the padded efficiency: real seconds over
B x the longest clip's seconds, summed over the micro-batches (rank 0's for Lhotse, every rank's for
ours).
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

LANGS = ("en", "de", "fr", "es", "it", "pt", "hi", "bn", "ta", "te", "sw", "yo")
SHARES = np.array([30, 15, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1], np.float64) / 100


def write_manifests(rows: int, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """The same utterances as a parquet manifest and as a Lhotse cut manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    durations = np.clip(rng.lognormal(math.log(5.0), 0.6, rows), 0.5, 20.0).astype(np.float32)
    langs = rng.choice(len(LANGS), size=rows, p=SHARES)
    parquet = folder / "train.parquet"
    pq.write_table(
        pa.table({"duration": durations, "lang": pa.array([LANGS[i] for i in langs]).dictionary_encode()}),
        parquet,
    )
    cuts = folder / "cuts.jsonl.gz"
    with gzip.open(cuts, "wt") as f:
        for i, (d, lang) in enumerate(zip(durations.tolist(), langs.tolist())):
            cut_id = f"u{i:08d}"
            sup = {"id": cut_id, "recording_id": cut_id, "start": 0.0, "duration": d, "channel": 0,
                   "language": LANGS[lang]}  # fmt: skip
            f.write(json.dumps({"id": cut_id, "start": 0.0, "duration": d, "channel": 0,
                                "supervisions": [sup], "type": "MonoCut"}) + "\n")  # fmt: skip
    return parquet, cuts


def _rss(field: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field))
    return int(line.split()[1]) * 1024


def padded_efficiency(batches: list[np.ndarray]) -> float:
    real = sum(float(b.sum(dtype=np.float64)) for b in batches)
    padded = sum(len(b) * float(b.max()) for b in batches)
    return real / padded if padded else 1.0


def run_ours(parquet: str, buckets: str) -> dict[str, Any]:
    from speechlm.config import load_config
    from speechlm.data.plan.figures import summarize_plan
    from speechlm.data.plan.inputs import read_plan_inputs
    from speechlm.data.sampler.build import make_sampler, sampler_settings

    overrides = ["sampler.max_batch_duration=90"]
    if buckets == "fixed":
        overrides.append("sampler.bucket_boundaries=[3, 5, 8, 12, 16]")
    cfg = load_config(None, overrides)
    settings = sampler_settings(cfg, dp_size=8)
    after_imports = _rss("VmRSS")
    t0 = time.perf_counter()
    inputs = read_plan_inputs(parquet)
    sampler = make_sampler(settings, inputs, dp_rank=0)
    summary = summarize_plan(sampler.plan, inputs, sampler.settings)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "peak_rss": _rss("VmHWM"),
        "rss_after_imports": after_imports,
        "micro_batches_per_rank": summary["micro_batches_per_rank"],
        "padded_efficiency": summary["padding"]["bshd_audio_efficiency"],
        "buckets": len(sampler.settings.boundaries) + 1,
    }


def run_lhotse(cuts_path: str) -> dict[str, Any]:
    from lhotse import CutSet
    from lhotse.dataset.sampling.dynamic_bucketing import DynamicBucketingSampler

    after_imports = _rss("VmRSS")
    t0 = time.perf_counter()
    cuts = CutSet.from_jsonl_lazy(cuts_path)
    sampler = DynamicBucketingSampler(
        cuts, max_duration=90.0, num_buckets=30, shuffle=True, seed=0, world_size=8, rank=0
    )
    batches = [np.array([c.duration for c in batch], np.float64) for batch in sampler]
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "peak_rss": _rss("VmHWM"),
        "rss_after_imports": after_imports,
        "micro_batches_per_rank": len(batches),
        "padded_efficiency": padded_efficiency(batches),
        "buckets": 30,
    }


def child(kind: str, path: str) -> dict[str, Any]:
    if kind == "lhotse":
        return run_lhotse(path)
    return run_ours(path, buckets=kind.removeprefix("ours-"))


def versions() -> dict[str, str]:
    import lhotse
    import pyarrow

    return {"python": sys.version.split()[0], "numpy": np.__version__, "pyarrow": pyarrow.__version__,
            "lhotse": lhotse.__version__}  # fmt: skip


def compare(rows: int, as_json: str | None = None) -> int:
    """Write the manifests, run each sampler in its own process, print the table."""
    try:
        import lhotse  # noqa: F401
    except ImportError:
        print(
            "speechlm bench sampler --lhotse: lhotse is not installed (pip install lhotse)", file=sys.stderr
        )
        return 1
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        parquet, cuts = write_manifests(rows, Path(tmp))
        for kind, path in (("ours-estimated", parquet), ("ours-fixed", parquet), ("lhotse", cuts)):
            out = subprocess.run([sys.executable, __file__, kind, str(path)], capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{kind} done", flush=True)
    names = {
        "ours-estimated": "speechlm plan, 30 buckets from the data",
        "ours-fixed": "speechlm plan, 6 fixed buckets",
        "lhotse": "Lhotse DynamicBucketingSampler, 30 buckets",
    }
    print(
        f"\n{rows:,} utterances (log-normal, 0.5-20 s, 12 languages), dp 8, 90 s per micro-batch, one epoch"
    )
    print(f"{'sampler':<44}{'wall s':>8}{'peak MiB':>10}{'(imports)':>10}{'mb/rank':>9}{'padded':>8}")
    for kind, r in results.items():
        print(
            f"{names[kind]:<44}{r['seconds']:>8.2f}{r['peak_rss'] / 2**20:>10.0f}"
            f"{r['rss_after_imports'] / 2**20:>10.0f}{r['micro_batches_per_rank']:>9,}"
            f"{100 * r['padded_efficiency']:>7.1f}%"
        )
    ours, theirs = results["ours-estimated"], results["lhotse"]
    print(
        f"ours / Lhotse: {theirs['seconds'] / ours['seconds']:.1f}x faster, "
        f"{ours['peak_rss'] / theirs['peak_rss']:.2f}x the peak memory; versions {versions()}"
    )
    if as_json:
        Path(as_json).write_text(json.dumps({"rows": rows, "versions": versions(), **results}, indent=2))
    return 0


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
