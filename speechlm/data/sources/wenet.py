"""WeNet ``data.list`` files as a data source, in both of WeNet's modes.

Raw mode: one JSON object per line, ``{"key": ID, "wav": PATH, "txt": TEXT}`` plus an optional
``"lang"``; a relative PATH resolves against the list's folder. Shard mode: one tar path per line
(relative to the list's folder), each tar holding per utterance ``KEY.wav`` (or .flac, .ogg, .opus,
.mp3) and ``KEY.txt``, optionally ``KEY.lang``; a KEY is the member name up to its last dot. The
language is the line's/member's, else `default_lang`, else a `ManifestError` naming the utterance.

Indexing needs each clip's duration, which a WeNet list does not carry: it is taken from the audio
header (`soundfile.info`) of each file or member, and in shard mode the texts are read from the
tars. Both cost a pass over the data, so the resulting table is cached next to the list
(``data.list.speechlm.parquet``, or under ``$SPEECHLM_CACHE/tar_index`` when that folder is
read-only) with a fingerprint of the list and, in shard mode, of every tar: a change to either is
seen and the list indexed again. The drops of that pass are stored with it and reported on every load.

Dropped and counted (per list file in raw mode, per tar in shard mode): an audio file that is
missing (``missing_file``) or has no readable header (``undecodable``); in a tar, a KEY with audio
but no text or text but no audio (``missing_member``, or ``truncated_shard`` when the tar ends
early). A tar that is missing or not a tar stops the load with a ManifestError naming it. Audio is
read by position from the tar at training time, its header checked against the member name.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from speechlm.data.manifest.schema import LOCATOR_SCHEMA, MANIFEST_SCHEMA, ManifestError, build_manifest_table
from speechlm.data.sources.detect import register_source
from speechlm.data.sources.join import scan_or_fail, with_tar_locators
from speechlm.data.sources.members import MemberError, MemberReader
from speechlm.data.sources.report import SourceReport
from speechlm.data.sources.tar_index import (
    TarFingerprint,
    TarScan,
    default_cache_dir,
    sidecar_path,
    write_parquet_atomic,
)
from speechlm.data.text import clean_text, normalize_lang, tag_text

AUDIO_SUFFIXES = ("wav", "flac", "ogg", "opus", "mp3")
CACHE_SUFFIX = ".speechlm.parquet"
CACHE_KEY = b"speechlm.wenet"
FORMAT_VERSION = 1


def _lang(value: Any, default: str | None, where: str) -> str:
    code = normalize_lang(value) if isinstance(value, str) else None
    if value is not None and code is None:
        raise ManifestError(f"{where}: language {value!r} is not a code; use e.g. 'hi' or 'en'")
    code = code or default
    if code is None:
        raise ManifestError(f'{where}: no language; add "lang" (or a KEY.lang member) or pass default_lang')
    return code


def _list_lines(path: Path) -> list[str]:
    try:
        return [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"cannot read WeNet list {path}: {e}") from None


def _duration(source: str | io.BytesIO) -> float:
    info = sf.info(source)
    return info.frames / info.samplerate


def _index_raw(path: Path, lines: list[str], default: str | None, report: SourceReport) -> pa.Table:
    base = path.resolve().parent
    ids: list[str] = []
    wavs: list[str] = []
    durations: list[float] = []
    texts: list[str] = []
    langs: list[str] = []
    for n, line in enumerate(lines, start=1):
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ManifestError(
                f"{where}: not valid JSON ({e.msg}); a raw WeNet list has one object per line"
            ) from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("key", "wav", "txt")):
            raise ManifestError(f"{where}: expected an object with string 'key', 'wav' and 'txt'")
        lang = _lang(row.get("lang"), default, f"{where} ({row['key']})")
        wav = os.path.normpath(os.path.join(base, row["wav"]))
        if not os.path.isfile(wav):
            report.drop(str(path), "missing_file")
            continue
        try:
            duration = _duration(wav)
        except (sf.SoundFileError, RuntimeError, OSError):
            report.drop(str(path), "undecodable")
            continue
        ids.append(row["key"])
        wavs.append(wav)
        durations.append(duration)
        texts.append(tag_text(clean_text(row["txt"]), lang))
        langs.append(lang)
    return build_manifest_table(ids, wavs, durations, texts, langs, shard_ids=path.name, source="wenet")


def _index_tar(
    tar: Path, what: str, default: str | None, report: SourceReport, reader: MemberReader
) -> tuple[TarScan, list[tuple[str, int, float, str, str]]]:
    """One WeNet shard tar: its scan and (key, audio member position, duration, text, lang) per utterance."""
    scan = scan_or_fail(tar, what)
    keys: dict[str, dict[str, int]] = {}  # key -> {suffix: member position}, in tar order
    for j, name in enumerate(scan.names):
        key, dot, suffix = name.rpartition(".")
        if dot:
            keys.setdefault(key, {})[suffix.lower()] = j

    def read(j: int) -> bytes:
        return reader.read(str(tar), scan.names[j], scan.offsets[j], scan.sizes[j], scan.header_bytes[j])

    rows: list[tuple[str, int, float, str, str]] = []
    orphan = "truncated_shard" if scan.truncated_bytes else "missing_member"
    # a truncated tar: the utterance at the cut may have lost a member (audio, text or lang), so it is
    # dropped too; utterances wholly past the cut leave no trace to count
    cut_at = next(reversed(keys), None) if scan.truncated_bytes else None
    if scan.truncated_bytes and cut_at is None:
        report.drop(str(tar), "truncated_shard")
    for key, parts in keys.items():
        audio = next((parts[s] for s in AUDIO_SUFFIXES if s in parts), None)
        if audio is None or "txt" not in parts or key == cut_at:
            report.drop(str(tar), orphan)
            continue
        try:
            text = read(parts["txt"]).decode("utf-8").strip()
            lang_raw = read(parts["lang"]).decode("utf-8").strip() if "lang" in parts else None
            duration = _duration(io.BytesIO(read(audio)))
        except MemberError as e:
            report.drop(str(tar), e.reason)
            continue
        except (UnicodeDecodeError, sf.SoundFileError, RuntimeError):
            report.drop(str(tar), "undecodable")
            continue
        lang = _lang(lang_raw, default, f"{tar}:{key}")
        rows.append((key, audio, duration, tag_text(clean_text(text), lang), lang))
    return scan, rows


def _index_shards(path: Path, tars: list[Path], default: str | None, report: SourceReport) -> pa.Table:
    reader = MemberReader()
    rows: list[tuple[str, int, float, str, str]] = []
    codes: list[int] = []
    located: list[tuple[str, int, int, int]] = []  # member name, offset, size, header bytes
    for k, tar in enumerate(tars):
        scan, tar_rows = _index_tar(tar, str(path), default, report, reader)
        rows += tar_rows
        codes += [k] * len(tar_rows)
        located += [
            (scan.names[j], int(scan.offsets[j]), int(scan.sizes[j]), int(scan.header_bytes[j]))
            for _, j, *_rest in tar_rows
        ]
    reader.close()
    ids, _, durations, texts, langs = (list(c) for c in zip(*rows)) if rows else ([], [], [], [], [])
    members, offsets, sizes, headers = (list(c) for c in zip(*located)) if located else ([], [], [], [])
    table = build_manifest_table(
        ids, members, durations, texts, langs, shard_ids=[tars[c].name for c in codes], source="wenet"
    )
    return with_tar_locators(
        table,
        np.asarray(codes, np.int64),
        tars,
        np.asarray(offsets, np.int64),
        np.asarray(sizes, np.int64),
        np.asarray(headers, np.uint16),
    )


def _fingerprint(path: Path, tars: list[Path] | None, default: str | None) -> str:
    parts: dict[str, Any] = {"version": FORMAT_VERSION, "default_lang": default}
    parts["list"] = TarFingerprint.of(path).to_json()
    if tars is not None:
        parts["tars"] = [
            [str(t.resolve()), TarFingerprint.of(t).to_json() if t.is_file() else None] for t in tars
        ]
    return json.dumps(parts, sort_keys=True)


def _read_cache(path: Path, fingerprint: str, report: SourceReport) -> pa.Table | None:
    for candidate in (
        sidecar_path(path, None, CACHE_SUFFIX),
        sidecar_path(path, default_cache_dir(), CACHE_SUFFIX),
    ):
        try:
            table = pq.read_table(candidate)
            meta = json.loads((table.schema.metadata or {})[CACHE_KEY])
        except (OSError, pa.ArrowException, KeyError, ValueError):
            continue
        if meta.get("fingerprint") != fingerprint:
            continue
        for shard, per in meta.get("dropped", {}).items():
            for reason, n in per.items():
                report.drop(shard, reason, n)
        fields = {f.name: f for f in (*MANIFEST_SCHEMA, *LOCATOR_SCHEMA)}
        return table.replace_schema_metadata(None).cast(pa.schema([fields[c] for c in table.column_names]))
    return None


@register_source("wenet")
def read_wenet(
    path: str | os.PathLike[str], *, report: SourceReport, default_lang: str | None = None, **_: Any
) -> pa.Table:
    """The manifest table of a WeNet data.list (raw or shard mode; see the module docstring)."""
    path = Path(path)
    default = None
    if default_lang is not None and (default := normalize_lang(default_lang)) is None:
        raise ManifestError(f"default_lang {default_lang!r} is not a language code; pass e.g. 'hi' or 'en'")
    if not path.is_file():
        raise ManifestError(f"WeNet list {path} does not exist")
    lines = _list_lines(path)
    raw = bool(lines) and lines[0].startswith("{")
    base = path.resolve().parent
    tars = None if raw else [Path(os.path.normpath(os.path.join(base, ln))) for ln in lines]
    fingerprint = _fingerprint(path, tars, default)
    cached = _read_cache(path, fingerprint, report)
    if cached is not None:
        return cached
    fresh = SourceReport()
    table = (
        _index_raw(path, lines, default, fresh) if tars is None else _index_shards(path, tars, default, fresh)
    )
    for shard, per in fresh.dropped.items():
        for reason, n in per.items():
            report.drop(shard, reason, n)
    meta = json.dumps({"fingerprint": fingerprint, "dropped": fresh.dropped})
    stored = table.replace_schema_metadata({CACHE_KEY: meta})
    if not write_parquet_atomic(sidecar_path(path, None, CACHE_SUFFIX), stored):
        write_parquet_atomic(sidecar_path(path, default_cache_dir(), CACHE_SUFFIX), stored)
    return table
