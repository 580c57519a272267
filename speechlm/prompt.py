"""Build the token prompt of one utterance: ``[bos, <audio>, *instruction, *target, eos]``.

Letters: B batch rows, L prompt length (here: one utterance, audio still a single placeholder).

``ids_L`` holds one ``audio_id`` placeholder that packing (``speechlm.packing``) replaces by the
clip's audio embeddings. ``target_mask_L`` is True on the transcript tokens (which begin with the
language tag, so the language is supervised) and on EOS; BOS, the placeholder and the instruction
are context only. Example, instruction of 2 tokens, target ``[<en>, w1, w2]``::

    ids_L          bos  <audio>  i1  i2  <en>  w1  w2  eos
    target_mask_L   0      0      0   0    1    1   1    1
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from speechlm.packing import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "build_prompt", "build_prompts"]


def build_prompt(
    target_ids: Sequence[int],
    *,
    bos_id: int,
    eos_id: int,
    audio_id: int,
    instruction_ids: Sequence[int] = (),
) -> tuple[Tensor, Tensor]:
    """Return ``(ids_L, target_mask_L)`` (int64, bool) for one utterance."""
    target = [int(t) for t in target_ids]
    instruction = [int(t) for t in instruction_ids]
    for name, part in (("target_ids", target), ("instruction_ids", instruction)):
        if audio_id in part:
            raise ValueError(
                f"{name} contains the audio placeholder id {audio_id}; the placeholder must appear only "
                "once, between BOS and the instruction (use a dedicated special token for audio_id)"
            )
    ids = [bos_id, audio_id, *instruction, *target, eos_id]
    n_context = 2 + len(instruction)
    ids_L = torch.tensor(ids, dtype=torch.long)
    target_mask_L = torch.zeros(len(ids), dtype=torch.bool)
    target_mask_L[n_context:] = True
    return ids_L, target_mask_L


def build_prompts(
    tokens_BL: Tensor,
    token_lens_B: Tensor | Sequence[int],
    *,
    bos_id: int,
    eos_id: int,
    audio_id: int,
    instruction_ids: Sequence[int] = (),
) -> list[tuple[Tensor, Tensor]]:
    """Build one prompt per row of a collated batch; row ``b`` uses ``tokens_BL[b, :token_lens_B[b]]``."""
    lens = [int(n) for n in (token_lens_B.tolist() if isinstance(token_lens_B, Tensor) else token_lens_B)]
    if tokens_BL.dim() != 2 or len(lens) != tokens_BL.shape[0]:
        raise ValueError(
            f"tokens must be [B, L] with one length per row, got shape {tuple(tokens_BL.shape)} and "
            f"{len(lens)} lengths"
        )
    rows = tokens_BL.detach().cpu().tolist()
    out = []
    for b, (row, n) in enumerate(zip(rows, lens)):
        if not 0 <= n <= len(row):
            raise ValueError(f"row {b}: token length {n} is outside [0, {len(row)}]")
        out.append(
            build_prompt(
                row[:n], bos_id=bos_id, eos_id=eos_id, audio_id=audio_id, instruction_ids=instruction_ids
            )
        )
    return out
