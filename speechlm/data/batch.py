"""A micro-batch as the model reads it, and the collation that builds it from the dataset's samples.

Shapes: B rows, C clips (one per row for transcription rows), N audio samples (16 kHz mono), L tokens,
P rendered prompt tokens, K CTC target tokens.

    Collator(pad_id)   drop the DroppedSamples (counted per reason), zero-pad audio and pad tokens_BL
                       with pad_id -> Batch; all dropped -> an empty Batch (B = 0). Conversations (a
                       dataset with a renderer: `conversation_samples`): audio per clip, the rendered
                       prompts, per-clip CTC targets, tasks.

A transcription batch (the conversation fields None) is read by the model as one-turn conversations
(`speechlm.model.conversation_inputs.as_conversation`): one Batch shape reaches the model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from speechlm.data.conversation_samples import conversation_fields
from speechlm.data.samples import DroppedSample, Sample

__all__ = ["Batch", "Collator"]


@dataclass
class Batch:
    """Padded utterances of one micro-batch; B = 0 when every row of it was dropped."""

    audio: torch.Tensor  # [B, N] float32, zero-padded ([C, N]: one row per clip with conversations)
    audio_lens: torch.Tensor  # [B] int64, valid samples per row (per clip: [C])
    tokens: torch.Tensor  # [B, L] int64, padded with the tokenizer's pad_id
    token_lens: torch.Tensor  # [B] int64
    langs: list[str]
    indices: list[int]  # manifest rows, in the sampler's order
    durations: torch.Tensor  # [B] float32, seconds of decoded audio
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows dropped from this batch
    dropped_files: list[str] = field(default_factory=list)  # "path (reason)" of each dropped row
    # Conversations (`speechlm.data.conversation`). All None: transcription rows, one clip each (C = B), which
    # the model reads as one-turn conversations (`as_conversation`: the prompt rendered from `tokens` with the
    # run's PromptFormat, CTC on every clip against `tokens`). Set: C clips in
    # `audio`/`audio_lens` (rows in order, each row's clips in the order of its placeholders), `tokens` the
    # reference tokens of each row's last assistant turn (what evaluation scores).
    clip_sample: torch.Tensor | None = None  # [C] int64, the row of each clip (non-decreasing)
    prompt_ids: torch.Tensor | None = (
        None  # [B, P] int64, rendered conversation, one audio_id per clip, pad_id
    )
    prompt_mask: torch.Tensor | None = None  # [B, P] bool, True on supervised (assistant) tokens
    prompt_lens: torch.Tensor | None = None  # [B] int64
    ctc_tokens: torch.Tensor | None = None  # [C, K] int64, each clip's transcript ids (tag first), pad_id
    ctc_token_lens: torch.Tensor | None = None  # [C] int64, 0: no transcript, the clip gets no CTC loss
    tasks: list[str] = field(default_factory=list)  # [B] each row's task ([] = all "asr")
    # `speechlm.data.local_decode` (data.decode_local under CP): [C] bool, True where this rank decoded the clip
    # (its encoder reads it); a False row of `audio` holds no samples. None: every clip is decoded.
    audio_present: torch.Tensor | None = None
    # `local_decode`: the sampler's rows of this micro-batch, and why a clip this rank decodes failed (None: none
    # did); the ranks then decode the step's rows whole, as today (`speechlm.train.data.StepLoader.redecode`)
    source_rows: list[int] | None = None
    local_failure: str | None = None

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def is_empty(self) -> bool:
        return len(self.indices) == 0

    @classmethod
    def empty(cls, dropped: Mapping[str, int] | None = None, dropped_files: Sequence[str] = ()) -> Batch:
        """A batch with no utterances (B = 0), carrying the drop counts."""
        return cls(
            audio=torch.zeros(0, 0, dtype=torch.float32),
            audio_lens=torch.zeros(0, dtype=torch.int64),
            tokens=torch.zeros(0, 0, dtype=torch.int64),
            token_lens=torch.zeros(0, dtype=torch.int64),
            langs=[],
            indices=[],
            durations=torch.zeros(0, dtype=torch.float32),
            dropped=dict(dropped or {}),
            dropped_files=list(dropped_files),
        )

    @property
    def num_clips(self) -> int:
        return int(self.audio_lens.numel())

    def _map_tensors(self, fn: Any) -> Batch:
        opt = (
            "clip_sample",
            "prompt_ids",
            "prompt_mask",
            "prompt_lens",
            "ctc_tokens",
            "ctc_token_lens",
            "audio_present",
        )
        return replace(
            self,
            **{k: fn(getattr(self, k)) for k in opt if getattr(self, k) is not None},
            tasks=list(self.tasks),
            audio=fn(self.audio),
            audio_lens=fn(self.audio_lens),
            tokens=fn(self.tokens),
            token_lens=fn(self.token_lens),
            durations=fn(self.durations),
            langs=list(self.langs),
            indices=list(self.indices),
            dropped=dict(self.dropped),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on `device`."""
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self, device: Any = None) -> Batch:
        """A copy in page-locked memory; DataLoader(pin_memory=True) calls this on each batch."""
        return self._map_tensors(lambda t: t.pin_memory())


class Collator:
    """collate_fn: Samples -> padded Batch; DroppedSamples are left out and counted per reason."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = int(pad_id)

    def __repr__(self) -> str:
        return f"Collator(pad_id={self.pad_id})"

    def __call__(self, items: Sequence[Sample | DroppedSample]) -> Batch:
        kept: list[Sample] = []
        dropped: Counter[str] = Counter()
        dropped_files: list[str] = []
        for item in items:
            if isinstance(item, Sample):
                kept.append(item)
            elif isinstance(item, DroppedSample):
                dropped[item.reason] += 1
                where = f"{item.path or f'row {item.index}'} ({item.reason})"
                # the detail says what is wrong and what to do (a bad cut, duration or text is not fixed
                # by restoring the file)
                dropped_files.append(f"{where}: {item.detail}" if item.detail else where)
            else:
                raise TypeError(f"Collator got a {type(item).__name__}; expected Sample or DroppedSample")
        if not kept:
            return Batch.empty(dropped, dropped_files)
        token_lens_B = torch.tensor([s.tokens.numel() for s in kept], dtype=torch.int64)
        tokens_BL = torch.full((len(kept), int(token_lens_B.max())), self.pad_id, dtype=torch.int64)
        for b, s in enumerate(kept):
            tokens_BL[b, : s.tokens.numel()] = s.tokens
        if kept[0].prompt_ids is not None:  # conversations (a dataset with a renderer): audio per clip
            fields = conversation_fields(kept, self.pad_id)
        else:
            audio_lens_B = torch.tensor([s.audio.numel() for s in kept], dtype=torch.int64)
            audio_BN = torch.zeros(len(kept), int(audio_lens_B.max()), dtype=torch.float32)
            for b, s in enumerate(kept):
                audio_BN[b, : s.audio.numel()] = s.audio
            fields = {"audio": audio_BN, "audio_lens": audio_lens_B}
        return Batch(
            tokens=tokens_BL,
            token_lens=token_lens_B,
            langs=[s.lang for s in kept],
            indices=[s.index for s in kept],
            durations=torch.tensor([s.duration for s in kept], dtype=torch.float32),
            dropped=dict(dropped),
            dropped_files=dropped_files,
            **fields,
        )
