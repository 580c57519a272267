"""What `speechlm transcribe` reads: audio to transcribe, with or without transcripts.

Every input becomes an `AudioInput`: the fields of its output line (``path``, and ``row`` / ``clip``
for a manifest), its duration in seconds (from the manifest or the file header; 0 when unknown, used
for batching and the ``--max-duration`` check) and a loader. A loader returns float32 mono samples at
the model's rate or raises `InputError`, whose message becomes the input's ``{"error"}`` line: a bad
input never stops the others.

``--manifest M`` takes, by what M is:

- a **list of paths** (any text file that is not a manifest the trainer reads, e.g. ``.txt``, ``.scp``):
  one audio path per line, blank lines and ``#`` comments skipped, relative paths resolved against the
  list's folder;
- a **NeMo JSON-lines** manifest: ``audio_filepath`` on every line; ``text``, ``duration`` (else the
  header's), ``offset`` and ``lang`` optional, so new audio needs no transcript; a line that cannot be
  used (not JSON, no ``audio_filepath``) gets its own error line;
- a **parquet** file with an ``audio_filepath`` column (``duration``, ``offset`` optional); a training
  manifest with its locator columns is read through the index like the other kinds;
- **any other reader** of the trainer (tar shards, NeMo tarred, Lhotse, WeNet, conversations): through
  `open_index`, every clip of every row (a conversation row with several clips gives one line per clip,
  with ``clip``), transcripts not needed and not checked. Those readers index rows whose transcript is
  empty or malformed out when they build the index, with a warning that counts them.

An input list that ends up empty is an error (exit 1), never a silent exit 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import soundfile as sf

from speechlm.data.audio import AudioDecodeError, decode_audio
from speechlm.data.dataset import SpeechDataset, load_audio
from speechlm.data.manifest.schema import MANIFEST_SCHEMA, ManifestError
from speechlm.data.sources.detect import detect_source_type
from speechlm.data.sources.members import MemberError
from speechlm.data.sources.mmap_cache import open_index
from speechlm.errors import DataError

# a text file that one of the trainer's readers recognises by its name or contents is read by it
NEMO_KIND, PARQUET_KIND = "nemo", "parquet"


class InputError(Exception):
    """One input that cannot be transcribed; the message names it and says why."""


@dataclass
class AudioInput:
    record: dict[str, Any]  # the output line's fields: path (+ row, clip)
    duration: float  # seconds, 0 when unknown
    load: Callable[[], np.ndarray]  # mono float32 at the model's rate; InputError when it cannot


def header_duration(path: str) -> float:
    """Seconds of `path` from its header; 0 when it cannot be read (the loader reports why)."""
    try:
        return float(sf.info(path).duration)
    except Exception:  # noqa: BLE001 - reported when the file is loaded
        return 0.0


def load_checked(load: Callable[[], np.ndarray], what: str) -> np.ndarray:
    """`load()`'s samples; every way a clip cannot be read becomes an InputError naming `what`."""
    try:
        audio = load()
    except (FileNotFoundError, AudioDecodeError, MemberError) as e:
        raise InputError(str(e)) from None
    if audio.size == 0:
        raise InputError(f"{what} decodes to no samples")
    return audio


def file_input(path: str, sample_rate: int, record: dict[str, Any] | None = None, *,
               duration: float | None = None, offset: float | None = None) -> AudioInput:  # fmt: skip
    """A whole audio file (or the segment [offset, offset + duration) of one)."""

    def load() -> np.ndarray:
        if offset is None:
            return load_checked(lambda: load_audio(path, sample_rate), path)
        if not Path(path).is_file():
            raise InputError(f"audio file {path} does not exist")
        return load_checked(
            lambda: decode_audio(path, path, sample_rate, start=offset, duration=duration), path
        )

    seconds = duration if duration is not None else header_duration(path)
    return AudioInput(record if record is not None else {"path": path}, seconds, load)


def file_inputs(paths: list[str], sample_rate: int) -> list[AudioInput]:
    """Audio files named on the command line."""
    return [file_input(p, sample_rate) for p in paths]


def failed_input(record: dict[str, Any], error: str) -> AudioInput:
    """An input known to be unusable before any audio is read (a bad manifest line)."""

    def load() -> np.ndarray:
        raise InputError(error)

    return AudioInput(record, 0.0, load)


# --- --manifest -----------------------------------------------------------------------------------------
def manifest_inputs(manifest: str, um: Any) -> list[AudioInput]:
    """The inputs of ``--manifest`` (module docstring); DataError when it holds none."""
    path = Path(manifest)
    if not path.exists():
        raise DataError(f"--manifest {path} does not exist")
    try:
        kind: str | None = detect_source_type(path)
    except ManifestError:
        kind = None  # not a manifest the trainer reads: a list of paths when it is a text file
    if kind is None:
        if path.is_dir():
            detect_source_type(path)  # a folder of no known kind: the readers' own error
        inputs = path_list_inputs(path, um.sample_rate)
    elif kind == NEMO_KIND:
        inputs = jsonl_inputs(path, um.sample_rate)
    elif kind == PARQUET_KIND and not is_training_parquet(path):
        inputs = parquet_inputs(path, um.sample_rate)
    else:
        inputs = table_inputs(path, um)
    if not inputs:
        raise DataError(
            f"--manifest {path} holds no audio to transcribe (0 inputs); give a list of audio paths (one per "
            "line), a NeMo JSON-lines manifest (audio_filepath on every line, text optional) or another manifest"
        )
    return inputs


def path_list_inputs(path: Path, sample_rate: int) -> list[AudioInput]:
    """One audio path per line (blank lines and # comments skipped), relative to the list's folder."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(
            f"--manifest {path} is neither a manifest the trainer reads nor a UTF-8 list of audio paths; give "
            "one audio path per line, a NeMo .jsonl or a .parquet manifest"
        ) from None
    except OSError as e:
        raise DataError(f"cannot read --manifest {path}: {e.strerror or e}") from None
    lines = [s.strip() for s in text.splitlines()]
    names = [s for s in lines if s and not s.startswith("#")]
    return [
        file_input(resolve(path.parent, name), sample_rate, {"row": row, "path": resolve(path.parent, name)})
        for row, name in enumerate(names)
    ]


def resolve(base: Path, name: str) -> str:
    p = Path(name)
    return str(p if p.is_absolute() else base / p)


def jsonl_inputs(path: Path, sample_rate: int) -> list[AudioInput]:
    """A NeMo JSON-lines manifest read for its audio only (text, lang optional); a bad line gets an error."""
    out = []
    with path.open("rb") as handle:
        raw_lines = [(n, raw) for n, raw in enumerate(handle, start=1) if raw.strip()]
    for row, (line_no, raw) in enumerate(raw_lines):
        where = f"{path}:{line_no}"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            out.append(failed_input({"row": row, "path": None}, f"{where}: not a JSON object ({e})"))
            continue
        out.append(row_input(obj, row, where, path.parent, sample_rate))
    return out


def row_input(obj: Any, row: int, where: str, base: Path, sample_rate: int) -> AudioInput:
    """One manifest row (a dict) with an ``audio_filepath``; ``duration`` and ``offset`` optional."""
    audio = obj.get("audio_filepath") if isinstance(obj, dict) else None
    if not isinstance(audio, str) or not audio:
        return failed_input(
            {"row": row, "path": None},
            f"{where}: no 'audio_filepath' (a non-empty string) to transcribe; give every row one",
        )
    full = resolve(base, audio)
    record = {"row": row, "path": full}
    duration, offset = obj.get("duration"), obj.get("offset")
    for key, value in (("duration", duration), ("offset", offset)):
        if value is not None and not (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        ):
            return failed_input(record, f"{where}: {key!r} {value!r} is not a number of seconds >= 0")
    if offset:
        if not duration:
            return failed_input(record, f"{where}: 'offset' {offset} needs the segment's 'duration'")
        return file_input(full, sample_rate, record, duration=float(duration), offset=float(offset))
    return file_input(full, sample_rate, record, duration=float(duration) if duration else None)


def is_training_parquet(path: Path) -> bool:
    """A parquet with every column of a training manifest (read through the index, locators and all)."""
    try:
        names = set(pq.read_schema(path).names)
    except Exception:  # noqa: BLE001 - the index reader gives the error
        return True
    return set(MANIFEST_SCHEMA.names) <= names


def parquet_inputs(path: Path, sample_rate: int) -> list[AudioInput]:
    """A parquet with an ``audio_filepath`` column (``text`` and the rest optional)."""
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - a damaged file: say which
        raise DataError(f"--manifest {path} cannot be read as parquet: {e}") from None
    if "audio_filepath" not in table.column_names:
        raise DataError(
            f"--manifest {path} has no 'audio_filepath' column (it has {table.column_names}); transcribe needs "
            "the audio paths"
        )
    keep = [c for c in ("audio_filepath", "duration", "offset") if c in table.column_names]
    rows = table.select(keep).to_pylist()
    return [row_input(r, i, f"{path}, row {i}", path.parent, sample_rate) for i, r in enumerate(rows)]


def table_inputs(path: Path, um: Any) -> list[AudioInput]:
    """Every clip of every row of a manifest the trainer's readers index (`open_index`), text unchecked."""
    table = open_index(path)
    try:
        ds = SpeechDataset(table, um.tokenizer, max_tokens=1 << 30, sample_rate=um.sample_rate)
    except ValueError as e:  # a null column, a language the tokenizer lacks: named by the dataset
        raise DataError(str(e)) from None
    return [item for i in range(len(ds)) for item in row_clips(ds, i)]


def row_clips(ds: SpeechDataset, i: int) -> Iterator[AudioInput]:
    """The clip of a transcription row, or each clip of a conversation row (``clip`` numbers them)."""
    if ds.optional("conversation", i) is None:  # a row of its own clip: a file, a segment or a tar member
        path = str(ds.resolve_path(i))
        claimed = ds.claimed_duration(i)
        yield AudioInput({"row": i, "path": path}, float(claimed or 0.0),
                         lambda: load_checked(lambda: ds.load_row_audio(i), path))  # fmt: skip
        return
    try:
        clips = ds.conversation(i).clips
    except ValueError as e:
        yield failed_input({"row": i, "path": None}, str(e))
        return
    for k, clip in enumerate(clips):
        what = f"{clip.tar}:{clip.path}" if clip.tar is not None else clip.path
        record = {"row": i, "path": what, **({"clip": k} if len(clips) > 1 else {})}
        seconds = clip.duration if clip.duration is not None else (
            header_duration(clip.path) if clip.tar is None else 0.0
        )  # fmt: skip
        yield AudioInput(record, float(seconds), clip_loader(ds, clip, what))


def clip_loader(ds: Any, clip: Any, what: str) -> Callable[[], np.ndarray]:
    return lambda: load_checked(lambda: ds.load_clip(clip), what)
