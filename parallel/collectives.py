"""Collectives shared by the CP code, including a differentiable all-gather that works on subgroups.

`torch.distributed.nn.functional.all_gather` cannot be used on gloo subgroups: its backward emulates
all-to-all with `dist.scatter(src=i)`, passing the *group* rank `i` where a global rank is expected,
so it fails ("Global rank 0 is not part of group") on any CP group of a 2-D mesh. `gather_dim0`
instead gathers with one `all_gather_into_tensor` and returns gradients with one reduce-scatter (sum),
which gloo and NCCL both support on any group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def all_gather_into(out: Tensor, inp: Tensor, group: Any) -> None:
    """`out` [world * n, ...] ← every rank's `inp` [n, ...], in group-rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def reduce_scatter_into(out: Tensor, inp: Tensor, group: Any) -> None:
    """`out` [n, ...] ← the sum over ranks of this rank's slice of `inp` [world * n, ...]."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


class _GatherDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        all_gather_into(out, x, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        world = dist.get_world_size(ctx.group)
        gx = grad_out.new_empty((grad_out.shape[0] // world, *grad_out.shape[1:]))
        reduce_scatter_into(gx, grad_out.contiguous(), ctx.group)
        return gx, None


def gather_dim0(x: Tensor, group: Any) -> Tensor:
    """Differentiable all-gather along dim 0 (equal sizes): [n, ...] → [world * n, ...].

    Backward sums every rank's gradient for rank r's slice into rank r (a reduce-scatter)."""
    return _GatherDim0.apply(x, group)
