"""The training index on disk, memory-mapped: what a rank holds in RAM is only what it touches.

Any source (`detect.load_source`) becomes a manifest table; `open_index` writes it once to an
uncompressed Arrow IPC file under the cache folder and opens that file memory-mapped. Texts, ids
and member names then stay on disk (in the page cache, shared by every process and DataLoader
worker on the node) until a clip is loaded; the sampler reads durations and languages, which are
small flat columns (plus ``text_chars``, each text's length, stored in the cache so that planning
never reads a text). A parquet manifest is converted batch by batch, so even building the cache
never holds the whole manifest in memory.

The cache file is named by the source's path and a fingerprint of its files (sizes and
modification times): an edited manifest or a rewritten shard index gets a new cache file. The file
is written to a temporary name and renamed, so an interrupted or full-disk write never leaves a
cache that looks whole; when the cache cannot be written, the table is used from memory (with a
warning), which is slower to start and larger, never wrong.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from speechlm.data.manifest.schema import LOCATOR_SCHEMA, MANIFEST_SCHEMA, ManifestError

logger = logging.getLogger(__name__)

CACHE_VERSION = "1"
BATCH_ROWS = 1 << 20


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPEECHLM_CACHE", Path.home() / ".cache" / "speechlm")) / "index"


def source_fingerprint(path: Path) -> str:
    """A digest of the path and the size and mtime of its files (a folder: its direct children)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{CACHE_VERSION}\0{path.resolve()}".encode())
    files = sorted(p for p in path.iterdir() if not p.name.startswith(".")) if path.is_dir() else [path]
    for f in files:
        st = f.stat()
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


TEXT_CHARS = "text_chars"  # int32 characters of `text`, stored so the sampler never reads the texts


def _write_ipc(target: Path, batches: object, schema: pa.Schema) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    schema = schema.append(pa.field(TEXT_CHARS, pa.int32(), nullable=False))
    try:
        with ipc.new_file(tmp, schema) as writer:
            for batch in batches:  # type: ignore[attr-defined]
                chars = pc.utf8_length(batch.column("text")).cast(pa.int32())
                writer.write_batch(pa.RecordBatch.from_arrays([*batch.columns, chars], schema=schema))
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _parquet_batches(path: Path, schema: pa.Schema) -> object:
    """The manifest's batches, each cast to `schema` and checked for nulls (the row is named)."""
    f = pq.ParquetFile(path)
    row = 0
    for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=schema.names):
        columns = []
        for field in schema:
            col = batch.column(field.name)
            if col.null_count and field.name in MANIFEST_SCHEMA.names:
                first = row + pc.index(pc.is_null(col), True).as_py()
                raise ManifestError(
                    f"{path} column {field.name!r} is null in row {first} (and {col.null_count - 1} more of "
                    f"rows {row}-{row + batch.num_rows - 1}); fix those rows or rebuild the manifest"
                )
            columns.append(col.cast(field.type))
        row += batch.num_rows
        yield pa.RecordBatch.from_arrays(columns, schema=schema)


def _parquet_schema(path: Path) -> pa.Schema:
    names = pq.read_schema(path).names
    missing = [f.name for f in MANIFEST_SCHEMA if f.name not in names]
    if missing:
        raise ManifestError(
            f"{path} is missing column {', '.join(map(repr, missing))}; a training manifest has "
            f"{MANIFEST_SCHEMA.names}: rebuild it with `speechlm manifest build`"
        )
    return pa.schema(list(MANIFEST_SCHEMA) + [f for f in LOCATOR_SCHEMA if f.name in names])


def open_index(
    path: str | os.PathLike[str],
    kind: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    default_lang: str | None = None,
) -> pa.Table:
    """The manifest table of any source at `path`, memory-mapped from the index cache."""
    from speechlm.data.sources.detect import detect_source_type, load_source

    path = Path(path)
    kind = kind or detect_source_type(path)
    if not path.exists():
        raise ManifestError(f"manifest {path} does not exist; build it with `speechlm manifest build`")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = folder / f"{path.name}.{source_fingerprint(path)}.arrow"
    if target.is_file():
        try:
            return _map(target)
        except (pa.ArrowInvalid, OSError, ValueError) as e:  # damaged on disk: rebuild it
            logger.warning("index cache %s is unreadable (%s); rebuilding it from %s", target, e, path)
            target.unlink(missing_ok=True)
    if not target.is_file():
        t0 = time.monotonic()
        print(
            f"indexing {path} ({kind}) into {target} (once; later runs map it)", file=sys.stderr, flush=True
        )
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if kind == "parquet":
                schema = _parquet_schema(path)
                _write_ipc(target, _parquet_batches(path, schema), schema)
            else:
                table = load_source(path, kind, default_lang=default_lang)
                _write_ipc(target, table.to_batches(max_chunksize=BATCH_ROWS), table.schema)
        except (OSError, pa.ArrowInvalid) as e:
            # a full disk or a read-only cache costs memory, not correctness; a corrupt manifest gets
            # its own error from the plain reader below
            logger.warning("cannot write the index cache %s (%s); using %s from memory", target, e, path)
            return load_source(path, kind, default_lang=default_lang)
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
