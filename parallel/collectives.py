"""The collectives of the training layer (`Collectives`), and those of the CP code, including a
differentiable all-gather that works on subgroups.

`Collectives` is the one object through which the optimizer step, evaluation and the target/clip counts
talk to the other ranks (built by `ParallelDims.collectives(rank)`; trivial for one process, where it
issues nothing). Every one of its collectives runs over the whole world, with each rank's part weighted
by its role, so no subgroup is needed and the sums are over exactly what the caller means:

- `agree(counts, flags)`: the step's one small all-reduce before any forward. Counts are per dp rank
  (CP/TP peers hold the same batch), so only the dp rank's `primary` member (cp_rank = tp_rank = 0)
  adds them: the result is the sum over dp ranks. Flags are true when any rank's is.
- `sum_shards(values)`: values held per CP shard (a loss sum over this rank's share of the tokens);
  TP peers hold the same value, so only `shard_primary` members (tp_rank = 0) add theirs: the sum over
  dp x cp.
- `any(flag)`: lockstep flag (greedy decoding, evaluation stop), true when any rank's is.
- `gather_objects(obj)`: every rank's object, in rank order.

`torch.distributed.nn.functional.all_gather` cannot be used on gloo subgroups: its backward emulates
all-to-all with `dist.scatter(src=i)`, passing the *group* rank `i` where a global rank is expected,
so it fails ("Global rank 0 is not part of group") on any CP group of a 2-D mesh. `gather_head_dim0`
instead gathers with one `all_gather_into_tensor` and returns gradients with one reduce-scatter (sum),
which gloo and NCCL both support on any group.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Collectives:
    """This rank's collectives and its roles in them (module docstring); the defaults are one process."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    primary: bool = True  # cp_rank == tp_rank == 0: speaks for its dp rank's batch (counts, decodes)
    shard_primary: bool = True  # tp_rank == 0: speaks for its CP shard (loss sums)
    device: Any = "cpu"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def agreement_payload(self, counts: list[float], flags: list[bool]) -> Tensor:
        """This rank's part of the agreement: counts (primary member only), then flags as 0/1."""
        mine = [float(c) if self.primary else 0.0 for c in counts] + [1.0 if f else 0.0 for f in flags]
        return torch.tensor(mine, dtype=torch.float64)

    @staticmethod
    def read_agreement(total: Tensor, n_counts: int) -> tuple[list[float], list[bool]]:
        """(counts summed over dp ranks, flags of any rank) from the summed payloads."""
        out = [float(x) for x in total.tolist()]
        return out[:n_counts], [x > 0 for x in out[n_counts:]]

    def shard_payload(self, values: list[float]) -> Tensor:
        return torch.tensor([float(v) if self.shard_primary else 0.0 for v in values], dtype=torch.float64)

    def agree(self, counts: list[float], flags: list[bool]) -> tuple[list[float], list[bool]]:
        """One all-reduce: counts summed over dp ranks, flags true when any rank's is."""
        if not self.distributed:
            return [float(c) for c in counts], [bool(f) for f in flags]
        return self.read_agreement(self._sum(self.agreement_payload(counts, flags)), len(counts))

    def sum_shards(self, values: list[float]) -> list[float]:
        """One all-reduce: per-CP-shard values summed over dp x cp."""
        if not self.distributed:
            return [float(v) for v in values]
        return [float(x) for x in self._sum(self.shard_payload(values)).tolist()]

    def any(self, flag: bool) -> bool:
        """One all-reduce: whether any rank's flag is set (every rank gets the same answer)."""
        if not self.distributed:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (pickled; for small, rare messages)."""
        if not self.distributed:
            return [obj]
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, obj)
        return parts

    def _sum(self, t: Tensor) -> Tensor:
        t = t.to(self.device)
        dist.all_reduce(t)
        return t.cpu()
