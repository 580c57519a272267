"""Read throughput: extracted files vs tar shards (indexed and streaming), clips/s per DataLoader worker.

What it does:
1. Builds a synthetic corpus of `--clips` clips (default 20,000) by copying the demo corpus's FLAC
   files under new names (one folder of 1,000 files per shard, like an extracted corpus), a parquet
   manifest over them, and the same corpus as speechlm tar shards (`speechlm shards write`).
2. For each layout, evicts the corpus from the page cache (`posix_fadvise(DONTNEED)` on every file;
   dropping the whole cache needs root, which this machine does not give; `fincore` checks that the
   files are out of the cache when it is installed), then loads one epoch's micro-batches in the
   sampler's order through the real `SpeechDataset` and `DataLoader` with `--workers` workers and
   reports clips/s per worker, twice: `read` (the bytes only: open + read of a file, or one
   positional read of a tar member) and `load` (read + FLAC decode + resample + tokenize, what
   training waits for). Indexed layouts follow the indexed epoch plan; streaming follows the
   streaming plan over the same tars.

The cold figures are what a first epoch on a local disk sees; on a network filesystem the gap
between one open per clip and positional reads of a few large files grows (not measurable here).

Run: ``speechlm bench read-throughput [--clips N] [--workers W]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_corpus(folder: Path, clips: int) -> Path:
    """A parquet manifest of `clips` copies of the demo corpus's clips, 1,000 per folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speechlm.data.manifest import build_manifest

    build_manifest(REPO / "data/demo/shards", folder / "demo")
    demo = pq.read_table(folder / "demo/train.parquet").to_pylist()
    rows = []
    for k in range(clips):
        src = demo[k % len(demo)]
        sub = folder / "audio" / f"part_{k // 1000:04d}"
        sub.mkdir(parents=True, exist_ok=True)
        dst = sub / f"clip_{k:07d}.flac"
        shutil.copyfile(src["audio_filepath"], dst)
        rows.append({**src, "segment_id": f"clip_{k:07d}", "audio_filepath": str(dst)})
    table = pa.Table.from_pylist(rows, schema=pq.read_schema(folder / "demo/train.parquet"))
    pq.write_table(table, folder / "manifest.parquet")
    return folder / "manifest.parquet"


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a corpus just written) cannot be evicted
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (util-linux `fincore`), or None without it."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", *map(str, paths[:2000])],
        capture_output=True,
        text=True,
    )
    res = size = 0
    for line in out.stdout.splitlines():
        a, b = line.split()
        res, size = res + int(a), size + int(b)
    return res / size if size else None


class _RawRead:
    """The bytes only: what the dataset reads for a row, without decoding it."""

    def __init__(self, dataset: object) -> None:
        self.ds = dataset

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> int:
        ds = self.ds
        loc = ds._locators  # type: ignore[attr-defined]
        tar = loc.tar(i)
        if tar is not None:
            member = ds._paths[i].as_py()  # type: ignore[attr-defined]
            return len(
                loc.reader.read(tar, member, int(loc.offset[i]), int(loc.nbytes[i]), int(loc.header_bytes[i]))
            )
        with open(ds.resolve_path(i), "rb") as f:  # type: ignore[attr-defined]
            return len(f.read())

    def __getitems__(self, indices: list[int]) -> list[int]:
        order = sorted(range(len(indices)), key=lambda k: self.ds._locators.sort_key(indices[k]))  # type: ignore[attr-defined]
        out = [0] * len(indices)
        for k in order:
            out[k] = self[indices[k]]
        return out


def measure(
    table: object, tok: object, files: list[Path], read_mode: str, workers: int, raw: bool
) -> dict[str, float]:
    from speechlm.config import ExperimentConfig
    from speechlm.data.dataset import SpeechDataset, build_dataloader
    from speechlm.data.sampler.build import build_sampler

    cfg = ExperimentConfig()
    cfg.data.read_mode = read_mode
    cfg.data.num_workers = workers
    cfg.sampler.max_batch_duration = 60.0
    sampler = build_sampler(cfg, table, dp_rank=0, dp_size=1)
    batches = list(sampler)
    ds = SpeechDataset(table, tok)  # type: ignore[arg-type]
    data = _RawRead(ds) if raw else ds
    evict(files)
    cached = cached_fraction(files)
    loader = build_dataloader(
        data,  # type: ignore[arg-type]
        batches,
        num_workers=workers,
        collate_fn=(lambda items: len(items)) if raw else None,
        persistent_workers=False,
    )
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += b if raw else len(b) + sum(b.dropped.values())
    dt = time.perf_counter() - t0
    return {
        "clips": n,
        "seconds": dt,
        "clips_per_s_per_worker": n / dt / max(1, workers),
        "cached_before": cached or 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clips", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--keep", metavar="DIR", help="build (or reuse) the corpus here")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)

    from speechlm.data.sources.detect import load_source
    from speechlm.data.sources.shards import write_shards
    from speechlm.data.tokenizer import Tokenizer

    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.keep or tmp.name)
    manifest = folder / "manifest.parquet"
    t0 = time.perf_counter()
    if not manifest.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        build_corpus(folder, args.clips)
        # the demo's random-bytes FLAC is not audio: shards write refuses it unless skipped (issue 20)
        write_shards(load_source(manifest), folder / "tars", shard_size=1000, skip_bad_audio=True)
    print(f"corpus: {args.clips:,} clips in {folder} ({time.perf_counter() - t0:.0f} s to build)", flush=True)
    tok_prefix = folder / "tok"
    if not tok_prefix.with_suffix(".model").is_file():
        from speechlm.cli import main as cli

        cli(["tokenizer", "train", "--manifest", str(folder / "demo/train.parquet"), "--out", str(tok_prefix),
             "--vocab-size", "300"])  # fmt: skip
    tok = Tokenizer(str(tok_prefix.with_suffix(".model")))
    files_table = load_source(manifest)
    tars_table = load_source(folder / "tars")
    audio_files = [Path(p) for p in files_table.column("audio_filepath").to_pylist()]
    tar_files = sorted((folder / "tars").glob("*.tar"))
    results: dict[str, dict[str, float]] = {}
    for raw in (True, False):
        for name, table, files, mode in (
            ("extracted files", files_table, audio_files, "indexed"),
            ("tar indexed", tars_table, tar_files, "indexed"),
            ("tar streaming", tars_table, tar_files, "streaming"),
        ):
            key = f"{'read' if raw else 'load'}: {name}"
            r = measure(table, tok, files, mode, args.workers, raw)
            results[key] = r
            print(
                f"{key:>24}: {r['clips_per_s_per_worker']:8.0f} clips/s per worker ({r['clips']} clips, "
                f"{r['seconds']:.1f} s, {100 * r['cached_before']:.0f}% cached before)",
                flush=True,
            )
    for kind in ("read", "load"):
        base = results[f"{kind}: extracted files"]["clips_per_s_per_worker"]
        ratios = ", ".join(
            f"{n} {results[f'{kind}: {n}']['clips_per_s_per_worker'] / base:.2f}x"
            for n in ("tar indexed", "tar streaming")
        )
        print(f"{kind}: vs extracted files: {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
