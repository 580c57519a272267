"""One ring step as a pure function: one varlen call covering every sequence of the pack.

Layout (parallel/cp_shard.py): every sequence of length L is cut into 2*cp chunks of c = L/(2cp)
tokens and CP rank r keeps chunks r and 2cp-1-r, so its local copy of a sequence is 2c tokens:
the "first half" (chunk r) then the "second half" (chunk 2cp-1-r). At ring step s rank r holds the
K/V of rank src = (r - s) mod cp. Under causal attention exactly one of three cases holds, for
*every* sequence at once, so one varlen call per step suffices:

- s == 0 (src == r): the local pair is causal on itself (chunk r precedes chunk 2cp-1-r): all local
  queries over all local keys, ``causal=True``, local cu_seqlens.
- src < r: chunk src precedes both local chunks and chunk 2cp-1-src follows both: all local
  queries over the *first half* of the received K/V, not causal.
- src > r: both received chunks precede chunk 2cp-1-r and follow chunk r: the *second half* of
  the local queries over all received K/V, not causal.

`plan_ring_step(local_cu, step, rank, cp)` turns (step, rank) into a `RingStepPlan`: the query
rows and the key rows to take (index tensors, or None for "all") and the `VarlenMeta` of the call.
It depends only on host integers, so a micro-batch computes all cp plans once and every layer reuses
them. `ring_step_fwd` / `ring_step_bwd` run one step on (local q, received K/V): no communication,
so all cp ranks can be simulated in one process (`simulate_ring_attention`, used by tests on CPU
and by the GPU kit) and the distributed ring only has to pass K/V (and dK/dV) around.

Dynamic CP hook: a sequence kept whole on one rank has only a step-0 block; a plan built from a
per-sequence "split" flag would keep such sequences out of the s > 0 calls (not done here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from parallel.attention_ops import merge_partials
from parallel.varlen import varlen_bwd, varlen_fwd
from parallel.varlen_meta import VarlenMeta, build_varlen_meta

__all__ = [
    "RingStepPlan",
    "check_local_boundaries",
    "plan_ring_step",
    "ring_step_fwd",
    "ring_step_bwd",
    "simulate_ring_attention",
]


@dataclass(frozen=True)
class RingStepPlan:
    q_rows: Tensor | None  # local query rows this step computes (None: all)
    k_rows: Tensor | None  # rows of the received K/V it reads (None: all)
    meta: VarlenMeta
    causal: bool


def check_local_boundaries(
    cu_seqlens_local: Tensor | Sequence[int], n_tokens: int | None = None
) -> list[int]:
    """The local boundaries as host integers, checked: from 0 to the local token count (`n_tokens`,
    when given), every local sequence two chunks of equal size (an even length)."""
    cu = [
        int(x)
        for x in (cu_seqlens_local.tolist() if isinstance(cu_seqlens_local, Tensor) else cu_seqlens_local)
    ]
    if not cu or cu[0] != 0 or (n_tokens is not None and cu[-1] != n_tokens):
        raise ValueError(
            f"local cu_seqlens must run from 0 to the number of local tokens ({n_tokens}), got {cu[:4]}...{cu[-2:]}"
        )
    odd = [(n, b - a) for n, (a, b) in enumerate(zip(cu, cu[1:], strict=False)) if b < a or (b - a) % 2]
    if odd:
        n, length = odd[0]
        raise ValueError(
            f"local sequence {n} has length {length} ({len(odd)} odd or negative in all): under CP every "
            "local sequence is two chunks of equal size, so its global length must be a multiple of 2*cp "
            "(pad with parallel.cp_shard's rounding before sharding)"
        )
    return cu


def boundaries(lengths: Sequence[int]) -> list[int]:
    """cu_seqlens of consecutive blocks of these lengths: [0, l0, l0 + l1, ...]."""
    return [0, *accumulate(lengths)]


def concat_ranges(starts: Sequence[int], lengths: Sequence[int], device: torch.device | str) -> Tensor:
    """[s0, s0+1, .., s0+l0-1, s1, ..]: the rows of several ranges, concatenated, without a Python loop."""
    lengths_N = torch.tensor(lengths, dtype=torch.long)
    total = int(lengths_N.sum())
    offsets_N = lengths_N.cumsum(0) - lengths_N
    base_T = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - offsets_N, lengths_N)
    return (torch.arange(total) + base_T).to(device)


def _halves(local_cu: Sequence[int], which: int, device: torch.device | str) -> tuple[Tensor, list[int]]:
    """Row indices and cu_seqlens of the first (0) or second (1) half of every local sequence."""
    halves = [(b - a) // 2 for a, b in zip(local_cu, local_cu[1:], strict=False)]
    starts = [a + which * h for a, h in zip(local_cu, halves, strict=False)]
    return concat_ranges(starts, halves, device), boundaries(halves)


def plan_ring_step(
    local_cu: Sequence[int],
    step: int,
    rank: int,
    cp: int,
    device: torch.device | str = "cpu",
    causal: bool = True,
) -> RingStepPlan:
    """The varlen call of ring step `step` on CP rank `rank` (a pure function of host integers).
    Without `causal` every step is all local queries over all received K/V."""
    if not 0 <= step < cp or not 0 <= rank < cp:
        raise ValueError(f"ring step {step} / rank {rank} out of range for cp={cp}")
    local_cu = check_local_boundaries(local_cu)
    src = (rank - step) % cp
    if not causal:
        return RingStepPlan(None, None, build_varlen_meta(local_cu, device=device), causal=False)
    if src == rank:
        return RingStepPlan(None, None, build_varlen_meta(local_cu, device=device), causal=True)
    if src < rank:
        k_rows, k_cu = _halves(local_cu, 0, device)
        meta = build_varlen_meta(local_cu, k_cu, device=device)
        return RingStepPlan(None, k_rows, meta, causal=False)
    q_rows, q_cu = _halves(local_cu, 1, device)
    meta = build_varlen_meta(q_cu, local_cu, device=device)
    return RingStepPlan(q_rows, None, meta, causal=False)


def _take(x: Tensor, rows: Tensor | None) -> Tensor:
    return x if rows is None else x.index_select(0, rows)


def ring_step_fwd(
    q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, plan: RingStepPlan, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """(out, lse_HT) of the plan's query rows over the received K/V: one varlen call."""
    return varlen_fwd(
        _take(q_THD, plan.q_rows),
        _take(k_TGD, plan.k_rows),
        _take(v_TGD, plan.k_rows),
        plan.meta,
        causal=plan.causal,
        scale=scale,
    )


def merge_step(
    out_THD: Tensor, lse_HT: Tensor, step_out: Tensor, step_lse: Tensor, plan: RingStepPlan
) -> tuple[Tensor, Tensor]:
    """Merge a step's partial result into the running (out, lse) of all local rows."""
    if plan.q_rows is None:
        o, lse = merge_partials(out_THD, lse_HT.T, step_out, step_lse.T)
        return o, lse.T
    o_rows, lse_rows = merge_partials(out_THD[plan.q_rows], lse_HT[:, plan.q_rows].T, step_out, step_lse.T)
    out_THD, lse_HT = out_THD.clone(), lse_HT.clone()
    out_THD[plan.q_rows] = o_rows
    lse_HT[:, plan.q_rows] = lse_rows.T
    return out_THD, lse_HT


def ring_step_bwd(
    dout_THD: Tensor,
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    out_THD: Tensor,
    lse_HT: Tensor,
    plan: RingStepPlan,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """This step's share of dq (all local rows) and dk, dv (all received rows), from the merged
    (out, lse): one varlen backward call."""
    sel = plan.q_rows
    dq_s, dk_s, dv_s = varlen_bwd(
        _take(dout_THD, sel),
        _take(q_THD, sel),
        _take(k_TGD, plan.k_rows),
        _take(v_TGD, plan.k_rows),
        _take(out_THD, sel),
        lse_HT if sel is None else lse_HT[:, sel],
        plan.meta,
        causal=plan.causal,
        scale=scale,
    )

    def scatter(full_like: Tensor, part: Tensor, rows: Tensor | None) -> Tensor:
        if rows is None:
            return part
        return torch.zeros_like(full_like).index_add_(0, rows, part)

    return scatter(q_THD, dq_s, sel), scatter(k_TGD, dk_s, plan.k_rows), scatter(v_TGD, dv_s, plan.k_rows)


def simulate_ring_attention(
    q_local: Sequence[Tensor],
    k_local: Sequence[Tensor],
    v_local: Sequence[Tensor],
    local_cu: Sequence[int],
    dout_local: Sequence[Tensor] | None = None,
    scale: float | None = None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """All cp ranks of causal ring attention in one process: per rank the outputs (and, with
    `dout_local`, the gradients (dq, dk, dv) each rank would hold after the backward ring)."""
    cp = len(q_local)
    plans = [[plan_ring_step(local_cu, s, r, cp, q_local[0].device) for s in range(cp)] for r in range(cp)]
    outs, lses = [], []
    for r in range(cp):
        T, H = q_local[r].shape[:2]
        out = q_local[r].new_zeros(T, H, v_local[r].shape[2])
        lse = torch.full((H, T), -torch.inf, dtype=torch.float32, device=q_local[r].device)
        for s in range(cp):
            src = (r - s) % cp
            o, l_ = ring_step_fwd(q_local[r], k_local[src], v_local[src], plans[r][s], scale)
            out, lse = merge_step(out, lse, o.to(out.dtype), l_, plans[r][s])
        outs.append(out)
        lses.append(lse)
    if dout_local is None:
        return outs, None
    dq = [torch.zeros_like(q) for q in q_local]
    dk = [torch.zeros_like(k) for k in k_local]
    dv = [torch.zeros_like(v) for v in v_local]
    for r in range(cp):
        for s in range(cp):
            src = (r - s) % cp
            gq, gk, gv = ring_step_bwd(
                dout_local[r], q_local[r], k_local[src], v_local[src], outs[r], lses[r], plans[r][s], scale
            )
            dq[r] += gq
            dk[src] += gk  # travels back to its owner with the dK/dV ring
            dv[src] += gv
    grads = [t for r in range(cp) for t in (dq[r], dk[r], dv[r])]
    return outs, grads
