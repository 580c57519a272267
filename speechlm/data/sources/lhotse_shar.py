"""Lhotse Shar folders as a data source: cuts read from the JSONL shards, audio by position from the tars.

A Shar folder written by Lhotse's ``SharWriter`` with the ``recording`` field holds, per shard N::

    cuts.N.jsonl.gz     one cut per line; its recording is a placeholder (source type ``shar``)
    recording.N.tar     per cut, ``CUT_ID.EXT`` (the cut's audio only, EXT = flac, wav, ...) and
                        ``CUT_ID.json`` (its recording manifest); a cut with no audio has
                        ``CUT_ID.nodata`` + ``CUT_ID.nometa`` instead

(N is six digits, or absent when Shar was written without sharding.) Lhotse streams both files in
step; we index instead: each cut is joined to the audio member whose name without its extension is
the cut id, which is the pairing check Lhotse makes while streaming, done once at index time (the
member's header is checked again at read time). The member holds just the cut's audio, so a row is
a whole member of `duration` = the cut's duration. The cuts go through the same per-cut checks as a
cuts file (`speechlm.data.lhotse_adapter.check_cut`), several supervisions joined in time order; since
a member is read whole, a cut that its supervisions do not cover (its supervised span is shorter
than the cut, `speechlm.data.lhotse_span`) is refused, naming the cut and the fix, rather than trained
on audio no transcript describes. A cut whose member is missing is dropped and counted against the
tar, and a missing or unreadable tar stops the load naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from speechlm.data.lhotse_adapter import check_cut, checked_default_lang, load_cuts
from speechlm.data.lhotse_span import Coverage
from speechlm.data.manifest.schema import ManifestError, build_manifest_table
from speechlm.data.sources.detect import register_source
from speechlm.data.sources.join import locate_members, with_tar_locators
from speechlm.data.sources.report import SourceReport
from speechlm.data.sources.tar_index import TarScan
from speechlm.data.text import clean_text, tag_text

_CUTS = re.compile(r"cuts(\.\d+)?\.jsonl(\.gz)?")
_NOT_AUDIO = (".json", ".nodata", ".nometa")


def audio_members_by_cut_id(scan: TarScan) -> dict[str, int]:
    """{cut id: position} of a Shar field tar's data members (manifests and placeholders left out)."""
    out: dict[str, int] = {}
    for j, name in enumerate(scan.names):
        stem, dot, _ = name.rpartition(".")
        if dot and not name.endswith(_NOT_AUDIO):
            out[stem] = j
    return out


def shar_shards(folder: Path, field: str = "recording") -> list[tuple[Path, Path]]:
    """(cuts file, field tar) of every shard of Shar folder `folder`, in shard order."""
    pairs = []
    for cuts in sorted(folder.iterdir()):
        m = _CUTS.fullmatch(cuts.name)
        if m is not None:
            pairs.append((cuts, folder / f"{field}{m.group(1) or ''}.tar"))
    if not pairs:
        raise ManifestError(f"{folder} has no cuts.NNNNNN.jsonl.gz: not a Lhotse Shar folder")
    return pairs


@register_source("lhotse_shar")
def read_lhotse_shar(
    path: str | os.PathLike[str], *, report: SourceReport, default_lang: str | None = None, **_: Any
) -> pa.Table:
    """The manifest table of the Lhotse Shar folder `path` (see the module docstring)."""
    default = checked_default_lang(default_lang)
    shards = shar_shards(Path(path))
    ids: list[str] = []
    durations: list[float] = []
    texts: list[str] = []
    langs: list[str] = []
    codes: list[int] = []
    coverage = Coverage()
    for k, (cuts_path, _tar) in enumerate(shards):
        for cut in load_cuts(cuts_path):
            where = f"cut {cut.id!r} ({cuts_path})"
            clip = check_cut(cut, where, default, source_types=("shar",))
            if clip.duration < float(cut.duration):
                raise ManifestError(
                    f"{where}: its supervisions cover {clip.span.start:.3f}-{clip.span.end:.3f} s of the "
                    f"cut's {float(cut.duration):.3f} s, but a Shar member is read whole, so the cut cannot "
                    "train on its supervised span alone (docs/data.md, 'Lhotse cuts'); write the Shar from "
                    "cuts their supervisions cover (cuts.trim_to_supervisions()), or read a cuts file"
                )
            coverage.add(float(cut.duration), clip.span, where)
            ids.append(cut.id)
            durations.append(float(cut.duration))
            texts.append(tag_text(clean_text(clip.span.text), clip.lang))
            langs.append(clip.lang)
            codes.append(k)
    tars = [tar for _, tar in shards]
    code_arr = np.asarray(codes, np.int64)
    loc = locate_members(tars, code_arr, ids, report, what=str(path), key_map=audio_members_by_cut_id)
    table = build_manifest_table(
        ids, loc.names, durations, texts, langs, shard_ids=[tars[c].name for c in codes], source="lhotse"
    )
    table = with_tar_locators(table, code_arr, tars, loc.offsets, loc.sizes, loc.headers, loc.keep)
    return coverage.finish(table, str(path))
