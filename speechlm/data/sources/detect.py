"""Which kind of data a path is, and the one entry that turns any of them into a manifest table.

Every source becomes the same in-memory index the sampler and the dataset use: a table in
`MANIFEST_SCHEMA` plus, where the bytes are not a whole file of their own, the locator columns of
`LOCATOR_SCHEMA` (tar member or file segment). Kinds, detected from the path's contents:

========================  ==============================================================
``parquet``               a training manifest (``speechlm manifest build``)
``nemo``                  a NeMo JSON-lines manifest of extracted files
``speechlm_shards``       a folder from ``speechlm shards write`` (``index.parquet`` + tars)
``nemo_tarred``           a NeMo tarred dataset folder (``tarred_audio_manifest.json`` + tars)
``lhotse_shar``           a Lhotse Shar folder (``cuts.NNNNNN.jsonl.gz`` + ``recording.NNNNNN.tar``)
``lhotse_cuts``           a Lhotse cuts file as ``CutSet.to_file`` writes it: JSON lines (``.jsonl``) or a
                          JSON array (``.json``), either optionally gzipped; offsets allowed
``wenet``                 a WeNet ``data.list`` (raw: one JSON per line; shard: one tar per line)
``conversations``         samples with prompts and several clips (`conversations`): NeMo multimodal
                          conversation JSONL or its tarred folder, ShareGPT JSON, rows with a conversation
========================  ==============================================================

`load_source` is the one dispatcher from a path to a manifest table, in memory: it detects the kind
(`detect_source_type`) unless given, and calls that kind's reader. Readers register themselves in
`SOURCE_READERS`; an explicit ``type`` (`data.input_cfg`) skips detection. Whatever trains or plans
reads through the index instead (`mmap_cache.open_index`), which calls `load_source` once and maps
the result; this module imports the manifest readers and nothing imports it back from there.
"""

from __future__ import annotations

import gzip
import importlib
import io
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from speechlm.data.manifest.load import read_parquet_manifest
from speechlm.data.manifest.nemo import read_nemo_manifest
from speechlm.data.manifest.schema import ManifestError
from speechlm.data.sources.report import SourceReport
from speechlm.data.sources.shards import is_shard_dir, read_shards

logger = logging.getLogger(__name__)

SourceReader = Callable[..., pa.Table]  # (path, *, report, default_lang, **options) -> table

SOURCE_READERS: dict[str, SourceReader] = {}
SOURCE_TYPES = (
    "parquet",
    "nemo",
    "speechlm_shards",
    "nemo_tarred",
    "lhotse_shar",
    "lhotse_cuts",
    "wenet",
    "conversations",
)


def register_source(kind: str) -> Callable[[SourceReader], SourceReader]:
    def wrap(fn: SourceReader) -> SourceReader:
        SOURCE_READERS[kind] = fn
        return fn

    return wrap


@register_source("parquet")
def _read_parquet(path: Path, *, report: SourceReport, default_lang: str | None = None, **_: Any) -> pa.Table:
    return read_parquet_manifest(path)


@register_source("nemo")
def _read_nemo(path: Path, *, report: SourceReport, default_lang: str | None = None, **_: Any) -> pa.Table:
    return read_nemo_manifest(path, default_lang=default_lang)


@register_source("speechlm_shards")
def _read_speechlm_shards(
    path: Path, *, report: SourceReport, default_lang: str | None = None, **_: Any
) -> pa.Table:
    return read_shards(path, report)


_PROBE_CHARS = 1 << 16  # a cut, even with many supervisions, is a few kB; the probe reads up to 1 MiB


def _first_json_record(path: Path) -> tuple[bool, dict[str, Any] | None]:
    """Whether JSON-lines or JSON-array file `path` (gzipped if it ends in .gz) is an array, and its first
    record (None when there is none, or it is not an object, or the file cannot be read or parsed).

    A JSON array (ShareGPT, Lhotse's ``CutSet.to_file("x.json")``) may be one pretty-printed object
    over many lines, or the whole file on one line: its first element is parsed from the front of the
    file alone, so a large file is not read whole to be told apart."""
    opener: Any = gzip.open if path.suffix.lower() == ".gz" else open
    try:
        # bytes, decoded leniently: a bad byte further down is the reader's to name, with its line
        with opener(path, "rb") as raw:
            f = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
            head = ""
            while not head.strip():
                line = f.readline(_PROBE_CHARS)  # bounded: a JSON array may be all on one line
                if not line:
                    return False, None
                head = line
            if not head.lstrip().startswith("["):
                value = json.loads(head if head.endswith("\n") else head + f.readline())
                return False, value if isinstance(value, dict) else None
            head = head.lstrip()[1:]
            for _ in range(16):
                try:
                    value, _end = json.JSONDecoder().raw_decode(head.lstrip())
                    return True, value if isinstance(value, dict) else None
                except ValueError:
                    try:
                        more = f.read(_PROBE_CHARS)
                    except (OSError, EOFError, UnicodeDecodeError):
                        break  # an array all the same: its reader names what is wrong in it
                    if not more:
                        break
                    head += more
            return True, None
    except (OSError, EOFError, ValueError, UnicodeDecodeError):
        return False, None


_CUT_TYPES = ("MonoCut", "Cut", "MultiCut", "MixedCut", "PaddingCut", "DataCut")


def _is_lhotse_record(record: dict[str, Any] | None) -> bool:
    """A record as `CutSet.to_file` writes a cut (also Lhotse's older fixtures, whose type is `Cut`), or
    as Lhotse writes a recording or a supervision: those files are read by the cuts reader too, whose
    error says to make cuts of them."""
    if record is None:
        return False
    if record.get("type") in _CUT_TYPES and "duration" in record:
        return True
    if "sources" in record and "sampling_rate" in record:  # a RecordingSet
        return True
    if {"recording_id", "start", "duration"} <= record.keys() and "audio_filepath" not in record:
        return True  # a SupervisionSet
    return "supervisions" in record and ("recording" in record or "features" in record)


def _has_conversations_column(path: Path) -> bool:
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError):
        return False  # the parquet reader gives the error
    return "conversations" in names or "messages" in names


def tarred_shards(folder: Path) -> list[tuple[Path, Path]]:
    """(manifest_K.jsonl, audio_K.tar) of a tarred conversation folder, in shard order."""
    pairs = []
    for manifest in folder.glob("manifest_*.json*"):
        k = re.fullmatch(r"manifest_(\d+)\.jsonl?", manifest.name)
        if k is not None:
            pairs.append((int(k.group(1)), manifest, folder / f"audio_{k.group(1)}.tar"))
    if not pairs:
        raise ManifestError(f"{folder} has no manifest_K.jsonl: not a tarred conversation folder")
    return [(m, t) for _, m, t in sorted(pairs)]


def is_tarred_conversations(folder: Path) -> bool:
    try:
        pairs = tarred_shards(folder)
    except ManifestError:
        return False
    return all(t.is_file() for _, t in pairs)


def detect_source_type(path: str | Path) -> str:
    """The kind of `path` (see the module docstring); ManifestError when it is none of them."""
    path = Path(path)
    if path.is_dir():
        if is_shard_dir(path):
            return "speechlm_shards"
        if (path / "tarred_audio_manifest.json").is_file() or any(
            path.glob("sharded_manifests/manifest_*.json")
        ):
            return "nemo_tarred"
        if any(path.glob("cuts.*.jsonl*")):
            return "lhotse_shar"
        if is_tarred_conversations(path):
            return "conversations"
        raise ManifestError(
            f"{path} is a folder but not a known dataset: expected index.parquet + shard-*.tar (speechlm "
            "shards), tarred_audio_manifest.json + audio_*.tar (NeMo tarred), or cuts.NNNNNN.jsonl.gz "
            "(Lhotse Shar), manifest_K.jsonl + audio_K.tar (NeMo conversations); for a manifest file pass the file, e.g. "
            f"{path / 'train.parquet'}"
        )
    if path.name == "index.parquet" and is_shard_dir(path.parent):
        return "speechlm_shards"
    suffixes = "".join(path.suffixes[-2:]).lower()
    if path.suffix.lower() == ".parquet":
        if path.is_file() and _has_conversations_column(path):
            return "conversations"  # NeMo/ShareGPT turns in a column: normalised by that reader
        return "parquet"
    if path.suffix.lower() == ".list" or path.name == "data.list":
        return "wenet"
    if suffixes.endswith((".jsonl.gz", ".json.gz")):
        return "lhotse_cuts"  # the gzipped forms `CutSet.to_file` writes; no other reader takes gzip
    if path.suffix.lower() in (".json", ".jsonl"):
        array, first = _first_json_record(path) if path.is_file() else (False, None)
        if _is_lhotse_record(first):
            return "lhotse_cuts"
        if array or (
            first is not None
            and any(first.get(k) is not None for k in ("conversations", "messages", "conversation"))
        ):
            return "conversations"  # a JSON array is ShareGPT's form; its reader names what is wrong in it
        return "nemo"
    raise ManifestError(
        f"{path}: unknown manifest format; expected a .parquet manifest, a NeMo .json(l), a Lhotse "
        "cuts file (.json, .jsonl, .json.gz, .jsonl.gz), a WeNet data.list, or a shard folder (speechlm, NeMo tarred, Lhotse Shar); "
        f"or name the type explicitly in data.input_cfg ({', '.join(SOURCE_TYPES)})"
    )


def load_source(
    path: str | Path, kind: str | None = None, *, default_lang: str | None = None, **options: Any
) -> pa.Table:
    """Read `path` as `kind` (detected when None) into a manifest table; drops are logged per shard."""
    path = Path(path)
    kind = kind or detect_source_type(path)
    if kind not in SOURCE_READERS:
        _import_readers()
    reader = SOURCE_READERS.get(kind)
    if reader is None:
        raise ManifestError(f"{path}: data type {kind!r} is not known; use one of {', '.join(SOURCE_TYPES)}")
    report = SourceReport()
    table = reader(path, report=report, default_lang=default_lang, **options)
    if report.total:
        logger.warning(
            "%s: %d utterances dropped while indexing:\n  %s", path, report.total, "\n  ".join(report.lines())
        )
    return table


def _import_readers() -> None:
    """Import the reader modules so that they register (each imports its optional dependency lazily)."""
    for module in ("nemo_tarred", "lhotse_shar", "wenet", "lhotse_cuts", "conversations"):
        try:
            importlib.import_module(f"speechlm.data.sources.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"speechlm.data.sources.{module}":
                raise
