"""The training index on disk, memory-mapped: what a rank holds in RAM is only what it touches.

Any source (`detect.load_source`) becomes a manifest table; `open_index` writes it once to an
uncompressed Arrow IPC file under the cache folder and opens that file memory-mapped. Texts, ids
and member names then stay on disk (in the page cache, shared by every process and DataLoader
worker on the node) until a clip is loaded; the sampler reads durations and languages, which are
small flat columns (plus ``text_chars``, each text's length, stored in the cache so that planning
never reads a text). A parquet manifest is converted batch by batch, so even building the cache
never holds the whole manifest in memory.

The cache file is named by the source's path, the default language and a fingerprint of the
path itself (its size and mtime; a folder: those of its direct children), and it records every
other file it indexed (each tar a row points into, wherever it lives: a WeNet list's tars are often
in another folder) with its size and mtime in its schema metadata: on every open those are compared,
and a changed, added or removed file makes the entry stale and rebuilt, never mapped with offsets
that no longer hold. (Plain audio files are not recorded: a clip whose length changed is caught when
it is decoded, `dataset.SpeechDataset`'s duration check.) A parquet manifest's relative audio paths
are resolved against the manifest's folder while it is indexed, as NeMo, WeNet and Lhotse paths are.

Concurrent builders (every rank of a node opens the index at start) take an exclusive `fcntl.flock`
on a lock file next to the cache entry: the first builds and prints "indexing ..." once, the others
wait and then map what it wrote. The file is written to a temporary name and renamed (`os.replace`),
so an interrupted or full-disk write (SIGTERM, SIGKILL, ENOSPC) never leaves a cache that looks
whole; a killed builder's lock is released by the kernel and its temporary file removed by the
next builder. When the cache cannot be written, the
table is used from memory (with a warning), which is slower to start and larger, never wrong; a
damaged cache file is rebuilt.

A manifest whose durations are not finite numbers > 0 is refused when it is opened
(`check_durations`), naming the file and the row (``FILE:LINE`` for NeMo JSON), before training.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from speechlm.data.manifest.load import check_durations, resolve_audio_paths
from speechlm.data.manifest.schema import (
    CONVERSATION_SCHEMA,
    LOCATOR_SCHEMA,
    MANIFEST_SCHEMA,
    ManifestError,
    check_conversations,
    conversation_columns,
    llm_text_chars,
)
from speechlm.data.sources.detect import detect_source_type, load_source
from speechlm.io import atomic_path, temp_glob

logger = logging.getLogger(__name__)

CACHE_VERSION = "4"  # 2: relative parquet paths resolved, indexed files recorded; 3: conversation columns;
# 4: Lhotse cuts as their supervised span, language names as codes; prompt/target read as instruction/answer
# (an index built before is stale)
BATCH_ROWS = 1 << 20
FILES_KEY = b"speechlm.indexed_files"  # [[path, size, mtime_ns], ...] of the files an entry indexed
SOURCE_KEY = b"speechlm.source"  # the manifest path, for messages (dataset.SpeechDataset)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPEECHLM_CACHE", Path.home() / ".cache" / "speechlm")) / "index"


def source_fingerprint(path: Path, default_lang: str | None = None) -> str:
    """A digest of the path and the size and mtime of its files (a folder: its direct children)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{CACHE_VERSION}\0{path.resolve()}\0{default_lang}".encode())
    files = sorted(p for p in path.iterdir() if not p.name.startswith(".")) if path.is_dir() else [path]
    for f in files:
        st = f.stat()
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


TEXT_CHARS = "text_chars"  # int32 characters of `text`, stored so the sampler never reads the texts


def _write_ipc(target: Path, batches: object, schema: pa.Schema) -> None:
    schema = schema.append(pa.field(TEXT_CHARS, pa.int32(), nullable=False))
    with atomic_path(target) as tmp, ipc.new_file(tmp, schema) as writer:
        for batch in batches:  # type: ignore[attr-defined]
            chars = llm_text_chars(batch)
            writer.write_batch(pa.RecordBatch.from_arrays([*batch.columns, chars], schema=schema))


def _parquet_batches(path: Path, schema: pa.Schema) -> object:
    """The manifest's batches, each cast to `schema` and checked for nulls (the row is named), with
    relative audio paths resolved against the manifest's folder."""
    f = pq.ParquetFile(path)
    held = conversation_columns(f.schema_arrow.names, str(path))  # prompt/target: other names
    row = 0
    for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=[held.get(n, n) for n in schema.names]):
        columns = []
        for field in schema:
            col = batch.column(held.get(field.name, field.name))
            if col.null_count and field.name in MANIFEST_SCHEMA.names:
                first = row + int(pc.index(pc.is_null(col), True).as_py())
                raise ManifestError(
                    f"{path}, row {first}: column {field.name!r} is null ({col.null_count} null values in "
                    f"rows {row}-{row + batch.num_rows - 1}); fill it in or remove the row, or rebuild the "
                    "manifest with `speechlm manifest build`"
                )
            if field.name == "audio_filepath":
                col = resolve_audio_paths(batch, path.parent)
            columns.append(col.cast(field.type))
        check_conversations(batch, str(path), row)
        row += batch.num_rows
        yield pa.RecordBatch.from_arrays(columns, schema=schema)


def _stat(path: str) -> list[object]:
    try:
        st = os.stat(path)
    except OSError:
        return [path, -1, -1]
    return [path, st.st_size, st.st_mtime_ns]


def indexed_files(table: pa.Table) -> list[str]:
    """The files, besides the source itself, whose bytes the index points into: the distinct tars."""
    if "tar_path" not in table.column_names:
        return []
    col = table.column("tar_path")
    if pa.types.is_dictionary(col.type):
        values = {v for chunk in col.chunks for v in chunk.dictionary.to_pylist()}
    else:
        values = set(pc.unique(col).to_pylist())
    return sorted(v for v in values if v)


def _stale_files(table: pa.Table) -> list[str]:
    """The recorded indexed files whose size or mtime changed (or that are gone) since the build."""
    meta = (table.schema.metadata or {}).get(FILES_KEY)
    if meta is None:
        return []
    return [str(entry[0]) for entry in json.loads(meta) if _stat(str(entry[0])) != list(entry)]


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Exclusive lock on ``TARGET.lock`` while one process builds `target`; the others wait on it.

    The kernel releases it when its holder dies, so a killed builder blocks nobody. Where no lock file
    can be made (read-only cache folder), the caller goes on unlocked and falls back to memory anyway.
    """
    lock = target.with_name(target.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _parquet_schema(path: Path) -> pa.Schema:
    names = pq.read_schema(path).names
    missing = [f.name for f in MANIFEST_SCHEMA if f.name not in names]
    if missing:
        raise ManifestError(
            f"{path} is missing column {', '.join(map(repr, missing))}; a training manifest has "
            f"{MANIFEST_SCHEMA.names}: rebuild it with `speechlm manifest build`"
        )
    conv = conversation_columns(names, str(path))
    optional = [f for f in LOCATOR_SCHEMA if f.name in names] + [
        f for f in CONVERSATION_SCHEMA if f.name in conv
    ]
    return pa.schema(list(MANIFEST_SCHEMA) + optional)


def open_index(
    path: str | os.PathLike[str],
    kind: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    default_lang: str | None = None,
) -> pa.Table:
    """The manifest table of any source at `path`, memory-mapped from the index cache (see the module
    docstring: built once under a lock, rebuilt when a file it indexed changed; durations checked)."""
    path = Path(path)
    kind = kind or detect_source_type(path)
    if not path.exists():
        raise ManifestError(f"manifest {path} does not exist; build it with `speechlm manifest build`")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = folder / f"{path.name}.{source_fingerprint(path, default_lang)}.arrow"
    table = _open_cached(target, path)
    if table is None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # _build's write fails the same way and falls back to memory
        with _build_lock(target):
            table = _open_cached(target, path)  # another process may have built it while we waited
            if table is None:
                table = _build(target, path, kind, default_lang)
    check_durations(table, path, kind)
    return table.replace_schema_metadata({**(table.schema.metadata or {}), SOURCE_KEY: str(path).encode()})


def _open_cached(target: Path, path: Path) -> pa.Table | None:
    """The cache entry mapped, or None when there is none, it is damaged or a file it indexed changed."""
    if not target.is_file():
        return None
    try:
        table = _map(target)
    except (pa.ArrowInvalid, OSError, ValueError) as e:  # damaged on disk: rebuild it
        logger.warning("index cache %s is unreadable (%s); rebuilding it from %s", target, e, path)
        return None
    stale = _stale_files(table)
    if stale:
        logger.warning(
            "index cache %s is stale: %d file(s) it indexed changed since (%s%s); indexing %s again",
            target,
            len(stale),
            ", ".join(stale[:3]),
            ", ..." if len(stale) > 3 else "",
            path,
        )
        return None
    return table


def _build(target: Path, path: Path, kind: str, default_lang: str | None) -> pa.Table:
    for leftover in target.parent.glob(temp_glob(target.name)):  # a killed builder's (we hold the lock)
        leftover.unlink(missing_ok=True)
    t0 = time.monotonic()
    print(f"indexing {path} ({kind}) into {target} (once; later runs map it)", file=sys.stderr, flush=True)
    table: pa.Table | None = None
    try:
        if kind == "parquet":
            schema = _parquet_schema(path)
            _write_ipc(target, _parquet_batches(path, schema), schema)
        else:
            table = load_source(path, kind, default_lang=default_lang)
            files = json.dumps([_stat(f) for f in indexed_files(table)]).encode()
            schema = table.schema.with_metadata({**(table.schema.metadata or {}), FILES_KEY: files})
            _write_ipc(target, table.to_batches(max_chunksize=BATCH_ROWS), schema)
    except (OSError, pa.ArrowInvalid) as e:
        # a full disk or a read-only cache costs memory, not correctness; a corrupt manifest gets
        # its own error from the plain reader below
        logger.warning("cannot write the index cache %s (%s); using %s from memory", target, e, path)
        return table if table is not None else load_source(path, kind, default_lang=default_lang)
    print(f"indexed {path} in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return _map(target)


def _map(path: Path) -> pa.Table:
    """The IPC file mapped read-only, with the kernel told that reads are random: a clip's text is a
    few bytes, and the default readahead would page in ~100 KiB around each one."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return ipc.open_file(pa.BufferReader(pa.py_buffer(mapped))).read_all()
