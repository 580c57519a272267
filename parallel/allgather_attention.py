"""All-gather-KV context-parallel attention for packed (THD) sequences, on the varlen kernel interface.

Letters: T local tokens, G global tokens (= R*T), H query heads, K key/value heads, D head dim,
R CP ranks, r this rank, c a sequence's chunk size, g0 its global start.

Layout (``parallel.cp_shard``): every sequence of global length 2Rc is cut into 2R chunks and rank r
keeps chunk r then chunk 2R-1-r, so its local copy is 2c rows and local cu_seqlens = global / R.
Each rank all-gathers K and V (one stacked buffer); row s*T + i of the rank-major gather holds
global token ``cp_all_rank_indices_thd(cu_global)[s, i]``, and one inverse permutation (computed once
per micro-batch) puts the K/V of every sequence back in global order.

Causal attention. Local chunk k (k = r for the first half, k = 2R-1-r for the second) of a sequence
sees global keys [g0, g0 + (k+1)c): a causal rectangle aligned bottom-right, split into

    diagonal  chunk k x chunk k, square causal: these keys are the rank's OWN chunks, so all
              sequences' diagonals are one causal call over the local q/k/v with cu_seqlens at
              every half (no gathered K/V needed);
    prefix    chunk k x keys [g0, g0 + k*c), no mask: one non-causal call over every sequence's
              two halves; the keys of each (sequence, half) are gathered into one contiguous block
              (rows g0 .. g0 + k*c of the global K/V). With r = 0 the first half has no prefix and
              only the second halves' queries take part.

so a layer makes **two** calls into ``parallel.varlen`` forward and two backward, whatever the number
of utterances (one when cp = 1: the local pack is the whole pack). Without ``causal`` every local
query sees its whole sequence: one call over the global K/V in global order.
The calls and their row selections are a pure function of the local boundaries, rank and cp
(`plan_allgather`), built once per micro-batch from host integers and handed to every layer; each
call is a `parallel.ring_step.RingStepPlan` run by the same step functions the ring uses.

Backward. dq stays local. The diagonal's dK/dV are this rank's own rows. The prefix's dK/dV are
added, in fp32, into a gradient of the whole global K/V, which is permuted back to rank-major order
and reduce-scattered (sum), so each rank receives the gradient of its rows from every rank's queries.

Memory: the gathered K/V of all sequences (G rows) is kept for the backward, plus the prefix call's
gathered keys during a call ((2R-1)c rows per sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.collectives import all_gather_into as _all_gather
from parallel.collectives import reduce_scatter_into as _reduce_scatter
from parallel.cp_shard import cp_all_rank_indices_thd, cp_shard_indices_thd, inverse_permutation
from parallel.ring_attention import check_cp_inputs
from parallel.ring_step import (
    RingStepPlan,
    boundaries,
    check_local_boundaries,
    concat_ranges,
    merge_step,
    ring_step_bwd,
    ring_step_fwd,
)
from parallel.varlen_meta import build_varlen_meta

__all__ = ["allgather_attention_thd", "plan_allgather", "AllGatherPlan", "simulate_allgather_attention"]

LOCAL, GLOBAL = "local", "global"  # which K/V a call reads: this rank's own rows, or the gathered pack


@dataclass(frozen=True)
class AllGatherPlan:
    """The varlen calls of one layer on one rank, and the gather's permutation: built once per micro-batch."""

    perm_G: Tensor  # (R*T,) global index of each row of the rank-major gather
    inv_perm_G: Tensor  # (G,) rank-major row of each global index
    calls: tuple[tuple[str, RingStepPlan], ...]  # (LOCAL or GLOBAL, the call)


def plan_allgather(
    local_cu: Sequence[int],
    cp_size: int,
    cp_rank: int,
    causal: bool = True,
    device: torch.device | str = "cpu",
) -> AllGatherPlan:
    """All-gather attention's calls on rank `cp_rank` (a pure function of host integers; see the module
    docstring). `local_cu` are the local boundaries, every local length even (two chunks of c)."""
    local_cu = check_local_boundaries(local_cu)
    R, r = cp_size, cp_rank
    if not 0 <= r < R:
        raise ValueError(f"cp_rank must be in [0, {R}), got {r}")
    global_cu = [b * R for b in local_cu]
    perm_G = cp_all_rank_indices_thd(torch.tensor(global_cu, dtype=torch.long), R).flatten()
    inv_perm_G = inverse_permutation(perm_G)
    chunks = [(b - a) // 2 for a, b in zip(local_cu, local_cu[1:], strict=False)]
    if not causal:  # every local query over its whole sequence, keys in global order
        meta = build_varlen_meta(local_cu, global_cu, device=device)
        calls: tuple[tuple[str, RingStepPlan], ...] = ((GLOBAL, RingStepPlan(None, None, meta, False)),)
    elif R == 1:  # the local pack is the whole pack: one causal call
        calls = ((LOCAL, RingStepPlan(None, None, build_varlen_meta(local_cu, device=device), True)),)
    else:
        halves = [c for c in chunks for _ in (0, 1)]
        diagonal = RingStepPlan(None, None, build_varlen_meta(boundaries(halves), device=device), True)
        # prefix: (sequence, half) pairs whose prefix is not empty; half 0 of rank 0 has none
        q_starts, k_starts, q_lens, k_lens = [], [], [], []
        for n, c in enumerate(chunks):
            for half, chunk in ((0, r), (1, 2 * R - 1 - r)):
                if chunk == 0:
                    continue
                q_starts.append(local_cu[n] + half * c)
                q_lens.append(c)
                k_starts.append(global_cu[n])
                k_lens.append(chunk * c)
        q_rows = None if r > 0 else concat_ranges(q_starts, q_lens, device)
        k_rows = concat_ranges(k_starts, k_lens, device)
        meta = build_varlen_meta(boundaries(q_lens), boundaries(k_lens), device=device)
        calls = ((LOCAL, diagonal), (GLOBAL, RingStepPlan(q_rows, k_rows, meta, False)))
    return AllGatherPlan(perm_G.to(device), inv_perm_G.to(device), calls)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_local: Tensor,
        group: dist.ProcessGroup | None,
        cp_size: int,
        cp_rank: int,
        scale: float | None,
        causal: bool,
        plan: AllGatherPlan | None,
    ) -> Tensor:
        check_cp_inputs(q, k, v, group, cp_size, cp_rank)
        if plan is None:
            plan = plan_allgather(cu_seqlens_local.tolist(), cp_size, cp_rank, causal, q.device)
        kv_local = torch.stack([k, v])  # (2, T, K, D)
        if cp_size > 1:
            # concatenated (not stacked) output: the form every backend accepts
            gathered = kv_local.new_empty((cp_size * 2, *kv_local.shape[1:]))
            _all_gather(gathered, kv_local, group)
            kv_rank_major = (
                gathered.unflatten(0, (cp_size, 2)).transpose(0, 1).flatten(1, 2)
            )  # (2, R*T, K, D)
            kv_global = kv_rank_major.index_select(1, plan.inv_perm_G)
        else:
            kv_global = kv_local
        out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.full(q.shape[1::-1], float("-inf"), dtype=torch.float32, device=q.device)  # (H, T)
        for source, call in plan.calls:
            kv = kv_local if source == LOCAL else kv_global
            o, lse = ring_step_fwd(q, kv[0], kv[1], call, scale)  # one varlen call
            out_acc, lse_acc = merge_step(out_acc, lse_acc, o.float(), lse, call)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv_local, kv_global, out, lse_acc)
        ctx.plan, ctx.group, ctx.cp_size, ctx.scale = plan, group, cp_size, scale
        ctx.k_dtype, ctx.v_dtype = k.dtype, v.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, kv_local, kv_global, out, lse = ctx.saved_tensors
        plan: AllGatherPlan = ctx.plan
        grad_out = grad_out.contiguous()
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = {
            LOCAL: torch.zeros(kv_local.shape, dtype=torch.float32, device=q.device),
            GLOBAL: torch.zeros(kv_global.shape, dtype=torch.float32, device=q.device),
        }
        for source, call in plan.calls:
            kv = kv_local if source == LOCAL else kv_global
            dq_s, dk_s, dv_s = ring_step_bwd(grad_out, q, kv[0], kv[1], out, lse, call, ctx.scale)
            dq_acc += dq_s.float()
            dkv[source][0] += dk_s.float()
            dkv[source][1] += dv_s.float()
        cp_size, n_local = ctx.cp_size, q.shape[0]
        dkv_local = dkv[LOCAL]
        if cp_size > 1:
            # global order -> rank-major (R, 2, T, K, D), then sum every rank's share into its owner
            dkv_rank_major = dkv[GLOBAL].index_select(1, plan.perm_G).unflatten(1, (cp_size, n_local))
            received = torch.empty_like(dkv_local)
            _reduce_scatter(received, dkv_rank_major.transpose(0, 1).flatten(0, 1).contiguous(), ctx.group)
            dkv_local = dkv_local + received
        else:
            dkv_local = dkv_local + dkv[GLOBAL]
        return (
            dq_acc.to(q.dtype), dkv_local[0].to(ctx.k_dtype), dkv_local[1].to(ctx.v_dtype),
            None, None, None, None, None, None, None,
        )  # fmt: skip


def allgather_attention_thd(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    cu_seqlens_local: Tensor,
    *,
    group: dist.ProcessGroup | None,
    cp_size: int,
    cp_rank: int,
    scale: float | None,
    causal: bool = True,
    plan: AllGatherPlan | None = None,
) -> Tensor:
    """Same contract as :func:`parallel.ring_attention.ring_attention_thd`, via all-gather of K/V.

    q_THD [T, H, D], k_THD/v_THD [T, K, D] in the ``cp_shard`` layout, local cu_seqlens.
    Returns out_THD [T, H, D] in q's dtype (fp32 accumulation); differentiable. ``plan``
    (`plan_allgather` on host integers, once per micro-batch) spares every layer reading
    ``cu_seqlens_local`` back from the device; it must have been built with the same ``causal``.
    """
    return _AllGatherAttention.apply(
        q_THD, k_THD, v_THD, cu_seqlens_local, group, cp_size, cp_rank, scale, causal, plan
    )


def simulate_allgather_attention(
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    cu_seqlens: Sequence[int],
    cp_size: int,
    dout_THD: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """Causal all-gather attention of a whole pack with every CP rank run in turn in one process (no
    communication: a rank's gathered K/V is the pack's K/V in global order). ``cu_seqlens`` are the
    global boundaries, each length a multiple of 2*cp. Returns the output and, with ``dout_THD``, the
    gradients (dq, dk, dv), in global order: what the ranks would hold after the backward's
    reduce-scatter, put back together. Used by the CPU tests and the one-GPU kit."""
    cu_t = torch.tensor(list(cu_seqlens), dtype=torch.long)
    local_cu = [c // cp_size for c in cu_seqlens]
    out = torch.zeros(q_THD.shape, dtype=torch.float32, device=q_THD.device)
    grads = (
        None
        if dout_THD is None
        else [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q_THD, k_TGD, v_TGD)]
    )
    for r in range(cp_size):
        plan = plan_allgather(local_cu, cp_size, r, True, q_THD.device)
        rows = cp_shard_indices_thd(cu_t, cp_size, r).to(q_THD.device)
        q, k, v = (x.index_select(0, rows) for x in (q_THD, k_TGD, v_TGD))
        sources = {LOCAL: (k, v), GLOBAL: (k_TGD, v_TGD)}
        o_r = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_r = torch.full(q.shape[1::-1], float("-inf"), dtype=torch.float32, device=q.device)
        for source, call in plan.calls:
            o, lse = ring_step_fwd(q, *sources[source], call, scale)
            o_r, lse_r = merge_step(o_r, lse_r, o.float(), lse, call)
        out[rows] = o_r
        if grads is None or dout_THD is None:
            continue
        o_q, dout = o_r.to(q.dtype), dout_THD.index_select(0, rows)
        for source, call in plan.calls:
            dq, dk, dv = ring_step_bwd(dout, q, *sources[source], o_q, lse_r, call, scale)
            grads[0].index_add_(0, rows, dq.float())
            for g, d in ((grads[1], dk), (grads[2], dv)):
                if source == LOCAL:
                    g.index_add_(0, rows, d.float())
                else:
                    g += d.float()
    result = out.to(q_THD.dtype)
    if grads is None:
        return result, None
    return result, (grads[0].to(q_THD.dtype), grads[1].to(k_TGD.dtype), grads[2].to(v_TGD.dtype))
