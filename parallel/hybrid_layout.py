"""Hybrid CP degrees in training (``parallel.cp_degrees=hybrid``): the `CPLayout` of
`parallel.cp_placement.place_hybrid`.

Letters: T local tokens, H query heads, G key/value heads, D head dim.

A sequence lives whole on one CP rank or is split over an aligned sub-group of degree d in 2, 4, ..., cp
(ranks ``[k·d, k·d + d)``). Rank r's local stream before sharding is one segment per degree, largest
first, whole sequences last (`HybridPlacement.segments`):

    [ degree-cp sequences | degree-cp/2 of r's sub-group | ... | degree-2 of r's pair | r's whole ones ]

`HybridCPLayout` differs from `parallel.cp_layout.DynamicCPLayout` in three decisions only:

- ``place``: `place_hybrid` (the plan's `HybridLocalPlacement.local_degrees` says each local sequence's
  degree; the split ones are the first `n_split`, as under dynamic CP);
- ``shard``: each degree-d segment cut into the load-balanced chunk pairs of `parallel.cp_shard` over its
  sub-group (`shard_by_degree`), the whole sequences kept;
- ``attention_context``: `HybridAttention`, attention per segment over the sub-group of its degree, the
  groups built once at mesh setup (`ParallelDims.build_cp_subgroups`): ring or all-gather for the
  reference backend (`attention_by_degree`), and for a backend with CP kernels of its own one call per
  segment (``HybridAttention.run``), see below.

Encoding follows the sub-groups too (`process_groups`: degree -> this rank's process group of that size):

- each clip is encoded on one rank of its sequence's sub-group (`parallel.cp_layout.ClipPlan.clip_owners`
  deals a split sequence's clips over that sub-group's ranks) and all-gathered to that sub-group only
  (`parallel.dist_encode.encode_placed`, one gather per degree, largest first);
- a long clip (`parallel.clip_placement`) is sharded over its sequence's sub-group: its contiguous slices,
  halo exchange, feature statistics, hand-over to the sequence's chunk pairs and CTC gather all run over
  those d ranks (`speechlm.model.cp_audio`); a whole sequence's long clip is sharded over the whole CP
  group and handed to its rank, as under dynamic CP;
- CTC-compressed audio gathers every clip to every CP rank as under dynamic CP (its sequences are placed
  only after the encoder).

A backend with CP kernels of its own (transformer-engine) calls ``HybridAttention.run``: each non-empty
degree-d segment is this rank's chunk pairs of sequences split over its sub-group ``[k·d, k·d + d)`` of
CP ranks (k = cp_rank // d) as rank ``cp_rank % d``, exactly the dual-chunk-swap THD layout over d ranks,
so the backend gets it with the segment's `parallel.cp_attention.CPSplit`: the sub-group, its global ranks
(those of CP ranks ``k·d .. k·d + d - 1``: the members `ParallelDims.cp_subgroup_ranks` gives it) and
the segment's *global* boundaries (local ones times d). The whole segment (d = 1) goes to its CP-free
call with its local boundaries. With d = cp the sub-group is the CP group itself.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby
from typing import Any

import torch
from torch import Tensor

from parallel.cp_attention import (
    CPSplit,
    SplitFn,
    WholeFn,
    attention_by_degree,
    prepare_by_degree,
    run_by_segment,
    split_over,
)
from parallel.cp_layout import CPPlan, DynamicCPLayout
from parallel.cp_placement import LocalPlacement, place_hybrid
from parallel.cp_shard import shard_by_degree
from parallel.varlen_meta import VarlenMeta, build_varlen_meta

__all__ = ["HybridAttention", "HybridCPLayout", "local_segments"]


def local_segments(degrees: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(d, lengths of its sequences)`` per degree segment of a local stream whose sequences have these
    degrees and lengths, in stream order. The degrees must not increase along the stream (each degree one
    segment, largest first: `HybridPlacement.segments`)."""
    if list(degrees) != sorted(degrees, reverse=True):
        raise ValueError(f"local degrees {list(degrees)} must not increase along the stream")
    if len(degrees) != len(lengths):
        raise ValueError(f"got {len(degrees)} degrees for {len(lengths)} sequences")
    pairs = list(zip(degrees, lengths))
    return [(int(d), [n for _, n in run]) for d, run in groupby(pairs, key=lambda p: p[0])]


class HybridAttention:
    """The `parallel.cp_attention.CPAttentionContext` of one micro-batch under hybrid degrees: the local
    stream's segments (``(d, host cu_local)`` each). The reference backend's ``attention`` runs
    `attention_by_degree`; a backend with CP kernels of its own calls ``run``, which hands it each
    non-empty split segment with the `CPSplit` of this rank's sub-group of that degree (``groups[d]``, its
    global ranks ``global_ranks[k·d : k·d + d]`` of the CP group's, this rank ``cp_rank % d`` in it) and
    the whole segment with its varlen boundaries."""

    def __init__(
        self,
        segments: list[tuple[int, list[int]]],
        groups: Mapping[int, Any],
        cp_size: int,
        cp_rank: int,
        kind: str,
        global_ranks: list[int],
        device: torch.device,
    ):
        if len(global_ranks) != cp_size:
            raise ValueError(f"a CP group of {cp_size} ranks has {len(global_ranks)} global ranks")
        self.segments, self.groups = segments, dict(groups)
        self.kind, self.cp_size, self.cp_rank = kind, cp_size, cp_rank
        self.group, self.global_ranks = self.groups.get(cp_size), list(global_ranks)
        self.device = device

    @functools.cached_property
    def prepared(self) -> list[dict[str, Any]]:
        """Built by the first layer, from host integers, for every layer (`prepare_by_degree`)."""
        return prepare_by_degree(self.segments, self.cp_rank, self.kind, self.device)

    def subgroup_ranks(self, d: int) -> list[int]:
        """The global ranks of this rank's aligned sub-group of degree ``d``: CP ranks ``[k·d, k·d + d)``
        with ``k = cp_rank // d``, the members `ParallelDims.cp_subgroup_ranks` gives that group."""
        lo = self.cp_rank // d * d
        return self.global_ranks[lo : lo + d]

    @functools.cached_property
    def parts(self) -> list[CPSplit | VarlenMeta | None]:
        """Per segment, built by the first layer from host integers: what ``run`` hands the backend (a
        split segment's `CPSplit`, the whole segment's boundaries; None for an empty segment)."""
        out: list[CPSplit | VarlenMeta | None] = []
        for d, cu in self.segments:
            if not cu or cu[-1] == 0:
                out.append(None)
            elif d == 1:
                out.append(build_varlen_meta(cu, device=self.device))
            else:
                ranks = self.subgroup_ranks(d)
                out.append(split_over(self.kind, self.groups[d], ranks, self.cp_rank % d, cu, self.device))
        return out

    def attention(
        self, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, cu_seqlens_local: Tensor, scale: float | None
    ) -> Tensor:
        return attention_by_degree(
            q_THD, k_TGD, v_TGD, self.segments, self.groups, self.cp_rank, self.kind, scale, self.prepared
        )

    def run(
        self, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, split_fn: SplitFn, whole_fn: WholeFn
    ) -> Tensor:
        """``split_fn(q, k, v, split)`` over each non-empty split segment's rows (its sub-group's
        `CPSplit`), ``whole_fn(q, k, v, meta)`` over the whole segment's, in the local stream's order.
        Every member of a sub-group holds the same segment, so they call together."""

        def call(j: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            part = self.parts[j]
            if isinstance(part, CPSplit):
                return split_fn(q, k, v, part)
            assert part is not None  # run_by_segment skips the empty segments
            return whole_fn(q, k, v, part)

        return run_by_segment(q_THD, k_TGD, v_TGD, self.segments, call)


@dataclass(frozen=True)
class HybridCPLayout(DynamicCPLayout):
    """cp > 1 with hybrid degrees (module docstring). ``subgroups``: this rank's aligned sub-group of each
    degree between 2 and cp/2 (`ParallelDims.build_cp_subgroups`); the degree-cp one is ``group``."""

    subgroups: Mapping[int, Any] = field(default_factory=dict)

    def for_planning(self) -> HybridCPLayout:
        """This layout without any process group (placement only, picklable: the data pipeline's)."""
        return replace(self, group=None, subgroups={})

    def place(self, seq_lens: Sequence[int]) -> LocalPlacement:
        placement = place_hybrid(
            seq_lens, self.cp_size, tp=self.tp, pair_cost=self.pair_cost, pad_to_multiple=self.pad_to_multiple
        )
        return placement.local(self.cp_rank)

    def process_groups(self) -> dict[int, Any]:
        """This rank's aligned sub-group of every degree, the whole CP group for degree cp: a split
        sequence's clips are gathered, and a long clip of it sharded, over its sequence's sub-group."""
        return {**self.subgroups, self.cp_size: self.group}

    def shard(
        self, tensors: Mapping[str, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: CPPlan
    ) -> tuple[dict[str, Tensor], Tensor, int]:
        segments = local_segments(plan.local_degrees, plan.padded_lengths)
        total = sum(sum(lengths) for _, lengths in segments)
        if int(cu_seqlens[-1]) != total:
            raise ValueError(f"the packed stream has {int(cu_seqlens[-1])} rows, the plan {total}")
        parts, local = shard_by_degree(tensors, segments, self.cp_rank)
        cu, longest = [0], 0
        for _, seg_cu in local:
            cu += [cu[-1] + c for c in seg_cu[1:]]
            longest = max([longest, *(b - a for a, b in zip(seg_cu, seg_cu[1:]))])
        return parts, torch.tensor(cu, dtype=torch.int32, device=cu_seqlens.device), longest

    def attention_context(
        self, meta: VarlenMeta, n_split: int, degrees: Sequence[int] = ()
    ) -> HybridAttention:
        cu = list(meta.cu_q)
        if len(degrees) != len(cu) - 1:
            raise ValueError(
                f"hybrid CP needs each local sequence's degree: got {len(degrees)} for {len(cu) - 1}"
            )
        segments, k = [], 0
        for d, lengths in local_segments(degrees, [b - a for a, b in zip(cu, cu[1:])]):
            segments.append((d, [c - cu[k] for c in cu[k : k + len(lengths) + 1]]))
            k += len(lengths)
        groups = {**self.subgroups, self.cp_size: self.group}
        ranks, device = self.cp_attention.global_ranks, meta.cu_seqlens_q.device
        return HybridAttention(segments, groups, self.cp_size, self.cp_rank, self.kind, ranks, device)
