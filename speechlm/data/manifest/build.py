"""Building a manifest from raw shards: list and read the shards, filter, clean, split, write.

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
   ``hi_000``), a null/NaN/infinite/zero/negative duration, too short, too long, quality below the
   threshold (or null), blank text, text empty after cleaning, a leading ``<|xx|>`` tag that is not
   the row's language (`speechlm.data.text.check_transcript`'s rule), and last a ``segment_id``
   already kept (the first kept copy wins, so a duplicate of a filtered row is not lost).
4. Clean the text once per distinct string (dictionary-encode, clean the dictionary, take), then
   prepend the language tag.
5. Split train/val: a row whose optional ``split`` column says ``train`` or ``val`` (``dev``,
   ``validation``) goes there; the others by a stable hash of ``segment_id`` and the seed (see
   `split`), so adding shards never moves an existing row between train and val.

Default filters: 0.5 s <= duration <= 20 s (shorter clips are mostly fillers, longer ones blow up
micro-batch budgets), ``tx_quality_score >= 0.5`` (`DEFAULT_MIN_QUALITY`, the midpoint of the score
range: the scorer's own accept/reject boundary, which drops the transcripts it judged more likely
wrong than right; raise it for cleaner, smaller data), 5 % validation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speechlm.data.manifest.checks import check_utf8
from speechlm.data.manifest.load import _read_checked
from speechlm.data.manifest.outputs import prepare_dir, write_atomic
from speechlm.data.manifest.report import DROP_REASONS, UNKNOWN_LANG, BuildReport
from speechlm.data.manifest.schema import ManifestError, _dictionary, _encode_sorted, build_manifest_table
from speechlm.data.manifest.split import HASHED, check_train_rows, hash_uniform, split_codes, split_val
from speechlm.data.text import clean_text, lang_tag, normalize_lang
from speechlm.progress import Progress

_TAG_PATTERN = r"^\s*<\|(?P<tag>[A-Za-z][A-Za-z0-9_-]*)\|>"
DEFAULT_MIN_DURATION = 0.5
DEFAULT_MAX_DURATION = 20.0
DEFAULT_MIN_QUALITY = 0.5
DEFAULT_VAL_FRACTION = 0.05

# column -> kind ("string" or "number"); None-typed (all-null) columns are accepted where nullable
METADATA_COLUMNS = {
    "segment_id": "string",
    "transcription_native": "string",
    "duration_s": "number",
    "tx_quality_score": "number",
    "segment_language": "string",
}
METADATA_OPTIONAL_COLUMNS = {"split": "string"}  # split.SPLIT_VALUES, or null: the hash decides
INDEX_COLUMNS = {"segment_id": "string", "tar_member_name": "string"}
INDEX_OPTIONAL_COLUMNS = {"tar_path": "string"}


# ----------------------------------------------------------------------------------------- shards
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
    quality, text (raw), lang (null: unknown), split (int8 `split.split_codes`: -1 for the hash)."""
    meta = _read_checked(shard_dir / "metadata.parquet", METADATA_COLUMNS, METADATA_OPTIONAL_COLUMNS)
    index = _read_checked(shard_dir / "audio_index.parquet", INDEX_COLUMNS, INDEX_OPTIONAL_COLUMNS)
    for name, table, columns in (
        ("metadata.parquet", meta, {**METADATA_COLUMNS, **METADATA_OPTIONAL_COLUMNS}),
        ("audio_index.parquet", index, {**INDEX_COLUMNS, **INDEX_OPTIONAL_COLUMNS}),
    ):
        for col, kind in columns.items():
            if kind == "string" and col in table.column_names:
                check_utf8(table.column(col), str(shard_dir / name), col)
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
    split = np.full(len(meta), HASHED, np.int8)
    if "split" in meta.column_names:
        split = split_codes(meta.column("split"), seg, str(shard_dir / "metadata.parquet"))
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
            "split": pa.array(split, pa.int8()),
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
    languages: Sequence[str] | None = None,
) -> BuildReport:
    """Build ``train.parquet``, ``val.parquet`` and ``build_report.json`` in `out_dir` (see module doc).

    The steps: check the settings, read the shards (`read_shard_rows`), mark the rows the filters drop
    (`filter_rows`), clean and check the texts (`clean_texts`), drop repeated ids (`first_of_each_id`),
    assemble the manifest and its split (`assemble_manifest`), count, and write (`write_build`)."""
    check_build_settings(min_duration, max_duration, val_fraction)
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
            **({"languages": sorted(languages)} if languages else {}),
        },
    )
    rows, shard, shard_names = read_shard_rows(shards_dir, report, skip_bad_shards=skip_bad_shards)
    # the rest in phases, shown on a terminal (speechlm.progress; nothing in logs)
    with Progress(4, "manifest build", "phases", leave=False) as bar, bar.heartbeat():
        bar.phase("filtering rows")
        duration = _as_float64(rows.column("duration"))
        reason = filter_rows(
            rows,
            duration,
            min_duration=min_duration,
            max_duration=max_duration,
            min_quality=min_quality,
            languages=languages,
        )
        bar.phase("cleaning texts")
        survivors, cleaned = clean_texts(rows, reason)
        bar.phase("assembling and splitting")
        keep, seg_ids, cleaned = first_of_each_id(rows, survivors, cleaned, reason)
        table, lang_codes, lang_names = assemble_manifest(
            rows, keep, seg_ids, cleaned, duration, shard, shard_names
        )
        fixed = rows.column("split").to_numpy()[keep]
        is_val = split_val(hash_uniform(table.column("segment_id"), seed), lang_codes, val_fraction, fixed)
        check_train_rows(is_val, lang_codes, lang_names)
        _fill_counts(report, rows.column("lang"), reason, lang_names, lang_codes, is_val, duration[keep])
        _fill_split_source(report, lang_names, lang_codes, is_val, fixed)
        report.elapsed_s = round(time.perf_counter() - start, 3)
        bar.phase("writing")
        write_build(table, is_val, report, shards_dir, out_dir)
    return report


def check_build_settings(min_duration: float, max_duration: float, val_fraction: float) -> None:
    """ManifestError unless 0 <= val_fraction < 1 and 0 <= min_duration <= max_duration."""
    if not 0.0 <= val_fraction < 1.0:
        raise ManifestError(f"val_fraction={val_fraction} is outside [0, 1); pass e.g. 0.05 for 5 %")
    if not 0.0 <= min_duration <= max_duration:
        raise ManifestError(
            f"min_duration={min_duration} and max_duration={max_duration} must satisfy "
            "0 <= min_duration <= max_duration"
        )


def read_shard_rows(
    shards_dir: str | os.PathLike[str], report: BuildReport, *, skip_bad_shards: bool
) -> tuple[pa.Table, np.ndarray, list[str]]:
    """(every usable shard's rows, one after the other; each row's shard code; the shard names).

    An unusable shard stops the build (ManifestError listing them all) unless `skip_bad_shards`; then
    it is recorded in `report.failed_shards`. No usable shard at all is an error either way."""
    shards = list_shards(shards_dir)
    tables: list[pa.Table] = []
    shard_codes: list[np.ndarray] = []
    shard_names: list[str] = []
    failures: dict[str, str] = {}
    with Progress(len(shards), "reading shards", "shards", leave=False) as bar:
        for shard_dir in shards:
            bar.update(1)
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
    report.rows_read = len(rows)
    return rows, np.concatenate(shard_codes), shard_names


def _drop(reason: np.ndarray, mask: np.ndarray, name: str) -> None:
    """Mark the rows of `mask` not yet dropped as dropped for `name` (the first reason wins)."""
    reason[(reason < 0) & mask] = DROP_REASONS.index(name)


def filter_rows(
    rows: pa.Table,
    duration: np.ndarray,
    *,
    min_duration: float,
    max_duration: float,
    min_quality: float,
    languages: Sequence[str] | None = None,
) -> np.ndarray:
    """Per row, the index into DROP_REASONS of the first filter that drops it, or -1 (kept so far).
    ``languages``: keep only rows of these language codes (``manifest build --lang``)."""
    reason = np.full(len(rows), -1, dtype=np.int8)
    codes = pc.utf8_lower(pc.utf8_trim_whitespace(rows.column("lang")))  # as normalize_lang spells them
    if languages:
        languages = [normalize_lang(code) or code for code in languages]
        present = set(pc.unique(codes.drop_null()).to_pylist())
        absent = sorted(set(languages) - present)
        if absent:
            raise ManifestError(
                f"--lang {' '.join(absent)}: no row of that language in the shards (their languages: "
                f"{', '.join(sorted(present))}); give codes as the shards' metadata spells them"
            )
    quality = _as_float64(rows.column("quality"))
    with np.errstate(invalid="ignore"):
        _drop(
            reason, rows.column("audio_filepath").is_null().to_numpy(zero_copy_only=False), "no_audio_index"
        )
        _drop(reason, rows.column("lang").is_null().to_numpy(zero_copy_only=False), "missing_language")
        if languages:
            chosen = pc.fill_null(pc.is_in(codes, value_set=pa.array(list(languages))), False)
            _drop(reason, ~chosen.to_numpy(zero_copy_only=False), "other_language")
        _drop(reason, ~np.isfinite(duration) | (duration <= 0), "invalid_duration")
        _drop(reason, duration < min_duration, "too_short")
        _drop(reason, duration > max_duration, "too_long")
        _drop(reason, ~(quality >= min_quality), "low_quality")
    blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(rows.column("text")), ""), True)
    _drop(reason, blank.to_numpy(zero_copy_only=False), "empty_text")
    return reason


def clean_texts(rows: pa.Table, reason: np.ndarray) -> tuple[np.ndarray, pa.ChunkedArray]:
    """(the rows still kept, their cleaned texts): rows whose text cleans to nothing, or whose leading
    <|xx|> tag names another language than the row's, are marked in `reason`."""
    raw_text = rows.column("text")
    survivors = np.flatnonzero(reason < 0)
    cleaned = clean_text_column(raw_text.take(survivors))
    empty = pc.equal(cleaned, "").to_numpy(zero_copy_only=False)
    reason[survivors[empty]] = DROP_REASONS.index("empty_after_cleaning")
    cleaned = cleaned.filter(pa.array(~empty))
    survivors = survivors[~empty]
    # a leading <|xx|> tag must name the row's language (text.check_transcript's rule); clean_text
    # removes the tag, so a mismatch would otherwise be relabelled silently
    tags = pc.struct_field(pc.extract_regex(raw_text.take(survivors), _TAG_PATTERN), "tag")
    wrong = pc.not_equal(pc.utf8_lower(tags), rows.column("lang").take(survivors))
    wrong = pc.fill_null(wrong, False).to_numpy(zero_copy_only=False)
    reason[survivors[wrong]] = DROP_REASONS.index("tag_mismatch")
    return survivors[~wrong], cleaned.filter(pa.array(~wrong))


def first_of_each_id(
    rows: pa.Table, survivors: np.ndarray, cleaned: pa.ChunkedArray, reason: np.ndarray
) -> tuple[np.ndarray, pa.ChunkedArray, pa.ChunkedArray]:
    """(kept rows, their segment ids, their texts): a repeated ``segment_id`` keeps its first row, the
    others are marked ``duplicate`` in `reason`."""
    seg_ids = rows.column("segment_id").take(survivors)
    seg_codes = pc.dictionary_encode(seg_ids.cast(pa.large_string()).combine_chunks()).indices.to_numpy()
    _, first = np.unique(seg_codes, return_index=True)
    is_first = np.zeros(survivors.size, bool)
    is_first[first] = True
    reason[survivors[~is_first]] = DROP_REASONS.index("duplicate")
    return survivors[is_first], seg_ids.filter(pa.array(is_first)), cleaned.filter(pa.array(is_first))


def assemble_manifest(
    rows: pa.Table,
    keep: np.ndarray,
    seg_ids: pa.ChunkedArray,
    cleaned: pa.ChunkedArray,
    duration: np.ndarray,
    shard: np.ndarray,
    shard_names: list[str],
) -> tuple[pa.Table, np.ndarray, list[str]]:
    """(the manifest table of the kept rows, each one's language code, the sorted language names);
    every text gets its language's ``<|xx|>`` tag in front."""
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
    return table, lang_codes, lang_names


def write_build(
    table: pa.Table,
    is_val: np.ndarray,
    report: BuildReport,
    shards_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
) -> None:
    """Write the report, then (unless nothing passed the filters: an error) the train and val parquets."""
    out = prepare_dir(out_dir)
    write_atomic(out / "build_report.json", report.write_json)
    if not len(table):
        raise ManifestError(
            f"no row of {shards_dir} passed the filters; nothing written but the report "
            f"{out / 'build_report.json'}:\n{report.format()}"
        )
    for name, mask in (("train", ~is_val), ("val", is_val)):
        write_atomic(out / f"{name}.parquet", _parquet_writer(table.filter(pa.array(mask))))


def _parquet_writer(table: pa.Table) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        pq.write_table(table, path, compression="zstd")

    return write


def _fill_split_source(
    report: BuildReport, lang_names: list[str], lang_codes: np.ndarray, is_val: np.ndarray, fixed: np.ndarray
) -> None:
    """Kept rows per language placed by the ``split`` column and by the hash, each as train and val."""
    cell = lang_codes * 4 + (fixed == HASHED) * 2 + is_val
    counts = np.bincount(cell, minlength=4 * len(lang_names)).reshape(len(lang_names), 2, 2)
    for i, name in enumerate(lang_names):
        report.split_source[name] = {
            how: {"train": int(counts[i, j, 0]), "val": int(counts[i, j, 1])}
            for j, how in enumerate(("column", "hash"))
        }


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
