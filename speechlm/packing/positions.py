"""Position ids of the audio rows: sequential, or aligned with the answer (``model.audio_positions``).

Letters: T positions of a stream (THD: sequences back to back; BSHD: rows flattened), C clips, A audio rows.

Sequential positions count every row of a sequence, audio rows included (`plan_thd`, `pack_bshd`). With
``model.audio_positions: aligned`` (and CTC-compressed audio, one row per heard token:
`speechlm.model.compression`) row k of a clip takes the position id of the token it stands for: the k-th
token after the first ``skip`` (the language tag) of the first answer (target run) that follows the clip in
its sequence; a clip with no answer after it in its sequence (a generation prompt, whose answer is yet to
come) counts from the sequence's next position. Text keeps its sequential positions, so the first token
of the answer predicts its successor from the position whose audio row holds that successor at a fixed
offset of one: copying the audio becomes a lookup by relative position (RoPE), not a search by content
that a decoder trained from scratch learns slowly (docs/training.md, the demo's LLM alone). Causality is
untouched: it follows the order of the rows, not their position ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def align_audio_positions(
    position_ids_T: Tensor,
    audio_mask_T: Tensor,
    target_mask_T: Tensor,
    seq_of_T: Tensor,
    clip_lens: Sequence[int],
    next_position: Sequence[int],
    *,
    skip: int,
) -> Tensor:
    """``position_ids_T`` with each clip's rows moved to its answer's positions (module docstring).

    ``audio_mask_T``: the audio rows, whose clips come in stream order with ``clip_lens`` rows each;
    ``target_mask_T``: the rows whose id is a target (the answers); ``seq_of_T``: the sequence of each row;
    ``next_position``: per sequence, the position id its next token would take (its real length)."""
    T = int(position_ids_T.numel())
    device = position_ids_T.device
    audio_idx = torch.nonzero(audio_mask_T).flatten()
    lens = torch.tensor([int(n) for n in clip_lens], dtype=torch.long)
    if int(lens.sum()) != int(audio_idx.numel()):
        raise ValueError(f"{int(audio_idx.numel())} audio rows for clips of {int(lens.sum())} rows in all")
    lens = lens[lens > 0].to(device)
    if lens.numel() == 0:
        return position_ids_T
    first = torch.cumsum(lens, 0) - lens  # index of each clip's first row in audio_idx
    start_C = audio_idx[first]
    end_C = audio_idx[first + lens - 1] + 1
    idx = torch.where(target_mask_T.to(device), torch.arange(T, device=device), T)
    next_target = torch.cat(
        [torch.flip(torch.cummin(torch.flip(idx, [0]), 0).values, [0]), idx.new_tensor([T])]
    )
    answer_C = next_target[end_C]
    seq_C = seq_of_T[start_C].to(device)
    own = answer_C < T
    own[own.clone()] = seq_of_T[answer_C[own]].to(device) == seq_C[own]
    nxt = torch.tensor([int(n) for n in next_position], dtype=torch.long, device=device)
    base_C = torch.where(own, position_ids_T[answer_C.clamp(max=T - 1)], nxt[seq_C]) + int(skip)
    clip_A = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
    offset_A = torch.arange(int(audio_idx.numel()), device=device) - first[clip_A]
    out = position_ids_T.clone()
    out[audio_idx] = base_C[clip_A] + offset_A
    return out
