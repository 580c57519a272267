"""The manifest table: its column schema, `ManifestError`, and `build_manifest_table`, which
assembles columns into that schema (dictionary-encoding the repeated strings).

Schema (`MANIFEST_SCHEMA`): ``segment_id`` string, ``shard_id`` dictionary<int32,string>,
``audio_filepath`` string (absolute), ``duration`` float32 seconds, ``text`` string (cleaned by
`speechlm.data.text.clean_text`, starting with the language tag ``<|xx|>``), ``lang``
dictionary<int8,string>, ``source`` dictionary<int8,string> (``shards``, ``nemo``, ``lhotse``).
Repeated strings are dictionary-encoded and every column is a flat Arrow buffer, so ten million rows
cost about the size of their strings, with no Python object per row (see docs/data.md, memory).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from speechlm.data.conversation import Conversation, ConversationError
from speechlm.errors import DataError

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("segment_id", pa.string(), nullable=False),
        pa.field("shard_id", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("audio_filepath", pa.string(), nullable=False),
        pa.field("duration", pa.float32(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("lang", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("source", pa.dictionary(pa.int8(), pa.string()), nullable=False),
    ]
)

# Optional columns that say where a row's audio bytes are when they are not a whole file of their own
# (`speechlm.data.sources`): a member of an uncompressed tar (``tar_path`` absolute, ``offset`` of
# the data, ``nbytes``, ``header_bytes`` of its tar headers; ``audio_filepath`` is then the member
# name, checked against the tar header at read time), or a segment of a longer file (``start``
# seconds into ``audio_filepath``, for ``duration`` seconds). ``dataset`` names the input of a
# weighted mix (`data.input_cfg`). A null ``tar_path`` means a plain file.
LOCATOR_SCHEMA = pa.schema(
    [
        pa.field("tar_path", pa.dictionary(pa.int32(), pa.string()), nullable=True),
        pa.field("offset", pa.int64(), nullable=True),
        pa.field("nbytes", pa.int64(), nullable=True),
        pa.field("header_bytes", pa.uint16(), nullable=True),
        pa.field("start", pa.float64(), nullable=True),
        pa.field("dataset", pa.dictionary(pa.int16(), pa.string()), nullable=True),
    ]
)


# Optional columns of a sample that is more than a transcript (`speechlm.data.conversation`, issue 23):
# ``task`` (null: the `data.input_cfg` entry's task, else "asr"), ``instruction`` (the user's text after
# the audio of a one-clip row; null: the entry's prompt, else data.instruction), ``answer`` (what the
# assistant says; null: ``text``, the tagged transcript), ``conversation`` (`Conversation.to_json`, its
# clips with their own locators; null: the row is the transcription shape built from the columns).
# ``text`` stays the row's ASR transcript where it has one (the CTC target of its one clip), else "".
CONVERSATION_SCHEMA = pa.schema(
    [
        pa.field("task", pa.string(), nullable=True),
        pa.field("instruction", pa.string(), nullable=True),
        pa.field("answer", pa.string(), nullable=True),
        pa.field("conversation", pa.string(), nullable=True),
    ]
)


# Other names a manifest may give a conversation column (docs/data.md): ``prompt`` for ``instruction``
# and ``target`` for ``answer``, as NeMo's and Lhotse's readers accept them.
COLUMN_ALIASES = {"instruction": "prompt", "answer": "target"}


def conversation_columns(names: list[str], where: str) -> dict[str, str]:
    """{`CONVERSATION_SCHEMA` column: the name the manifest `where` (with columns `names`) holds it
    under} for the columns it has; a column given under both names is refused (which one to train on
    would be a guess)."""
    out = {}
    for f in CONVERSATION_SCHEMA:
        alias = COLUMN_ALIASES.get(f.name)
        if alias is not None and f.name in names and alias in names:
            raise ManifestError(
                f"{where} has both column {f.name!r} and its other name {alias!r}; keep one of them (they "
                "mean the same thing)"
            )
        if f.name in names:
            out[f.name] = f.name
        elif alias is not None and alias in names:
            out[f.name] = alias
    return out


class ManifestError(DataError, ValueError):
    """A shard, manifest or option that cannot be used; the message says where and what to do."""


def _dictionary(codes: np.ndarray, names: Sequence[str], index_type: pa.DataType) -> pa.DictionaryArray:
    indices = pa.array(codes.astype(index_type.to_pandas_dtype(), copy=False), index_type)
    return pa.DictionaryArray.from_arrays(indices, pa.array(list(names), pa.string()))


def _encode_sorted(values: pa.Array | pa.ChunkedArray, what: str, limit: int) -> tuple[np.ndarray, list[str]]:
    """Codes (int64) into the sorted distinct values; error if more than `limit` distinct values."""
    names = sorted(pc.unique(values).to_pylist())
    if len(names) > limit:
        raise ManifestError(f"{len(names)} distinct {what} values, the manifest schema holds at most {limit}")
    codes = pc.index_in(values, value_set=pa.array(names, pa.string()))
    return np.asarray(codes.to_numpy(zero_copy_only=False), dtype=np.int64), names


Column: TypeAlias = Sequence[str] | pa.Array | pa.ChunkedArray


def _string_column(values: Column) -> pa.Array | pa.ChunkedArray:
    return values if isinstance(values, pa.Array | pa.ChunkedArray) else pa.array(list(values), pa.string())


def _dict_column(values: Column | str, n: int, index_type: pa.DataType, what: str) -> pa.Array:
    """A dictionary column: a constant for a str, a cast for a dictionary array, else sorted codes."""
    if isinstance(values, str):
        return _dictionary(np.zeros(n, np.int64), [values], index_type)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.DictionaryArray):
        return values.cast(pa.dictionary(index_type, pa.string()))
    limit = int(np.iinfo(index_type.to_pandas_dtype()).max)
    codes, names = _encode_sorted(_string_column(values), what, limit)
    return _dictionary(codes, names, index_type)


def build_manifest_table(
    segment_ids: Column,
    audio_filepaths: Column,
    durations: Sequence[float] | np.ndarray,
    texts: Column,
    langs: Column,
    *,
    shard_ids: Column | str,
    source: str,
) -> pa.Table:
    """Assemble a table in `MANIFEST_SCHEMA` from columns (texts already cleaned and tagged).

    `shard_ids` and `langs` may be one string per row, a dictionary array, or (shard_ids) one
    string for all rows.
    """
    n = len(segment_ids)
    columns = [
        _string_column(segment_ids),
        _dict_column(shard_ids, n, pa.int32(), "shard_id"),
        _string_column(audio_filepaths),
        pa.array(np.asarray(durations, dtype=np.float32), pa.float32()),
        _string_column(texts),
        _dict_column(langs, n, pa.int8(), "lang"),
        _dict_column(source, n, pa.int8(), "source"),
    ]
    return pa.Table.from_arrays(columns, schema=MANIFEST_SCHEMA)


def duration_mismatch(
    claimed: float, real: float, tolerance_s: float = 0.5, tolerance_frac: float = 0.1
) -> bool:
    """True when a manifest's `claimed` duration is too far from the audio's `real` one.

    The one rule for every check of claimed against decoded or header durations (``shards write``,
    the dataset): a clip is refused when ``|real - claimed| > max(tolerance_s, tolerance_frac *
    claimed)``. A claimed or real duration that is not a finite number is always a mismatch.
    """
    if not (math.isfinite(claimed) and math.isfinite(real)):
        return True
    return abs(real - claimed) > max(tolerance_s, tolerance_frac * abs(claimed))


def llm_text_chars(columns: pa.Table | pa.RecordBatch) -> pa.Array:
    """Characters of text each row puts into the LLM (int32), for the sampler's token estimate: ``text``
    for a transcript row (as before issue 23); ``instruction`` + ``answer`` (or ``text``) for a row of the
    transcription shape with those columns; every turn's text for a ``conversation`` row."""
    names = columns.column_names

    def length(name: str) -> np.ndarray:
        col = columns.column(name)
        return np.asarray(pc.fill_null(pc.utf8_length(col), 0).to_numpy(zero_copy_only=False), np.int64)

    chars = length("text")
    if "answer" in names:
        has = np.asarray(pc.is_valid(columns.column("answer")).to_numpy(zero_copy_only=False), bool)
        chars = np.where(has, length("answer"), chars)
    if "instruction" in names:
        chars = chars + length("instruction")
    if "conversation" in names and columns.column("conversation").null_count < len(columns):
        docs = columns.column("conversation").to_pylist()
        for i, doc in enumerate(docs):
            if doc is not None:
                turns = json.loads(doc).get("turns", [])
                chars[i] = sum(len(p.get("text", "")) for t in turns for p in t.get("parts", []))
    return pa.array(chars.astype(np.int32), pa.int32())


@dataclass(frozen=True)
class RowContents:
    """What each row of a manifest holds for training (int32 [N] each): its clips, the clips with a CTC
    target (`Conversation.ctc_transcripts`' rule: a clip's own transcript, or the answer of a one-clip
    ``asr`` row), and the characters of its answers (every assistant turn: the labelled text)."""

    clips: np.ndarray
    ctc_clips: np.ndarray
    answer_chars: np.ndarray


def row_contents(columns: pa.Table | pa.RecordBatch) -> RowContents:
    """`RowContents` of `columns`: vectorised over rows of the transcription shape (their ``text``,
    ``answer`` and ``task`` columns), a JSON parse per ``conversation`` row only."""
    names = columns.column_names
    n = columns.num_rows

    def strings(name: str) -> pa.Array | None:
        return columns.column(name) if name in names else None

    def length(col: Any) -> np.ndarray:
        return np.asarray(pc.fill_null(pc.utf8_length(col), 0).to_numpy(zero_copy_only=False), np.int64)

    text, answer, task = strings("text"), strings("answer"), strings("task")
    text_chars = length(pc.utf8_trim_whitespace(text)) if text is not None else np.zeros(n, np.int64)
    has_answer = (
        np.asarray(pc.is_valid(answer).to_numpy(zero_copy_only=False), bool) if answer is not None else None
    )
    answer_chars = text_chars if has_answer is None else np.where(has_answer, length(answer), text_chars)
    is_asr = (
        np.ones(n, bool)
        if task is None
        else np.asarray(pc.fill_null(pc.equal(task, "asr"), True).to_numpy(zero_copy_only=False), bool)
        | np.asarray(pc.is_null(task).to_numpy(zero_copy_only=False), bool)
    )
    ctc = ((text_chars > 0) | (is_asr & (answer_chars > 0))).astype(np.int32)
    clips = np.ones(n, np.int32)
    if "conversation" in names and columns.column("conversation").null_count < n:
        docs = columns.column("conversation").to_pylist()
        tasks = task.to_pylist() if task is not None else [None] * n
        for i, doc in enumerate(docs):
            if doc is not None:
                conv = Conversation.from_json(doc)
                if tasks[i]:
                    conv = replace(conv, task=str(tasks[i]))
                clips[i] = len(conv.clips)
                ctc[i] = sum(t is not None for t in conv.ctc_transcripts())
                answer_chars[i] = sum(len(t.text) for t in conv.turns if t.role == "assistant")
    return RowContents(clips, ctc, answer_chars.astype(np.int32))


def check_conversations(columns: pa.Table | pa.RecordBatch, where: str, first_row: int = 0) -> None:
    """ManifestError naming the row (``where, row N``) whose ``conversation`` is not a conversation one can
    train on (`speechlm.data.conversation.Conversation.check`): caught when the manifest is indexed, not
    when a worker reaches the row."""
    if "conversation" not in columns.column_names or columns.column("conversation").null_count == len(
        columns
    ):
        return

    for k, doc in enumerate(columns.column("conversation").to_pylist()):
        if doc is not None:
            try:
                Conversation.from_json(doc)
            except ConversationError as e:
                raise ManifestError(
                    f"{where}, row {first_row + k}: {e}; fix the row's 'conversation' (speechlm's JSON form, "
                    "docs/data.md) or rebuild the manifest"
                ) from None
