"""Halo exchange over the CP group for a clip sharded in contiguous slices (`parallel.clip_placement`).

Letters: U frames of this rank's slice, E features per frame, l / r the halo widths (frames a rank
needs from its previous / next neighbour), cp the CP size, k this rank's place in the group.

Rank k holds frames ``[lo_k, hi_k)`` of one clip. A local operator that reads ``l`` frames to the left
and ``r`` to the right (a depthwise convolution: l = r = (K-1)/2; limited-context attention: its
window) needs the last ``l`` frames of rank k-1 and the first ``r`` frames of rank k+1:

    halo_exchange(x_UE, l, r, group) -> (x_ext [n_l + U + n_r, E], n_l, n_r)

with ``n_l = l`` except on rank 0 (0: the clip starts there) and ``n_r = r`` except on the last rank.
Forward: every rank contributes its edges (first r, last l frames) to one ``all_gather_into_tensor``
and takes its neighbours' blocks. Backward (the gradient of what a neighbour read must reach the rank
that owns the frames): every rank contributes the gradients of the halo frames it received to a second
all-gather, and adds its neighbours' gradients of its own edge frames. Volume per call: cp * (l + r) * E
values each way, whatever the slice length (an all-gather, not point-to-point, so gloo subgroups and
NCCL both run it without ordering concerns). Every slice must hold at least max(l, r) frames.

The model never calls torch.distributed: the training layer (or a test) binds the group into a
`HaloExchange` and hands that to the encoder, as `CPAttentionContext` does for the LLM's attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.collectives import all_gather_into

__all__ = ["Exchange", "HaloExchange", "halo_exchange"]

Exchange = Callable[[Tensor, int, int], tuple[Tensor, int, int]]  # (x_UE, l, r) -> (x_ext, n_l, n_r)


def _gather_blocks(payload: Tensor, group: Any) -> Tensor:
    """[cp, n, E] <- every rank's payload [n, E], in group-rank order."""
    world = dist.get_world_size(group)
    out = payload.new_empty((world * payload.shape[0], *payload.shape[1:]))
    all_gather_into(out, payload.contiguous(), group)
    return out.view(world, *payload.shape)


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, left: int, right: int, group: Any) -> Tensor:  # type: ignore[override]
        k, world = dist.get_rank(group), dist.get_world_size(group)
        U = x.shape[0]
        blocks = _gather_blocks(torch.cat([x[:right], x[U - left :]]), group)  # [cp, r + l, E]
        n_l = left if k > 0 else 0
        n_r = right if k < world - 1 else 0
        prev = blocks[k - 1, right:] if n_l else x[:0]
        nxt = blocks[k + 1, :right] if n_r else x[:0]
        ctx.left, ctx.right, ctx.group, ctx.U, ctx.n_l, ctx.n_r = left, right, group, U, n_l, n_r
        return torch.cat([prev, x, nxt])

    @staticmethod
    def backward(ctx: Any, g_ext: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        left, right, U, n_l, n_r = ctx.left, ctx.right, ctx.U, ctx.n_l, ctx.n_r
        k, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        g_prev = g_ext[:n_l] if n_l else g_ext.new_zeros(left, *g_ext.shape[1:])
        g_next = g_ext[n_l + U :] if n_r else g_ext.new_zeros(right, *g_ext.shape[1:])
        blocks = _gather_blocks(torch.cat([g_prev, g_next]), ctx.group)  # [cp, l + r, E]
        g_x = g_ext[n_l : n_l + U].clone()
        if k > 0:  # my first `right` frames were rank k-1's right halo
            g_x[:right] += blocks[k - 1, left:]
        if k < world - 1:  # my last `left` frames were rank k+1's left halo
            g_x[U - left :] += blocks[k + 1, :left]
        return g_x, None, None, None


def halo_exchange(x_UE: Tensor, left: int, right: int, group: Any) -> tuple[Tensor, int, int]:
    """(``[n_l + U + n_r, E]``, n_l, n_r): this rank's frames with its neighbours' edge frames around them
    (module docstring); differentiable, the backward returns the neighbours' gradients to their owners."""
    if left < 0 or right < 0:
        raise ValueError(f"halo widths must be >= 0, got left={left}, right={right}")
    if x_UE.shape[0] < max(left, right):
        raise ValueError(
            f"this rank's slice has {x_UE.shape[0]} frames, fewer than the halo ({left}, {right}) it must "
            "send: shard only clips with at least max(halo) frames per rank (parallel.clip_placement)"
        )
    if left == right == 0:
        return x_UE, 0, 0
    ext = _Halo.apply(x_UE, int(left), int(right), group)
    k, world = dist.get_rank(group), dist.get_world_size(group)
    return ext, (left if k > 0 else 0), (right if k < world - 1 else 0)


@dataclass(frozen=True)
class HaloExchange:
    """The halo exchange of one CP group, bound by the training layer and called by the model:
    ``exchange(x_UE, left, right) -> (x_ext, n_l, n_r)``."""

    group: Any

    def __call__(self, x_UE: Tensor, left: int, right: int) -> tuple[Tensor, int, int]:
        return halo_exchange(x_UE, left, right, self.group)
