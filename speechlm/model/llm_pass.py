"""The decoder's half of `SpeechLLM.forward`: the micro-batch's prompts and audio rows packed (THD, this
rank's share under CP) or padded (BSHD), then the LLM's token cross-entropy.

Letters: T packed positions, B rows, S padded length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from parallel.cp_layout import CPLayout, CPPlan
from speechlm.config import ModelConfig
from speechlm.model import cp_audio
from speechlm.model.encoder_output import EncoderOutput
from speechlm.packing.thd import PackedBatch, PaddedBatch, pack_bshd


class DecoderModel(Protocol):
    """What the decoder's pass reads of the model (`SpeechLLM` has it)."""

    cfg: ModelConfig

    @property
    def audio_id(self) -> int: ...
    @property
    def align_skip(self) -> int | None: ...
    def embed_tokens(self, ids: Tensor) -> Tensor: ...
    def forward_packed(
        self, packed: PackedBatch, *, return_logits: bool = False, per_seq: bool = False
    ) -> tuple[Tensor, int, Tensor | None] | Tensor: ...
    def forward_padded(
        self, padded: PaddedBatch, *, per_seq: bool = False
    ) -> tuple[Tensor, int, Tensor | None]: ...


class DecoderPass(NamedTuple):
    """What the decoder computed on this rank."""

    ce_sum: Tensor  # summed token CE of this rank's share (fp32)
    n_labelled: int  # labelled tokens it holds (BSHD: the micro-batch's; THD: this rank's share)
    ce_local: Tensor | None  # each local sequence's CE (``per_seq``), else None
    local: list[int]  # the sequences this rank decoded, in stream order
    n_split: int  # how many of them (the first) are split over the CP group
    computed: int  # the positions the LLM computed (padding included)
    degrees: list[int]  # per local sequence: the CP ranks it is split over (1: whole here)


def decoder_pass(
    model: DecoderModel,
    lay: CPLayout,
    prompts: list[tuple[Tensor, Tensor]],
    enc: EncoderOutput,
    plan: CPPlan,
    clip_counts: Sequence[int],
    *,
    device: torch.device,
    per_seq: bool,
) -> DecoderPass:
    """THD (``model.packed_sequences``): `cp_audio.pack_for_layout` to the plan's lengths, then
    `SpeechLLM.forward_packed`; BSHD: `pack_bshd` (rounded to ``pad_to_multiple`` or the TP size), then
    `SpeechLLM.forward_padded`. The audio rows' positions follow ``model.align_skip``."""
    if model.cfg.packed_sequences:
        packed = cp_audio.pack_for_layout(
            lay,
            prompts,
            enc,
            plan,
            model.embed_tokens,
            audio_id=model.audio_id,
            clip_counts=clip_counts,
            device=device,
            align_skip=model.align_skip,
        )
        out = model.forward_packed(packed, per_seq=per_seq)
        if not isinstance(out, tuple):  # only return_logits=True gives the logits
            raise TypeError("forward_packed returned logits where the loss sums were asked for")
        ce_sum, n_labelled, ce_local = out
        computed = int(packed.inputs_embeds.shape[0])
        return DecoderPass(
            ce_sum, n_labelled, ce_local, plan.indices, plan.n_split, computed, plan.local_degrees
        )
    padded = pack_bshd(
        prompts,
        enc.embeds_of(range(len(enc.embeds))),
        model.embed_tokens,
        audio_id=model.audio_id,
        pad_to_multiple=model.cfg.pad_to_multiple or lay.tp,
        clip_counts=clip_counts,
        align_skip=model.align_skip,
    )
    ce_sum, n_labelled, ce_local = model.forward_padded(padded, per_seq=per_seq)
    computed = int(padded.inputs_embeds.shape[0] * padded.inputs_embeds.shape[1])
    rows = list(range(len(prompts)))
    return DecoderPass(ce_sum, n_labelled, ce_local, rows, 0, computed, [1] * len(rows))
