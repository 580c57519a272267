"""The collectives of a clip sharded over the CP group (issue 25), both differentiable:

- `hand_over(x_PH, handover, rank, group)`: the clip's projected rows from the encoder's contiguous slices
  to the rows each rank's LLM stream holds (`parallel.clip_handover.Handover`), in ONE
  ``all_to_all_single`` (each moved row sent once, by the rank that computed it); the backward sends each
  row's gradient back along the same route in one more. Returns ``[A, H]``: the rows this rank needs,
  zeros elsewhere (the packing of the CP layout drops those rows; they receive no gradient).
- `gather_slices(x_UE, counts, group)`: every rank's slice of the clip's encoder frames, concatenated
  (``[sum counts, E]``) on every rank: the auxiliary CTC loss reads the whole clip (its alignment is a
  recursion over all frames). One all-gather of the slices padded to the longest; the backward is one
  reduce-scatter (`parallel.collectives.gather_head_dim0`), so a rank that does not compute the loss
  must still keep the result in its graph (weight 0) for the reduce-scatter to run on every rank.

Letters: P rows this rank projected, A the clip's rows, H width, U this rank's encoder frames, E width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.clip_handover import Handover, Interval
from parallel.collectives import gather_head_dim0

__all__ = ["gather_slices", "hand_over", "reduce_sum", "tie"]


def _rows(intervals: Sequence[Interval], shift: int = 0) -> list[int]:
    return [i - shift for lo, hi in intervals for i in range(lo, hi)]


def _index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _exchange(send: Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> Tensor:
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out


class _HandOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_PH: Tensor, handover: Handover, rank: int, group: Any) -> Tensor:  # type: ignore[override]
        cp, lo = handover.cp, handover.have[rank][0]
        dev = x_PH.device
        sent = [_rows(handover.moves(rank, d)) for d in range(cp)]  # clip rows, per destination
        got = [_rows(handover.moves(s, rank)) for s in range(cp)]  # clip rows, per source
        kept = _rows(handover.kept(rank))
        send_idx = _index([i - lo for rows in sent for i in rows], dev)
        recv = _exchange(x_PH.index_select(0, send_idx), [len(r) for r in sent], [len(r) for r in got], group)
        out = x_PH.new_zeros((handover.frames, *x_PH.shape[1:]))
        out.index_copy_(0, _index(kept, dev), x_PH.index_select(0, _index([i - lo for i in kept], dev)))
        out.index_copy_(0, _index([i for rows in got for i in rows], dev), recv)
        ctx.save_for_backward(send_idx)
        ctx.meta = (sent, got, kept, lo, int(x_PH.shape[0]), group)
        return out

    @staticmethod
    def backward(ctx: Any, g_AH: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (send_idx,) = ctx.saved_tensors
        sent, got, kept, lo, n_rows, group = ctx.meta
        dev = g_AH.device
        back = _exchange(
            g_AH.index_select(0, _index([i for rows in got for i in rows], dev)),
            [len(r) for r in got],
            [len(r) for r in sent],
            group,
        )
        g_PH = g_AH.new_zeros((n_rows, *g_AH.shape[1:]))
        g_PH.index_add_(0, _index([i - lo for i in kept], dev), g_AH.index_select(0, _index(kept, dev)))
        g_PH.index_add_(0, send_idx, back)
        return g_PH, None, None, None


def hand_over(x_PH: Tensor, handover: Handover, rank: int, group: Any) -> Tensor:
    """``[A, H]``: the clip's rows this rank's stream holds (module docstring); ``x_PH`` holds rows
    ``handover.have[rank]``. Every CP rank must call it, with the same ``handover``."""
    lo, hi = handover.have[rank]
    if x_PH.shape[0] != hi - lo:
        raise ValueError(f"rank {rank} projected {x_PH.shape[0]} rows, its slice is [{lo}, {hi})")
    return _HandOver.apply(x_PH, handover, rank, group)


def gather_slices(x_UE: Tensor, counts: Sequence[int], rank: int, group: Any) -> Tensor:
    """``[sum counts, E]``: the slices of every CP rank (``counts[r]`` frames on rank r, in rank order),
    on every rank; differentiable (module docstring)."""
    if x_UE.shape[0] != counts[rank]:
        raise ValueError(f"rank {rank} holds {x_UE.shape[0]} frames, counts say {counts[rank]}")
    pad_to = max(1, max(counts))
    gathered, _ = gather_head_dim0(x_UE, int(x_UE.shape[0]), pad_to, group)
    blocks = gathered.split(pad_to, dim=0)
    return torch.cat([b[:n] for b, n in zip(blocks, counts, strict=True)])


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *xs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return grads


def tie(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The same tensors, passed through ONE autograd node: in backward, none of their producers runs before
    every use of every one of them is done, and then all are ready at once, so the engine takes them in
    the same order (latest created first) on every rank. A sharded clip adds collectives on the CP group
    (the hand-over, the CTC gather, the halos) beside FSDP's reductions of the encoder; without
    this, a rank whose stream does not hold the clip would reach them before the ranks whose LLM backward
    still runs, in another order, and the blocking collectives would wait on each other for ever.
    Outputs nobody uses receive zeros, so their producers' collectives still run: keep one output in the
    loss (weight 0) to be sure the node itself runs."""
    return list(_Tie.apply(*tensors))


def reduce_sum(x: Tensor, group: Any) -> Tensor:
    """``x`` summed over the CP group, on every rank (a copy; no gradient): the per-bin sums of a sharded
    clip's log-mel features (`speechlm.model.features.LogMelFeatures.frames_of_clip`)."""
    out = x.detach().clone().contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
