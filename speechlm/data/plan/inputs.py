"""What `speechlm plan` reads: per-row durations, languages and text lengths, from any source.

A parquet manifest is read column by column, never as a table: the durations and languages row
group by row group, the texts in pieces of 64k rows, each piece reduced to its character counts at
once (the token estimate of `speechlm plan` is ceil(characters / CHARS_PER_TOKEN)). Ids, paths and
whole texts are never held, so planning 10M utterances stays under 600 MiB.

Counting the characters means decompressing and decoding every text (1.2 GB for 10M rows): most
of a first plan's reading time, and not needed to build an epoch plan whose budget is seconds. So
`read_plan_columns` returns the durations and languages at once and the text lengths as a function
still to call, which `speechlm plan` runs on a second thread while the epoch plan is built; the
lengths it read are kept in the cache folder (`text_chars_cache`), and the next plan of the same
file reads no text at all. The characters of a piece come from the Arrow string column in C++
(`pyarrow.compute.utf8_length`), or straight from its offsets when every byte is ASCII
(`text_lengths`). Other kinds (NeMo, tar shards, Lhotse, WeNet) go through the memory-mapped index
cache, which stores the text lengths; a YAML file is read as a `data.input_cfg` list of datasets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speechlm.config import ExperimentConfig
from speechlm.data.manifest.schema import COLUMN_ALIASES, CONVERSATION_SCHEMA, ManifestError, row_contents
from speechlm.data.plan.figures import PlanRequest
from speechlm.data.sampler.build import SamplerInputs, sampler_inputs
from speechlm.data.sources.detect import detect_source_type
from speechlm.data.sources.input_cfg import load_input_cfg
from speechlm.data.sources.mmap_cache import default_cache_dir, open_index, source_fingerprint
from speechlm.io import atomic_path

TEXT_PIECE_ROWS = 1 << 16  # texts decoded at a time: ~8 MB of a 10M-row manifest's 1.2 GB


def read_plan_inputs(path: str | Path) -> SamplerInputs:
    """Durations, languages and text lengths of any source `speechlm train` accepts (see the module
    docstring): `read_plan_columns`, then its text lengths, on this thread."""
    inputs, read_text = read_plan_columns(path)
    return inputs if read_text is None else replace(inputs, text_chars=read_text())


def read_plan_columns(path: str | Path) -> tuple[SamplerInputs, Callable[[], np.ndarray] | None]:
    """The inputs of `path` and, when they still lack the text lengths of a parquet manifest (it has a
    `text` column and `text_chars_cache` holds none for it), the function that reads them (int32, one
    per row; it raises `ManifestError` naming the row of a null text, and keeps what it read in the
    cache). Otherwise the function is None and `text_chars` is filled in, or None without a text."""

    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        return plan_inputs_of_input_cfg(str(path)), None
    if not path.exists():
        raise ManifestError(f"manifest {path} does not exist; pass --manifest or set data.train_manifest")
    if (
        path.is_dir()
        or detect_source_type(path) != "parquet"
        or set(pq.read_schema(path).names)
        & {*CONVERSATION_SCHEMA.names, *COLUMN_ALIASES.values()}  # tasks, prompts: the index
    ):
        return plan_inputs_of_table(open_index(path)), None
    try:
        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        missing = [c for c in ("duration", "lang") if c not in names]
        if missing:
            raise ManifestError(
                f"manifest {path} has no column {', '.join(map(repr, missing))}; "
                f"it has {names}. Build it with `speechlm manifest build`"
            )
        n = f.metadata.num_rows
        durations = np.empty(n, np.float32)  # filled in place: no lists of pieces, no concatenation
        codes = np.empty(n, np.int16)
        seen: dict[str, int] = {}  # language -> code in order of appearance (sorted at the end)
        lo = 0
        for group in range(f.num_row_groups):
            batch = f.read_row_group(group, columns=["duration", "lang"], use_threads=False)
            for column in ("duration", "lang"):
                if batch.column(column).null_count:
                    raise ManifestError(
                        f"manifest {path}: column {column!r} has {batch.column(column).null_count} empty "
                        "values; every row needs a duration and a language"
                    )
            hi = lo + batch.num_rows
            durations[lo:hi] = batch.column("duration").cast(pa.float32()).to_numpy()
            lang = batch.column("lang")
            lang = lang if pa.types.is_dictionary(lang.type) else pc.dictionary_encode(lang)
            at = lo
            for chunk in lang.chunks:
                remap = np.array(
                    [seen.setdefault(str(v), len(seen)) for v in chunk.dictionary.to_pylist()], np.int16
                )
                codes[at : at + len(chunk)] = remap[chunk.indices.to_numpy(zero_copy_only=False)]
                at += len(chunk)
            lo = hi
            del batch, lang
        pa.default_memory_pool().release_unused()
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(f"manifest {path} is not a readable parquet file ({e})") from None
    has_text = "text" in names
    cached = load_text_chars(path, n) if has_text else None
    lang_names = sorted(seen)
    order = np.array([lang_names.index(name) for name in seen], np.int16)
    inputs = SamplerInputs(
        durations=durations,
        lang_codes=order[codes] if len(order) else codes,
        lang_names=lang_names,
        text_chars=cached,
    )
    return inputs, functools.partial(read_text_chars, path, n) if has_text and cached is None else None


def read_text_chars(path: Path, rows: int) -> np.ndarray:
    """The characters of the `text` of each of the `rows` rows of parquet manifest `path` (int32), read
    in pieces of `TEXT_PIECE_ROWS` (a row group's texts are never held whole) and kept for the next
    plan (`save_text_chars`). A null text raises `ManifestError` naming its row."""
    chars = np.empty(rows, np.int32)
    at = 0
    try:
        f = pq.ParquetFile(path)  # a handle of its own: this may run on another thread
        for group in range(f.num_row_groups):
            for piece in f.iter_batches(
                batch_size=TEXT_PIECE_ROWS, row_groups=[group], columns=["text"], use_threads=False
            ):
                if piece.column(0).null_count:
                    row = at + int(pc.index(pc.is_null(piece.column(0)), True).as_py())
                    raise ManifestError(
                        f"manifest {path}, row {row}: column 'text' is null; every row needs a "
                        "transcript: fill it in or remove the row, or rebuild the manifest"
                    )
                chars[at : at + piece.num_rows] = text_lengths(piece.column(0))
                at += piece.num_rows
                del piece  # and back to the system at once: the epoch plan peaks beside this thread
                pa.default_memory_pool().release_unused()
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(f"manifest {path} is not a readable parquet file ({e})") from None
    save_text_chars(path, chars)
    return chars


def text_lengths(texts: Any) -> np.ndarray:
    """Characters (code points) of each string of Arrow array `texts`, as `len(str)` counts them.

    A string or large_string array whose bytes are all ASCII (one byte, one character) takes its
    lengths from the offsets, without reading a string; otherwise `pyarrow.compute.utf8_length`
    counts in C++ the bytes that do not continue a UTF-8 sequence. No Python string is made."""
    width = {pa.string(): np.int32, pa.large_string(): np.int64}.get(texts.type)
    if width is not None and texts.null_count == 0:
        _, offsets_buf, data_buf = texts.buffers()
        offsets = np.frombuffer(offsets_buf, width, len(texts) + 1, texts.offset * np.dtype(width).itemsize)
        lo, hi = (int(offsets[0]), int(offsets[-1])) if len(texts) else (0, 0)
        data = np.frombuffer(data_buf, np.uint8, hi - lo, lo) if hi > lo else np.zeros(0, np.uint8)
        if not len(data) or int(data.max()) < 0x80:
            return np.diff(offsets)
    return np.asarray(pc.utf8_length(texts).to_numpy(zero_copy_only=False))


def text_chars_cache(path: Path) -> Path:
    """Where `speechlm plan` keeps the text lengths of parquet manifest `path`: beside the index cache,
    named by the digest of its path, size and mtime (`source_fingerprint`), so an edited file misses."""
    return default_cache_dir().parent / "plan" / f"{path.name}.{source_fingerprint(path)}.text_chars.npy"


def load_text_chars(path: Path, rows: int) -> np.ndarray | None:
    """The cached text lengths of `path` (int32, one per row), or None when there are none yet, or the
    file is unreadable or of another length (then `save_text_chars` writes it again)."""
    try:
        chars = np.load(text_chars_cache(path), allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return chars if chars.dtype == np.int32 and chars.shape == (rows,) else None


def save_text_chars(path: Path, chars: np.ndarray) -> None:
    """Keep the text lengths for the next plan of `path` (reading 10M texts is most of a plan's time).
    Written to a temporary file and renamed, so a plan killed mid-write leaves no partial cache; a cache
    that cannot be written (read-only, full disk) only costs the next plan the time to read the texts."""
    target = text_chars_cache(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp, open(tmp, "wb") as f:
            np.save(f, chars, allow_pickle=False)
    except OSError:
        pass


def plan_inputs_of_table(table: Any, cfg: Any = None) -> SamplerInputs:
    """The plan inputs of `table` (an index of any source) under `cfg` (default: the default config),
    with each row's clips, CTC clips and answer characters when the table has conversation columns (the
    plan's per-task figures; training's sampler never reads them, so only the plan pays for them)."""
    inputs = sampler_inputs(cfg if cfg is not None else ExperimentConfig(), table)
    if not {"task", "answer", "conversation"} & set(table.column_names):
        return inputs
    return replace(inputs, contents=row_contents(table))


def plan_inputs_of_input_cfg(entries: Any, cfg: Any = None) -> SamplerInputs:
    """The plan inputs of a `data.input_cfg` (a list of entries or a YAML file of one)."""
    return plan_inputs_of_table(load_input_cfg(entries), cfg)


def plan_inputs(req: PlanRequest) -> tuple[SamplerInputs, Callable[[], np.ndarray] | None]:
    """The inputs `req` plans: its data.input_cfg, or its manifest (read as training reads it when the
    run streams: the streaming plan needs every row's tar and offset from the index). With the function
    that reads their text lengths when those are still to read (`read_plan_columns`)."""
    if req.input_cfg is not None:
        return plan_inputs_of_input_cfg(req.input_cfg, req.cfg), None
    if req.cfg is not None and req.cfg.data.read_mode == "streaming":
        return plan_inputs_of_table(open_index(req.manifest), req.cfg), None
    return read_plan_columns(req.manifest)
