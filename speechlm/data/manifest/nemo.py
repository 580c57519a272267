"""NeMo JSON-lines manifests: `read_nemo_manifest` reads one into `MANIFEST_SCHEMA`; `iter_nemo_lines`
checks the lines (shared with the NeMo tarred reader, `speechlm.data.sources.nemo_tarred`)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa

from speechlm.data.manifest.schema import CONVERSATION_SCHEMA, ManifestError, build_manifest_table
from speechlm.data.text import check_transcript, clean_text, normalize_lang, split_lang_tag, tag_text

logger = logging.getLogger(__name__)


class NemoLine(NamedTuple):
    """One checked line of a NeMo manifest: the raw row, and its fields as the manifest stores them."""

    where: str  # "PATH:LINE" for error messages
    row: dict[str, Any]
    audio: str  # audio_filepath as written
    duration: float
    text: str  # cleaned and tagged with `lang`
    lang: str


def count_drop(dropped: dict[str, int], reason: str) -> None:
    dropped[reason] = dropped.get(reason, 0) + 1


def warn_dropped(where: str | os.PathLike[str], dropped: dict[str, int]) -> None:
    if dropped:
        detail = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()))
        logger.warning("%s: dropped %d rows (%s)", where, sum(dropped.values()), detail)


def iter_nemo_lines(
    path: Path, default_lang: str | None, dropped: dict[str, int] | None = None
) -> Iterator[NemoLine]:
    """Parse and check every line of NeMo manifest `path` (language rules of `read_nemo_manifest`).

    A duration that is not a positive, finite number is an error naming the line. A line whose
    transcript fails `check_transcript` (empty after cleaning, a ``<|xx|>`` tag that disagrees with
    ``lang``) is skipped and counted in `dropped` by reason (logged as a warning when `dropped` is
    None), never kept.
    """
    counts: dict[str, int] = {} if dropped is None else dropped
    yield from _iter_nemo_lines(path, default_lang, counts)
    if dropped is None:
        warn_dropped(path, counts)


def _iter_nemo_lines(path: Path, default_lang: str | None, dropped: dict[str, int]) -> Iterator[NemoLine]:
    default = None
    if default_lang is not None and (default := normalize_lang(default_lang)) is None:
        raise ManifestError(f"--lang {default_lang!r} is not a language code; pass e.g. 'hi' or 'en'")
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
            conv_key = next(
                (k for k in ("conversations", "messages", "conversation") if row.get(k) is not None), None
            )
            if conv_key is not None:
                raise ManifestError(
                    f"{where}: the line holds {conv_key!r}, a conversation; read the file as type "
                    "'conversations' (data.input_cfg `type: conversations`, or put such a line first so that it "
                    "is detected)"
                )
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
            if not math.isfinite(duration) or duration <= 0:
                raise ManifestError(
                    f"{where}: 'duration' {duration!r} is not a positive, finite number of seconds; "
                    "write the audio file's length (e.g. soundfile.info(path).duration) or remove the line"
                )
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
            cleaned = clean_text(text)
            reason = check_transcript(tag_text(cleaned, tagged or code), code)
            if reason is not None:
                count_drop(dropped, reason)
                continue
            yield NemoLine(where, row, audio, float(duration), tag_text(cleaned, code), code)


def read_nemo_manifest(
    path: str | os.PathLike[str], *, default_lang: str | None = None, dropped: dict[str, int] | None = None
) -> pa.Table:
    """Read a NeMo JSON-lines manifest into `MANIFEST_SCHEMA` (source ``nemo``).

    Each line: ``audio_filepath`` (relative paths resolve against the manifest's folder),
    ``duration`` (s), ``text``, optional ``lang``, and the optional ``task``, ``instruction`` (or
    ``prompt``) and ``answer`` (or ``target``) of `CONVERSATION_SCHEMA` (columns added only when a line
    has one). The language is ``lang``, else a leading ``<|xx|>``
    tag of the text, else `default_lang`. The id is ``segment_id``/``utt_id``/``id`` if present,
    else ``audio_filepath`` as written. A duration that is NaN, Inf or <= 0 is an error naming the
    line; rows whose transcript fails `check_transcript` are dropped and counted in `dropped` (a
    warning when None). Rows whose audio lies outside the manifest's folder are kept (datasets often
    share an audio tree) and counted in a warning; `speechlm shards write` refuses any that is not audio.
    """
    path = Path(path)
    base = path.resolve().parent
    ids: list[str] = []
    paths: list[str] = []
    durations: list[float] = []
    texts: list[str] = []
    langs: list[str] = []
    extra: dict[str, list[str | None]] = {"task": [], "instruction": [], "answer": []}
    for line in iter_nemo_lines(path, default_lang, dropped):
        row = line.row
        for name, keys in (
            ("task", ("task",)),
            ("instruction", ("instruction", "prompt")),
            ("answer", ("answer", "target")),
        ):
            value = next((row[k] for k in keys if row.get(k) is not None), None)
            if value is not None and not isinstance(value, str):
                raise ManifestError(f"{line.where}: {name!r} must be a string, got {value!r}")
            extra[name].append(value)
        ids.append(str(row.get("segment_id") or row.get("utt_id") or row.get("id") or line.audio))
        paths.append(os.path.normpath(os.path.join(base, line.audio)))
        durations.append(line.duration)
        texts.append(line.text)
        langs.append(line.lang)
    outside = [p for p in paths if not p.startswith(str(base) + os.sep)]
    if outside:
        logger.warning(
            "%s: %d audio path(s) lie outside the manifest's folder %s (first: %s)",
            path,
            len(outside),
            base,
            outside[0],
        )
    table = build_manifest_table(ids, paths, durations, texts, langs, shard_ids=path.name, source="nemo")
    if any(v is not None for values in extra.values() for v in values):
        for f in CONVERSATION_SCHEMA:
            values = extra.get(f.name) or [None] * len(ids)
            table = table.append_column(f, pa.array(values, f.type))
    return table
