"""Conversation datasets (issue 23) as a data source: NeMo multimodal-conversation JSONL (and its tarred
form), ShareGPT-style JSON, and JSON-lines manifests whose rows carry a conversation, all normalised to
the manifest of `speechlm.data.manifest.schema` plus `CONVERSATION_SCHEMA`: one row per sample.

Record shapes (one JSON object per line of a ``.jsonl``, or a ``.json`` holding a list of them):

``conversations`` with ``type``  NeMo's multimodal conversation (lhotse ``cutset.py``
                                 ``multimodal_conversation``): ``{"id", "conversations": [{"from":
                                 "User"|"Assistant"|"System", "type": "text"|"audio", "value": text or
                                 audio path, "duration", "offset"}]}``; consecutive entries of one role
                                 are one turn. An audio entry may give its ``text`` (the clip's
                                 transcript, its CTC target).
``conversations`` / ``messages`` ShareGPT (NeMo's ``share_gpt``, LLaVA, ms-swift): ``{"from": "human"|
                                 "gpt"|"system", "value"}`` or ``{"role", "content"}`` turns; each
                                 ``<sound>``/``<speech>``/``<audio>`` in a text is the next clip of the
                                 record's ``audios`` / ``audio`` / ``sound`` (a path or a list) or, in a
                                 NeMo manifest row, its ``audio_filepath``.
``conversation``                 speechlm's own form (`Conversation.to_json`, a string or an object).
                                 A parquet manifest with a ``conversations``/``messages`` column (JSON
                                 text, NeMo or ShareGPT form) is read row by row the same way.
none of these                    a NeMo manifest row (``audio_filepath``, ``duration``, ``text``) with
                                 the optional ``task``, ``instruction``/``prompt``, ``answer``/``target``.

Every record may give ``task``, ``lang`` (else the text's ``<|xx|>`` tag, else the dataset's language)
and ``id``. A clip's relative path resolves against the file's folder; a clip without a ``duration``
gets its file's (soundfile). The tarred form is a folder of ``manifest_K.jsonl`` + ``audio_K.tar`` (as
NeMo's ``NeMoMultimodalConversationTarWriter`` writes it): an audio value is a member name of the tar of
its shard, located by the tar's cached index (`speechlm.data.sources.tar_index`).

A one-clip sample of the transcription shape (user: clip + instruction, assistant: answer) becomes the
plain columns (``audio_filepath``, ``text``, ``instruction``, ``answer``, ``start`` for an offset); any
other sample a ``conversation`` JSON (``audio_filepath`` names its first clip, ``duration`` is the sum).
Bad input (an unknown role, a placeholder without a clip, a clip never referred to, no assistant turn,
a missing file or member) stops the load with a `ManifestError` naming the file and line.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from speechlm.data.conversation import AudioRef, Clip, Conversation, ConversationError, Turn
from speechlm.data.manifest.schema import (
    CONVERSATION_SCHEMA,
    LOCATOR_SCHEMA,
    ManifestError,
    build_manifest_table,
)
from speechlm.data.sources.detect import register_source, tarred_shards
from speechlm.data.sources.join import members_by_name, scan_or_fail
from speechlm.data.sources.report import SourceReport
from speechlm.data.text import as_transcript, clean_text, normalize_lang, split_lang_tag, tag_text

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "system": "system",
}
AUDIO_PLACEHOLDERS = ("<sound>", "<speech>", "<audio>")
_PLACEHOLDER = re.compile("|".join(re.escape(p) for p in AUDIO_PLACEHOLDERS))
CONVERSATION_KEYS = ("conversations", "messages", "conversation")
ANSWER_KEYS = ("answer", "target")
INSTRUCTION_KEYS = ("instruction", "prompt")


def is_conversation_record(rec: Any) -> bool:
    """True for a JSON record that carries a conversation (any form of the module docstring)."""
    return isinstance(rec, dict) and any(rec.get(k) is not None for k in CONVERSATION_KEYS)


def first_of(rec: dict[str, Any], keys: tuple[str, ...], where: str) -> str | None:
    """The record's value of the first key of `keys` it has (a string), None when it has none."""
    for k in keys:
        value = rec.get(k)
        if value is not None:
            if not isinstance(value, str):
                raise ManifestError(f"{where}: {k!r} must be a string, got {value!r}")
            return value
    return None


def role_of(value: Any, where: str) -> str:
    role = ROLE_ALIASES.get(str(value).lower()) if isinstance(value, str) else None
    if role is None:
        raise ManifestError(
            f"{where}: role {value!r} is not one of {sorted(ROLE_ALIASES)}; write the turn's 'from'/'role' "
            "as user/human, assistant/gpt or system"
        )
    return role


# ----------------------------------------------------------------------------------------------
# Clips
# ----------------------------------------------------------------------------------------------


@dataclass
class ClipSource:
    """Turns an audio value into a `Clip`: a file relative to `base`, or a member of `tar`."""

    base: Path
    tar: Path | None = None
    _members: dict[str, tuple[int, int, int]] | None = None

    def clip(
        self, value: Any, where: str, *, duration: Any = None, offset: Any = None, text: Any = None
    ) -> Clip:
        if not isinstance(value, str) or not value:
            raise ManifestError(f"{where}: an audio value must be a non-empty path, got {value!r}")
        for name, v in (("duration", duration), ("offset", offset)):
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
            ):
                raise ManifestError(f"{where}: audio {value!r} has {name} {v!r}, not a number of seconds")
        if offset is not None and offset < 0:
            raise ManifestError(
                f"{where}: audio {value!r} has offset {offset!r}; give where the clip starts in its file "
                "(>= 0 s)"
            )
        if duration is not None and duration <= 0:
            raise ManifestError(
                f"{where}: audio {value!r} has duration {duration!r}; give its length (> 0 s)"
            )
        transcript = str(text) if text else None
        start = float(offset) if offset is not None else None
        if self.tar is not None:
            located = self.members().get(value)
            if located is None:
                raise ManifestError(
                    f"{where}: audio {value!r} is not a member of {self.tar}; restore the member or fix the value"
                )
            if duration is None:
                raise ManifestError(
                    f"{where}: tar member {value!r} has no 'duration'; write its length in seconds"
                )
            off, size, header = located
            return Clip(value, start, float(duration), str(self.tar.resolve()), off, size, header, transcript)
        path = Path(os.path.normpath(self.base / value))
        if not path.is_file():
            raise ManifestError(
                f"{where}: audio file {path} does not exist; fix the path or restore the file"
            )
        if duration is None:
            try:
                info = sf.info(str(path))
            except (RuntimeError, sf.LibsndfileError) as e:
                raise ManifestError(
                    f"{where}: cannot read audio file {path} ({e}); give its 'duration'"
                ) from None
            duration = info.frames / info.samplerate - (start or 0.0)
        return Clip(str(path), start, float(duration), transcript=transcript)

    def members(self) -> dict[str, tuple[int, int, int]]:
        if self._members is None:
            assert self.tar is not None
            scan = scan_or_fail(self.tar, f"the conversations of {self.tar.parent}")
            self._members = {
                name: (int(scan.offsets[j]), int(scan.sizes[j]), int(scan.header_bytes[j]))
                for name, j in members_by_name(scan).items()
            }
        return self._members


# ----------------------------------------------------------------------------------------------
# Records -> Conversation
# ----------------------------------------------------------------------------------------------


def _merge(entries: list[tuple[str, str | AudioRef]]) -> tuple[Turn, ...]:
    """Consecutive parts of one role become one turn (NeMo collapses them the same way)."""
    turns: list[Turn] = []
    for role, part in entries:
        if turns and turns[-1].role == role:
            turns[-1] = Turn(role, (*turns[-1].parts, part))
        else:
            turns.append(Turn(role, (part,)))
    return tuple(turns)


def _nemo_turns(items: list[Any], where: str, source: ClipSource) -> tuple[tuple[Turn, ...], list[Clip]]:
    entries: list[tuple[str, str | AudioRef]] = []
    clips: list[Clip] = []
    for t, item in enumerate(items):
        at = f"{where}, conversations[{t}]"
        if not isinstance(item, dict) or "value" not in item:
            raise ManifestError(f"{at}: expected an object with 'from', 'type' and 'value', got {item!r}")
        role = role_of(item.get("from", item.get("role")), at)
        kind = item.get("type", "text")
        if kind == "audio":
            clips.append(
                source.clip(
                    item["value"], at, duration=item.get("duration"), offset=item.get("offset"),
                    text=item.get("text"),
                )
            )  # fmt: skip
            entries.append((role, AudioRef(len(clips) - 1)))
        elif kind == "text":
            if not isinstance(item["value"], str):
                raise ManifestError(f"{at}: a text 'value' must be a string, got {item['value']!r}")
            entries.append((role, item["value"]))
        else:
            raise ManifestError(f"{at}: 'type' {kind!r} is neither 'text' nor 'audio'")
    return _merge(entries), clips


def _sharegpt_turns(
    items: list[Any], audios: list[Any], where: str, source: ClipSource
) -> tuple[tuple[Turn, ...], list[Clip]]:
    entries: list[tuple[str, str | AudioRef]] = []
    clips: list[Clip] = []
    for t, item in enumerate(items):
        at = f"{where}, turn {t}"
        if not isinstance(item, dict):
            raise ManifestError(
                f"{at}: expected an object with 'from'/'value' or 'role'/'content', got {item!r}"
            )
        role = role_of(item.get("from", item.get("role")), at)
        text = item.get("value", item.get("content"))
        if not isinstance(text, str):
            raise ManifestError(f"{at}: the turn's text must be a string, got {text!r}")
        pos = 0
        for m in _PLACEHOLDER.finditer(text):
            if text[pos : m.start()].strip():
                entries.append((role, text[pos : m.start()].strip()))
            if len(clips) >= len(audios):
                raise ManifestError(
                    f"{at}: audio placeholder {m.group(0)} number {len(clips) + 1} has no clip (the record "
                    f"lists {len(audios)} in 'audios'/'sound'); add the audio or remove the placeholder"
                )
            clips.append(source.clip(audios[len(clips)], at))
            entries.append((role, AudioRef(len(clips) - 1)))
            pos = m.end()
        if text[pos:].strip() or not entries or entries[-1][0] != role:
            entries.append((role, text[pos:].strip()))
    if len(clips) < len(audios):
        raise ManifestError(
            f"{where}: {len(audios)} audio file(s) but {len(clips)} placeholder(s) "
            f"({'/'.join(AUDIO_PLACEHOLDERS)}); audio {audios[len(clips)]!r} is never referred to: add a "
            "placeholder where it is heard"
        )
    return _merge(entries), clips


def _audio_list(rec: dict[str, Any], where: str) -> list[Any]:
    for key in ("audios", "audio", "sound", "audio_filepath"):
        value = rec.get(key)
        if value is not None:
            if isinstance(value, str):
                return [value]
            if isinstance(value, list):
                return value
            raise ManifestError(f"{where}: {key!r} must be a path or a list of paths, got {value!r}")
    return []


def record_lang(rec: dict[str, Any], where: str, default_lang: str | None, text: str = "") -> str:
    lang = rec.get("lang")
    if lang is not None:
        code = normalize_lang(lang) if isinstance(lang, str) else None
        if code is None:
            raise ManifestError(f"{where}: 'lang' {lang!r} is not a language code; use e.g. 'hi' or 'en'")
        return code
    tagged, _ = split_lang_tag(text)
    code = tagged or default_lang
    if code is None:
        raise ManifestError(
            f"{where}: no language: the record has no 'lang' and its text no <|xx|> tag; add \"lang\" or "
            "give the dataset's language (data.input_cfg 'lang:', --lang)"
        )
    return code


def conversation_of_record(
    rec: dict[str, Any], where: str, source: ClipSource, default_lang: str | None
) -> Conversation:
    """The `Conversation` of one JSON record of any shape of the module docstring (ManifestError naming
    `where` when it cannot be trained on)."""
    task = first_of(rec, ("task",), where) or "asr"
    rec_id = str(rec.get("id") or rec.get("segment_id") or rec.get("utt_id") or "")
    try:
        if rec.get("conversation") is not None:
            doc = rec["conversation"]
            conv = Conversation.from_json(doc if isinstance(doc, str) else json.dumps(doc), where=where)
            resolved = tuple(
                source.clip(c.path, where, duration=c.duration, offset=c.offset, text=c.transcript)
                if c.tar is None
                else c
                for c in conv.clips
            )
            lang = conv.lang or record_lang(rec, where, default_lang)
            return replace(conv, clips=tagged_clips(resolved, lang), lang=lang, id=conv.id or rec_id)
        items = rec.get("conversations", rec.get("messages"))
        if isinstance(items, str):  # a parquet column of JSON text
            try:
                items = json.loads(items)
            except json.JSONDecodeError as e:
                raise ManifestError(f"{where}: 'conversations' is not valid JSON ({e.msg})") from None
        if items is not None:
            if not isinstance(items, list) or not items:
                raise ManifestError(f"{where}: 'conversations' must be a non-empty list of turns")
            if all(isinstance(t, dict) and "type" in t for t in items):
                turns, clips = _nemo_turns(items, where, source)
            else:
                turns, clips = _sharegpt_turns(items, _audio_list(rec, where), where, source)
            lang = record_lang(rec, where, default_lang, next((c.transcript or "" for c in clips), ""))
            return Conversation(turns, tagged_clips(clips, lang), task, lang, rec_id)
        text = rec.get("text")
        answer = first_of(rec, ANSWER_KEYS, where)
        if not isinstance(rec.get("audio_filepath"), str) or (text is None and answer is None):
            raise ManifestError(
                f"{where}: a record needs 'conversations' (NeMo or ShareGPT form), 'conversation', or "
                "'audio_filepath' with 'text' (or 'answer')"
            )
        if text is not None and not isinstance(text, str):
            raise ManifestError(f"{where}: 'text' must be a string, got {text!r}")
        lang = record_lang(rec, where, default_lang, text or "")
        transcript = tag_text(clean_text(split_lang_tag(text)[1]), lang) if text else None
        clip = source.clip(
            rec["audio_filepath"],
            where,
            duration=rec.get("duration"),
            offset=rec.get("offset"),
            text=transcript,
        )
        target = answer if answer is not None else transcript or ""
        instruction = first_of(rec, INSTRUCTION_KEYS, where) or ""
        return Conversation.transcription(
            clip, target, lang=lang, instruction=instruction, task=task, id=rec_id
        )
    except ConversationError as e:
        raise ManifestError(f"{where}: {e}; fix the record") from None


def tagged_clips(clips: Sequence[Clip], lang: str) -> tuple[Clip, ...]:
    """`clips` with each transcript as readers store it (`data.text.as_transcript`): an untagged
    per-clip ``text``, as NeMo writes it, cleaned and tagged with the sample's language, as the NeMo-row
    and Lhotse readers do for theirs."""
    return tuple(
        replace(c, transcript=as_transcript(c.transcript, lang)) if c.transcript else c for c in clips
    )


# ----------------------------------------------------------------------------------------------
# Conversations -> manifest rows
# ----------------------------------------------------------------------------------------------


def transcription_parts(conv: Conversation) -> tuple[str, str] | None:
    """(instruction, answer) when `conv` is the one-clip transcription shape a row's columns hold."""
    turns = conv.turns
    if (
        len(conv.clips) == 1
        and conv.clips[0].tar is None
        and len(turns) == 2
        and turns[0].role == "user"
        and turns[1].role == "assistant"
        and turns[0].parts[:1] == (AudioRef(0),)
        and all(isinstance(p, str) for p in turns[0].parts[1:])
    ):
        return "\n".join(str(p) for p in turns[0].parts[1:]), turns[1].text
    return None


@dataclass
class RowsBuilder:
    """Collects samples as manifest columns (`add`) and builds the table (`table`)."""

    ids: list[str]
    paths: list[str]
    durations: list[float]
    texts: list[str]
    langs: list[str]
    starts: list[float | None]
    extra: dict[str, list[str | None]]

    @classmethod
    def new(cls) -> RowsBuilder:
        return cls([], [], [], [], [], [], {f.name: [] for f in CONVERSATION_SCHEMA})

    def add(self, conv: Conversation, where: str, *, task_given: bool) -> None:
        duration = conv.duration
        if duration is None or duration <= 0:
            raise ManifestError(f"{where}: the sample's clips have no positive total duration ({duration!r})")
        clip0 = conv.clips[0]
        self.ids.append(conv.id or where)
        self.durations.append(duration)
        self.langs.append(conv.lang)
        self.extra["task"].append(conv.task if task_given else None)
        shape = transcription_parts(conv)
        if shape is not None:
            instruction, answer = shape
            text = clip0.transcript or ""
            self.paths.append(clip0.path)
            self.texts.append(text)
            self.starts.append(clip0.offset)
            self.extra["instruction"].append(instruction or None)
            self.extra["answer"].append(None if answer == text else answer)
            self.extra["conversation"].append(None)
            return
        self.paths.append(clip0.path if clip0.tar is None else f"{clip0.tar}:{clip0.path}")
        self.texts.append(clip0.transcript or "" if len(conv.clips) == 1 else "")
        self.starts.append(None)
        self.extra["instruction"].append(None)
        self.extra["answer"].append(None)
        self.extra["conversation"].append(conv.to_json())

    def table(self, shard_id: str, source: str) -> pa.Table:
        table = build_manifest_table(
            self.ids, self.paths, self.durations, self.texts, self.langs, shard_ids=shard_id, source=source
        )
        if any(s is not None for s in self.starts):
            table = table.append_column(LOCATOR_SCHEMA.field("start"), pa.array(self.starts, pa.float64()))
        for f in CONVERSATION_SCHEMA:
            table = table.append_column(f, pa.array(self.extra[f.name], f.type))
        return table


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """("PATH:LINE", record) of a JSON-lines file (gzip allowed), ("PATH[i]", record) of a JSON list, or
    ("PATH, row i", record) of a parquet manifest with a ``conversations``/``messages`` column."""
    if path.suffix.lower() == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ManifestError(f"{path} is not a readable parquet file ({e})") from None
        for i, rec in enumerate(rows):
            yield f"{path}, row {i}", {k: v for k, v in rec.items() if v is not None}
        return
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ManifestError(f"cannot read {path} ({e}); expected UTF-8 JSON lines or a JSON list") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ManifestError(
            f"{path}:{line}: byte 0x{data[e.start]:02x} at column {column} is not UTF-8; save the file as "
            "UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or fix that line"
        ) from None
    if text.lstrip().startswith("["):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        for i, rec in enumerate(doc):
            yield f"{path}[{i}]", rec
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{line_no}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ManifestError(
                f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno}); each line must be one object"
            ) from None


@register_source("conversations")
def read_conversations(
    path: str | os.PathLike[str], *, report: SourceReport, default_lang: str | None = None, **_: Any
) -> pa.Table:
    """The manifest table of a conversation file or tarred folder (see the module docstring)."""
    path = Path(path)
    default = normalize_lang(default_lang) if default_lang is not None else None
    if default_lang is not None and default is None:
        raise ManifestError(f"default language {default_lang!r} is not a language code; pass e.g. 'hi'")
    rows = RowsBuilder.new()
    if path.is_dir():
        files = [(m, ClipSource(folder_of(m), tar)) for m, tar in tarred_shards(path)]
    else:
        files = [(path, ClipSource(folder_of(path)))]
    for file, source in files:
        for where, rec in iter_records(file):
            if not isinstance(rec, dict):
                raise ManifestError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            conv = conversation_of_record(rec, where, source, default)
            rows.add(conv, where, task_given=rec.get("task") is not None)
    if not rows.ids:
        raise ManifestError(f"{path} holds no sample")
    return rows.table(path.name, "nemo")


def folder_of(path: Path) -> Path:
    return path.resolve().parent


__all__ = [
    "AUDIO_PLACEHOLDERS",
    "ClipSource",
    "conversation_of_record",
    "is_conversation_record",
    "read_conversations",
    "transcription_parts",
]
