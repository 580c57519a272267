"""The model's view of a batch, one shape: a conversation batch (`speechlm.data.dataset.Batch` with ``prompt_ids`` set):
its prompts, which clips belong to which row, the packed length of each row, where its last answer
starts, and its per-clip CTC targets. Pure functions of the batch's tensors; `SpeechLLM` uses them.

A batch of transcription rows (``audio``, ``tokens``/``token_lens`` only: the form tests, benchmarks and
`speechlm transcribe` build) is the one-turn case: `as_conversation` renders each row's prompt in the
run's `PromptFormat` (``[*prefix, <audio>, *middle, *transcript, *stop, *trailing]``), one clip per row,
its transcript the clip's CTC target. Every consumer (the model, the step's counts, generation) reads
that one shape.

Letters: B rows, P padded prompt length, C clips, K CTC tokens, L one prompt's length.

    prompt_ids [B, P], prompt_mask [B, P], prompt_lens [B]   -> [(ids_L, target_mask_L)] per row
    clip_sample [C] (non-decreasing)                         -> clips per row
    audio_lens (projected frames per clip)                   -> seq_len = L - k + sum of its clips' frames
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from speechlm.packing.prompt import PromptFormat, build_prompts

__all__ = [
    "as_conversation",
    "batch_field",
    "clips_per_sample",
    "conversation_ctc_targets",
    "conversation_prompts",
    "conversation_seq_lens",
    "ctc_target_lens",
    "last_answer_start",
    "last_target_start",
    "optional_field",
]


def batch_field(batch: Any, name: str) -> Any:
    """``batch.name`` (attribute or mapping key)."""
    return batch[name] if isinstance(batch, Mapping) else getattr(batch, name)


def optional_field(batch: Any, name: str) -> Any:
    """``batch.name`` (attribute or mapping key), None when it has none."""
    return batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)


def as_conversation(batch: Any, prompt: PromptFormat) -> Any:
    """``batch`` in the one shape: itself when it is a conversation batch (``prompt_ids`` set), else its
    transcription rows as one-turn conversations (module docstring): ``prompt_ids``/``prompt_mask``/
    ``prompt_lens`` rendered by ``prompt``, ``clip_sample`` one clip per row, ``ctc_tokens`` the
    transcripts. A mapping stays a mapping, a dataclass (`speechlm.data.dataset.Batch`) its own type."""
    if optional_field(batch, "prompt_ids") is not None:
        return batch
    tokens_BL, token_lens_B = batch_field(batch, "tokens"), batch_field(batch, "token_lens")
    prompts = build_prompts(tokens_BL, token_lens_B, prompt=prompt)
    lens = [int(ids.shape[0]) for ids, _ in prompts]
    ids_BP = torch.full((len(prompts), max(lens, default=0)), prompt.audio_id, dtype=torch.long)
    mask_BP = torch.zeros(ids_BP.shape, dtype=torch.bool)
    for b, (ids, mask) in enumerate(prompts):
        ids_BP[b, : lens[b]], mask_BP[b, : lens[b]] = ids, mask
    fields = dict(
        prompt_ids=ids_BP,
        prompt_mask=mask_BP,
        prompt_lens=torch.tensor(lens, dtype=torch.long),
        clip_sample=torch.arange(len(prompts)),
        ctc_tokens=tokens_BL,
        ctc_token_lens=token_lens_B,
    )
    if isinstance(batch, Mapping):
        return {**batch, **fields}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **fields)
    return SimpleNamespace(**{**vars(batch), **fields})


def ctc_target_lens(batch: Any) -> Tensor | None:
    """Each clip's CTC target length as collated (language tag included; 0: no transcript), None when the
    batch has none: a conversation batch's ``ctc_token_lens``, a transcription row's ``token_lens`` (its
    transcript is its one clip's, `as_conversation`)."""
    if optional_field(batch, "prompt_ids") is not None:
        return optional_field(batch, "ctc_token_lens")
    return batch_field(batch, "token_lens")


def conversation_prompts(batch: Any, audio_id: int) -> tuple[list[tuple[Tensor, Tensor]], list[int]]:
    """``([(ids_L, target_mask_L)] per row, clip_sample)`` of a conversation batch: each row's rendered prompt
    (``prompt_ids``/``prompt_mask`` cut to ``prompt_lens``) and the row of each clip; a batch whose fields
    disagree is a ValueError naming them."""
    ids_BP, mask_BP = batch_field(batch, "prompt_ids"), optional_field(batch, "prompt_mask")
    lens_B, clip_sample_C = optional_field(batch, "prompt_lens"), optional_field(batch, "clip_sample")
    if mask_BP is None or lens_B is None or clip_sample_C is None:
        raise ValueError(
            "a conversation batch (prompt_ids set) needs prompt_mask, prompt_lens and clip_sample too; "
            "collate it with speechlm.data.dataset.Collator and a ConversationRenderer"
        )
    B = int(ids_BP.shape[0])
    if tuple(mask_BP.shape) != tuple(ids_BP.shape) or int(lens_B.numel()) != B:
        raise ValueError(
            f"prompt_ids {tuple(ids_BP.shape)}, prompt_mask {tuple(mask_BP.shape)} and prompt_lens "
            f"{tuple(lens_B.shape)} must describe the same B rows"
        )
    lens = [int(n) for n in lens_B.tolist()]
    rows, masks = ids_BP.detach().cpu(), mask_BP.detach().cpu().to(torch.bool)
    prompts = [(rows[b, : lens[b]].clone(), masks[b, : lens[b]].clone()) for b in range(B)]
    clip_sample = [int(c) for c in clip_sample_C.tolist()]
    n_audio = int(batch_field(batch, "audio_lens").numel())
    if len(clip_sample) != n_audio:
        raise ValueError(f"clip_sample has {len(clip_sample)} entries for {n_audio} clips (audio_lens)")
    if any(b < a for a, b in zip(clip_sample, clip_sample[1:])) or any(not 0 <= c < B for c in clip_sample):
        raise ValueError(
            f"clip_sample {clip_sample} must list each clip's row in [0, {B}), non-decreasing (rows in order, "
            "each row's clips in the order of its placeholders)"
        )
    counts = clips_per_sample(clip_sample, B)
    indices = optional_field(batch, "indices") or list(range(B))
    for b, ((ids, _), k) in enumerate(zip(prompts, counts)):
        n = int((ids == audio_id).sum())
        if n != k:
            raise ValueError(
                f"row {b} (manifest row {indices[b]}): its prompt holds {n} audio placeholders "
                f"(audio_id={audio_id}) but the batch gives it {k} clip(s); render it with "
                "ConversationRenderer (one placeholder per clip reference) and collate its clips in order"
            )
    return prompts, clip_sample


def clips_per_sample(clip_sample: Sequence[int], n: int) -> list[int]:
    """How many clips each of the ``n`` samples holds."""
    counts = [0] * n
    for s in clip_sample:
        counts[s] += 1
    return counts


def conversation_seq_lens(
    prompts: Sequence[tuple[Tensor, Tensor]], clip_counts: Sequence[int], audio_lens: Sequence[int]
) -> list[int]:
    """Packed length of each sample: its prompt, each placeholder replaced by its clip's frames."""
    out, c = [], 0
    for (ids, _), k in zip(prompts, clip_counts):
        out.append(int(ids.shape[0]) - k + sum(audio_lens[c : c + k]))
        c += k
    return out


def last_target_start(target_mask_L: Tensor, row: int = 0) -> int:
    """Index of the first position of the last run of targets (where the last answer starts)."""
    where = torch.nonzero(target_mask_L).flatten()
    if where.numel() == 0:
        raise ValueError(f"row {row}: the prompt has no target (assistant) tokens; nothing to generate")
    start = int(where[-1])
    while start > 0 and bool(target_mask_L[start - 1]):
        start -= 1
    return start


def last_answer_start(ids_L: Tensor, target_mask_L: Tensor, answer_ids: Sequence[int], row: int = 0) -> int:
    """Where the last answer starts: the start of the last target run, or, when that run holds
    ``answer_ids`` (the row's last answer, `Batch.tokens`) later on, followed by at least one stop token,
    the last such place (two answers labelled back to back make one run)."""
    start = last_target_start(target_mask_L, row)
    end = start
    while end < target_mask_L.numel() and bool(target_mask_L[end]):
        end += 1
    n = len(answer_ids)
    if n == 0:
        return start
    want = torch.as_tensor(list(answer_ids), dtype=ids_L.dtype)
    for s in range(end - n - 1, start, -1):
        if torch.equal(ids_L[s : s + n], want):
            return s
    return start


def conversation_ctc_targets(batch: Any, n_clips: int) -> tuple[Tensor, Tensor]:
    """``(ctc_tokens [C, K], ctc_token_lens [C])`` of a conversation batch; none given: every clip 0."""
    tokens, lens = optional_field(batch, "ctc_tokens"), optional_field(batch, "ctc_token_lens")
    device = batch_field(batch, "audio_lens").device
    if tokens is None or lens is None:
        return torch.zeros(n_clips, 1, dtype=torch.long, device=device), torch.zeros(
            n_clips, dtype=torch.long, device=device
        )
    if int(tokens.shape[0]) != n_clips or int(lens.numel()) != n_clips:
        raise ValueError(
            f"ctc_tokens {tuple(tokens.shape)} / ctc_token_lens {tuple(lens.shape)} need one row per clip "
            f"({n_clips} clips)"
        )
    return tokens, lens
