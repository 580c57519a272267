"""speechlm tar shards: a manifest's audio packed into uncompressed tars plus one parquet index.

Layout of a shard folder written by `write_shards` (``speechlm shards write``)::

    DIR/shard-000000.tar     one member per utterance, the audio file's bytes unchanged,
    DIR/shard-000001.tar     named SEGMENT_ID + the audio file's extension ('/' in ids become '__')
    ...
    DIR/index.parquet        the manifest's rows (MANIFEST_SCHEMA, audio_filepath = member name)
                             plus tar (file name), offset, nbytes, header_bytes; its metadata
                             records each tar's size, so a changed tar is detected on load

Writing is restartable and never leaves a half-written shard that looks whole: each tar is written
to a temporary name and renamed when complete, and ``index.parquet`` is written last (atomically).
A folder without ``index.parquet`` is an interrupted write: `read_shards` refuses it and says to
run the write again (finished tars are reused when their bytes match what would be written).

`read_shards` returns the manifest table with absolute ``tar_path`` locators. A tar whose size no
longer matches the index is re-scanned (`tar_index`) and its rows re-joined by member name; rows
whose member is gone are dropped and counted per shard (`SourceReport`), never silently kept.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speechlm.data.manifest.schema import MANIFEST_SCHEMA, ManifestError
from speechlm.data.sources.join import locate_members, with_tar_locators

INDEX_NAME = "index.parquet"
SHARDS_KEY = b"speechlm.shards"
FORMAT_VERSION = 1


@dataclass
class SourceReport:
    """What loading a source dropped, per shard and reason (printed by the loader, never silent)."""

    dropped: dict[str, dict[str, int]] = field(default_factory=dict)  # shard -> reason -> rows

    def drop(self, shard: str, reason: str, n: int = 1) -> None:
        if n:
            per = self.dropped.setdefault(shard, {})
            per[reason] = per.get(reason, 0) + int(n)

    @property
    def total(self) -> int:
        return sum(sum(v.values()) for v in self.dropped.values())

    def lines(self) -> list[str]:
        return [
            f"{shard}: " + ", ".join(f"{n} {reason}" for reason, n in sorted(per.items()))
            for shard, per in sorted(self.dropped.items())
        ]


def member_name(segment_id: str, suffix: str) -> str:
    """The tar member name of an utterance: its id (path separators flattened) + the audio suffix."""
    return segment_id.replace("/", "__") + suffix


def plan_members(table: pa.Table, base_dir: Path | None) -> tuple[list[str], list[str]]:
    """(member name, audio file) of every row of an extracted-file manifest about to be packed.

    Raises ManifestError naming the row when a file is missing (a shard set with holes would
    silently shrink the corpus) or when two rows would get the same member name.
    """
    if "tar_path" in table.column_names:
        raise ManifestError("the manifest already points into tar shards; pass an extracted-file manifest")
    ids = table.column("segment_id").to_pylist()
    paths = table.column("audio_filepath").to_pylist()
    resolved = [str(Path(p) if Path(p).is_absolute() or base_dir is None else base_dir / p) for p in paths]
    for row, p in enumerate(resolved):
        if not os.path.isfile(p):
            raise ManifestError(
                f"row {row} (segment {ids[row]}): audio file {p} does not exist; fix the manifest first "
                "(`speechlm manifest build` drops missing files)"
            )
    names = [member_name(s, Path(p).suffix) for s, p in zip(ids, resolved)]
    if len(set(names)) != len(names):
        raise ManifestError("segment_id values are not unique; tar members must be: deduplicate the manifest")
    return names, resolved


def print_progress(k: int, n_shards: int, done: int, n: int, t0: float) -> None:
    print(
        f"\rshards: {k + 1}/{n_shards} written ({done}/{n} utterances, {time.monotonic() - t0:.0f} s)",
        end="" if k + 1 < n_shards else "\n",
        file=sys.stderr,
        flush=True,
    )


def _tar_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def write_one_tar(path: Path, members: list[tuple[str, str]]) -> list[tuple[int, int, int]]:
    """Write (member name, source file) pairs to `path` atomically; (offset, nbytes, header_bytes) each."""
    tmp = path.with_name(f".{path.name}.tmp")
    out: list[tuple[int, int, int]] = []
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, source in members:
            with open(source, "rb") as f:
                st = os.fstat(f.fileno())
                info = tarfile.TarInfo(name)
                info.size = st.st_size
                info.mtime = 0  # reproducible tars: the same manifest gives the same bytes
                info.mode = 0o644
                start = tf.offset
                tf.addfile(info, f)
            # in write mode tarfile leaves offset_data unset: the headers are what the write added
            # beyond the data, which is padded to whole 512-byte blocks
            header = tf.offset - start - -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            out.append((start + header, info.size, header))
    os.replace(tmp, path)
    return out


def write_shards(
    table: pa.Table, out_dir: str | os.PathLike[str], *, shard_size: int = 1000, base_dir: Path | None = None
) -> Path:
    """Pack the audio of manifest `table` into tar shards of `shard_size` utterances under `out_dir`.

    Returns the index path. Raises ManifestError naming the row when an audio file is missing (a
    shard set with holes would silently shrink the corpus).
    """
    if shard_size < 1:
        raise ManifestError(f"--shard-size {shard_size} must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_NAME).unlink(missing_ok=True)  # the index appears again only when every tar is whole
    names, resolved = plan_members(table, base_dir)
    n = len(names)
    offsets = np.zeros(n, np.int64)
    sizes = np.zeros(n, np.int64)
    headers = np.zeros(n, np.uint16)
    tars: list[str] = []
    tar_of_row = np.zeros(n, np.int32)
    shard_sizes: dict[str, int] = {}
    t0 = time.monotonic()
    n_shards = (n + shard_size - 1) // shard_size
    for k, lo in enumerate(range(0, n, shard_size)):
        hi = min(n, lo + shard_size)
        tar = _tar_name(k)
        placed = write_one_tar(out / tar, list(zip(names[lo:hi], resolved[lo:hi])))
        for j, (off, size, hdr) in enumerate(placed):
            offsets[lo + j], sizes[lo + j], headers[lo + j] = off, size, hdr
        tars.append(tar)
        tar_of_row[lo:hi] = k
        shard_sizes[tar] = (out / tar).stat().st_size
        print_progress(k, n_shards, hi, n, t0)
    columns = {f.name: table.column(f.name) for f in MANIFEST_SCHEMA}
    columns["audio_filepath"] = pa.chunked_array([pa.array(names, pa.string())])
    index = pa.table(
        {
            **columns,
            "tar": pa.DictionaryArray.from_arrays(
                pa.array(tar_of_row, pa.int32()), pa.array(tars, pa.string())
            ),
            "offset": pa.array(offsets, pa.int64()),
            "nbytes": pa.array(sizes, pa.int64()),
            "header_bytes": pa.array(headers, pa.uint16()),
        }
    ).replace_schema_metadata(
        {SHARDS_KEY: json.dumps({"format_version": FORMAT_VERSION, "tar_sizes": shard_sizes})}
    )
    tmp = out / f".{INDEX_NAME}.tmp"
    pq.write_table(index, tmp, row_group_size=64 * 1024)
    os.replace(tmp, out / INDEX_NAME)
    return out / INDEX_NAME


def is_shard_dir(path: Path) -> bool:
    return path.is_dir() and ((path / INDEX_NAME).is_file() or any(path.glob("shard-*.tar")))


def read_shards(path: str | os.PathLike[str], report: SourceReport | None = None) -> pa.Table:
    """The manifest table of a shard folder (`write_shards`), with absolute tar locators."""
    folder = Path(path)
    if folder.name == INDEX_NAME:
        folder = folder.parent
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        raise ManifestError(
            f"{folder} has tar shards but no {INDEX_NAME}: `speechlm shards write` was interrupted; run it again"
        )
    try:
        index = pq.read_table(index_path)
        meta = json.loads((index.schema.metadata or {})[SHARDS_KEY])
    except (pa.ArrowException, OSError, KeyError, ValueError) as e:
        raise ManifestError(f"{index_path} is not a speechlm shard index ({e}); re-create it") from None
    report = report if report is not None else SourceReport()
    tar_col = index.column("tar").combine_chunks()
    tar_names: list[str] = tar_col.dictionary.to_pylist()
    codes = tar_col.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = index.column("offset").to_numpy().astype(np.int64)
    sizes = index.column("nbytes").to_numpy().astype(np.int64)
    headers = index.column("header_bytes").to_numpy().astype(np.uint16)
    keep = np.ones(len(index), bool)
    tars = [folder / t for t in tar_names]
    changed = []
    for k, (tar, tar_path) in enumerate(zip(tar_names, tars)):
        if not tar_path.is_file():
            raise ManifestError(f"shard {tar_path} (listed in {index_path}) does not exist: restore it")
        if tar_path.stat().st_size != int(meta["tar_sizes"].get(tar, -1)):
            changed.append(k)
    if changed:  # a tar changed since the index was written: trust only what its headers say now
        rows = np.flatnonzero(np.isin(codes, changed))
        members = index.column("audio_filepath").take(pa.array(rows)).to_pylist()
        loc = locate_members(tars, codes[rows], members, report, what=str(index_path))
        offsets[rows], sizes[rows], headers[rows], keep[rows] = loc.offsets, loc.sizes, loc.headers, loc.keep
    return with_tar_locators(index, codes, tars, offsets, sizes, headers, keep)


LOCATOR_COLUMNS = ("tar_path", "offset", "nbytes", "header_bytes")


def tar_rows(table: pa.Table) -> np.ndarray:
    """Boolean mask of the rows whose audio is a tar member."""
    if "tar_path" not in table.column_names:
        return np.zeros(len(table), bool)
    return np.asarray(pc.is_valid(table.column("tar_path")).to_numpy(zero_copy_only=False), bool)
