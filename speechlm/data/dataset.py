"""Dataset and loader: row indices in, padded `Batch` out (the Batch and its collation: `speechlm.data.batch`).

Shapes: B utterances in a batch, N audio samples (16 kHz mono), L tokens.

The sampler (elsewhere) yields lists of manifest row indices; this module does all the I/O:

    SpeechDataset[i]   check row i's transcript (`text.check_transcript`); tokenize it; decode its
                       audio -> mono -> resample to 16 kHz; compare the decoded length with the
                       manifest's duration -> Sample, or DroppedSample(reason) when the row cannot be used
    Collator(pad_id)   drop the DroppedSamples (counted per reason), zero-pad audio_BN and
                       pad tokens_BL with pad_id -> Batch; all dropped -> an empty Batch (B = 0)
                       (conversations, `SpeechDataset(renderer=...)`: `conversation_samples`; audio
                       per clip, the rendered prompts, per-clip CTC targets, tasks)
    build_dataloader   DataLoader(batch_sampler=..., collate_fn=Collator, worker_init_fn=seed_worker)

A bad clip is never replaced by silence or by another row: the batch simply has one utterance
fewer, and `Batch.dropped` says why. Rows are dropped (and counted per reason, reaching the step's
logged ``dropped_*`` metrics) for their audio (missing, undecodable, empty, a cut beyond the end of its
recording, a decoded length that differs from the manifest's duration by more than
`data.duration_tolerance`: `manifest.schema.duration_mismatch`) and for their text (not UTF-8,
`check_transcript`'s empty/untagged/mistagged, more than `max_tokens` tokens: a transcript is never
cut, since an EOS after a cut would teach the model to stop mid-sentence). Workers are separate processes, so drop counts travel inside the
batches (`Batch.dropped`) and the step adds them up (`StepBatch.dropped`); nothing is shared between processes.

The manifest stays columnar (Arrow string arrays, numpy codes for the language), so that forked
workers do not touch millions of Python objects and slowly copy the parent's memory.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset

from speechlm.data.audio import AudioDecodeError, SegmentOutOfRangeError, decode_audio
from speechlm.data.batch import Batch as Batch  # re-exported: the loader's output
from speechlm.data.batch import Collator as Collator  # re-exported: the loader's default collate_fn
from speechlm.data.conversation import Clip, Conversation
from speechlm.data.conversation_samples import conversation_sample
from speechlm.data.manifest.load import dictionary_codes
from speechlm.data.manifest.schema import CONVERSATION_SCHEMA, duration_mismatch
from speechlm.data.samples import DroppedSample, Sample
from speechlm.data.sources.detect import load_source
from speechlm.data.sources.input_cfg import MIX_KEY
from speechlm.data.sources.locators import IntColumn, RowLocators
from speechlm.data.sources.members import MemberError
from speechlm.data.text import TRANSCRIPT_DROP_REASONS, check_transcript
from speechlm.errors import UsageError

if TYPE_CHECKING:
    from speechlm.packing.prompt import ConversationRenderer

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("audio_filepath", "text", "lang")
# the last three are tar members (`speechlm.data.sources`): the shard is gone or cut short, or the
# offset index no longer matches the tar's headers (the clip is refused, never decoded unpaired)
DROP_REASONS = (
    "missing_file",
    "undecodable",
    "empty_audio",
    "missing_shard",
    "truncated_shard",
    "stale_index",
    "segment_beyond_audio",  # a cut that starts at or past the end of its recording
    "duration_mismatch",  # decoded length far from the manifest's duration (data.duration_tolerance)
    "invalid_text",  # the text is not valid UTF-8
    *TRANSCRIPT_DROP_REASONS,  # empty_text, missing_tag, tag_mismatch (text.check_transcript)
    "too_many_tokens",  # more than data.max_tokens tokens (never cut: an EOS after a cut is wrong)
)
SOURCE_KEY = b"speechlm.source"  # schema metadata naming the manifest a table was read from (messages)
_WARNED_ROWS: set[str] = set()  # "manifest#row" already reported as dropped by this process


class TextTokenizer(Protocol):
    """What the dataset needs from a tokenizer (`speechlm.data.tokenizer.Tokenizer` and
    `speechlm.data.hf_tokenizer.HFTokenizer` have it)."""

    pad_id: int

    @property
    def langs(self) -> Sequence[str]: ...

    def encode(self, text: str) -> list[int]: ...


def load_audio(path: str | Path, target_sr: int = 16000, *, read: Any = decode_audio) -> Any:
    """Decode an audio file to float32 mono at `target_sr` (channels averaged, soxr HQ resampling).

    Raises FileNotFoundError when there is no such file and AudioDecodeError when libsndfile cannot
    decode it (unknown format, truncated stream) or it holds NaN/inf samples. An empty file decodes
    to an empty array: whether that is an error is the caller's call.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"audio file {path} does not exist: fix audio_filepath in the manifest")
    return read(path, path, target_sr)


def _read_table(path: Path) -> pa.Table:
    """The manifest at `path`, any kind `sources.detect` knows, read in memory as it is: training passes
    the table of `sources.mmap_cache.open_index` instead (memory-mapped, its durations checked)."""
    return load_source(path)


def _dataset_paths(table: pa.Table) -> tuple[IntColumn | None, list[str] | None]:
    """Per-row codes into the paths of a `data.input_cfg` table's datasets (for messages), or Nones."""
    meta = (table.schema.metadata or {}).get(MIX_KEY)
    if meta is None or "dataset" not in table.column_names:
        return None, None
    col = table.column("dataset")
    if not pa.types.is_dictionary(col.type) or col.null_count or not col.num_chunks:
        return None, None
    names = col.chunk(0).dictionary.to_pylist()
    if any(c.dictionary.to_pylist() != names for c in col.chunks[1:]):
        return None, None  # not as `load_input_cfg` builds it: messages name the table instead
    info = json.loads(meta)
    path_of = dict(zip(info.get("names", []), info.get("paths", [])))
    codes = IntColumn(pa.chunked_array([c.indices for c in col.chunks], col.type.index_type), -1)
    return codes, [str(path_of.get(n, n)) for n in names]


def _as_str(value: pa.Scalar) -> str:
    """A path or id as a str; bytes that are not UTF-8 are kept as Python keeps such file names
    (surrogateescape), so the file still opens and a message still prints, never a UnicodeDecodeError."""
    try:
        return str(value.as_py())
    except UnicodeDecodeError:
        return bytes(value.as_buffer()).decode("utf-8", "surrogateescape")


def _strings(col: pa.ChunkedArray) -> pa.ChunkedArray:
    return col if pa.types.is_string(col.type) else col.cast(pa.string())


class SpeechDataset(Dataset):
    """Map-style dataset over a training manifest: row index -> Sample | DroppedSample.

    `table_or_path` is a pyarrow Table or a parquet manifest. Relative audio paths are resolved
    against `base_dir` (default: the manifest's folder; for a Table, the paths are taken as they are:
    `sources.mmap_cache.open_index` has already resolved them against the manifest's folder).
    `source` names the manifest in messages (default: the path, or the Table's ``speechlm.source``
    metadata). A decoded clip whose length differs from the row's ``duration`` by more than
    ``max(duration_tolerance, 10% of it)`` seconds is dropped as ``duration_mismatch``.

    ``renderer`` (a `speechlm.packing.prompt.ConversationRenderer`; training passes the run's): each row is read as
    a conversation (`conversation`), every clip decoded and the whole rendered (`conversation_samples`);
    ``instruction`` is the instruction of rows that give none (data.instruction). Without one, today's
    Samples.

    ``defer_audio`` (with a renderer): each clip's length is read from its header (`audio.probe_length`),
    and its checks (missing, empty, cut beyond the end, duration mismatch) run on that length; the clip is
    decoded later, by `speechlm.data.local_decode.LocalCollator`, on the CP ranks that encode it.
    """

    def __init__(
        self,
        table_or_path: pa.Table | str | Path,
        tokenizer: TextTokenizer,
        *,
        max_tokens: int = 512,
        sample_rate: int = 16000,
        base_dir: str | Path | None = None,
        duration_tolerance: float = 0.5,
        source: str | None = None,
        renderer: ConversationRenderer | None = None,
        instruction: str = "",
        defer_audio: bool = False,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1")
        if not 0 <= duration_tolerance < float("inf"):
            raise UsageError(
                f"data.duration_tolerance={duration_tolerance}: give the seconds a decoded clip may differ from "
                "its manifest duration, a finite number >= 0 (default 0.5)"
            )
        if isinstance(table_or_path, pa.Table):
            table = table_or_path
            named = (table.schema.metadata or {}).get(SOURCE_KEY)
            self.source = source or (named.decode() if named else "<table>")
        else:
            path = Path(table_or_path)
            table, self.source = _read_table(path), source or str(path)
            if base_dir is None:
                base_dir = path.resolve().parent if path.is_file() else path.resolve()
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(
                f"manifest {self.source} lacks column(s) {missing} (has {table.column_names}): rebuild it "
                f"with `speechlm manifest build`"
            )
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.sample_rate = int(sample_rate)
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.duration_tolerance = float(duration_tolerance)
        self._claimed = IntColumn(table.column("duration")) if "duration" in table.column_names else None
        # string columns stay as they are (chunked, maybe memory-mapped: `sources.mmap_cache`), so a
        # row's text and path are read from disk when its clip is loaded, not held per row in RAM
        self._paths = _strings(table.column("audio_filepath"))
        self._texts = _strings(table.column("text"))
        self._segment_ids = (
            _strings(table.column("segment_id")) if "segment_id" in table.column_names else None
        )
        self._locators = RowLocators(table)
        self._dataset_codes, self._dataset_paths = _dataset_paths(table)
        # issue 23: the sample as a conversation (`conversation`), rendered when a renderer is given
        self.renderer = renderer
        self.instruction = instruction
        if defer_audio and renderer is None:
            raise ValueError("defer_audio=True reads rows as conversations: pass the run's renderer too")
        self.defer_audio = defer_audio  # `speechlm.data.local_decode`
        self._optional = {
            f.name: _strings(table.column(f.name))
            for f in CONVERSATION_SCHEMA
            if f.name in table.column_names and table.column(f.name).null_count < len(table)
        }
        lang_col = table.column("lang")
        if pa.types.is_dictionary(lang_col.type) and not lang_col.null_count:
            codes, self._lang_names = dictionary_codes(lang_col)
            self._lang_codes = codes.astype(np.int16)
        else:
            langs = pc.dictionary_encode(lang_col.cast(pa.string()).combine_chunks())
            self._lang_codes = langs.indices.to_numpy(zero_copy_only=False)
            self._lang_names = langs.dictionary.to_pylist()
        for name, col in (("audio_filepath", self._paths), ("text", self._texts), ("lang", lang_col)):
            if col.null_count:
                row = pc.index(pc.is_null(col), True).as_py()
                raise ValueError(
                    f"manifest {self.source}, row {row} ({self._describe(row)}): column {name} is null "
                    f"({col.null_count} null rows in all); fix or rebuild the manifest"
                )
        unknown = sorted(set(self._lang_names) - set(tokenizer.langs))
        if unknown:
            raise ValueError(
                f"manifest {self.source} has language(s) {unknown} that the tokenizer does not know "
                f"(it knows {list(tokenizer.langs)}); retrain it with `speechlm tokenizer train --manifest ...`"
            )

    def __len__(self) -> int:
        return len(self._paths)

    def _describe(self, i: int) -> str:
        if self._segment_ids is not None and self._segment_ids[i].is_valid:
            return f"segment {_as_str(self._segment_ids[i])}"
        return f"row {i}"

    def resolve_path(self, i: int) -> Path:
        """Absolute (or base-dir relative) audio path of row `i` (``TAR:MEMBER`` for a tar member)."""
        tar = self._locators.tar(i)
        if tar is not None:
            return Path(f"{tar}:{_as_str(self._paths[i])}")
        path = Path(_as_str(self._paths[i]))
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        return path

    def claimed_duration(self, i: int) -> int | float | None:
        """Row `i`'s duration as its manifest gives it (None: the manifest has no duration column)."""
        return self._claimed[i] if self._claimed is not None else None

    def load_row_audio(self, i: int) -> np.ndarray:
        """Row `i`'s own audio (a whole file, a segment of one, or a tar member), as training reads it."""
        return self._load(i)

    def _load(self, i: int, read: Any = decode_audio) -> Any:
        """Row `i`'s audio: a whole file, a segment of one, or a tar member read by position (``read``:
        `audio.decode_audio`, or `audio.probe_length` for its length only)."""
        loc = self._locators
        tar = loc.tar(i)
        if tar is not None:
            member = _as_str(self._paths[i])
            data = loc.reader.read(
                tar, member, int(loc.offset[i]), int(loc.nbytes[i]), int(loc.header_bytes[i])
            )
            return read(io.BytesIO(data), f"{tar}:{member}", self.sample_rate)
        start = loc.start_of(i)
        if start is None:
            return load_audio(self.resolve_path(i), self.sample_rate, read=read)
        path = self.resolve_path(i)
        if not path.is_file():
            raise FileNotFoundError(f"audio file {path} does not exist: fix audio_filepath in the manifest")
        return read(str(path), str(path), self.sample_rate, start=start, duration=loc.duration_of(i))

    def __getitems__(self, indices: Sequence[int]) -> list[Sample | DroppedSample]:
        """A micro-batch's rows, read grouped by tar and offset (sequential within a shard), in order."""
        order = sorted(range(len(indices)), key=lambda k: self._locators.sort_key(int(indices[k])))
        out: list[Sample | DroppedSample | None] = [None] * len(indices)
        for k in order:
            out[k] = self[indices[k]]
        return [x for x in out if x is not None]

    def lang(self, i: int) -> str:
        return self._lang_names[int(self._lang_codes[i])]

    def __getitem__(self, index: int) -> Sample | DroppedSample:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"row {index} is out of range for manifest {self.source} with {len(self)} rows")
        if self.renderer is not None:
            return conversation_sample(self, i)
        ids = self._tokens(i)
        if isinstance(ids, DroppedSample):
            return ids
        path = self.resolve_path(i)
        start = self._locators.start_of(i)
        claimed = float(self._claimed[i]) if self._claimed is not None else None
        audio_N = self._decoded(i, lambda: self._load(i), str(path), start, claimed)
        if isinstance(audio_N, DroppedSample):
            return audio_N
        real = audio_N.size / self.sample_rate
        return Sample(
            index=i,
            audio=torch.from_numpy(audio_N),
            tokens=torch.tensor(ids, dtype=torch.int64),
            duration=real,
            lang=self.lang(i),
        )

    def _decoded(
        self, i: int, load: Any, path: str, start: float | None, claimed: float | None, what: str = ""
    ) -> Any:
        """`load()`'s audio (or its length in samples, from a header: `probe_length`), or the DroppedSample
        of row `i` saying why it cannot be used (`what` names the clip of a conversation in the message)."""
        try:
            audio_N = load()
        except FileNotFoundError as e:
            return self._drop(i, "missing_file", f"{what}{e}")
        except SegmentOutOfRangeError as e:
            return self._drop(i, "segment_beyond_audio", f"{what}{e}")
        except AudioDecodeError as e:
            return self._drop(i, "undecodable", f"{what}{e}")
        except MemberError as e:
            return self._drop(i, e.reason, f"{what}{e}")
        n = audio_N if isinstance(audio_N, int) else audio_N.size
        if n == 0:
            return self._drop(
                i, "empty_audio", f"{what}{path} decodes to no samples: restore or remove the file"
            )
        real = n / self.sample_rate
        if claimed is not None and duration_mismatch(claimed, real, tolerance_s=self.duration_tolerance):
            cut = "" if start is None else f" (the segment from {start:.2f} s)"
            return self._drop(
                i,
                "duration_mismatch",
                f"{what}{path}{cut} decodes to {real:.2f} s but the manifest says {claimed:.2f} s (more than "
                f"data.duration_tolerance={self.duration_tolerance:g} s or 10% apart): fix the row's "
                "duration or audio_filepath and rebuild the manifest",
            )
        return audio_N

    def optional(self, name: str, i: int) -> str | None:
        """Row `i`'s value of a `CONVERSATION_SCHEMA` column (None: absent or null)."""
        col = self._optional.get(name)
        return None if col is None else col[i].as_py()

    def conversation(self, i: int) -> Conversation:
        """Row `i` as a `Conversation`: its ``conversation`` JSON (relative clip paths resolved against its
        manifest's folder), or the transcription shape of its columns (``instruction`` null: the
        dataset's `instruction`; ``answer`` null: ``text``; ``task`` null: "asr")."""
        task, lang = self.optional("task", i), self.lang(i)
        doc = self.optional("conversation", i)
        if doc is not None:
            where = f"manifest {self._source_of(i)}, {self._describe(i)}"
            conv = Conversation.from_json(doc, where=where)
            base = self.base_dir
            if base is None:
                src = Path(self._source_of(i))
                base = src.parent if src.is_file() else src
            clips = tuple(
                c if c.tar is not None or os.path.isabs(c.path) else replace(c, path=str(base / c.path))
                for c in conv.clips
            )
            return replace(conv, clips=clips, task=task or conv.task, lang=conv.lang or lang)
        text = self._texts[i].as_py()
        loc = self._locators
        tar = loc.tar(i)
        clip = Clip(
            _as_str(self._paths[i]) if tar is not None else str(self.resolve_path(i)),
            offset=loc.start_of(i),
            duration=float(self._claimed[i]) if self._claimed is not None else None,
            tar=tar,
            transcript=text or None,
        )
        answer = self.optional("answer", i)
        instruction = self.optional("instruction", i)
        seg = self._segment_ids[i].as_py() if self._segment_ids is not None else None
        return Conversation.transcription(
            clip,
            answer if answer is not None else text,
            lang=lang,
            instruction=self.instruction if instruction is None else instruction,
            task=task or "asr",
            id=str(seg or ""),
        )

    def load_clip(self, clip: Clip, read: Any = decode_audio) -> Any:
        """One clip of a conversation: a tar member by position, a segment of a file, or a whole file
        (``read``: as `_load`'s)."""
        if clip.tar is not None:
            if clip.member_offset is None or clip.member_nbytes is None or clip.header_bytes is None:
                raise MemberError("stale_index", f"{clip.tar}:{clip.path}: the clip has no member locator")
            data = self._locators.reader.read(
                clip.tar, clip.path, clip.member_offset, clip.member_nbytes, clip.header_bytes
            )
            return read(io.BytesIO(data), f"{clip.tar}:{clip.path}", self.sample_rate)
        if clip.offset is None:
            return load_audio(clip.path, self.sample_rate, read=read)
        if not os.path.isfile(clip.path):
            raise FileNotFoundError(
                f"audio file {clip.path} does not exist: fix the clip's path in the manifest"
            )
        return read(clip.path, clip.path, self.sample_rate, start=clip.offset, duration=clip.duration)

    def _tokens(self, i: int) -> list[int] | DroppedSample:
        """Row `i`'s token ids, or the DroppedSample saying why its text cannot be trained on."""
        try:
            text = self._texts[i].as_py()
        except UnicodeDecodeError as e:
            return self._drop(
                i,
                "invalid_text",
                f"column 'text' is not valid UTF-8 ({e}): fix the text and rebuild the manifest",
            )
        lang = self.lang(i)
        reason = check_transcript(text, lang)
        if reason is not None:
            advice = {
                "empty_text": "it holds no words after its language tag",
                "missing_tag": f"it does not start with the tag <|{lang}|> of its language {lang!r}",
                "tag_mismatch": f"its tag is not <|{lang}|>, that of its language {lang!r}",
            }[reason]
            return self._drop(
                i,
                reason,
                f"text {text[:60]!r}: {advice}; fix the row (`speechlm manifest build` tags and cleans)",
            )
        try:  # a target: the renderer's data.text_normalize rule applies (prompt.ConversationRenderer)
            ids = self.tokenizer.encode(text) if self.renderer is None else self.renderer.encode_target(text)
        except ValueError as e:  # a tag the tokenizer lacks further in (or in other case): not <|lang|>
            return self._drop(i, "tag_mismatch", f"{e}")
        if len(ids) > self.max_tokens:
            return self._drop(
                i,
                "too_many_tokens",
                f"its text has {len(ids)} tokens, more than data.max_tokens={self.max_tokens} (a cut "
                "transcript would teach the model to stop mid-sentence): raise data.max_tokens or split the "
                "utterance",
            )
        return ids

    def _drop(self, i: int, reason: str, detail: str) -> DroppedSample:
        # warn once per row and process (every epoch and every validation would repeat it); the counts
        # still travel in each Batch
        key = str(self.resolve_path(i))
        row = f"{self._source_of(i)}#{i}"
        if row not in _WARNED_ROWS:
            _WARNED_ROWS.add(row)
            logger.warning(
                "dropping %s of %s (%s): %s", self._describe(i), self._source_of(i), reason, detail
            )
        return DroppedSample(index=i, reason=reason, detail=detail, path=key)

    def _source_of(self, i: int) -> str:
        """The manifest row `i` came from: its `data.input_cfg` dataset's path, else `self.source`."""
        if self._dataset_paths is not None and self._dataset_codes is not None:
            code = int(self._dataset_codes[i])
            if 0 <= code < len(self._dataset_paths):
                return self._dataset_paths[code]
        return self.source


def seed_worker(worker_id: int, *, seed: int) -> None:
    """worker_init_fn: seed random, numpy and torch in a worker from (seed, worker_id) only."""
    words = np.random.SeedSequence([int(seed), int(worker_id)]).generate_state(4, dtype=np.uint32)
    random.seed(int(words[0]) << 32 | int(words[1]))
    np.random.seed(int(words[2]))
    torch.manual_seed(int(words[3]) << 32 | int(words[1]))


def build_dataloader(
    dataset: Dataset,
    batch_sampler: Iterable[list[int]],
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    seed: int = 0,
    prefetch_factor: int = 2,
    collate_fn: Collator | None = None,
) -> DataLoader:
    """DataLoader over `batch_sampler` (lists of row indices) yielding `Batch`es in the sampler's order.

    `collate_fn` defaults to `Collator(dataset.tokenizer.pad_id)`. With workers, each one is seeded
    from (seed, worker id); persistent_workers and prefetch_factor apply only when num_workers > 0.
    `pin_memory` is ignored when no accelerator is present.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    if collate_fn is None:
        tokenizer = getattr(dataset, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"{type(dataset).__name__} has no .tokenizer to take pad_id from: pass collate_fn=Collator(pad_id)"
            )
        collate_fn = Collator(tokenizer.pad_id)
    extra: dict[str, Any] = {}
    if num_workers > 0:
        extra.update(persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory and torch.accelerator.is_available(),
        worker_init_fn=functools.partial(seed_worker, seed=seed),
        generator=torch.Generator().manual_seed(seed),
        in_order=True,
        **extra,
    )
