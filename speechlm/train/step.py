"""One micro-batch through the model, and what the training step needs to know about the layout.

The model's `forward` (`speechlm.model.speech_llm.SpeechLLM.forward`) takes a micro-batch to its
loss sums; its CP/TP hooks are bound once when it is parallelized (`train/distributed.py`).
`StepContext` is the rest of the layout the *step* needs: the collectives that sum counts and losses
over data ranks, the gradient scale and the gradient clipping of sharded parameters. It is a frozen
value, built once per layout: trivial (`StepContext()`) for one process, so no collective is issued.

A micro-batch whose every clip failed to decode (an empty `Batch`) still runs a forward and backward on
a tiny dummy clip with weight 0, so every rank issues the same collectives in the same order (FSDP and
CP would otherwise hang) and the objective is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from speechlm.config import ExperimentConfig
from speechlm.model.speech_llm import MicroLosses
from speechlm.train.schedule import encoder_frozen as is_encoder_frozen


def _identity_sum(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return xs


def _local_agreement(counts: list[float], flags: list[bool]) -> tuple[list[float], list[bool]]:
    return list(counts), list(flags)


@dataclass(frozen=True)
class StepContext:
    """What an optimizer step needs to know about the parallel layout (trivial for one process)."""

    grad_scale: float = 1.0  # size of the group gradients are averaged over (dp * cp)
    sum_counts_over_dp: Callable[[list[float]], list[float]] = field(default=lambda xs: list(xs))
    sum_over_data_ranks: Callable[..., tuple[torch.Tensor, ...]] = field(default=_identity_sum)
    sum_over_cp: Callable[..., tuple[torch.Tensor, ...]] = field(default=_identity_sum)
    clip_grad_norm: Callable[..., Any] | None = None  # (params, max_norm) -> norm; None: torch's
    rank: int = 0
    # the step's one agreement (module._agree_step): (counts summed over dp ranks, flags: any rank of the
    # world) in a single all-reduce; and all ranks' objects, rank order (only when a flag says stop)
    agree_step: Callable[[list[float], list[bool]], tuple[list[float], list[bool]]] = field(
        default=_local_agreement
    )
    gather_objects: Callable[[Any], list[Any]] = field(default=lambda x: [x])


def count_targets(batch: Any, model: Any) -> int:
    """Labelled tokens of a micro-batch: the transcript tokens and EOS of every utterance."""
    if len(batch) == 0:
        return 0
    return int(sum(int(mask.sum()) for _, mask in model.build_prompts(batch.tokens, batch.token_lens)))


def count_step_targets(micro_batches: list[Any], model: Any, ctx: StepContext) -> tuple[int, int]:
    """(labelled tokens, clips) of a whole optimizer step, summed over data-parallel ranks."""
    n_tok = sum(count_targets(b, model) for b in micro_batches)
    n_clip = sum(len(b) for b in micro_batches)
    tot_tok, tot_clip = ctx.sum_counts_over_dp([float(n_tok), float(n_clip)])
    return int(round(tot_tok)), int(round(tot_clip))


def make_dummy_batch(like: Any, eos_id: int) -> Any:
    """A one-clip, one-token batch of silence used (with weight 0) when every clip of a batch failed."""
    from speechlm.data.dataset import Batch

    device = like.audio.device if like.audio is not None else torch.device("cpu")
    return Batch(
        audio=torch.zeros(1, 1600, device=device),
        audio_lens=torch.tensor([1600], device=device),
        tokens=torch.full((1, 1), eos_id, dtype=torch.long, device=device),
        token_lens=torch.tensor([1], device=device),
        langs=["dummy"],
        indices=[-1],
        durations=torch.tensor([0.1]),
        dropped={},
    )


def compute_micro_losses(model: Any, batch: Any, *, encoder_frozen: bool = False) -> MicroLosses:
    """`model(batch)`, or its weight-0 dummy when the batch is empty (see the module docstring)."""
    if len(batch) == 0:
        out = model(make_dummy_batch(batch, model.eos_id), encoder_frozen=encoder_frozen)
        out.weight = 0.0
        return out
    return model(batch, encoder_frozen=encoder_frozen)


def run_optimizer_step(
    model: Any,
    micro_batches: list[Any],
    ctx: Any,
    opt: Any,
    sched: Any,
    cfg: ExperimentConfig,
    *,
    step: int,
    backward: Any = None,
    clip: Any = None,
    autocast: Any = None,
) -> dict[str, Any]:
    """One optimizer step over `micro_batches` (this rank's share); returns the step's global metrics.

    Shared by the Lightning `training_step`, the multi-process equivalence tests and the benchmarks.
    """
    backward = backward or (lambda loss: loss.backward())
    frozen = is_encoder_frozen(step, cfg.optim.unfreeze_step)
    n_tok, n_clip = count_step_targets(micro_batches, model, ctx)
    w_ctc = cfg.model.ctc_weight
    ce_total = torch.zeros((), dtype=torch.float64)
    ctc_total = torch.zeros((), dtype=torch.float64)
    for b in micro_batches:
        with autocast() if autocast is not None else nullcontext():  # forward only
            out = compute_micro_losses(model, b, encoder_frozen=frozen)
        loss = out.ce_sum / max(n_tok, 1)
        if w_ctc > 0 and out.ctc_sum is not None:
            loss = loss + w_ctc * out.ctc_sum / max(n_clip, 1)
        # gradients are averaged over the dp*cp group by FSDP2; grad_scale turns that into a sum
        backward(loss * ctx.grad_scale * out.weight)
        ce_total += out.ce_sum.detach().double().cpu() * out.weight
        if out.ctc_sum is not None:
            ctc_total += out.ctc_sum.detach().double().cpu() * out.weight
    grad_norm = (
        clip() if clip is not None else clip_model_gradients(model, cfg.optim.grad_clip, ctx.clip_grad_norm)
    )
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    ce_total, ctc_total = ctx.sum_over_data_ranks(ce_total, ctc_total)
    ce = float(ce_total) / max(n_tok, 1)
    ctc = float(ctc_total) / max(n_clip, 1)
    return {
        "loss": ce + (w_ctc * ctc if w_ctc > 0 else 0.0),
        "ce": ce,
        "ctc": ctc if w_ctc > 0 else None,
        "grad_norm": grad_norm,
        "tokens": n_tok,
        "utterances": n_clip,
        "encoder_frozen": frozen,
    }


def clip_model_gradients(model: Any, max_norm: float | None, clip_fn: Any) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm and max_norm > 0 else math.inf
    norm = (
        clip_fn(params, limit)
        if clip_fn is not None
        else torch.nn.utils.clip_grad_norm_(params, limit, foreach=False)
    )
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
