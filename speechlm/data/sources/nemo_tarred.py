"""NeMo tarred datasets: write one from a manifest, and read one into the in-memory index.

Layout (as the NeMo ASR docs describe it, and as `write_nemo_tarred` writes it)::

    DIR/audio_0.tar, audio_1.tar, ...          the audio files' bytes unchanged, one member per
                                               utterance, named SEGMENT_ID + suffix ('/' -> '__')
    DIR/tarred_audio_manifest.json             one JSON object per line: audio_filepath (= the member
                                               name), duration, text (cleaned, no language tag),
                                               lang, shard_id (k of audio_k.tar)
    DIR/sharded_manifests/manifest_0.json ...  the lines of shard k only

Reading takes a folder like that, or NeMo's own options: ``manifest_filepath`` (one JSON file, or a
brace pattern over sharded manifests) and ``tarred_audio_filepaths`` (a brace pattern or list; NeMo
writes ``audio__OP_0..N_CL_.tar`` for ``audio_{0..N}.tar``). Line k of the expanded tar list is
shard_id k. Rows are joined to their tar's members by name (`speechlm.data.sources.join`): the
offsets come from the tar headers, scanned once and cached, so a rewritten tar cannot be read at a
stale offset. A member missing from its tar is dropped and counted against that tar; a missing or
unreadable tar stops the load with a `ManifestError` naming it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from speechlm.data.manifest.nemo import iter_nemo_lines
from speechlm.data.manifest.schema import ManifestError, build_manifest_table
from speechlm.data.sources.detect import register_source
from speechlm.data.sources.join import locate_members, with_tar_locators
from speechlm.data.sources.shards import SourceReport, finish_tar_set, start_tar_set, write_tars
from speechlm.data.text import split_lang_tag
from speechlm.io import atomic_path, temp_glob

MANIFEST_NAME = "tarred_audio_manifest.json"
SHARDED_DIR = "sharded_manifests"

_NEMO_BRACE = re.compile(r"_OP_(.*?)_CL_")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{a..b}`` ranges, ``{x,y}`` lists and NeMo's ``_OP_a..b_CL_`` in `pattern`, left to right.

    A range keeps the zero padding of its bounds (``{00..02}`` -> 00, 01, 02), as a shell does; a
    brace with neither ``..`` nor ``,`` is kept as written.
    """
    pattern = _NEMO_BRACE.sub(r"{\1}", pattern)
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), expand_braces(pattern[m.end() :])
    r = _RANGE.fullmatch(body)
    if r is not None:
        lo, hi = r.group(1), r.group(2)
        padded = any(len(b.lstrip("-")) > 1 and b.lstrip("-").startswith("0") for b in (lo, hi))
        width = max(len(lo), len(hi)) if padded else 0
        step = 1 if int(hi) >= int(lo) else -1
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    elif "," in body:
        items = body.split(",")
    else:
        items = [m.group(0)]
    return [head + item + rest for item in items for rest in tail]


def _write_json_lines(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp:
        _write_json_lines_to(tmp, lines)


def _write_json_lines_to(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def write_nemo_tarred(
    table: pa.Table,
    out_dir: str | os.PathLike[str],
    *,
    shard_size: int = 1000,
    base_dir: Path | None = None,
    skip_bad_audio: bool = False,
    skipped: list[tuple[int, str, str, str]] | None = None,
    where: str = "the manifest",
) -> Path:
    """Write manifest `table` as a NeMo tarred dataset under `out_dir`; returns the manifest path.

    The skeleton of `speechlm.data.sources.shards` (`start_tar_set`, `write_tars`, `finish_tar_set`): each
    tar and each manifest is written to a temporary name and renamed when whole; the combined manifest is
    written last, so a folder that has it is complete.
    """
    out = Path(out_dir)
    # issue 20 (convert): never write into a finished set or a foreign folder; check every row first
    start = start_tar_set(
        table,
        out,
        complete=MANIFEST_NAME,
        partial=("audio_*.tar", temp_glob("audio_*.tar"), SHARDED_DIR, temp_glob(MANIFEST_NAME)),
        shard_size=shard_size,
        base_dir=base_dir,
        skip_bad_audio=skip_bad_audio,
        skipped=skipped,
        where=where,
    )
    table, plan = start.table, start.plan
    names = plan.names
    (out / SHARDED_DIR).mkdir(parents=True, exist_ok=True)
    durations = plan.durations.astype(np.float32).tolist()  # the audio headers', not the claims
    texts = [split_lang_tag(t)[1] for t in table.column("text").to_pylist()]
    langs = table.column("lang").cast(pa.string()).to_pylist()
    every: list[dict[str, Any]] = []
    written: set[str] = set()
    for k, lo, hi, _ in write_tars(out, plan, shard_size, _tar_name, MANIFEST_NAME):
        written.add(_tar_name(k))
        lines = [
            {
                "audio_filepath": names[i],
                "duration": durations[i],
                "text": texts[i],
                "lang": langs[i],
                "shard_id": k,
            }
            for i in range(lo, hi)
        ]
        _write_json_lines(out / SHARDED_DIR / f"manifest_{k}.json", lines)
        every.extend(lines)
    return finish_tar_set(out, MANIFEST_NAME, lambda tmp: _write_json_lines_to(tmp, every), start, written)


def _tar_name(k: int) -> str:
    return f"audio_{k}.tar"


def _manifests_of(folder: Path) -> list[Path]:
    if (folder / MANIFEST_NAME).is_file():
        return [folder / MANIFEST_NAME]
    shards = list((folder / SHARDED_DIR).glob("manifest_*.json"))
    if not shards:
        raise ManifestError(f"{folder} has no {MANIFEST_NAME} and no {SHARDED_DIR}/manifest_*.json")
    return sorted(shards, key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))


@register_source("nemo_tarred")
def read_nemo_tarred(
    path: str | os.PathLike[str],
    *,
    report: SourceReport,
    default_lang: str | None = None,
    manifest_filepath: str | None = None,
    tarred_audio_filepaths: str | Sequence[str] | None = None,
    **_: Any,
) -> pa.Table:
    """The manifest table of a NeMo tarred dataset (folder, or NeMo's two options; module docstring)."""
    path = Path(path)
    if tarred_audio_filepaths is not None:
        patterns = (
            [tarred_audio_filepaths] if isinstance(tarred_audio_filepaths, str) else tarred_audio_filepaths
        )
        tar_list = [Path(t) for p in patterns for t in expand_braces(str(p))]
        manifests = [Path(m) for m in expand_braces(str(manifest_filepath or path))]
    else:
        folder = path if path.is_dir() else path.parent
        manifests = [path] if path.is_file() else _manifests_of(folder)
        tar_list = []
    where = ", ".join(map(str, manifests))
    ids: list[str] = []
    members: list[str] = []
    durations: list[float] = []
    texts: list[str] = []
    langs: list[str] = []
    shard_ids: list[int] = []
    for manifest in manifests:
        for line in iter_nemo_lines(manifest, default_lang):
            shard = line.row.get("shard_id")
            if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
                raise ManifestError(
                    f"{line.where}: 'shard_id' {shard!r} is not a shard number; every line of a tarred "
                    "manifest needs the k of its audio_k.tar"
                )
            if tar_list and shard >= len(tar_list):
                raise ManifestError(
                    f"{line.where}: shard_id {shard} but tarred_audio_filepaths expands to {len(tar_list)} "
                    "tars; pass the whole range"
                )
            ids.append(str(line.row.get("segment_id") or Path(line.audio).stem))
            members.append(line.audio)
            durations.append(line.duration)
            texts.append(line.text)
            langs.append(line.lang)
            shard_ids.append(shard)
    used = sorted(set(shard_ids))
    tars = [tar_list[k] if tar_list else folder / f"audio_{k}.tar" for k in used]
    codes = np.searchsorted(np.asarray(used, np.int64), np.asarray(shard_ids, np.int64))
    loc = locate_members(tars, codes, members, report, what=where)
    manifest_table = build_manifest_table(
        ids, members, durations, texts, langs, shard_ids=[tars[c].name for c in codes], source="nemo"
    )
    return with_tar_locators(manifest_table, codes, tars, loc.offsets, loc.sizes, loc.headers, loc.keep)
