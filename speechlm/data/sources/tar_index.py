"""Where each member's bytes live in an uncompressed tar: scanned once from the headers, then cached.

A tar is a sequence of 512-byte headers, each followed by its member's data rounded up to 512 bytes,
so (offset of the data, size) is all a reader needs for one positional read (`os.pread`) per clip;
no decompression, no sequential walk. `scan_tar` walks the headers with `tarfile` (it seeks over the
data, so a scan reads about 1 KiB per member) and `tar_member_index` caches the result as a small
parquet table next to the tar (``NAME.tar.idx.parquet``) or, when that folder is read-only, under a
cache folder, keyed by the tar's absolute path.

The cache carries a fingerprint of the tar (size and modification time, nanoseconds): a tar that was
rewritten, appended to or truncated since is detected and scanned again, so a stale offset can never
pair one clip's text with another clip's bytes. A reader still checks each member's header at read
time (`speechlm.data.sources.members`), which catches what a fingerprint cannot (a tar replaced by
one of the same size and time).

A truncated tar keeps the members that are whole and reports how many bytes were cut; an unreadable
one (not a tar, compressed, missing) raises `TarIndexError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from speechlm.errors import DataError
from speechlm.io import atomic_path

INDEX_SUFFIX = ".idx.parquet"
FINGERPRINT_KEY = b"speechlm.tar_fingerprint"


def default_cache_dir() -> Path:
    """``$SPEECHLM_CACHE/tar_index``, by default under ``~/.cache/speechlm``."""
    return Path(os.environ.get("SPEECHLM_CACHE", Path.home() / ".cache" / "speechlm")) / "tar_index"


class TarIndexError(DataError, ValueError):
    """A tar that cannot be indexed at all; the message names it and says what to do."""


@dataclass(frozen=True)
class TarFingerprint:
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> TarFingerprint:
        st = os.stat(path)
        return cls(int(st.st_size), int(st.st_mtime_ns))

    def to_json(self) -> str:
        return json.dumps({"size": self.size, "mtime_ns": self.mtime_ns})

    @classmethod
    def from_json(cls, text: str | bytes) -> TarFingerprint:
        d = json.loads(text)
        return cls(int(d["size"]), int(d["mtime_ns"]))


@dataclass(frozen=True)
class TarScan:
    """The members of one tar: names, data offsets and sizes (regular files only, in tar order)."""

    names: list[str]
    offsets: np.ndarray  # int64 [M] byte offset of each member's data
    sizes: np.ndarray  # int64 [M] bytes
    header_bytes: np.ndarray  # uint16 [M] bytes of the member's headers before its data (512, more for pax)
    truncated_bytes: int = 0  # > 0: the file ends inside a member; members past the end are left out

    def __len__(self) -> int:
        return len(self.names)

    def to_table(self) -> pa.Table:
        return pa.table(
            {
                "member": pa.array(self.names, pa.string()),
                "offset": pa.array(self.offsets, pa.int64()),
                "nbytes": pa.array(self.sizes, pa.int64()),
                "header_bytes": pa.array(self.header_bytes, pa.uint16()),
            }
        )


def scan_tar(path: str | os.PathLike[str]) -> TarScan:
    """Walk the headers of the uncompressed tar `path` (see the module docstring for truncation)."""
    path = Path(path)
    if not path.is_file():
        raise TarIndexError(f"tar shard {path} does not exist: restore it, or remove its rows from the index")
    file_size = path.stat().st_size
    names: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    headers: list[int] = []
    truncated = 0
    try:
        with tarfile.open(path, mode="r:") as tf:  # "r:" refuses compressed tars (no positional reads)
            while True:
                try:
                    info = tf.next()
                except tarfile.ReadError as e:
                    if "unexpected end of data" in str(e) or "truncated" in str(e):
                        truncated = 1
                        break
                    raise
                if info is None:
                    break
                if not info.isreg():
                    continue
                if info.offset_data + info.size > file_size:
                    truncated = info.offset_data + info.size - file_size
                    break
                names.append(info.name)
                offsets.append(info.offset_data)
                sizes.append(info.size)
                headers.append(info.offset_data - info.offset)
    except (tarfile.ReadError, EOFError, OSError) as e:
        if names:  # the headers read so far are sound: keep them, report the rest as cut off
            truncated = max(truncated, 1)
        else:
            raise TarIndexError(
                f"{path} is not a readable uncompressed tar ({e}); positional reads need a plain .tar "
                "(not .tar.gz): re-create the shard with `speechlm shards write`"
            ) from None
    return TarScan(
        names,
        np.asarray(offsets, np.int64),
        np.asarray(sizes, np.int64),
        np.asarray(headers, np.uint16),
        truncated,
    )


def sidecar_path(data: Path, cache_dir: Path | None, suffix: str = INDEX_SUFFIX) -> Path:
    """Where a cache derived from file `data` lives: next to it, or in `cache_dir` keyed by its path."""
    if cache_dir is None:
        return data.with_name(data.name + suffix)
    key = hashlib.sha1(str(data.resolve()).encode()).hexdigest()[:16]
    return cache_dir / f"{data.name}.{key}{suffix}"


def _read_cached(path: Path, fingerprint: TarFingerprint) -> TarScan | None:
    try:
        table = pq.read_table(path)
        meta = table.schema.metadata or {}
        saved = TarFingerprint.from_json(meta[FINGERPRINT_KEY])
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError):
        return None  # unreadable or foreign cache: scan again
    if saved != fingerprint:
        return None
    truncated = int(meta.get(b"speechlm.truncated_bytes", b"0"))
    return TarScan(
        table.column("member").to_pylist(),
        table.column("offset").to_numpy().astype(np.int64),
        table.column("nbytes").to_numpy().astype(np.int64),
        table.column("header_bytes").to_numpy().astype(np.uint16),
        truncated,
    )


def _write_cache(path: Path, scan: TarScan, fingerprint: TarFingerprint) -> bool:
    table = scan.to_table().replace_schema_metadata(
        {FINGERPRINT_KEY: fingerprint.to_json(), b"speechlm.truncated_bytes": str(scan.truncated_bytes)}
    )
    return write_parquet_atomic(path, table)


def write_parquet_atomic(path: Path, table: pa.Table) -> bool:
    """Write `table` to `path` via a temporary file and a rename; False (nothing left) when that fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:  # a reader sees the old cache or the new one, never half
            pq.write_table(table, tmp)
        return True
    except OSError:
        return False


def tar_member_index(
    tar: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> TarScan:
    """The member index of `tar`, from its cache when the fingerprint matches, else scanned and cached.

    The cache is written next to the tar; when that fails (read-only data) it goes to `cache_dir`
    (default ``$SPEECHLM_CACHE/tar_index`` or ``~/.cache/speechlm/tar_index``). A full disk only
    costs the cache: the scan is returned either way.
    """
    tar = Path(tar)
    fingerprint = TarFingerprint.of(tar) if tar.is_file() else None
    if fingerprint is None:
        raise TarIndexError(f"tar shard {tar} does not exist: restore it, or remove its rows from the index")
    fallback = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for candidate in (sidecar_path(tar, None), sidecar_path(tar, fallback)):
        if candidate.is_file():
            cached = _read_cached(candidate, fingerprint)
            if cached is not None:
                return cached
    scan = scan_tar(tar)
    if not _write_cache(sidecar_path(tar, None), scan, fingerprint):
        _write_cache(sidecar_path(tar, fallback), scan, fingerprint)
    return scan
