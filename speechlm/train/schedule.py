"""Learning-rate schedules as pure functions of the optimizer step.

Two parameter groups share one `LambdaLR`:
- the decoder side (LLM, projector, CTC head): linear warmup over `warmup_steps`, then cosine decay
  to `min_lr_ratio * lr` at `max_steps`;
- the audio encoder: zero before `unfreeze_step` (the encoder is also run without gradients then),
  then its own linear warmup over `encoder_warmup_steps` from the unfreeze step, then the same cosine
  decay to `max_steps`. With `unfreeze_step=0` both groups follow the same shape.
"""

from __future__ import annotations

import math


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
