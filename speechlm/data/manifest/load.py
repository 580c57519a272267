"""Reading parquet with checks: a shard file against the columns it must have (`_read_checked`),
a training manifest against `MANIFEST_SCHEMA` (`read_parquet_manifest`, the ``parquet`` reader of
`speechlm.data.sources.detect`), and the per-row numbers a sampler needs as flat arrays
(`manifest_arrays`, decoding dictionary columns). Nothing here detects a format: that is
`sources.detect`'s one job, and it imports this module, never the other way round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speechlm.data.manifest.schema import (
    CONVERSATION_SCHEMA,
    LOCATOR_SCHEMA,
    MANIFEST_SCHEMA,
    ManifestError,
    _encode_sorted,
    check_conversations,
    conversation_columns,
    llm_text_chars,
)

NOT_NULL_COLUMNS = ("segment_id",)


def _kind_of(type_: pa.DataType) -> str:
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    if pa.types.is_null(type_):
        return "null"
    if pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_):
        return "string"
    if pa.types.is_floating(type_) or pa.types.is_integer(type_):
        return "number"
    return str(type_)


def _read_checked(path: Path, required: dict[str, str], optional: dict[str, str]) -> pa.Table:
    """Read `path`'s required and present optional columns; raise ManifestError naming what is wrong."""
    if not path.is_file():
        raise ManifestError(
            f"{path} is missing: every shard directory needs metadata.parquet and audio_index.parquet; "
            "restore the file or move the shard out of the shards directory"
        )
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(
            f"{path} is not a readable parquet file ({e}); re-export the shard or move it out"
        ) from None
    missing = [c for c in required if c not in schema.names]
    if missing:
        raise ManifestError(
            f"{path} has no column {', '.join(repr(c) for c in missing)} (it has {schema.names}); "
            f"the shard must provide {list(required)}; re-export it with those columns"
        )
    wanted = {**required, **{c: k for c, k in optional.items() if c in schema.names}}
    for name, kind in wanted.items():
        got = _kind_of(schema.field(name).type)
        if got != kind and got != "null":  # an all-null column is checked for nulls below
            expected = "a string" if kind == "string" else "a number (float or int)"
            raise ManifestError(
                f"{path} column {name!r} has type {schema.field(name).type}, expected {expected}; "
                f"re-export the shard with {name!r} as {'string' if kind == 'string' else 'float64'}"
            )
    try:
        table = pq.read_table(path, columns=list(wanted))
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(f"{path} could not be read ({e}); re-export the shard or move it out") from None
    for name in NOT_NULL_COLUMNS:
        if name in wanted and table.column(name).null_count:
            raise ManifestError(
                f"{path} column {name!r} has {table.column(name).null_count} null values; "
                "every row needs an id: fix the exporter"
            )
    return table


def resolve_audio_paths(columns: pa.RecordBatch | pa.Table, base: Path) -> pa.Array | pa.ChunkedArray:
    """``audio_filepath`` of `columns` with relative paths made absolute against `base` (the manifest's
    folder, as NeMo resolves them); tar members (rows with a ``tar_path``) are names, left alone."""
    col = columns.column("audio_filepath")
    if not pa.types.is_string(col.type):
        col = col.cast(pa.string())
    relative = pc.invert(pc.starts_with(col, "/"))
    if "tar_path" in columns.column_names:
        relative = pc.and_(relative, pc.is_null(columns.column("tar_path")))
    if not pc.any(relative).as_py():
        return col
    joined = pc.binary_join_element_wise(pa.scalar(str(base.resolve())), col, "/")
    return pc.if_else(relative, joined, col)


def _nemo_line(path: Path, row: int) -> int | None:
    """The line number of row `row` of NeMo manifest `path` (its rows are its non-empty lines)."""
    try:
        with path.open("rb") as f:
            seen = -1
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    seen += 1
                    if seen == row:
                        return line_no
    except OSError:
        return None
    return None


def check_durations(table: pa.Table, path: Path, kind: str | None = None) -> None:
    """ManifestError naming the first row (``FILE:LINE`` for NeMo JSON) whose duration is not a finite
    number > 0: the sampler packs by duration, so such a row cannot be planned."""
    durations = table.column("duration").to_numpy()
    bad = ~(np.isfinite(durations) & (durations > 0))
    if not bad.any():
        return
    row = int(np.flatnonzero(bad)[0])
    line = _nemo_line(path, row) if kind == "nemo" else None
    where = f"{path}:{line}" if line is not None else f"{path}, row {row}"
    seg = table.column("segment_id")[row].as_py() if "segment_id" in table.column_names else None
    named = f" (segment {seg})" if seg is not None else ""
    raise ManifestError(
        f"{where}{named}: duration {float(durations[row])!r} s is not a finite number > 0 "
        f"({int(bad.sum())} such rows in all); put the audio's length in seconds there, or remove the "
        "row, and rebuild the manifest"
    )


def read_parquet_manifest(path: str | os.PathLike[str]) -> pa.Table:
    """A parquet training manifest, checked against `MANIFEST_SCHEMA` (locator columns kept), in memory.

    The reader of the ``parquet`` kind; any path goes through `speechlm.data.sources.detect.load_source`
    (or, cached and memory-mapped, `speechlm.data.sources.mmap_cache.open_index`)."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} does not exist; build it with `speechlm manifest build`")
    try:
        schema = pq.read_schema(path)
        missing = [f.name for f in MANIFEST_SCHEMA if f.name not in schema.names]
        if missing:
            raise ManifestError(
                f"{path} is missing column {', '.join(map(repr, missing))}; a training manifest "
                f"has {MANIFEST_SCHEMA.names}: rebuild it with `speechlm manifest build` or "
                "`speechlm manifest convert`"
            )
        conv = conversation_columns(schema.names, str(path))
        extra = [f.name for f in LOCATOR_SCHEMA if f.name in schema.names] + list(conv.values())
        table = pq.read_table(path, columns=MANIFEST_SCHEMA.names + extra)
        canonical = {held: name for name, held in conv.items()}  # prompt -> instruction, target -> answer
        table = table.rename_columns([canonical.get(n, n) for n in table.column_names])
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(f"{path} is not a readable parquet file ({e}); rebuild the manifest") from None
    table = table.set_column(
        table.schema.get_field_index("audio_filepath"),
        "audio_filepath",
        resolve_audio_paths(table, path.parent),
    )
    columns = []
    for f in MANIFEST_SCHEMA:
        col = table.column(f.name)
        if col.null_count:
            raise ManifestError(
                f"{path} column {f.name!r} has {col.null_count} null values; rebuild the manifest"
            )
        try:
            columns.append(col.cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ManifestError(
                f"{path} column {f.name!r} has type {col.type}, expected {f.type} ({e}); rebuild the manifest"
            ) from None
    check_conversations(table, str(path))
    fields = list(MANIFEST_SCHEMA)
    for f in (*LOCATOR_SCHEMA, *CONVERSATION_SCHEMA):
        if f.name in table.column_names:
            columns.append(table.column(f.name).cast(f.type))
            fields.append(f)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


@dataclass(frozen=True)
class ManifestArrays:
    """The per-row numbers a sampler needs, as flat numpy arrays (no Python object per row)."""

    durations: np.ndarray  # float32 [N], seconds
    lang_codes: np.ndarray  # int16 [N], index into lang_names
    lang_names: list[str]  # sorted
    text_lengths: np.ndarray  # int32 [N], characters of `text` (tag included)

    def __len__(self) -> int:
        return int(self.durations.size)


def dictionary_codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Codes into the sorted names of the used values, from each chunk's indices (no strings made)."""
    dictionaries = [chunk.dictionary.to_pylist() for chunk in col.chunks]
    names = sorted({v for d in dictionaries for v in d})
    position = {v: i for i, v in enumerate(names)}
    codes = np.empty(len(col), np.int64)
    start = 0
    for chunk, dictionary in zip(col.chunks, dictionaries):
        remap = np.array([position[v] for v in dictionary], dtype=np.int64)
        indices = chunk.indices.to_numpy(zero_copy_only=False)
        codes[start : start + len(chunk)] = remap[indices] if remap.size else indices
        start += len(chunk)
    used = np.unique(codes)
    if used.size < len(names):  # drop dictionary entries no row uses
        return np.searchsorted(used, codes), [names[i] for i in used]
    return codes, names


def manifest_arrays(table: pa.Table) -> ManifestArrays:
    """Extract `ManifestArrays` from a manifest table (dictionary or plain string ``lang``)."""
    durations = table.column("duration").cast(pa.float32()).to_numpy()
    lang = table.column("lang")
    if lang.null_count:
        raise ManifestError(f"column 'lang' has {lang.null_count} null values; every row needs a language")
    if pa.types.is_dictionary(lang.type):
        codes, names = dictionary_codes(lang)
    else:
        codes, names = _encode_sorted(lang, "lang", np.iinfo(np.int16).max)
    if "text_chars" in table.column_names:  # the index cache stores them (sources/mmap_cache.py)
        lengths = table.column("text_chars").to_numpy()
    else:
        lengths = llm_text_chars(table).to_numpy()
    return ManifestArrays(
        durations=np.ascontiguousarray(durations, dtype=np.float32),
        lang_codes=codes.astype(np.int16),
        lang_names=names,
        text_lengths=lengths.astype(np.int32),
    )


def task_codes(table: pa.Table) -> tuple[np.ndarray, list[str]] | None:
    """Each row's task (a null ``task`` is "asr") as codes into the sorted task names; None when the table
    has no ``task`` column (every row is a transcript: "asr")."""
    if "task" not in table.column_names:
        return None
    col = table.column("task").cast(pa.string()).fill_null("asr")
    codes, names = _encode_sorted(col, "task", np.iinfo(np.int16).max)
    return codes.astype(np.int16), names
