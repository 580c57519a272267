"""One micro-batch through the model: encode audio, build prompts, pack, (CP-shard), decode, sum losses.

This is where the data, packing, model and parallel layers meet. `StepContext` holds what the layout
needs (packing rounding for cp/tp, the CP attention object, the collectives for counts); for a single
process it is trivial and no collective is issued.

A micro-batch whose every clip failed to decode (an empty `Batch`) still runs a forward and backward on
a tiny dummy clip with weight 0, so every rank issues the same collectives in the same order (FSDP and
CP would otherwise hang) and the objective is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speechlm.prompt import build_prompts


@dataclass
class MicroLosses:
    ce_sum: torch.Tensor  # summed token cross-entropy of this rank's share (fp32)
    n_labelled: int
    ctc_sum: torch.Tensor | None  # summed CTC of the clips this rank owns (None: CTC off)
    n_clips: int
    weight: float = 1.0  # 0 for a dummy micro-batch


def _identity_sum(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return xs


@dataclass
class StepContext:
    """What a micro-batch needs to know about the parallel layout (trivial for one process)."""

    packed: bool
    bos_id: int
    eos_id: int
    audio_id: int
    pad_id: int
    instruction_ids: tuple[int, ...] = ()
    pad_to_multiple: int | None = None
    cp: int = 1
    tp: int = 1
    grad_scale: float = 1.0  # size of the group gradients are averaged over (dp * cp)
    cp_attention: Any = None  # object with .attention(q, k, v, cu_seqlens_local, scale), set under CP
    shard_packed: Callable[[Any], Any] | None = None  # THD batch -> this CP rank's share
    encode_audio: Callable[..., Any] | None = None  # distributed encoder (CP); None: model.encode_audio
    sum_counts_over_dp: Callable[[list[float]], list[float]] = field(default=lambda xs: list(xs))
    sum_over_data_ranks: Callable[..., tuple[torch.Tensor, ...]] = field(default=_identity_sum)
    sum_over_cp: Callable[..., tuple[torch.Tensor, ...]] = field(default=_identity_sum)
    rank: int = 0

    @staticmethod
    def single(cfg: Any, tok: Any) -> StepContext:
        return StepContext(
            packed=cfg.model.packed_sequences,
            bos_id=tok.bos_id,
            eos_id=tok.eos_id,
            audio_id=tok.audio_id,
            pad_id=tok.pad_id,
            instruction_ids=tuple(tok.instruction_ids),
            pad_to_multiple=cfg.model.pad_to_multiple,
        )

    def prompts(self, batch: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return build_prompts(
            batch.tokens,
            batch.token_lens,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            audio_id=self.audio_id,
            instruction_ids=self.instruction_ids,
        )


def count_targets(batch: Any, ctx: StepContext) -> int:
    """Labelled tokens of a micro-batch: the transcript tokens and EOS of every utterance."""
    if len(batch) == 0:
        return 0
    return int(sum(int(mask.sum()) for _, mask in ctx.prompts(batch)))


def count_step_targets(micro_batches: list[Any], ctx: StepContext) -> tuple[int, int]:
    """(labelled tokens, clips) of a whole optimizer step, summed over data-parallel ranks."""
    n_tok = sum(count_targets(b, ctx) for b in micro_batches)
    n_clip = sum(len(b) for b in micro_batches)
    tot_tok, tot_clip = ctx.sum_counts_over_dp([float(n_tok), float(n_clip)])
    return int(round(tot_tok)), int(round(tot_clip))


def make_dummy_batch(like: Any, ctx: StepContext) -> Any:
    """A one-clip, one-token batch of silence used (with weight 0) when every clip of a batch failed."""
    from speechlm.data.dataset import Batch

    device = like.audio.device if like.audio is not None else torch.device("cpu")
    return Batch(
        audio=torch.zeros(1, 1600, device=device),
        audio_lens=torch.tensor([1600], device=device),
        tokens=torch.full((1, 1), ctx.eos_id, dtype=torch.long, device=device),
        token_lens=torch.tensor([1], device=device),
        langs=["dummy"],
        indices=[-1],
        durations=torch.tensor([0.1]),
        dropped={},
    )


def compute_micro_losses(
    model: Any, batch: Any, ctx: StepContext, *, encoder_frozen: bool = False
) -> MicroLosses:
    weight = 1.0
    if len(batch) == 0:
        batch, weight = make_dummy_batch(batch, ctx), 0.0
    prompts = ctx.prompts(batch)
    # a frozen encoder runs without autograd inside encode_audio; the projector still trains
    if ctx.encode_audio is not None:
        enc = ctx.encode_audio(model, batch.audio, batch.audio_lens, freeze_encoder=encoder_frozen)
    else:
        enc = model.encode_audio(batch.audio, batch.audio_lens, freeze_encoder=encoder_frozen)
    ctc_sum = None
    if getattr(model, "ctc_head", None) is not None:
        tokens, token_lens = batch.tokens, batch.token_lens
        ctc_slice = getattr(enc, "ctc_slice", slice(None))  # under CP: only the clips this rank encoded
        if ctc_slice is None:  # this CP rank encoded only a dummy clip: keep the head in the graph, weight 0
            n = len(enc.enc_lens)
            tokens = torch.full((n, 2), ctx.eos_id, dtype=torch.long, device=tokens.device)
            token_lens = torch.full((n,), 2, dtype=torch.long, device=tokens.device)
        else:
            tokens, token_lens = tokens[ctc_slice], token_lens[ctc_slice]
        ctc_sum, _ = model.ctc_loss_sum(
            enc.enc_hidden,
            enc.enc_lens,
            tokens,
            token_lens,
        )
        ctc_sum = ctc_sum * getattr(enc, "ctc_weight", 1.0)
    embeds = enc.embeds
    if ctx.packed:
        from speechlm.packing import pack_thd

        packed = pack_thd(
            prompts,
            embeds,
            model.embed_tokens,
            audio_id=ctx.audio_id,
            cp=ctx.cp,
            tp=ctx.tp,
            pad_to_multiple=ctx.pad_to_multiple,
        )
        n_labelled = packed.num_labelled()
        if ctx.shard_packed is not None:
            packed = ctx.shard_packed(packed)
        ce_sum, _ = model.forward_packed(packed, attn_context=ctx.cp_attention)
    else:
        from speechlm.packing import pack_bshd

        padded = pack_bshd(
            prompts,
            embeds,
            model.embed_tokens,
            audio_id=ctx.audio_id,
            pad_to_multiple=ctx.pad_to_multiple or ctx.tp,
        )
        ce_sum, n_labelled = model.forward_padded(padded)
    return MicroLosses(
        ce_sum=ce_sum.float(), n_labelled=int(n_labelled), ctc_sum=ctc_sum, n_clips=len(batch), weight=weight
    )
