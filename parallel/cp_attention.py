"""CP attention for one micro-batch: what an attention backend receives under context parallelism.

Letters: T local tokens, H query heads, G key/value heads, D head dim, N sequences.

A micro-batch's local stream (`parallel.cp_placement`) holds first the ``n_split`` sequences that are
split over the CP group (this rank's chunk pairs of each, `parallel.cp_shard`), then the sequences
that live whole on this rank. The split part attends over the group (ring or all-gather-KV, their
K/V travel); the whole part attends locally with one varlen call and no communication. The
placement is identical on every CP rank, so either all ranks run the collective part or none does.

`CPAttention` holds the group (built once per layout); `CPAttention.for_split_prefix` gives the
`PlacedCPAttention` of one micro-batch, built from its host boundaries once, handed to every layer.
`CPAttentionContext` is the declared protocol the backends consume (speechlm/model/attention/):
- a backend without CP kernels of its own (the reference) calls ``attention(q, k, v, cu_local, scale)``;
- a backend with its own CP kernels (transformer-engine) calls ``run(q, k, v, split_fn, whole_fn)``
  with its two calls: ``split_fn(q, k, v, split)`` once per part of the stream that is split over one
  group, with that part's `CPSplit` (the group, its global ranks, this rank's place in it and the part's
  *global* boundaries: each split sequence's full length, the local one times the group's size), and
  ``whole_fn(q, k, v, meta)`` over the whole sequences. Dynamic CP has one split part (the CP group);
  hybrid degrees (`parallel.hybrid_layout.HybridAttention`) one per degree, each over its sub-group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.allgather_attention import allgather_attention_thd, plan_allgather
from parallel.ring_attention import plan_ring, ring_attention_thd
from parallel.varlen import varlen_attention
from parallel.varlen_meta import VarlenMeta, build_varlen_meta

__all__ = [
    "CPAttention",
    "CPAttentionContext",
    "CPSplit",
    "PlacedCPAttention",
    "attention_by_degree",
    "plan_cp",
    "prepare_by_degree",
    "run_by_segment",
    "split_over",
]


@dataclass(frozen=True)
class CPSplit:
    """One part of a local stream whose sequences are all split over one CP group (or sub-group), as a
    backend with CP kernels of its own needs it: the group, its members as global ranks (in group rank
    order), its size and this rank's place in it, and the part's *global* boundaries on the device
    (``cu_global``: each local boundary times ``cp_size``, int32) and longest global sequence."""

    kind: str  # "ring" or "allgather" (parallel.cp_attention)
    group: Any  # opaque to the model
    global_ranks: tuple[int, ...]
    cp_size: int
    cp_rank: int
    cu_global: Tensor
    max_global: int


def split_over(
    kind: str,
    group: Any,
    global_ranks: Sequence[int],
    cp_rank: int,
    cu_local: Sequence[int],
    device: torch.device,
) -> CPSplit:
    """The `CPSplit` of a part with host boundaries ``cu_local`` (this rank's rows of each sequence) over
    the group of ``global_ranks``, in which this rank is ``cp_rank``."""
    d = len(global_ranks)
    if not 0 <= cp_rank < d:
        raise ValueError(f"CP rank {cp_rank} is outside a group of {d} ranks {list(global_ranks)}")
    longest = max((b - a for a, b in zip(cu_local, cu_local[1:])), default=0)
    cu_global = torch.tensor([c * d for c in cu_local], dtype=torch.int32, device=device)
    return CPSplit(kind, group, tuple(global_ranks), d, cp_rank, cu_global, d * longest)


SplitFn = Callable[[Tensor, Tensor, Tensor, CPSplit], Tensor]
WholeFn = Callable[[Tensor, Tensor, Tensor, VarlenMeta], Tensor]


class CPAttentionContext(Protocol):
    """What an attention backend may read of one micro-batch's CP layout (module docstring)."""

    kind: str  # "ring" or "allgather" (parallel.cp_attention)
    group: Any  # the CP process group, opaque to the model
    global_ranks: list[int]  # the group's members as global ranks
    cp_size: int
    cp_rank: int

    def attention(
        self, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, cu_seqlens_local: Tensor, scale: float | None
    ) -> Tensor: ...

    def run(
        self, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, split_fn: SplitFn, whole_fn: WholeFn
    ) -> Tensor: ...


def plan_cp(
    kind: str, host_cu: list[int], cp_size: int, cp_rank: int, device: torch.device
) -> dict[str, Any]:
    """The keyword arguments that spare ring (``plans``) or all-gather (``plan``) attention over ``cp_size``
    ranks any read of ``cu_seqlens_local`` from the device: built once per micro-batch from host integers."""
    if kind == "ring":
        return {"plans": plan_ring(host_cu, host_cu[-1], cp_size, cp_rank, True, device)}
    return {"plan": plan_allgather(host_cu, cp_size, cp_rank, True, device)}


class CPAttention:
    """Ring or all-gather-KV attention over one CP group; `for_split_prefix` places it on a stream."""

    def __init__(self, group: Any, cp_size: int, cp_rank: int, kind: str):
        self.fn = ring_attention_thd if kind == "ring" else allgather_attention_thd
        self.kind = kind
        self.group, self.cp_size, self.cp_rank = group, cp_size, cp_rank
        # the group's members as global ranks (transformer-engine's set_context_parallel_group wants them)
        if group is not None and dist.is_initialized():
            self.global_ranks = list(dist.get_process_group_ranks(group))
        else:
            self.global_ranks = list(range(cp_size))

    def prepare(self, host_cu: list[int], device: torch.device) -> dict[str, Any]:
        """What every layer of one micro-batch needs beyond the tensors, from host integers, once:
        the ring's step plans, or the all-gather's calls and permutation. No device sync in any layer."""
        return plan_cp(self.kind, host_cu, self.cp_size, self.cp_rank, device)

    def attention(
        self,
        q_THD: Tensor,
        k_THD: Tensor,
        v_THD: Tensor,
        cu_seqlens_local: Tensor,
        scale: float | None,
        prepared: dict[str, Any] | None = None,
    ) -> Tensor:
        return self.fn(
            q_THD,
            k_THD,
            v_THD,
            cu_seqlens_local,
            group=self.group,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            scale=scale,
            causal=True,
            **(prepared or {}),
        )

    def for_split_prefix(self, n_split: int, meta: VarlenMeta) -> PlacedCPAttention:
        """The first ``n_split`` sequences of the local stream with boundaries ``meta`` are split."""
        return PlacedCPAttention(self, n_split, meta)


class PlacedCPAttention:
    """`CPAttentionContext` of one micro-batch: the first ``n_split`` sequences of the local stream are
    split over the CP group, the rest are whole on this rank (module docstring)."""

    def __init__(self, cp: CPAttention, n_split: int, meta: VarlenMeta):
        self.cp, self.n_split = cp, n_split
        self.group, self.global_ranks, self.kind = cp.group, cp.global_ranks, cp.kind
        self.cp_size, self.cp_rank = cp.cp_size, cp.cp_rank
        # the whole part's boundaries, from the micro-batch's host integers: no device sync per layer
        t = meta.cu_q[n_split]
        self.t_split = t
        device = meta.cu_seqlens_q.device
        self.whole = build_varlen_meta([c - t for c in meta.cu_q[n_split:]], device=device)
        self._split_cu, self._device = list(meta.cu_q[: n_split + 1]), device

    # built on first use (by the first layer), from host integers: what the ring/all-gather needs, or
    # what a backend with its own CP kernels needs

    @functools.cached_property
    def prepared(self) -> dict[str, Any] | None:
        return self.cp.prepare(self._split_cu, self._device) if self.n_split else None

    @functools.cached_property
    def split(self) -> CPSplit:
        """The split prefix over the whole CP group."""
        return split_over(
            self.kind, self.group, self.global_ranks, self.cp_rank, self._split_cu, self._device
        )

    def run(
        self, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, split_fn: SplitFn, whole_fn: WholeFn
    ) -> Tensor:
        """``split_fn(q, k, v, self.split)`` over the split prefix's rows, ``whole_fn(q, k, v, meta)`` over
        the whole sequences' rows (with their local boundaries), concatenated in the local stream's order."""
        t = self.t_split
        parts = []
        if self.n_split:
            parts.append(split_fn(q_THD[:t], k_TGD[:t], v_TGD[:t], self.split))
        if q_THD.shape[0] > t:
            parts.append(whole_fn(q_THD[t:], k_TGD[t:], v_TGD[t:], self.whole))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def attention(
        self, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, cu_seqlens_local: Tensor, scale: float | None
    ) -> Tensor:
        """Ring or all-gather attention over the split part, one varlen call over the whole part."""
        n = self.n_split
        return self.run(
            q_THD,
            k_TGD,
            v_TGD,
            lambda q, k, v, _: self.cp.attention(q, k, v, cu_seqlens_local[: n + 1], scale, self.prepared),
            lambda q, k, v, meta: varlen_attention(q, k, v, meta, causal=True, scale=scale),
        )


def attention_by_degree(
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    segments: list[tuple[int, list[int]]],
    groups: dict[int, Any],
    cp_rank: int,
    kind: str,
    scale: float | None,
    prepared: Sequence[Mapping[str, Any]] = (),
) -> Tensor:
    """Hybrid CP degrees (`parallel.cp_placement.HybridPlacement`): attention over a local stream of
    segments, one per degree, largest first, ``segments[j] = (d, cu_local)`` with ``cu_local`` the host
    boundaries of this rank's rows of the segment's sequences (each sharded over its aligned sub-group of d
    ranks as `parallel.cp_shard.shard_thd` does; d = 1: whole sequences, attended locally). A degree-d
    segment runs ring or all-gather attention over ``groups[d]`` (this rank's aligned sub-group of that
    degree, `ParallelDims.build_cp_subgroups`; the whole CP group for d = cp) as rank ``cp_rank % d``.
    Every rank walks the degrees in the same order and the members of a sub-group share one placement,
    so they skip an empty segment together and no collective waits on a rank that is elsewhere.
    ``prepared[j]`` (`prepare_by_degree`, once per micro-batch): segment j's varlen ``meta`` (d = 1) or its
    ring/all-gather plan (`plan_cp`), so that no layer reads boundaries back from the device."""
    fn = ring_attention_thd if kind == "ring" else allgather_attention_thd

    def attend(j: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        d, cu = segments[j]
        extra = dict(prepared[j]) if prepared else {}
        if d == 1:
            meta = extra["meta"] if "meta" in extra else build_varlen_meta(cu, device=q_THD.device)
            return varlen_attention(q, k, v, meta, causal=True, scale=scale)
        cu_local = extra.pop("cu_local", None)
        if cu_local is None:
            cu_local = torch.tensor(cu, dtype=torch.int32, device=q_THD.device)
        group, rank = groups[d], cp_rank % d
        return fn(q, k, v, cu_local, group=group, cp_size=d, cp_rank=rank, scale=scale, causal=True, **extra)

    return run_by_segment(q_THD, k_TGD, v_TGD, segments, attend)


def run_by_segment(
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    segments: Sequence[tuple[int, Sequence[int]]],
    fn: Callable[[int, Tensor, Tensor, Tensor], Tensor],
) -> Tensor:
    """``fn(j, q, k, v)`` over the rows of each non-empty segment ``j`` of a local stream
    (``segments[j] = (d, cu_local)`` as in `attention_by_degree`), concatenated in stream order."""
    parts, start = [], 0
    for j, (_, cu) in enumerate(segments):
        rows = cu[-1] if cu else 0
        if rows == 0:
            continue
        end = start + rows
        parts.append(fn(j, q_THD[start:end], k_TGD[start:end], v_TGD[start:end]))
        start = end
    if start != q_THD.shape[0]:
        raise ValueError(f"the segments cover {start} rows, the local stream has {q_THD.shape[0]}")
    return torch.cat(parts)


def prepare_by_degree(
    segments: list[tuple[int, list[int]]], cp_rank: int, kind: str, device: torch.device
) -> list[dict[str, Any]]:
    """Per segment of `attention_by_degree`, what every layer needs from host integers, once: the whole
    part's varlen ``meta``; a split segment's local boundaries (``cu_local``) and ring/all-gather plan."""
    out: list[dict[str, Any]] = []
    for d, cu in segments:
        if not cu or cu[-1] == 0:
            out.append({})
        elif d == 1:
            out.append({"meta": build_varlen_meta(cu, device=device)})
        else:
            cu_local = torch.tensor(cu, dtype=torch.int32, device=device)
            out.append({"cu_local": cu_local, **plan_cp(kind, cu, d, cp_rank % d, device)})
    return out
