"""Training manifests: one parquet row per utterance, built from raw shards, NeMo or Lhotse.

Schema (`MANIFEST_SCHEMA`): ``segment_id`` string, ``shard_id`` dictionary<int32,string>,
``audio_filepath`` string (absolute), ``duration`` float32 seconds, ``text`` string (cleaned by
`speechlm.data.text.clean_text`, starting with the language tag ``<|xx|>``), ``lang``
dictionary<int8,string>, ``source`` dictionary<int8,string> (``shards``, ``nemo``, ``lhotse``).
Repeated strings are dictionary-encoded and every column is a flat Arrow buffer, so ten million rows
cost about the size of their strings, with no Python object per row (see docs/data.md, memory).

`build_manifest` turns a directory of raw shards into ``train.parquet``, ``val.parquet`` and
``build_report.json`` in one vectorised pass:

1. Read every shard's ``metadata.parquet`` and ``audio_index.parquet``, checking columns and types
   first. A bad shard fails the build, listing every bad shard at once, unless
   ``skip_bad_shards=True``, which goes on and lists them in the report as failed shards.
2. Look each metadata row up in the index by ``segment_id`` (`pyarrow.compute.index_in`: an
   order-preserving inner join, first index entry wins); the audio path is
   ``<shard_dir>/<tar_member_name>``, or ``dirname(tar_path)/<tar_member_name>`` in the legacy layout.
3. Give each row the first reason, in `DROP_REASONS` order, that drops it: no index entry, no usable
   language (``segment_language`` null or blank falls back to the shard-name prefix ``hi`` of
   ``hi_000``), a null/NaN/negative duration, too short, too long, quality below the threshold (or
   null), blank text, text empty after cleaning, and last a ``segment_id`` already kept (the first
   kept copy wins, so a duplicate of a filtered row is not lost).
4. Clean the text once per distinct string (dictionary-encode, clean the dictionary, take), then
   prepend the language tag.
5. Split train/val by a stable hash of ``segment_id``: ``u = splitmix64(fnv1a64(utf8(id)) ^
   splitmix64(seed)) / 2**64`` and a row is val when ``u < val_fraction``. The hash runs over byte
   columns in numpy, so no per-row Python. A row's split depends only on its id and the seed, so
   adding shards never moves an existing row between train and val. Per language: a language with
   at least 2 rows gets at least one val row (the row of smallest u) and keeps at least one train
   row (the row of largest u) when ``0 < val_fraction``; a language with a single row keeps it in
   train.

Default filters: 0.5 s <= duration <= 20 s (shorter clips are mostly fillers, longer ones blow up
micro-batch budgets), ``tx_quality_score >= 0.5`` (`DEFAULT_MIN_QUALITY`, the midpoint of the score
range: the scorer's own accept/reject boundary, which drops the transcripts it judged more likely
wrong than right; raise it for cleaner, smaller data), 5 % validation.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speechlm.data.text import clean_text, lang_tag, normalize_lang, split_lang_tag, tag_text

DEFAULT_MIN_DURATION = 0.5
DEFAULT_MAX_DURATION = 20.0
DEFAULT_MIN_QUALITY = 0.5
DEFAULT_VAL_FRACTION = 0.05

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("segment_id", pa.string(), nullable=False),
        pa.field("shard_id", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("audio_filepath", pa.string(), nullable=False),
        pa.field("duration", pa.float32(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("lang", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("source", pa.dictionary(pa.int8(), pa.string()), nullable=False),
    ]
)

DROP_REASONS = (
    "no_audio_index",
    "missing_language",
    "invalid_duration",
    "too_short",
    "too_long",
    "low_quality",
    "empty_text",
    "empty_after_cleaning",
    "duplicate",
)
UNKNOWN_LANG = "?"  # report key for rows whose language could not be determined

# column -> kind ("string" or "number"); None-typed (all-null) columns are accepted where nullable
METADATA_COLUMNS = {
    "segment_id": "string",
    "transcription_native": "string",
    "duration_s": "number",
    "tx_quality_score": "number",
    "segment_language": "string",
}
INDEX_COLUMNS = {"segment_id": "string", "tar_member_name": "string"}
INDEX_OPTIONAL_COLUMNS = {"tar_path": "string"}
NOT_NULL_COLUMNS = ("segment_id",)


class ManifestError(ValueError):
    """A shard, manifest or option that cannot be used; the message says where and what to do."""


# --------------------------------------------------------------------------------------------- report
@dataclass
class BuildReport:
    """What `build_manifest` kept and dropped, per language; `format()` renders it as tables."""

    shards_dir: str
    out_dir: str
    settings: dict[str, float | int] = field(default_factory=dict)
    shards_read: int = 0
    rows_read: int = 0
    kept: dict[str, dict[str, int]] = field(default_factory=dict)  # lang -> {"train": n, "val": n}
    kept_hours: dict[str, float] = field(default_factory=dict)  # lang -> hours, train + val
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)  # reason -> lang -> n
    failed_shards: dict[str, str] = field(default_factory=dict)  # shard path -> error message
    elapsed_s: float = 0.0

    @property
    def total_kept(self) -> int:
        return sum(c["train"] + c["val"] for c in self.kept.values())

    @property
    def total_dropped(self) -> int:
        return sum(sum(per_lang.values()) for per_lang in self.dropped.values())

    def dropped_count(self, reason: str, lang: str | None = None) -> int:
        """Rows dropped for `reason` (one of `DROP_REASONS`), in `lang` or in all languages."""
        per_lang = self.dropped.get(reason, {})
        return sum(per_lang.values()) if lang is None else per_lang.get(lang, 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total_kept": self.total_kept, "total_dropped": self.total_dropped}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")

    def format(self) -> str:
        """Readable summary: totals, kept per language, dropped per reason and language, failures."""
        train = sum(c["train"] for c in self.kept.values())
        val = sum(c["val"] for c in self.kept.values())
        lines = [
            f"manifest build: {self.shards_dir} -> {self.out_dir}",
            f"  shards read {self.shards_read}, failed {len(self.failed_shards)}; rows read {self.rows_read}, "
            f"kept {self.total_kept} (train {train}, val {val}), dropped {self.total_dropped}; "
            f"{self.elapsed_s:.1f} s",
            "  settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
            "",
        ]
        rows = [
            [lang, c["train"], c["val"], f"{self.kept_hours.get(lang, 0.0):.2f}"]
            for lang, c in self.kept.items()
        ]
        rows.append(["total", train, val, f"{sum(self.kept_hours.values()):.2f}"])
        lines += _format_table(["kept", "train", "val", "hours"], rows) + [""]
        langs = sorted({lang for per_lang in self.dropped.values() for lang in per_lang})
        drop_rows = [
            [
                reason,
                *(self.dropped.get(reason, {}).get(lang, 0) for lang in langs),
                self.dropped_count(reason),
            ]
            for reason in DROP_REASONS
        ]
        drop_rows.append(
            [
                "total",
                *(sum(self.dropped.get(r, {}).get(lang, 0) for r in DROP_REASONS) for lang in langs),
                self.total_dropped,
            ]
        )
        lines += _format_table(["dropped", *langs, "total"], drop_rows)
        if self.failed_shards:
            lines += ["", f"failed shards ({len(self.failed_shards)}, skipped):"]
            lines += [f"  {path}: {msg}" for path, msg in self.failed_shards.items()]
        return "\n".join(lines)


def _format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-align the first column, right-align the others."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = []
    for row in cells:
        first = row[0].ljust(widths[0])
        out.append(("  " + "  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))])).rstrip())
    return out


# ----------------------------------------------------------------------------------------- shards
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


def _as_string(col: pa.ChunkedArray) -> pa.ChunkedArray:
    return col.cast(pa.string())


def _as_float64(col: pa.ChunkedArray) -> np.ndarray:
    return pc.fill_null(col.cast(pa.float64()), float("nan")).to_numpy()


def shard_language(shard_name: str) -> str | None:
    """The language of a shard named ``<lang>_<rest>`` (``hi_000`` -> ``hi``); None if it has none."""
    prefix, sep, _ = shard_name.partition("_")
    return normalize_lang(prefix) if sep else None


def _read_shard(shard_dir: Path) -> pa.Table:
    """Candidate rows of one shard: segment_id, audio_filepath (null: no index entry), duration,
    quality, text (raw), lang (null: unknown)."""
    meta = _read_checked(shard_dir / "metadata.parquet", METADATA_COLUMNS, {})
    index = _read_checked(shard_dir / "audio_index.parquet", INDEX_COLUMNS, INDEX_OPTIONAL_COLUMNS)
    base = os.path.abspath(shard_dir)

    member = _as_string(index.column("tar_member_name"))
    absolute = pc.fill_null(pc.starts_with(member, "/"), False)
    paths = pc.binary_join_element_wise(pa.scalar(base), member, "/")
    if "tar_path" in index.column_names:  # legacy: the audio sits next to the tar it came from
        tar_path = _as_string(index.column("tar_path")).combine_chunks().dictionary_encode()
        dirs = [
            os.path.normpath(os.path.join(base, os.path.dirname(p))) for p in tar_path.dictionary.to_pylist()
        ]
        legacy_dir = pc.take(pa.array(dirs, pa.string()), tar_path.indices)
        legacy = pc.binary_join_element_wise(legacy_dir, member, "/")
        paths = pc.if_else(pc.is_null(legacy_dir), paths, legacy)
    paths = pc.if_else(absolute, member, paths)  # null where tar_member_name is null: no audio

    seg = _as_string(meta.column("segment_id"))
    hit = pc.index_in(seg, value_set=_as_string(index.column("segment_id")).combine_chunks())
    audio = pc.take(paths, pc.fill_null(hit, 0)) if len(index) else pa.nulls(len(meta), pa.string())
    audio = pc.if_else(pc.is_null(hit), pa.scalar(None, pa.string()), audio)

    lang = pc.utf8_lower(pc.utf8_trim_whitespace(_as_string(meta.column("segment_language"))))
    fallback = shard_language(shard_dir.name)
    blank = pc.fill_null(pc.equal(lang, ""), True)
    lang = pc.if_else(blank, pa.scalar(fallback, pa.string()), lang)
    valid = pc.fill_null(pc.match_substring_regex(lang, r"^[a-z][a-z0-9_-]*$"), False)
    lang = pc.if_else(valid, lang, pa.scalar(None, pa.string()))

    return pa.table(
        {
            "segment_id": seg,
            "audio_filepath": audio,
            "duration": meta.column("duration_s").cast(pa.float64()),
            "quality": meta.column("tx_quality_score").cast(pa.float64()),
            "text": _as_string(meta.column("transcription_native")),
            "lang": lang,
        }
    )


def list_shards(shards_dir: str | os.PathLike[str]) -> list[Path]:
    """Shard directories of `shards_dir`, sorted by name (hidden and ``_``-prefixed ones skipped)."""
    root = Path(shards_dir)
    if not root.is_dir():
        raise ManifestError(
            f"shards directory {root} does not exist or is not a directory; pass the folder "
            "that holds one sub-folder per shard (<shard_id>/metadata.parquet, ...)"
        )
    shards = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    if not shards:
        raise ManifestError(
            f"shards directory {root} has no shard sub-folders; expected <shard_id>/"
            "metadata.parquet and <shard_id>/audio_index.parquet inside it"
        )
    return shards


# ------------------------------------------------------------------------------------------ hashing
_U64 = np.uint64
_FNV_OFFSET = _U64(0xCBF29CE484222325)
_FNV_PRIME = _U64(0x100000001B3)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def hash_uniform(ids: pa.Array | pa.ChunkedArray, seed: int = 0, *, block: int = 1 << 20) -> np.ndarray:
    """Stable uniform [0, 1) value per string: ``splitmix64(fnv1a64(utf8) ^ len ^ splitmix64(seed))``.

    Vectorised over byte columns: for each byte position j, every string longer than j folds its
    j-th byte into its FNV-1a state; the same id gives the same value on any machine and run.
    """
    chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
    salt = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    out = []
    for chunk in chunks:
        chunk = chunk.cast(pa.large_string())  # int64 offsets, one code path
        if chunk.null_count:
            raise ManifestError("cannot hash null ids: every row needs a segment_id")
        _, offsets_buf, data_buf = chunk.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=len(chunk) + 1, offset=chunk.offset * 8)
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(1, np.uint8)
        data = data if data.size else np.zeros(1, np.uint8)
        for lo in range(0, len(chunk), block):
            starts = offsets[lo : lo + block + 1]
            lengths = np.diff(starts)
            starts = starts[:-1]
            h = np.full(lengths.size, _FNV_OFFSET, dtype=np.uint64)
            for j in range(int(lengths.max(initial=0))):
                active = lengths > j
                byte = data[np.minimum(starts + j, data.size - 1)].astype(np.uint64)
                h = np.where(active, (h ^ byte) * _FNV_PRIME, h)
            out.append(_splitmix64(h ^ lengths.astype(np.uint64) ^ salt))
    h = np.concatenate(out) if out else np.zeros(0, np.uint64)
    return (h >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def split_val(u: np.ndarray, lang_codes: np.ndarray, val_fraction: float) -> np.ndarray:
    """Boolean val mask: ``u < val_fraction``, then per language at least one val row and one train
    row when it has 2+ rows (and the only row of a 1-row language in train)."""
    is_val = u < val_fraction
    if val_fraction <= 0:
        return is_val
    for code in np.unique(lang_codes):
        rows = np.flatnonzero(lang_codes == code)
        if rows.size == 1:
            is_val[rows] = False
            continue
        if not is_val[rows].any():
            is_val[rows[np.argmin(u[rows])]] = True
        if is_val[rows].all():
            is_val[rows[np.argmax(u[rows])]] = False
    return is_val


# ------------------------------------------------------------------------------------------- tables
def _dictionary(codes: np.ndarray, names: Sequence[str], index_type: pa.DataType) -> pa.DictionaryArray:
    indices = pa.array(codes.astype(index_type.to_pandas_dtype(), copy=False), index_type)
    return pa.DictionaryArray.from_arrays(indices, pa.array(list(names), pa.string()))


def _encode_sorted(values: pa.Array | pa.ChunkedArray, what: str, limit: int) -> tuple[np.ndarray, list[str]]:
    """Codes (int64) into the sorted distinct values; error if more than `limit` distinct values."""
    names = sorted(pc.unique(values).to_pylist())
    if len(names) > limit:
        raise ManifestError(f"{len(names)} distinct {what} values, the manifest schema holds at most {limit}")
    codes = pc.index_in(values, value_set=pa.array(names, pa.string()))
    return np.asarray(codes.to_numpy(zero_copy_only=False), dtype=np.int64), names


Column: TypeAlias = Sequence[str] | pa.Array | pa.ChunkedArray


def _string_column(values: Column) -> pa.Array | pa.ChunkedArray:
    return values if isinstance(values, pa.Array | pa.ChunkedArray) else pa.array(list(values), pa.string())


def _dict_column(values: Column | str, n: int, index_type: pa.DataType, what: str) -> pa.Array:
    """A dictionary column: a constant for a str, a cast for a dictionary array, else sorted codes."""
    if isinstance(values, str):
        return _dictionary(np.zeros(n, np.int64), [values], index_type)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.DictionaryArray):
        return values.cast(pa.dictionary(index_type, pa.string()))
    limit = int(np.iinfo(index_type.to_pandas_dtype()).max)
    codes, names = _encode_sorted(_string_column(values), what, limit)
    return _dictionary(codes, names, index_type)


def build_manifest_table(
    segment_ids: Column,
    audio_filepaths: Column,
    durations: Sequence[float] | np.ndarray,
    texts: Column,
    langs: Column,
    *,
    shard_ids: Column | str,
    source: str,
) -> pa.Table:
    """Assemble a table in `MANIFEST_SCHEMA` from columns (texts already cleaned and tagged).

    `shard_ids` and `langs` may be one string per row, a dictionary array, or (shard_ids) one
    string for all rows.
    """
    n = len(segment_ids)
    columns = [
        _string_column(segment_ids),
        _dict_column(shard_ids, n, pa.int32(), "shard_id"),
        _string_column(audio_filepaths),
        pa.array(np.asarray(durations, dtype=np.float32), pa.float32()),
        _string_column(texts),
        _dict_column(langs, n, pa.int8(), "lang"),
        _dict_column(source, n, pa.int8(), "source"),
    ]
    return pa.Table.from_arrays(columns, schema=MANIFEST_SCHEMA)


def clean_text_column(texts: pa.ChunkedArray) -> pa.ChunkedArray:
    """`clean_text` over a column, once per distinct string of each chunk."""
    out = []
    for chunk in texts.chunks:
        encoded = chunk.dictionary_encode()
        cleaned = pa.array([clean_text(t) for t in encoded.dictionary.to_pylist()], pa.string())
        out.append(pc.take(cleaned, encoded.indices))
    return pa.chunked_array(out, pa.string())


# -------------------------------------------------------------------------------------------- build
def build_manifest(
    shards_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    min_duration: float = DEFAULT_MIN_DURATION,
    max_duration: float = DEFAULT_MAX_DURATION,
    min_quality: float = DEFAULT_MIN_QUALITY,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = 0,
    skip_bad_shards: bool = False,
) -> BuildReport:
    """Build ``train.parquet``, ``val.parquet`` and ``build_report.json`` in `out_dir` (see module doc)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ManifestError(f"val_fraction={val_fraction} is outside [0, 1); pass e.g. 0.05 for 5 %")
    if not 0.0 <= min_duration <= max_duration:
        raise ManifestError(
            f"min_duration={min_duration} and max_duration={max_duration} must satisfy "
            "0 <= min_duration <= max_duration"
        )
    start = time.perf_counter()
    report = BuildReport(
        shards_dir=str(shards_dir),
        out_dir=str(out_dir),
        settings={
            "min_duration": min_duration,
            "max_duration": max_duration,
            "min_quality": min_quality,
            "val_fraction": val_fraction,
            "seed": seed,
        },
    )
    shards = list_shards(shards_dir)
    tables: list[pa.Table] = []
    shard_codes: list[np.ndarray] = []
    shard_names: list[str] = []
    failures: dict[str, str] = {}
    for shard_dir in shards:
        try:
            table = _read_shard(shard_dir)
        except ManifestError as e:
            failures[str(shard_dir)] = str(e)
            continue
        tables.append(table)
        shard_codes.append(np.full(len(table), len(shard_names), np.int32))
        shard_names.append(shard_dir.name)
    if failures and not skip_bad_shards:
        listing = "\n".join(f"  - {path}: {msg}" for path, msg in failures.items())
        raise ManifestError(
            f"{len(failures)} of {len(shards)} shards in {shards_dir} are unusable:\n{listing}\n"
            "Fix or remove them, or pass --skip-bad-shards (skip_bad_shards=True) to build without them "
            "(they are then listed in the report)."
        )
    report.failed_shards = failures
    report.shards_read = len(tables)
    if not tables:
        raise ManifestError(
            f"no usable shard in {shards_dir}: all {len(shards)} failed:\n"
            + "\n".join(f"  - {p}: {m}" for p, m in failures.items())
        )

    rows = pa.concat_tables(tables)
    shard = np.concatenate(shard_codes)
    n = len(rows)
    report.rows_read = n
    reason = np.full(n, -1, dtype=np.int8)

    def drop(mask: np.ndarray, name: str) -> None:
        reason[(reason < 0) & mask] = DROP_REASONS.index(name)

    duration = _as_float64(rows.column("duration"))
    quality = _as_float64(rows.column("quality"))
    with np.errstate(invalid="ignore"):
        drop(rows.column("audio_filepath").is_null().to_numpy(zero_copy_only=False), "no_audio_index")
        drop(rows.column("lang").is_null().to_numpy(zero_copy_only=False), "missing_language")
        drop(~np.isfinite(duration) | (duration < 0), "invalid_duration")
        drop(duration < min_duration, "too_short")
        drop(duration > max_duration, "too_long")
        drop(~(quality >= min_quality), "low_quality")
    raw_text = rows.column("text")
    blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(raw_text), ""), True)
    drop(blank.to_numpy(zero_copy_only=False), "empty_text")

    survivors = np.flatnonzero(reason < 0)
    cleaned = clean_text_column(raw_text.take(survivors))
    empty = pc.equal(cleaned, "").to_numpy(zero_copy_only=False)
    reason[survivors[empty]] = DROP_REASONS.index("empty_after_cleaning")
    cleaned = cleaned.filter(pa.array(~empty))
    survivors = survivors[~empty]

    seg_ids = rows.column("segment_id").take(survivors)
    seg_codes = pc.dictionary_encode(seg_ids.cast(pa.large_string()).combine_chunks()).indices.to_numpy()
    _, first = np.unique(seg_codes, return_index=True)
    is_first = np.zeros(survivors.size, bool)
    is_first[first] = True
    reason[survivors[~is_first]] = DROP_REASONS.index("duplicate")
    keep = survivors[is_first]
    seg_ids, cleaned = seg_ids.filter(pa.array(is_first)), cleaned.filter(pa.array(is_first))

    langs = rows.column("lang").take(keep)
    lang_codes, lang_names = _encode_sorted(langs, "lang", 127)
    tags = pa.array([lang_tag(name) for name in lang_names], pa.string())
    texts = pc.binary_join_element_wise(pa.chunked_array([pc.take(tags, lang_codes)]), cleaned, " ")
    table = build_manifest_table(
        seg_ids,
        rows.column("audio_filepath").take(keep),
        duration[keep],
        texts,
        _dictionary(lang_codes, lang_names, pa.int8()),
        shard_ids=_dictionary(shard[keep], shard_names, pa.int32()),
        source="shards",
    )
    is_val = split_val(hash_uniform(table.column("segment_id"), seed), lang_codes, val_fraction)

    _fill_counts(report, rows.column("lang"), reason, lang_names, lang_codes, is_val, duration[keep])
    report.elapsed_s = round(time.perf_counter() - start, 3)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "build_report.json")
    if not len(table):
        raise ManifestError(
            f"no row of {shards_dir} passed the filters; nothing written but the report "
            f"{out / 'build_report.json'}:\n{report.format()}"
        )
    pq.write_table(table.filter(pa.array(~is_val)), out / "train.parquet", compression="zstd")
    pq.write_table(table.filter(pa.array(is_val)), out / "val.parquet", compression="zstd")
    return report


def _fill_counts(
    report: BuildReport,
    all_langs: pa.ChunkedArray,
    reason: np.ndarray,
    lang_names: list[str],
    lang_codes: np.ndarray,
    is_val: np.ndarray,
    kept_durations: np.ndarray,
) -> None:
    """Kept rows per language and split, hours, and dropped rows per (reason, language)."""
    nl = len(lang_names)
    train = np.bincount(lang_codes[~is_val], minlength=nl)
    val = np.bincount(lang_codes[is_val], minlength=nl)
    hours = np.bincount(lang_codes, weights=kept_durations, minlength=nl) / 3600.0
    for i, name in enumerate(lang_names):
        report.kept[name] = {"train": int(train[i]), "val": int(val[i])}
        report.kept_hours[name] = round(float(hours[i]), 4)
    dropped = np.flatnonzero(reason >= 0)
    if not dropped.size:
        return
    langs = pc.fill_null(all_langs.take(dropped), UNKNOWN_LANG)
    codes, names = _encode_sorted(langs, "lang", 1 << 30)
    pair = reason[dropped].astype(np.int64) * len(names) + codes
    counts = np.bincount(pair, minlength=len(DROP_REASONS) * len(names)).reshape(
        len(DROP_REASONS), len(names)
    )
    for r, why in enumerate(DROP_REASONS):
        per_lang = {names[j]: int(counts[r, j]) for j in np.flatnonzero(counts[r])}
        if per_lang:
            report.dropped[why] = per_lang


# ------------------------------------------------------------------------------------------ readers
def read_nemo_manifest(path: str | os.PathLike[str], *, default_lang: str | None = None) -> pa.Table:
    """Read a NeMo JSON-lines manifest into `MANIFEST_SCHEMA` (source ``nemo``).

    Each line: ``audio_filepath`` (relative paths resolve against the manifest's folder),
    ``duration`` (s), ``text``, optional ``lang``. The language is ``lang``, else a leading ``<|xx|>``
    tag of the text, else `default_lang`. The id is ``segment_id``/``utt_id``/``id`` if present,
    else ``audio_filepath`` as written. Rows are not filtered: the file is taken as curated.
    """
    path = Path(path)
    default = None
    if default_lang is not None and (default := normalize_lang(default_lang)) is None:
        raise ManifestError(f"--lang {default_lang!r} is not a language code; pass e.g. 'hi' or 'en'")
    base = path.resolve().parent
    ids: list[str] = []
    paths: list[str] = []
    durations: list[float] = []
    texts: list[str] = []
    langs: list[str] = []
    try:
        handle = path.open("rb")
    except OSError as e:
        raise ManifestError(f"cannot open NeMo manifest {path}: {e.strerror}") from None
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ManifestError(f"{where}: not UTF-8 text; re-save the manifest as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ManifestError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line of a "
                    "NeMo manifest must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise ManifestError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            missing = [k for k in ("audio_filepath", "duration", "text") if row.get(k) is None]
            if missing:
                raise ManifestError(
                    f"{where}: missing key {', '.join(map(repr, missing))}; every line needs "
                    "audio_filepath, duration and text"
                )
            audio, duration, text = row["audio_filepath"], row["duration"], row["text"]
            if not isinstance(audio, str) or not audio:
                raise ManifestError(f"{where}: 'audio_filepath' must be a non-empty string, got {audio!r}")
            if isinstance(duration, bool) or not isinstance(duration, int | float):
                raise ManifestError(f"{where}: 'duration' must be a number of seconds, got {duration!r}")
            if not isinstance(text, str):
                raise ManifestError(f"{where}: 'text' must be a string, got {text!r}")
            if row.get("offset") not in (None, 0, 0.0):
                raise ManifestError(
                    f"{where}: 'offset' {row['offset']!r} is not supported; cut the audio into "
                    "one file per utterance"
                )
            tagged, text = split_lang_tag(text)
            lang = row.get("lang")
            if lang is not None and (not isinstance(lang, str) or normalize_lang(lang) is None):
                raise ManifestError(f"{where}: 'lang' {lang!r} is not a language code; use e.g. 'hi' or 'en'")
            code = normalize_lang(lang) if lang is not None else (tagged or default)
            if code is None:
                raise ManifestError(
                    f"{where}: no language: the line has no 'lang' and its text no <|xx|> "
                    "tag; add \"lang\" to every line or pass --lang xx (default_lang='xx')"
                )
            seg = row.get("segment_id") or row.get("utt_id") or row.get("id") or audio
            ids.append(str(seg))
            paths.append(os.path.normpath(os.path.join(base, audio)))
            durations.append(float(duration))
            texts.append(tag_text(clean_text(text), code))
            langs.append(code)
    return build_manifest_table(ids, paths, durations, texts, langs, shard_ids=path.name, source="nemo")


def load_manifest(path: str | os.PathLike[str], *, default_lang: str | None = None) -> pa.Table:
    """Load a training manifest: ``.parquet`` (checked against `MANIFEST_SCHEMA`) or NeMo ``.json(l)``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir():
        raise ManifestError(f"{path} is a directory; pass one manifest file, e.g. {path / 'train.parquet'}")
    if suffix in (".json", ".jsonl"):
        return read_nemo_manifest(path, default_lang=default_lang)
    if suffix != ".parquet":
        raise ManifestError(
            f"{path}: unknown manifest format {suffix!r}; expected .parquet (from "
            "`speechlm manifest build`) or a NeMo .json/.jsonl"
        )
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
        table = pq.read_table(path, columns=MANIFEST_SCHEMA.names)
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(f"{path} is not a readable parquet file ({e}); rebuild the manifest") from None
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
    return pa.Table.from_arrays(columns, schema=MANIFEST_SCHEMA)


# ---------------------------------------------------------------------------------- arrays and stats
@dataclass(frozen=True)
class ManifestArrays:
    """The per-row numbers a sampler needs, as flat numpy arrays (no Python object per row)."""

    durations: np.ndarray  # float32 [N], seconds
    lang_codes: np.ndarray  # int16 [N], index into lang_names
    lang_names: list[str]  # sorted
    text_lengths: np.ndarray  # int32 [N], characters of `text` (tag included)

    def __len__(self) -> int:
        return int(self.durations.size)


def _decode_dictionary_codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
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
        codes, names = _decode_dictionary_codes(lang)
    else:
        codes, names = _encode_sorted(lang, "lang", np.iinfo(np.int16).max)
    lengths = pc.utf8_length(table.column("text")).to_numpy()
    return ManifestArrays(
        durations=np.ascontiguousarray(durations, dtype=np.float32),
        lang_codes=codes.astype(np.int16),
        lang_names=names,
        text_lengths=lengths.astype(np.int32),
    )


def _count_bins(longest: float, width: float) -> int:
    """Bins of `width` from 0 s such that `longest` falls inside the last one (not on its top edge)."""
    return int(np.floor(longest / width + 1e-9)) + 1


def manifest_stats(table: pa.Table, *, bin_width: float | None = None) -> dict[str, Any]:
    """Hours and utterances per language and in total, and a duration histogram per language.

    The histogram bins start at 0 s; `bin_width` defaults to the smallest of 0.1, 0.25, 0.5, 1, 2, 5,
    10 s that needs at most 40 bins.
    """
    arr = manifest_arrays(table)
    d = arr.durations.astype(np.float64)
    if bin_width is None:
        longest = float(d.max(initial=0.0))
        bin_width = next((w for w in (0.1, 0.25, 0.5, 1.0, 2.0, 5.0) if _count_bins(longest, w) <= 40), 10.0)
    edges = np.round(np.arange(_count_bins(float(d.max(initial=0.0)), bin_width) + 1) * bin_width, 6)
    languages: dict[str, Any] = {}
    for code, name in enumerate(arr.lang_names):
        dl = d[arr.lang_codes == code]
        languages[name] = {
            "utterances": int(dl.size),
            "hours": round(float(dl.sum()) / 3600.0, 4),
            "mean_duration_s": round(float(dl.mean()), 3) if dl.size else 0.0,
            "min_duration_s": round(float(dl.min()), 3) if dl.size else 0.0,
            "max_duration_s": round(float(dl.max()), 3) if dl.size else 0.0,
            "histogram": np.histogram(dl, bins=edges)[0].tolist(),
        }
    return {
        "utterances": int(d.size),
        "hours": round(float(d.sum()) / 3600.0, 4),
        "mean_duration_s": round(float(d.mean()), 3) if d.size else 0.0,
        "languages": languages,
        "histogram": {"bin_edges_s": edges.tolist(), "counts": np.histogram(d, bins=edges)[0].tolist()},
    }


def format_stats(stats: dict[str, Any]) -> str:
    """`manifest_stats` as a table plus a text histogram."""
    rows = [
        [
            name,
            s["utterances"],
            f"{s['hours']:.2f}",
            f"{s['mean_duration_s']:.2f}",
            f"{s['min_duration_s']:.2f}",
            f"{s['max_duration_s']:.2f}",
        ]
        for name, s in stats["languages"].items()
    ]
    rows.append(
        ["total", stats["utterances"], f"{stats['hours']:.2f}", f"{stats['mean_duration_s']:.2f}", "", ""]
    )
    lines = _format_table(["lang", "utterances", "hours", "mean s", "min s", "max s"], rows)
    edges, counts = stats["histogram"]["bin_edges_s"], stats["histogram"]["counts"]
    peak = max(counts, default=0) or 1
    first = next((i for i, c in enumerate(counts) if c), 0)  # leading empty bins are not printed
    lines += ["", "  duration histogram (s):"]
    for lo, hi, c in zip(edges[first:-1], edges[first + 1 :], counts[first:]):
        lines.append(f"  {lo:6.2f}-{hi:<6.2f} {c:>9}  {'#' * round(40 * c / peak)}".rstrip())
    return "\n".join(lines)


def plot_stats(stats: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Save a PNG: hours per language (bars) and the duration histogram stacked by language."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib is slow to import
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_hours, ax_hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    names = list(stats["languages"])
    hours = [stats["languages"][n]["hours"] for n in names]
    bars = ax_hours.bar(names, hours, color="#4c72b0")
    for bar, name in zip(bars, names):
        ax_hours.annotate(
            f"{stats['languages'][name]['utterances']}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_hours.set_title(f"hours per language ({stats['hours']:.2f} h, {stats['utterances']} utt.)")
    ax_hours.set_ylabel("hours")
    edges = np.asarray(stats["histogram"]["bin_edges_s"])
    bottom = np.zeros(max(edges.size - 1, 0))
    for name in names:
        counts = np.asarray(stats["languages"][name]["histogram"], dtype=float)
        ax_hist.bar(edges[:-1], counts, width=np.diff(edges), bottom=bottom, align="edge", label=name)
        bottom += counts
    ax_hist.set_title("duration histogram")
    ax_hist.set_xlabel("seconds")
    ax_hist.set_ylabel("utterances")
    if names:
        ax_hist.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
