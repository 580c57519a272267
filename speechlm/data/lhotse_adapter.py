"""Convert a Lhotse CutSet into a training manifest (`MANIFEST_SCHEMA`, source ``lhotse``).

Our manifest has one audio file per row and no offsets, so only the simple, common kind of cut is
accepted: a cut over a whole single-file mono recording, with exactly one supervision. Per cut:

- ``segment_id`` = the cut id; ``audio_filepath`` = the recording's file source, made absolute
  against the working directory, as Lhotse itself resolves it; ``duration`` = the cut duration;
- ``text`` = the supervision text, cleaned and tagged with the supervision's ``language`` (lower-cased;
  use ISO codes such as ``hi`` in Lhotse, or pass `default_lang` for cuts without one);
- ``shard_id`` = the cuts file's name, or ``cutset`` for an in-memory CutSet.

Anything else (several supervisions, multi-channel, URL/memory/command sources, a cut that covers
part of its recording) raises `ManifestError` naming the cut, since silently picking one supervision
or the whole file would train on the wrong audio/text pairs. Lhotse is imported only when called.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from speechlm.data.manifest import ManifestError, build_manifest_table
from speechlm.data.text import clean_text, normalize_lang, tag_text

_TOLERANCE_S = 1e-3  # a cut "covers" its recording if start and end match within a millisecond


def _import_cutset() -> Any:
    try:
        from lhotse import CutSet
    except ImportError:
        raise ImportError(
            "reading Lhotse cuts needs the lhotse package: pip install 'speechlm[lhotse]'"
        ) from None
    return CutSet


def cuts_to_manifest(cuts_or_path: Any, *, default_lang: str | None = None) -> pa.Table:
    """Convert a Lhotse ``CutSet`` (or a path to a cuts ``.jsonl(.gz)``) to a manifest table."""
    cut_set = _import_cutset()
    default = normalize_lang(default_lang) if default_lang is not None else None
    if default_lang is not None and default is None:
        raise ManifestError(f"default_lang {default_lang!r} is not a language code; pass e.g. 'hi' or 'en'")
    if isinstance(cuts_or_path, str | os.PathLike):
        path = Path(cuts_or_path)
        if not path.is_file():
            raise ManifestError(f"Lhotse cuts file {path} does not exist")
        cuts = cut_set.from_file(path)
        shard_id = path.name
    else:
        cuts, shard_id = cuts_or_path, "cutset"

    ids: list[str] = []
    paths: list[str] = []
    durations: list[float] = []
    texts: list[str] = []
    langs: list[str] = []
    for cut in cuts:
        where = f"cut {cut.id!r} ({shard_id})"
        if len(cut.supervisions) != 1:
            raise ManifestError(
                f"{where} has {len(cut.supervisions)} supervisions, expected exactly 1; "
                "split it with cuts.trim_to_supervisions() first"
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
        if source.type != "file":
            raise ManifestError(
                f"{where}: audio source type {source.type!r} is not supported; save the audio "
                "to files (for example with cuts.save_audios()) and point the recordings there"
            )
        if abs(cut.start) > _TOLERANCE_S or abs(cut.duration - recording.duration) > _TOLERANCE_S:
            raise ManifestError(
                f"{where} covers {cut.start:.3f}-{cut.end:.3f} s of a {recording.duration:.3f} s "
                "recording; the manifest has no offsets: save each cut's audio to its own file"
            )
        sup = cut.supervisions[0]
        lang = normalize_lang(sup.language) if sup.language else default
        if lang is None:
            raise ManifestError(
                f"{where}: supervision language {sup.language!r} is missing or not a code; set "
                "supervision.language (e.g. 'hi') or pass default_lang"
            )
        ids.append(cut.id)
        paths.append(os.path.abspath(source.source))
        durations.append(float(cut.duration))
        texts.append(tag_text(clean_text(sup.text or ""), lang))
        langs.append(lang)
    return build_manifest_table(ids, paths, durations, texts, langs, shard_ids=shard_id, source="lhotse")
