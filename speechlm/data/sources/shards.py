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
A folder without ``index.parquet`` is an interrupted write (a SIGKILL, a full disk): `read_shards`
refuses it and says to run the write again, which replaces those tars. A folder that holds
``index.parquet`` (a finished set) or any file a write did not leave is never written into.
Before the first byte, every row is checked (`plan_audio`): the audio file must exist and have an
audio header (a file that is not audio is never copied), and its real duration must agree with the
manifest's (`duration_mismatch`); the index records the real durations.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import soundfile as sf

from speechlm.data.manifest.checks import check_durations
from speechlm.data.manifest.outputs import prepare_dir
from speechlm.data.manifest.schema import MANIFEST_SCHEMA, ManifestError, duration_mismatch
from speechlm.data.sources.join import locate_members, with_tar_locators
from speechlm.data.sources.report import SourceReport
from speechlm.errors import OutputError
from speechlm.io import atomic_path, temp_glob
from speechlm.progress import Progress

INDEX_NAME = "index.parquet"
PARTIAL_PATTERNS = ("shard-*.tar", temp_glob("shard-*.tar"), temp_glob(INDEX_NAME))
SHARDS_KEY = b"speechlm.shards"
FORMAT_VERSION = 1


def member_name(segment_id: str, suffix: str) -> str:
    """The tar member name of an utterance: its id (path separators flattened) + the audio suffix."""
    return segment_id.replace("/", "__") + suffix


@dataclass(frozen=True)
class AudioPlan:
    """What packing a manifest's rows needs: tar member names, resolved audio files, real durations.

    `rows` are the manifest rows packed (all of them unless bad audio was skipped); `skipped` names
    each skipped row: (row, segment id, resolved path, reason).
    """

    names: list[str]
    resolved: list[str]
    durations: np.ndarray  # float64 [len(rows)], seconds, from the audio headers
    rows: np.ndarray  # int64 indices into the manifest
    skipped: list[tuple[int, str, str, str]] = field(default_factory=list)


class ShardWriteError(OutputError, OSError):
    """Writing a tar or the index failed (disk full, permissions); the folder is an interrupted write."""


def _row(ids: list[str], row: int) -> str:
    return f"row {row} (segment {ids[row]})"


def plan_audio(
    table: pa.Table,
    base_dir: Path | None,
    *,
    skip_bad_audio: bool = False,
    tolerance_s: float = 0.5,
    tolerance_frac: float = 0.1,
    where: str = "the manifest",
) -> AudioPlan:
    """Check every row of an extracted-file manifest before anything is packed (nothing is written).

    Raises ManifestError naming the row and its RESOLVED audio path when the duration is NaN, Inf or
    <= 0 or the file is missing; and, unless `skip_bad_audio` (then the row is skipped and listed in
    `AudioPlan.skipped`), when soundfile cannot read its header (not audio: never copied into a
    shard) or the header's duration is far from the manifest's (`duration_mismatch`). Two rows with
    the same member name are an error. The real durations are returned for the index.
    """
    if "tar_path" in table.column_names:
        raise ManifestError("the manifest already points into tar shards; pass an extracted-file manifest")
    check_durations(table, where)
    ids = [str(x) for x in table.column("segment_id").to_pylist()]
    paths = table.column("audio_filepath").to_pylist()
    claimed = table.column("duration").to_numpy().astype(np.float64)
    resolved = [
        os.path.abspath(p if Path(p).is_absolute() or base_dir is None else base_dir / p) for p in paths
    ]
    missing = [row for row, p in enumerate(resolved) if not os.path.isfile(p)]
    if missing:
        row = missing[0]
        raise ManifestError(
            f"{where} {_row(ids, row)}: audio file {resolved[row]} does not exist ({len(missing)} of "
            f"{len(ids)} rows have no file); restore the files, or remove those rows from the manifest "
            "(`speechlm manifest build` and `manifest convert` keep rows whose audio is missing, so "
            "rebuilding does not drop them)"
        )
    skip_hint = "; or pass --skip-bad-audio to leave such rows out (they are counted and listed)"
    real = np.zeros(len(ids), np.float64)
    keep = np.ones(len(ids), bool)
    skipped: list[tuple[int, str, str, str]] = []
    for row, p in enumerate(resolved):
        try:
            info = sf.info(p)
        except (RuntimeError, OSError, ValueError) as e:  # soundfile.LibsndfileError is a RuntimeError
            if skip_bad_audio:
                keep[row] = False
                skipped.append((row, ids[row], p, "not_audio"))
                continue
            raise ManifestError(
                f"{where} {_row(ids, row)}: {p} is not an audio file soundfile can read ({e}); nothing "
                f"was copied: fix the row's audio_filepath or remove the row from the manifest{skip_hint}"
            ) from None
        real[row] = float(info.duration)
        if duration_mismatch(float(claimed[row]), real[row], tolerance_s, tolerance_frac):
            if skip_bad_audio:
                keep[row] = False
                skipped.append((row, ids[row], p, "duration_mismatch"))
                continue
            raise ManifestError(
                f"{where} {_row(ids, row)}: the manifest says duration {claimed[row]:.3f} s but "
                f"{p} holds {real[row]:.3f} s (more than max({tolerance_s} s, "
                f"{tolerance_frac:.0%}) apart); fix the row's duration or its audio_filepath{skip_hint}"
            )
    rows = np.flatnonzero(keep)
    names = [member_name(ids[r], Path(resolved[r]).suffix) for r in rows]
    if len(set(names)) != len(names):
        raise ManifestError("segment_id values are not unique; tar members must be: deduplicate the manifest")
    return AudioPlan(names, [resolved[r] for r in rows], real[rows], rows, skipped)


def format_skipped(skipped: list[tuple[int, str, str, str]], limit: int = 5) -> str:
    """One paragraph naming the rows `plan_audio` skipped (the first `limit`) and their count."""
    counts: dict[str, int] = {}
    for *_, reason in skipped:
        counts[reason] = counts.get(reason, 0) + 1
    detail = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
    listed = "; ".join(f"row {r} (segment {s}) {p}: {why}" for r, s, p, why in skipped[:limit])
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"skipped {len(skipped)} rows ({detail}): {listed}{more}"


def check_out_dir(out: Path, complete: str, partial: tuple[str, ...]) -> list[Path]:
    """Refuse an output folder that holds anything but an interrupted write of this format.

    `complete` is the file a finished write ends with (``index.parquet``); `partial` are glob
    patterns of what an interrupted write leaves. Returns those leftovers (a re-run replaces them).
    A finished shard set, or any other file, is an OutputError naming it: an earlier set is never
    overwritten.
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"cannot write --out {out}: it is a file, not a folder; pass a folder path")
    if not out.exists():
        return []
    entries = sorted(out.iterdir())
    if (out / complete).exists():
        raise OutputError(
            f"--out {out} already holds a shard set ({complete} and {len(entries) - 1} other entries); "
            "nothing was changed: pass a new --out folder, or move that set away first"
        )
    ours = {p for pattern in partial for p in out.glob(pattern)}
    others = [p for p in entries if p not in ours]
    if others:
        shown = ", ".join(p.name for p in others[:5]) + (", ..." if len(others) > 5 else "")
        raise OutputError(
            f"--out {out} is not empty ({len(others)} entries that no shards write left: {shown}); "
            "nothing was changed: pass a new or empty --out folder"
        )
    return sorted(ours)


class ShardProgress:
    """Progress of a shard write: a display on a terminal (`speechlm.progress`), else a plain line on
    stderr per tenth of the shards (and the last one)."""

    def __init__(self, n_shards: int, n: int):
        self.bar = Progress(n_shards, "shards", "written")
        self.n_shards, self.n = n_shards, n
        self.every = max(1, n_shards // 10)
        self.t0 = time.monotonic()

    def written(self, k: int, done: int) -> None:
        """Shard `k` (0-based) is written; `done` utterances so far."""
        self.bar.update(1, utterances=f"{done}/{self.n}")
        if not self.bar.active and ((k + 1) % self.every == 0 or k + 1 == self.n_shards):
            print(
                f"shards: {k + 1}/{self.n_shards} written ({done}/{self.n} utterances, "
                f"{time.monotonic() - self.t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


def _tar_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def write_one_tar(path: Path, members: list[tuple[str, str]]) -> list[tuple[int, int, int]]:
    """Write (member name, source file) pairs to `path` atomically (`speechlm.io.atomic_path`: a failed
    write leaves no temporary); (offset, nbytes, header_bytes) each."""
    out: list[tuple[int, int, int]] = []
    with atomic_path(path) as tmp, tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tf:
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
    return out


@dataclass(frozen=True)
class TarSetStart:
    """A tar-set write about to begin (`start_tar_set`): the rows packed and what an interrupted write left."""

    table: pa.Table  # the manifest's rows that are packed (bad audio skipped when asked)
    plan: AudioPlan
    leftovers: list[
        Path
    ]  # an interrupted write's files (`check_out_dir`): a finished write removes the unused


def start_tar_set(
    table: pa.Table,
    out: Path,
    *,
    complete: str,
    partial: tuple[str, ...],
    shard_size: int,
    base_dir: Path | None,
    skip_bad_audio: bool,
    skipped: list[tuple[int, str, str, str]] | None,
    where: str,
) -> TarSetStart:
    """The checks every tar-set writer (`write_shards`, NeMo's `write_nemo_tarred`) makes before its first
    byte: the shard size, the output folder (`check_out_dir`: `complete` is the file a finished set ends
    with, `partial` what an interrupted one leaves), every row's audio (`plan_audio`; skipped rows are
    appended to `skipped`); then the folder is created."""
    if shard_size < 1:
        raise ManifestError(f"--shard-size {shard_size} must be at least 1")
    leftovers = check_out_dir(out, complete, partial)
    plan = plan_audio(table, base_dir, skip_bad_audio=skip_bad_audio, where=where)
    if skipped is not None:
        skipped.extend(plan.skipped)
    if not plan.rows.size:
        raise ManifestError(f"no row of {where} has readable audio: {format_skipped(plan.skipped)}")
    prepare_dir(out)
    return TarSetStart(table.take(pa.array(plan.rows)), plan, leftovers)


def write_tars(
    out: Path, plan: AudioPlan, shard_size: int, tar_name: Callable[[int], str], complete: str
) -> Iterator[tuple[int, int, int, list[tuple[int, int, int]]]]:
    """Write the planned rows into tars of `shard_size` members (`tar_name(k)` each), showing progress;
    yield (k, lo, hi, placements) after each tar, rows lo..hi. A tar that cannot be written leaves no
    temporary and is a `ShardWriteError` saying the folder is an interrupted write (no `complete` file)."""
    names, resolved = plan.names, plan.resolved
    n = len(names)
    n_shards = (n + shard_size - 1) // shard_size
    progress = ShardProgress(n_shards, n)
    for k, lo in enumerate(range(0, n, shard_size)):
        hi = min(n, lo + shard_size)
        tar = out / tar_name(k)
        try:
            placed = write_one_tar(tar, list(zip(names[lo:hi], resolved[lo:hi])))
        except OSError as e:
            progress.close()  # end the display line before the error
            raise ShardWriteError(
                f"cannot write {tar}: {e.strerror or e}; {out} now holds an interrupted write "
                f"(no {complete}, refused by readers): free space or fix the folder, then run the "
                "same `speechlm shards write` again"
            ) from e
        yield k, lo, hi, placed
        progress.written(k, hi)
    progress.close()


def finish_tar_set(
    out: Path, complete: str, write: Callable[[Path], None], start: TarSetStart, kept: set[str]
) -> Path:
    """Write the file that makes the set complete (`write(tmp)`, atomically: it is written last), then
    remove the interrupted write's leftovers whose names are not in `kept`; the file's path."""
    try:
        with atomic_path(out / complete) as tmp:
            write(tmp)
    except OSError as e:
        raise ShardWriteError(
            f"cannot write {out / complete}: {e.strerror or e}; every tar is written but the set has no "
            "index yet: free space, then run the same `speechlm shards write` again"
        ) from e
    for stale in start.leftovers:  # an interrupted write's tars that this set does not use
        if stale.name not in kept and not stale.is_dir():
            stale.unlink(missing_ok=True)
    return out / complete


def write_shards(
    table: pa.Table,
    out_dir: str | os.PathLike[str],
    *,
    shard_size: int = 1000,
    base_dir: Path | None = None,
    skip_bad_audio: bool = False,
    skipped: list[tuple[int, str, str, str]] | None = None,
    where: str = "the manifest",
) -> Path:
    """Pack the audio of manifest `table` into tar shards of `shard_size` utterances under `out_dir`.

    Returns the index path. Every row is checked first (`plan_audio`: missing or non-audio file,
    bad or far-off duration -> ManifestError naming the row; nothing written); the index holds the
    durations read from the audio headers. An `out_dir` holding a finished shard set or anything
    else is refused (OutputError, `check_out_dir`); one holding only an interrupted write's tars is
    written again. With `skip_bad_audio`, rows whose file is not audio or whose duration is far
    off are left out and appended to `skipped` (the caller prints them).
    """
    out = Path(out_dir)
    start = start_tar_set(
        table,
        out,
        complete=INDEX_NAME,
        partial=PARTIAL_PATTERNS,
        shard_size=shard_size,
        base_dir=base_dir,
        skip_bad_audio=skip_bad_audio,
        skipped=skipped,
        where=where,
    )
    table, plan = start.table, start.plan
    names = plan.names
    n = len(names)
    offsets = np.zeros(n, np.int64)
    sizes = np.zeros(n, np.int64)
    headers = np.zeros(n, np.uint16)
    tars: list[str] = []
    tar_of_row = np.zeros(n, np.int32)
    shard_sizes: dict[str, int] = {}
    for k, lo, hi, placed in write_tars(out, plan, shard_size, _tar_name, INDEX_NAME):
        tar = _tar_name(k)
        for j, (off, size, hdr) in enumerate(placed):
            offsets[lo + j], sizes[lo + j], headers[lo + j] = off, size, hdr
        tars.append(tar)
        tar_of_row[lo:hi] = k
        shard_sizes[tar] = (out / tar).stat().st_size
    columns = {f.name: table.column(f.name) for f in MANIFEST_SCHEMA}
    columns["audio_filepath"] = pa.chunked_array([pa.array(names, pa.string())])
    columns["duration"] = pa.chunked_array([pa.array(plan.durations.astype(np.float32), pa.float32())])
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
    return finish_tar_set(
        out,
        INDEX_NAME,
        lambda tmp: pq.write_table(index, tmp, row_group_size=64 * 1024),
        start,
        set(shard_sizes),
    )


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


def tar_rows(table: pa.Table) -> np.ndarray:
    """Boolean mask of the rows whose audio is a tar member."""
    if "tar_path" not in table.column_names:
        return np.zeros(len(table), bool)
    return np.asarray(pc.is_valid(table.column("tar_path")).to_numpy(zero_copy_only=False), bool)
