"""One micro-batch through the model, as training's step and evaluation's teacher-forced loss both run it.

`compute_micro_losses` is `model(batch)`, or, for a micro-batch whose every clip failed to decode (an
empty batch), a forward of a tiny dummy clip (`make_dummy_batch`) with weight 0: every rank then issues
the same collectives in the same order (FSDP and CP would otherwise hang) and the objective is
unchanged. `count_targets` is the micro-batch's labelled tokens, the cross-entropy normaliser;
`count_ctc_tokens` its CTC target tokens.

The batches are `speechlm.data.batch.Batch` values; the model layer never imports the data layer, so the
dummy is built as a batch of the empty one's own type.
"""

from __future__ import annotations

from typing import Any

import torch

from parallel.frames import DUMMY_CLIP_SAMPLES, SAMPLE_RATE
from speechlm.model.conversation_inputs import as_conversation, ctc_target_lens
from speechlm.model.speech_llm import MicroLosses, SpeechLLM


def count_targets(batch: Any, model: SpeechLLM) -> int:
    """Labelled tokens of a micro-batch: its rows' assistant tokens (``prompt_mask``; a transcription row is
    a one-turn conversation: `as_conversation`)."""
    if len(batch) == 0:
        return 0
    batch = as_conversation(batch, model.prompt)
    mask_BP, lens_B = batch.prompt_mask, batch.prompt_lens
    assert mask_BP is not None and lens_B is not None  # as_conversation fills both
    within_BP = (
        torch.arange(mask_BP.shape[1], device=mask_BP.device)[None] < lens_B.to(mask_BP.device)[:, None]
    )
    return int((mask_BP & within_BP).sum())


def count_ctc_tokens(batch: Any, skip_leading: int) -> int:
    """CTC target tokens of a micro-batch (its normaliser under ``model.ctc_reduction=token``, and
    validation's `ctc_per_token`): each clip's transcript less the ``skip_leading`` tokens the CTC drops
    (the language tag)."""
    lens = ctc_target_lens(batch) if len(batch) else None
    if lens is None:
        return 0
    return int((lens[lens > 0].to(torch.long) - skip_leading).clamp(min=0).sum())


def make_dummy_batch(like: Any, eos_id: int) -> Any:
    """A one-clip, one-token batch of silence (the one dummy clip, `parallel.frames.DUMMY_CLIP_SAMPLES`), of
    `like`'s type (a `Batch`), used (with weight 0) when every clip of a batch failed; the model reads it as a
    one-turn conversation."""
    device = like.audio.device if like.audio is not None else torch.device("cpu")
    n = DUMMY_CLIP_SAMPLES
    return type(like)(
        audio=torch.zeros(1, n, device=device),
        audio_lens=torch.tensor([n], device=device),
        tokens=torch.full((1, 1), eos_id, dtype=torch.long, device=device),
        token_lens=torch.tensor([1], device=device),
        langs=["dummy"],
        indices=[-1],
        durations=torch.tensor([n / SAMPLE_RATE]),
        dropped={},
    )


def compute_micro_losses(
    model: SpeechLLM, batch: Any, *, encoder_frozen: bool = False, oracle: bool = False, per_seq: bool = False
) -> MicroLosses:
    """`model(batch)`, or its weight-0 dummy when the batch is empty (see the module docstring); ``oracle``:
    the oracle prefix for this step (``model.oracle_warmup_steps``); ``per_seq``: also each row's CE
    (`MicroLosses.ce_per_seq`)."""
    kwargs = {
        "encoder_frozen": encoder_frozen,
        **{k: True for k, on in (("oracle", oracle), ("per_seq", per_seq)) if on},
    }
    if len(batch) == 0:
        out = model(make_dummy_batch(batch, model.eos_id), **kwargs)
        out.weight = 0.0
        return out
    return model(batch, **kwargs)
