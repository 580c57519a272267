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


class _GatherHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, n_head: int, pad_to: int, group: Any) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.group, ctx.n_head, ctx.pad_to = group, n_head, pad_to
        world = dist.get_world_size(group)
        head = torch.nn.functional.pad(x[:n_head], (0, 0, 0, pad_to - n_head)).contiguous()
        out = x.new_empty((world * pad_to, *x.shape[1:]))
        all_gather_into(out, head, group)
        return out, x[n_head:].clone()

    @staticmethod
    def backward(ctx: Any, grad_gathered: Tensor, grad_tail: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        g_head = grad_gathered.new_empty((ctx.pad_to, *grad_gathered.shape[1:]))
        reduce_scatter_into(g_head, grad_gathered.contiguous(), ctx.group)
        return torch.cat([g_head[: ctx.n_head], grad_tail]), None, None, None


def gather_head_dim0(x: Tensor, n_head: int, pad_to: int, group: Any) -> tuple[Tensor, Tensor]:
    """Differentiable all-gather of the first ``n_head`` rows of ``x`` (padded to ``pad_to`` rows per
    rank): returns ``([world * pad_to, ...], x[n_head:])``, the tail passed through by the same
    autograd node.

    One node for both parts is what keeps ranks in step: every use of ``x`` (the rows every rank
    needs and the rows only this rank needs) reaches ``x``'s producer through this node's backward,
    which runs the reduce-scatter. Were the tail used directly, the backward could reach the
    producer (an FSDP unit, whose hooks issue collectives on another group) before the reduce-scatter
    on one rank and after it on another, and the two groups' blocking collectives would deadlock."""
    return _GatherHead.apply(x, n_head, pad_to, group)
