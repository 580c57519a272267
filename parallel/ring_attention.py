"""Ring attention over context-parallel ranks for packed (THD) sequences, load-balanced causal.

Letters: T local tokens, H heads (Hq, Hkv), D head dim, N sequences, R CP ranks, c chunk size.

Layout (see ``parallel.cp_shard``): every rank r holds, for every sequence, chunk r followed by
chunk 2R-1-r (c tokens each); all ranks share the same local ``cu_seqlens`` (= global / R), so
row i of a K/V block that arrives from rank s belongs to the same sequence and local offset as
row i here, only the chunk ids differ (s and 2R-1-s).

Forward. K/V (stacked into one buffer) travel around the ring: at step j the rank holds the
block that originated at s = (r - j) mod R, sends it on to r+1 and receives the next one from
r-1 while it computes. With the causal mask each step is half a block of work:

    s == r   queries [r, 2R-1-r] x keys [r, 2R-1-r], causal. This is right because chunk r
             precedes chunk 2R-1-r globally: chunk-r queries see chunk r causally and nothing of
             the later chunk; chunk-(2R-1-r) queries see chunk r fully and their own causally,
             which is exactly a causal mask over the 2c local rows.
    s <  r   all local queries x the first half (chunk s) of the block, no mask: chunk s
             precedes both local chunks; chunk 2R-1-s follows both (2R-1-s > 2R-1-r > r).
    s >  r   the second half of the queries (chunk 2R-1-r) x the whole block, no mask: both
             s and 2R-1-s precede 2R-1-r; neither precedes chunk r (s > r, 2R-1-s >= R > r).

Each step is ONE call into the varlen kernel interface (``parallel.varlen``) covering every
sequence of the pack: the row selections and cu_seqlens of the three cases above are a pure
function of (local cu_seqlens, step, rank) (``parallel.ring_step.plan_ring_step``), built once per
call for all steps; the backward makes one varlen backward call per step too. Partials are
merged in fp32 with their log-sum-exp. Without ``causal`` every step is all queries x all keys.

Backward. dq stays local. The K/V blocks go around the ring again in the same order, and with
each block travels an fp32 accumulator of its dK/dV: at step j the rank adds its share for block
s (``attn_bwd`` with the final merged out/lse) to the accumulator it received, and passes it on
at step j+1; after step R-1 one last hop delivers each accumulator to its owner.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.ring_step import (
    RingStepPlan,
    check_local_boundaries,
    merge_step,
    plan_ring_step,
    ring_step_bwd,
    ring_step_fwd,
)

__all__ = ["ring_attention_thd", "check_local_boundaries", "check_cp_group", "plan_ring"]

_TAG_KV = 11
_TAG_DKV = 12


def check_cp_group(group: dist.ProcessGroup | None, cp_size: int, cp_rank: int) -> None:
    """Check that (cp_size, cp_rank) match ``group`` when a process group is in use."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if cp_size == 1:
        return
    if not dist.is_initialized():
        raise RuntimeError(f"cp_size={cp_size} needs an initialised process group")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (cp_size, cp_rank):
        raise ValueError(f"cp_size/cp_rank ({cp_size}, {cp_rank}) do not match the group ({size}, {rank})")


def check_cp_inputs(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, cp_size: int, cp_rank: int
) -> None:
    """The checks both CP attention functions start with: the group, and k/v shaped (T, Hkv, D) like q."""
    check_cp_group(group, cp_size, cp_rank)
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must be (T, Hkv, D) like q's T; got {tuple(k.shape)}, {tuple(v.shape)}")


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _ring_exchange(
    pairs: list[tuple[Tensor, Tensor, int]], group: dist.ProcessGroup | None, cp_size: int, cp_rank: int
) -> list[Any]:
    """Post (send to r+1, receive from r-1) for each (send, recv, tag); returns the works.

    Every rank posts the same list in the same order, so sends and receives match in order
    (NCCL ignores tags; gloo matches on them).
    """
    if not pairs:
        return []
    nxt = _global_rank(group, (cp_rank + 1) % cp_size)
    prv = _global_rank(group, (cp_rank - 1) % cp_size)
    ops = []
    for send, recv, tag in pairs:
        ops.append(dist.P2POp(dist.isend, send, nxt, group, tag))
        ops.append(dist.P2POp(dist.irecv, recv, prv, group, tag))
    return dist.batch_isend_irecv(ops)


def plan_ring(
    cu_seqlens_local: Tensor | Sequence[int],
    n_tokens: int,
    cp_size: int,
    cp_rank: int,
    causal: bool,
    device: torch.device | None = None,
) -> list[RingStepPlan]:
    """The cp step plans of this rank (parallel/ring_step.py), from the local boundaries read once.

    Give the boundaries as host integers (and the device) to plan without a device sync: a caller
    that plans once per micro-batch passes the plans to every layer (`ring_attention_thd(plans=)`)."""
    if isinstance(cu_seqlens_local, Tensor) and device is None:
        device = cu_seqlens_local.device
    cu = check_local_boundaries(cu_seqlens_local, n_tokens)
    return [plan_ring_step(cu, s, cp_rank, cp_size, device or "cpu", causal=causal) for s in range(cp_size)]


class _RingAttention(torch.autograd.Function):
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
        plans: list[RingStepPlan] | None,
    ) -> Tensor:
        check_cp_inputs(q, k, v, group, cp_size, cp_rank)
        if plans is None:
            plans = plan_ring(cu_seqlens_local, q.shape[0], cp_size, cp_rank, causal)
        out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.full(q.shape[1::-1], float("-inf"), dtype=torch.float32, device=q.device)  # (H, T)
        kv = torch.stack([k, v])  # one buffer: one message per hop
        for step in range(cp_size):
            nxt_kv = torch.empty_like(kv) if step < cp_size - 1 else None
            works = _ring_exchange(
                [(kv, nxt_kv, _TAG_KV)] if nxt_kv is not None else [], group, cp_size, cp_rank
            )
            o, lse = ring_step_fwd(q, kv[0], kv[1], plans[step], scale)  # one varlen call per step
            out_acc, lse_acc = merge_step(out_acc, lse_acc, o.float(), lse, plans[step])
            for w in works:
                w.wait()
            if nxt_kv is not None:
                kv = nxt_kv
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.plans, ctx.group, ctx.cp_size, ctx.cp_rank = plans, group, cp_size, cp_rank
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, cp_size, cp_rank = ctx.group, ctx.cp_size, ctx.cp_rank
        grad_out = grad_out.contiguous()
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_acc: Tensor | None = None  # fp32 dK/dV of the block held at the previous step
        for step in range(cp_size):
            pairs: list[tuple[Tensor, Tensor, int]] = []
            dkv_in = None
            if dkv_acc is not None:  # pass the previous block's accumulator on with its block
                dkv_in = torch.empty_like(dkv_acc)
                pairs.append((dkv_acc, dkv_in, _TAG_DKV))
            nxt_kv = None
            if step < cp_size - 1:
                nxt_kv = torch.empty_like(kv)
                pairs.append((kv, nxt_kv, _TAG_KV))
            works = _ring_exchange(pairs, group, cp_size, cp_rank)
            dkv_part = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            dq_s, dk_s, dv_s = ring_step_bwd(grad_out, q, kv[0], kv[1], out, lse, ctx.plans[step], ctx.scale)
            dq_acc += dq_s.float()
            dkv_part[0] += dk_s.float()
            dkv_part[1] += dv_s.float()
            for w in works:
                w.wait()
            dkv_acc = dkv_part if dkv_in is None else dkv_in + dkv_part
            if nxt_kv is not None:
                kv = nxt_kv
        assert dkv_acc is not None
        if cp_size > 1:  # the last hop: every accumulator goes home
            own = torch.empty_like(dkv_acc)
            for w in _ring_exchange([(dkv_acc, own, _TAG_DKV)], group, cp_size, cp_rank):
                w.wait()
            dkv_acc = own
        dq = dq_acc.to(q.dtype)
        return dq, dkv_acc[0].to(k.dtype), dkv_acc[1].to(v.dtype), None, None, None, None, None, None, None


def ring_attention_thd(
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
    plans: list[RingStepPlan] | None = None,
) -> Tensor:
    """Packed attention of this rank's load-balanced shard against all ranks' K/V (differentiable).

    q_THD [T, Hq, D], k_THD/v_THD [T, Hkv, D] (Hq a multiple of Hkv) are this rank's rows in the
    ``cp_shard`` layout, ``cu_seqlens_local`` the local cu_seqlens (global // cp, every local
    length even). ``group`` is the CP process group (None: the default group); every rank of it
    must call with the same cu_seqlens. With cp_size == 1 no communication happens. Returns
    out_THD [T, Hq, D] in q's dtype; accumulation is fp32. ``plans`` (`plan_ring` on host integers,
    once per micro-batch) spares every layer reading ``cu_seqlens_local`` back from the device.
    """
    return _RingAttention.apply(
        q_THD, k_THD, v_THD, cu_seqlens_local, group, cp_size, cp_rank, scale, causal, plans
    )
