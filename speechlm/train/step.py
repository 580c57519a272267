"""One micro-batch through the model, and what the training step needs to know about the layout.

The model's `forward` (`speechlm.model.speech_llm.SpeechLLM.forward`) takes a micro-batch to its
loss sums; its CP/TP hooks are bound once when it is parallelized (`train/distributed.py`).
`StepContext` is the rest of the layout the *step* needs: the one collectives object
(`parallel.collectives.Collectives`), the one precision policy (`speechlm.train.precision`), the
gradient scale and the gradient clipping of sharded parameters. It is a frozen value, built once per
layout: trivial (`StepContext()`) for one process, so no collective is issued.

Collectives of one optimizer step, besides FSDP's and CP's own: one small all-reduce before the first
forward (`agree_step`: labelled tokens and clips, the normalisers of the objective; the caller's
utterance/audio/drop counts; the SIGTERM and data-error flags), and one after the backwards, before
the optimizer step (the CE/CTC sums of the step: they exist only after the forwards).

Numbers are checked: a step whose loss or gradient norm is NaN or infinite stops the run
(`check_step_finite`, a `NonFiniteError`, exit 1) before the optimizer applies it, at its first
occurrence: no step is skipped and trained past (nothing here scales the loss, so an infinite step is
never routine). The figures checked are the same on every rank, so all ranks stop at the same step.

A micro-batch whose every clip failed to decode (an empty `Batch`) still runs a forward and backward on
a tiny dummy clip with weight 0 (`speechlm.model.micro_losses`), so every rank issues the same collectives
in the same order (FSDP and CP would otherwise hang) and the objective is unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from parallel.collectives import Collectives
from speechlm.config import ExperimentConfig
from speechlm.data.batch import Batch
from speechlm.errors import NonFiniteError
from speechlm.model.conversation_inputs import ctc_target_lens
from speechlm.model.flops import MicroWork, work_of
from speechlm.model.micro_losses import compute_micro_losses, count_ctc_tokens, count_targets
from speechlm.model.speech_llm import SpeechLLM
from speechlm.train.precision import PrecisionPolicy
from speechlm.train.schedule import encoder_runs_frozen, oracle_prefix_runs


@dataclass(frozen=True)
class StepContext:
    """What an optimizer step needs to know about the run's layout (trivial for one process)."""

    grad_scale: float = 1.0  # size of the group gradients are averaged over (dp * cp)
    clip_grad_norm: Callable[..., Any] | None = None  # (params, max_norm) -> norm; None: torch's
    rank: int = 0
    # the one object that talks to the other ranks (sums over dp, agreement, gathers): trivial here
    collectives: Collectives = field(default_factory=Collectives)
    # the one precision decision (speechlm/train/precision.py): fp32 here
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)


@dataclass(frozen=True)
class StepCounts:
    """The objective's normalisers for one optimizer step, summed over data-parallel ranks."""

    tokens: int  # labelled tokens (CE)
    clips: int  # clips with a CTC target (a transcript of their own): the CTC normaliser
    ctc_tokens: int = 0  # their CTC target tokens (the normaliser under model.ctc_reduction=token)
    samples: int = 0  # samples (rows) read: the step's utterances, whatever their clips and transcripts
    audio_clips: int = 0  # every clip of those samples, with a transcript or not

    def ctc_norm(self, reduction: str) -> int:
        """The CTC sum's divisor under ``model.ctc_reduction``."""
        return max(self.ctc_tokens if reduction == "token" else self.clips, 1)


@dataclass(frozen=True)
class StepWork:
    """What this rank computed in one optimizer step (its share under CP), and the sums over dp x cp
    (`Collectives.sum_shards`, in the step's one all-reduce after the optimizer step): real tokens (audio
    embeddings and prompt tokens), tokens the LLM computed (after padding and CP rounding), training
    FLOPs (`speechlm.model.flops`); and the seconds this rank spent in clipping and the optimizer step."""

    real_tokens: float = 0.0
    computed_tokens: float = 0.0
    flops: float = 0.0
    optim_s: float = 0.0
    real_tokens_total: float = 0.0
    computed_tokens_total: float = 0.0
    flops_total: float = 0.0

    @classmethod
    def of(cls, works: list[MicroWork], flops: float, optim_s: float) -> StepWork:
        return cls(
            real_tokens=sum(w.real_tokens for w in works),
            computed_tokens=float(sum(w.computed_tokens for w in works)),
            flops=flops,
            optim_s=optim_s,
        )

    def shard_values(self) -> list[float]:
        return [self.real_tokens, self.computed_tokens, self.flops]

    def with_totals(self, sums: list[float]) -> StepWork:
        return replace(self, real_tokens_total=sums[0], computed_tokens_total=sums[1], flops_total=sums[2])


def _synced_time(model: Any) -> float:
    """perf_counter after the device's queued work is done (CUDA runs asynchronously)."""
    p = next(iter(model.parameters()), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.synchronize(p.device)
    return time.perf_counter()


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks agreed on before the step's first forward (`agree_step`)."""

    counts: StepCounts
    extra: list[float]  # the caller's counts, summed over data-parallel ranks
    flags: list[bool]  # the caller's flags, true when any rank's is


def count_ctc_clips(batch: Batch) -> int:
    """Clips a micro-batch's CTC loss counts (its normaliser): the clips with a transcript."""
    lens = ctc_target_lens(batch) if len(batch) else None
    return 0 if lens is None else int((lens > 0).sum())


def count_samples(batch: Batch) -> tuple[int, int]:
    """(samples, clips) of a micro-batch: its rows as read (an empty, all-dropped batch has none), and
    all their audio clips (a conversation batch's ``audio_lens`` holds one entry per clip)."""
    n = len(batch)
    if n == 0:
        return 0, 0
    lens = getattr(batch, "audio_lens", None)
    return n, n if lens is None else int(lens.numel())


def agree_step(
    model: SpeechLLM,
    micro_batches: list[Batch],
    ctx: StepContext,
    *,
    extra: list[float] | tuple[float, ...] = (),
    flags: list[bool] | tuple[bool, ...] = (),
    skip: bool = False,
) -> StepAgreement:
    """The step's one small all-reduce, before any forward: this rank's labelled tokens and CTC clips
    (the objective's normalisers), its samples and clips (what the step read), the caller's `extra`
    counts summed over dp ranks, and its `flags` true when any rank's is. `skip`: this rank trains
    nothing this step (it found a data error): it adds zeros, and still takes part."""
    batches = [] if skip else micro_batches
    n_tok = sum(count_targets(b, model) for b in batches)
    n_clip = sum(count_ctc_clips(b) for b in batches)
    k = int(getattr(model, "ctc_skip_leading", 0))
    n_ctc = sum(count_ctc_tokens(b, k) for b in batches)
    read = [count_samples(b) for b in batches]
    n_samples, n_clips = sum(r[0] for r in read), sum(r[1] for r in read)
    local = [float(n_tok), float(n_clip), float(n_ctc), float(n_samples), float(n_clips)]
    total, agreed = ctx.collectives.agree([*local, *extra], list(flags))
    tokens, clips, ctc_tokens, samples, audio_clips = (int(round(v)) for v in total[: len(local)])
    counts = StepCounts(tokens, clips, ctc_tokens, samples, audio_clips)
    return StepAgreement(counts=counts, extra=total[len(local) :], flags=agreed)


def run_optimizer_step(
    model: SpeechLLM,
    micro_batches: list[Batch],
    ctx: StepContext,
    opt: Any,  # Any: a torch Optimizer, or Lightning's LightningOptimizer around one
    sched: torch.optim.lr_scheduler.LRScheduler,
    cfg: ExperimentConfig,
    *,
    step: int,
    backward: Callable[[torch.Tensor], None] | None = None,
    clip: Callable[[], float] | None = None,
    counts: StepCounts | None = None,
    flop_count: Callable[[list[MicroWork], bool], float] | None = None,
) -> dict[str, Any]:
    """One optimizer step over `micro_batches` (this rank's share); returns the step's global metrics,
    and under ``"work"`` its `StepWork` (what was computed, for the throughput figures).

    Shared by the Lightning `training_step`, the multi-process equivalence tests and the benchmarks.
    `counts`: the step's agreed normalisers (`agree_step`, which the Lightning module runs with its own
    counts and flags); None: agreed here. `flop_count`: (this rank's micro-batch work, encoder frozen)
    -> training FLOPs (`speechlm.model.flops.step_flops`); None: FLOPs are not counted (0).
    """
    backward = backward or (lambda loss: loss.backward())
    frozen = encoder_runs_frozen(step, cfg)
    oracle = oracle_prefix_runs(step, cfg)
    if counts is None:
        counts = agree_step(model, micro_batches, ctx).counts
    n_tok, n_ctc = counts.tokens, counts.ctc_norm(cfg.model.ctc_reduction)
    w_ctc = cfg.model.ctc_weight
    ce_total = torch.zeros((), dtype=torch.float64)
    ctc_total = torch.zeros((), dtype=torch.float64)
    works: list[MicroWork] = []
    for b in micro_batches:
        with ctx.precision.autocast():  # forward only; a no-op under FSDP mixed precision or fp32
            out = compute_micro_losses(model, b, encoder_frozen=frozen, oracle=oracle)
        loss = out.ce_sum / max(n_tok, 1)
        if w_ctc > 0 and out.ctc_sum is not None:
            loss = loss + w_ctc * out.ctc_sum / n_ctc
        # gradients are averaged over the dp*cp group by FSDP2; grad_scale turns that into a sum
        backward(loss * ctx.grad_scale * out.weight)
        ce_total += out.ce_sum.detach().double().cpu() * out.weight
        if out.ctc_sum is not None:
            ctc_total += out.ctc_sum.detach().double().cpu() * out.weight
        if out.placed is not None and out.weight > 0:  # a dummy micro-batch is no model work
            works.append(work_of(out.placed))
    local = StepWork.of(works, flop_count(works, frozen) if flop_count is not None else 0.0, 0.0)
    ce_sum, ctc_sum, *shard_sums = ctx.collectives.sum_shards(
        [float(ce_total), float(ctc_total), *local.shard_values()]
    )  # the step's loss (every rank gets the same sums) and work, for the log and the check below
    ce = ce_sum / max(n_tok, 1)
    ctc = ctc_sum / n_ctc
    step_loss = ce + (w_ctc * ctc if w_ctc > 0 else 0.0)
    t_optim = _synced_time(model)
    grad_norm = (
        clip() if clip is not None else clip_model_gradients(model, cfg.optim.grad_clip, ctx.clip_grad_norm)
    )
    check_step_finite(step + 1, step_loss, ce, ctc if w_ctc > 0 else None, grad_norm, cfg)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    optim_s = _synced_time(model) - t_optim
    work = replace(local, optim_s=optim_s).with_totals(shard_sums)
    return {
        "loss": step_loss,
        "ce": ce,
        "ctc": ctc if w_ctc > 0 and counts.clips > 0 else None,  # None: no clip of the step has a transcript
        "grad_norm": grad_norm,
        "tokens": n_tok,
        "utterances": counts.samples,  # samples read (a conversation is one, whatever its clips)
        "clips": counts.audio_clips,
        "ctc_clips": counts.clips,  # the clips with a transcript of their own (the CTC term's)
        "encoder_frozen": frozen,
        "work": work,
    }


def check_step_finite(
    step: int, loss: float, ce: float, ctc: float | None, grad_norm: float, cfg: ExperimentConfig
) -> None:
    """Stop the run at the first optimizer step whose loss or gradient norm is NaN or infinite, before the
    optimizer applies it. Both figures are the same on every rank (the loss sums come from one all-reduce,
    the norm from the clipping's), so every rank raises here at the same step and none waits on a
    collective the others never reach."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return

    parts = f"cross-entropy {ce:.4g}" + (f", CTC {ctc:.4g}" if ctc is not None else "")
    raise NonFiniteError(
        f"optimizer step {step}: the loss is {loss:.4g} ({parts}) and the gradient norm {grad_norm:.4g}: "
        "training stopped before this step changed the weights, and nothing of it is saved (metrics.jsonl "
        "and the checkpoints hold the steps before it). A NaN from the first step points at the weights "
        "(a damaged model.llm.pretrained / model.encoder.pretrained) or the data; a later one at divergence: "
        f"lower optim.lr (now {cfg.optim.lr:g}) and resume from the last checkpoint (trainer.resume=auto)"
    )


def clip_model_gradients(
    model: torch.nn.Module, max_norm: float | None, clip_fn: Callable[..., Any] | None
) -> float:
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
