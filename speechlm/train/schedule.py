"""Learning-rate schedules as pure functions of the optimizer step.

Two parameter groups share one `LambdaLR`:
- the decoder side (LLM, projector, CTC head): linear warmup over `warmup_steps`, then cosine decay
  to `min_lr_ratio * lr` at `max_steps`;
- the audio encoder: zero before `unfreeze_step` (the encoder is also run without gradients then),
  then its own linear warmup over `encoder_warmup_steps` from the unfreeze step, then the same cosine
  decay to `max_steps`. With `unfreeze_step=0` both groups follow the same shape.

`build_optimizer` makes the AdamW with those two groups and the `LambdaLR`; `sync_schedule_to_step`
moves a restored scheduler onto this run's schedule.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from speechlm.model.speech_llm import SpeechLLM
from speechlm.train.lightning_compat import set_scheduler_lrs

if TYPE_CHECKING:
    from speechlm.config import ExperimentConfig


def warmup_cosine(
    step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float, start: int = 0
) -> float:
    """Multiplier in [min_lr_ratio, 1] for optimizer step `step` (0-based), starting at `start`."""
    if step < start:
        return 0.0
    s = step - start
    if warmup_steps > 0 and s < warmup_steps:
        return (s + 1) / warmup_steps
    span = max(1, max_steps - start - warmup_steps)
    progress = min(1.0, (s - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decoder_lr_lambda(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    return warmup_cosine(step, warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio)


def encoder_lr_lambda(
    step: int,
    *,
    unfreeze_step: int,
    encoder_warmup_steps: int,
    warmup_steps: int,
    max_steps: int,
    min_lr_ratio: float,
) -> float:
    if unfreeze_step <= 0:
        return warmup_cosine(step, warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio)
    return warmup_cosine(
        step,
        warmup_steps=encoder_warmup_steps,
        max_steps=max_steps,
        min_lr_ratio=min_lr_ratio,
        start=unfreeze_step,
    )


def encoder_frozen(step: int, unfreeze_step: int) -> bool:
    """True while the encoder is frozen (before the optimizer step `unfreeze_step`)."""
    return unfreeze_step > 0 and step < unfreeze_step


def encoder_runs_frozen(step: int, cfg: ExperimentConfig) -> bool:
    """Whether optimizer step `step` runs the encoder without autograd: always with
    ``model.encoder.train=frozen``, before ``optim.unfreeze_step`` with ``full``."""
    return cfg.model.encoder.train == "frozen" or encoder_frozen(step, cfg.optim.unfreeze_step)


def oracle_prefix_runs(step: int, cfg: ExperimentConfig) -> bool:
    """Whether optimizer step `step` fills the audio rows with the transcripts (``model.oracle_warmup_steps``,
    `speechlm.model.oracle`)."""
    return step < cfg.model.oracle_warmup_steps


def build_optimizer(model: SpeechLLM, cfg: ExperimentConfig) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with two groups (decoder side, audio encoder) and one LambdaLR with a schedule per group.

    Only parameters that require gradients join (`speechlm.model.trainable`: a frozen LLM or encoder,
    a LoRA run's base weights have none), so frozen parameters get no optimizer state; a group may be
    empty (a frozen encoder's)."""
    o, t = cfg.optim, cfg.trainer
    enc_ids = {id(p) for p in model.encoder_parameters()}
    enc = [p for p in model.parameters() if id(p) in enc_ids and p.requires_grad]
    rest = [p for p in model.parameters() if id(p) not in enc_ids and p.requires_grad]
    groups = [
        {"params": rest, "lr": o.lr, "name": "decoder"},
        {"params": enc, "lr": o.encoder_lr if o.encoder_lr is not None else o.lr, "name": "encoder"},
    ]
    betas = (float(o.betas[0]), float(o.betas[1]))
    opt = torch.optim.AdamW(groups, betas=betas, weight_decay=o.weight_decay, eps=1e-8)
    max_steps, floor = t.max_steps, o.min_lr_ratio
    lambdas = [
        lambda s: decoder_lr_lambda(s, warmup_steps=o.warmup_steps, max_steps=max_steps, min_lr_ratio=floor),
        lambda s: encoder_lr_lambda(
            s,
            unfreeze_step=o.unfreeze_step,
            encoder_warmup_steps=o.encoder_warmup_steps,
            warmup_steps=o.warmup_steps,
            max_steps=max_steps,
            min_lr_ratio=floor,
        ),
    ]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas)


def sync_schedule_to_step(sched: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Set every group's learning rate to base_lr * lambda(step) of this run's LambdaLR."""
    lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    set_scheduler_lrs(sched, step, lrs)  # type: ignore[arg-type]  # base_lrs are floats here (our optimizer's)
