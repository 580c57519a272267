"""Convert a Lhotse CutSet into a training manifest (`MANIFEST_SCHEMA`, source ``lhotse``).

A cut over a single-file mono recording with one or more supervisions is accepted, whether it covers
the whole file or a part of it (several cuts may share one recording). It trains on its **supervised
span** (`speechlm.data.lhotse_span`: the extent of its supervisions, their texts joined in time
order); the seconds no supervision covers are logged and attached to the table (`Coverage`). Per cut:

- ``segment_id`` = the cut id; ``audio_filepath`` = the recording's file source, made absolute
  against the working directory, as Lhotse itself resolves it; ``duration`` = the span's duration;
- ``start`` (only for a span over part of its file) = the span's start in the file, in seconds: the
  dataset reads ``duration`` seconds from there;
- ``text`` = the supervisions' text, cleaned and tagged with their ``language``: a code (``hi``,
  ``EN``, ``zh-cn``) or a name of `speechlm.data.lang_names.LANGUAGE_NAMES` (``English``), else an
  error naming the cut; `default_lang` for cuts without one;
- ``shard_id`` = the cuts file's name, or ``cutset`` for an in-memory CutSet.

Cuts that carry a prompt and a target (issue 23): ``custom`` fields of the cut or of its supervision
``prompt``/``instruction``, ``answer``/``target``, ``task``, ``lang``, or ``conversation`` (a list of turns in
NeMo's multimodal-conversation form, `speechlm.data.sources.conversations`, where an audio turn whose
value is the cut's id or empty is the cut's own audio and any other value a file). A cut set with any
such cut is read through that module's rows (a one-clip row keeps its columns; ``answer``/``task``/
``instruction`` are added); such a cut may have no supervision (no transcript, no CTC target).

Anything else (no supervision on a plain cut, multi-channel, URL/memory/command sources, supervisions
that overlap, reach outside the cut or are in two languages) raises `ManifestError` naming the cut,
since silently picking one supervision or channel would train on the wrong audio/text pairs.
`check_cut` holds these checks for every Lhotse reader (cuts files here and in
`speechlm.data.sources.lhotse_cuts`, Shar in `speechlm.data.sources.lhotse_shar`). Lhotse is imported
only when called.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from speechlm.data.lang_names import checked_language_code
from speechlm.data.lhotse_span import Coverage, SupervisedSpan, supervised_span
from speechlm.data.manifest import LOCATOR_SCHEMA, ManifestError, build_manifest_table
from speechlm.data.manifest.nemo import count_drop, warn_dropped
from speechlm.data.sources.conversations import ClipSource, RowsBuilder, conversation_of_record
from speechlm.data.text import check_transcript, clean_text, tag_text

_TOLERANCE_S = 1e-3  # a cut "covers" its recording if start and end match within a millisecond


def _lhotse() -> Any:
    """The lhotse package, imported on first use: an optional dependency (``speechlm[lhotse]``)."""
    try:
        import lhotse  # lazy: an optional dependency (ImportError naming the extra without it)
    except ImportError:
        raise ImportError(
            "reading Lhotse cuts needs the lhotse package: pip install 'speechlm[lhotse]'"
        ) from None
    return lhotse


@dataclass(frozen=True)
class CutClip:
    """What one cut trains on: its audio file, the supervised span in it, the span's text and language."""

    source: Any  # the recording's one AudioSource
    span: SupervisedSpan  # seconds into the cut
    lang: str
    start: float  # seconds into the file: the cut's start plus the span's
    whole_file: bool  # the span is the whole file (no `start` locator needed)

    @property
    def duration(self) -> float:
        return self.span.duration

    def transcript(self, lang: str) -> tuple[str, str | None]:
        """The span's text cleaned and tagged with `lang`, and why `check_transcript` refuses it (or None)."""
        cleaned = clean_text(self.span.text)
        tag = next((t for t in self.span.tags if t != lang), lang)  # a tag that disagrees is the one to check
        return tag_text(cleaned, lang), check_transcript(tag_text(cleaned, tag), lang)


def check_cut(
    cut: Any, where: str, default_lang: str | None, *, source_types: tuple[str, ...] = ("file",)
) -> CutClip:
    """The checks every Lhotse reader applies to one cut, and the clip it trains on (`CutClip`).

    Raises ManifestError, naming the cut (`where`), for no supervision, no recording, a multi-channel
    or multi-file recording, a source type outside `source_types`, no language or one that is neither
    a code nor a known name, and the supervision errors of `speechlm.data.lhotse_span.supervised_span`.
    """
    if not cut.supervisions:
        raise ManifestError(
            f"{where} has 0 supervisions: nothing says what it holds; give it a supervision with the "
            "transcript, or prompt/answer custom fields (docs/data.md, 'Lhotse cuts')"
        )
    recording = getattr(cut, "recording", None)
    if recording is None:
        raise ManifestError(f"{where} has no recording; only cuts over audio recordings are supported")
    if recording.num_channels != 1 or len(recording.sources) != 1:
        raise ManifestError(
            f"{where}: recording {recording.id!r} has {recording.num_channels} channels and "
            f"{len(recording.sources)} sources; only mono single-file recordings are supported"
        )
    source = recording.sources[0]
    if source.type not in source_types:
        raise ManifestError(
            f"{where}: audio source type {source.type!r} is not supported; save the audio "
            "to files (for example with cuts.save_audios()) and point the recordings there"
        )
    start, duration = float(cut.start), float(cut.duration)
    if not (math.isfinite(duration) and duration > 0):
        raise ManifestError(
            f"{where}: duration {cut.duration!r} is not a positive, finite number of seconds; fix the cut"
        )
    if not math.isfinite(start) or start < 0 or start + duration > float(recording.duration) + _TOLERANCE_S:
        raise ManifestError(
            f"{where}: the cut spans {start:.3f}-{start + duration:.3f} s but recording {recording.id!r} "
            f"({source.source}) is {float(recording.duration):.3f} s long; fix the cut's start/duration "
            "or the recording's duration"
        )
    span = supervised_span(cut, where)
    lang = span.lang or default_lang
    if lang is None:
        raise ManifestError(
            f"{where} names no language; set supervision.language (e.g. 'hi' or 'English') or the "
            "cut's custom 'lang', or pass default_lang (--lang)"
        )
    first = start + span.start
    whole = abs(first) <= _TOLERANCE_S and abs(span.duration - float(recording.duration)) <= _TOLERANCE_S
    return CutClip(source, span, lang, first, whole)


def checked_default_lang(default_lang: str | None) -> str | None:
    """The code of `default_lang` (`--lang`, an input_cfg entry's language) by the rule of supervisions."""
    return None if default_lang is None else checked_language_code(default_lang, "default_lang")


_NOT_CUTS = "make cuts with CutSet.from_manifests(recordings=..., supervisions=...) and save them with CutSet.to_file()"


def _manifest_kind(path: Path) -> str | None:
    """The Lhotse manifest class of file `path` when it is one (RecordingSet, SupervisionSet, ...), else None."""
    try:
        return type(_lhotse().load_manifest(path)).__name__
    except Exception:  # noqa: BLE001 - only asked to name the file in an error; any failure means "not one"
        return None


def load_cuts(path: Path) -> Any:
    """The cuts in cuts file `path`, read whole (ManifestError naming the file when it is missing or
    is not a Lhotse cuts file: not gzip, not JSON, records that are not cuts, another Lhotse manifest)."""
    if not path.is_file():
        raise ManifestError(f"Lhotse cuts file {path} does not exist")
    cutset = _lhotse().CutSet
    try:
        cuts = list(cutset.from_file(path))
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as e:
        # gzip.BadGzipFile is an OSError, json.JSONDecodeError a ValueError; a JSON line that is not
        # a cut fails in Lhotse's deserialisation with a KeyError/TypeError/AttributeError
        kind = _manifest_kind(path)
        if kind is not None:
            raise ManifestError(f"{path} is a Lhotse {kind}, not a CutSet; {_NOT_CUTS}") from None
        raise ManifestError(
            f"{path} is not a readable Lhotse cuts file ({type(e).__name__}: {e}); expected what "
            "CutSet.to_file() writes: a JSON array (.json) or JSON lines (.jsonl), optionally gzipped "
            "(.gz); for a NeMo manifest use --format nemo"
        ) from None
    cut_type = _lhotse().cut.Cut
    for k, cut in enumerate(cuts):
        if not isinstance(cut, cut_type):  # Lhotse reads JSON lines of recordings or supervisions as a CutSet
            raise ManifestError(
                f"{path}: record {k} is a Lhotse {type(cut).__name__}, not a cut (the file is not a "
                f"CutSet); {_NOT_CUTS}"
            )
    return cuts


def cuts_to_manifest(
    cuts_or_path: Any, *, default_lang: str | None = None, dropped: dict[str, int] | None = None
) -> pa.Table:
    """Convert a Lhotse ``CutSet`` (or a path to a cuts file: ``.json`` array or ``.jsonl``, either
    optionally gzipped, as ``CutSet.to_file`` writes them) to a manifest table.

    A cut is its supervised span (module docstring); a span over part of its recording gets a ``start``
    (seconds into the file; `LOCATOR_SCHEMA`) and is read as that segment; the column is present only
    when some row needs it. The seconds no supervision covers are logged when a cut is trimmed and
    kept in the table's schema metadata (`speechlm.data.lhotse_span.Coverage`). A cut whose
    transcript fails `check_transcript` (empty after cleaning, a ``<|xx|>`` tag that disagrees with
    the supervision's language) is dropped and counted in `dropped` (a warning when None).
    """
    counts: dict[str, int] = {} if dropped is None else dropped
    default = checked_default_lang(default_lang)
    if isinstance(cuts_or_path, str | os.PathLike):
        path = Path(cuts_or_path)
        cuts, shard_id = load_cuts(path), path.name
    else:
        _lhotse()  # an in-memory CutSet: the package is there; the same error otherwise
        cuts, shard_id = cuts_or_path, "cutset"

    if any(_prompt_fields(cut) for cut in cuts):
        return _conversation_cuts(cuts, shard_id, default, counts)
    ids: list[str] = []
    paths: list[str] = []
    durations: list[float] = []
    texts: list[str] = []
    langs: list[str] = []
    starts: list[float | None] = []
    coverage = Coverage()
    for cut in cuts:
        where = f"cut {cut.id!r} ({shard_id})"
        clip = check_cut(cut, where, default)
        text, reason = clip.transcript(clip.lang)
        if reason is not None:
            count_drop(counts, reason)
            continue
        coverage.add(float(cut.duration), clip.span, where)
        ids.append(cut.id)
        paths.append(os.path.abspath(clip.source.source))
        durations.append(clip.duration)
        texts.append(text)
        langs.append(clip.lang)
        starts.append(None if clip.whole_file else clip.start)
    if dropped is None:
        warn_dropped(shard_id, counts)
    table = build_manifest_table(ids, paths, durations, texts, langs, shard_ids=shard_id, source="lhotse")
    if any(s is not None for s in starts):
        table = table.append_column(LOCATOR_SCHEMA.field("start"), pa.array(starts, pa.float64()))
    return coverage.finish(table, shard_id)


PROMPT_FIELDS = ("prompt", "instruction", "answer", "target", "task", "conversation")


def _prompt_fields(cut: Any) -> dict[str, Any]:
    """The issue-23 custom fields of a cut (its supervision's, overridden by the cut's own)."""
    fields: dict[str, Any] = {}
    sups = getattr(cut, "supervisions", None) or []
    for custom in ([sups[0].custom] if len(sups) == 1 else []) + [getattr(cut, "custom", None)]:
        for key, value in (custom or {}).items():
            if key in PROMPT_FIELDS or (key == "lang" and value is not None):
                fields[key] = value
    return fields if any(k in fields for k in PROMPT_FIELDS) else {}


def _conversation_cuts(cuts: Any, shard_id: str, default: str | None, dropped: dict[str, int]) -> pa.Table:
    """Cuts with prompts/targets as manifest rows (`speechlm.data.sources.conversations.RowsBuilder`)."""
    rows = RowsBuilder.new()
    coverage = Coverage()
    for cut in cuts:
        where = f"cut {cut.id!r} ({shard_id})"
        fields = _prompt_fields(cut)
        has_sup = bool(cut.supervisions)
        if not has_sup and not fields:
            check_cut(cut, where, default)  # its error: a plain cut needs a supervision
        given_lang = (
            checked_language_code(fields["lang"], f"{where}: custom 'lang'") if fields.get("lang") else None
        )
        probe = cut if has_sup else _with_dummy_supervision(cut, given_lang or default)
        clip = check_cut(probe, where, default)
        lang = given_lang or clip.lang
        text = ""
        if any(sup.text for sup in cut.supervisions):
            tagged_text, reason = clip.transcript(lang)
            if reason is not None and not (
                fields.get("answer") or fields.get("target") or fields.get("conversation")
            ):
                count_drop(dropped, reason)
                continue
            text = tagged_text if reason is None else ""
        if has_sup:
            coverage.add(float(cut.duration), clip.span, where)
        own = {
            "value": os.path.abspath(clip.source.source),
            "duration": clip.duration,
            **({} if clip.whole_file else {"offset": clip.start}),
            **({"text": text} if text else {}),
        }
        rec: dict[str, Any] = {"id": cut.id, "lang": lang, "task": fields.get("task")}
        if fields.get("conversation") is not None:
            turns = fields["conversation"]
            if not isinstance(turns, list):
                raise ManifestError(f"{where}: custom 'conversation' must be a list of turns, got {turns!r}")
            rec["conversations"] = [
                {**t, **own}
                if isinstance(t, dict) and t.get("type") == "audio" and t.get("value") in ("", cut.id)
                else t
                for t in turns
            ]
        else:
            rec.update(audio_filepath=own["value"], duration=own["duration"], offset=own.get("offset"))
            rec.update(text=text, instruction=fields.get("prompt", fields.get("instruction")))
            rec["answer"] = fields.get("answer", fields.get("target"))
        conv = conversation_of_record(rec, where, ClipSource(Path.cwd()), default)
        rows.add(conv, where, task_given=fields.get("task") is not None)
    warn_dropped(shard_id, dropped)
    return coverage.finish(rows.table(shard_id, "lhotse"), shard_id)


def _with_dummy_supervision(cut: Any, lang: str | None) -> Any:
    """`cut` with one empty supervision in `lang`, so that `check_cut`'s audio checks apply to it."""
    lhotse = _lhotse()
    sup = lhotse.SupervisionSegment(id=f"{cut.id}-prompt", recording_id=cut.recording.id, start=0.0,
                             duration=cut.duration, language=lang)  # fmt: skip
    return lhotse.utils.fastcopy(cut, supervisions=[sup])
