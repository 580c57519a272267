"""All-gather-KV context-parallel attention for packed (THD) sequences.

Letters: T local tokens, G global tokens (= R*T), H heads (Hq, Hkv), D head dim, R CP ranks,
c chunk size, n sequences of one chunk size.

Forward. Each rank all-gathers K and V (one stacked buffer) from the CP group. The gather is
rank-major: row r*T + i holds global token ``cp_all_rank_indices_thd(cu_global)[r, i]``, so one
inverse permutation puts the K/V of every sequence back in global order (cu_global = R * local).
The local queries then attend to the global K/V of their own sequence. A local chunk k (k = r
for the first local chunk, k = 2R-1-r for the second) of a sequence starting at global row g0
sees global keys [g0, g0 + (k+1)c): a causal rectangle aligned bottom-right, computed as two
blocks merged with their log-sum-exp:

    prefix    chunk-k queries x keys [g0, g0 + k*c), no mask (skipped when k = 0)
    diagonal  chunk-k queries x keys [g0 + k*c, g0 + (k+1)*c), square causal

Without ``causal`` each local query sees the whole sequence.

Backward. dq stays local; dK/dV are accumulated in fp32 for the whole gathered K/V, permuted
back to rank-major order and reduce-scattered (sum), so each rank receives the gradient of its
own rows from every rank's queries.

Memory: the gathered K/V of all sequences (G rows) is kept for the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.attention_ops import IndexBlock, block_attn_bwd_, block_attn_fwd_
from parallel.collectives import all_gather_into as _all_gather
from parallel.collectives import reduce_scatter_into as _reduce_scatter
from parallel.cp_shard import cp_all_rank_indices_thd, inverse_permutation
from parallel.ring_attention import check_cp_inputs, local_chunk_groups

__all__ = ["allgather_attention_thd"]


def _allgather_blocks(
    groups: list[tuple[int, Tensor]], cp_size: int, cp_rank: int, causal: bool
) -> list[IndexBlock]:
    """Blocks pairing local query rows with global K/V rows (see the module docstring)."""
    blocks = []
    for c, starts in groups:
        ar = torch.arange(c, device=starts.device)
        g0 = starts * cp_size  # global start of each sequence (local start * R)
        if not causal:
            q_BL = starts[:, None] + torch.arange(2 * c, device=starts.device)
            k_BL = g0[:, None] + torch.arange(2 * c * cp_size, device=starts.device)
            blocks.append(IndexBlock(q_BL, k_BL, False))
            continue
        for half, chunk in ((0, cp_rank), (1, 2 * cp_size - 1 - cp_rank)):
            q_BL = starts[:, None] + half * c + ar
            if chunk > 0:
                prefix_BL = g0[:, None] + torch.arange(chunk * c, device=starts.device)
                blocks.append(IndexBlock(q_BL, prefix_BL, False))
            blocks.append(IndexBlock(q_BL, g0[:, None] + chunk * c + ar, True))
    return blocks


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
        host_cu: list[int] | None,
    ) -> Tensor:
        check_cp_inputs(q, k, v, group, cp_size, cp_rank)
        n_local = q.shape[0]
        groups = local_chunk_groups(cu_seqlens_local if host_cu is None else host_cu, n_local, q.device)
        blocks = _allgather_blocks(groups, cp_size, cp_rank, causal)
        kv_local = torch.stack([k, v])  # (2, T, Hkv, D)
        if cp_size > 1:
            # concatenated (not stacked) output: the form every backend accepts
            gathered = kv_local.new_empty((cp_size * 2, *kv_local.shape[1:]))
            _all_gather(gathered, kv_local, group)
            gathered = gathered.unflatten(0, (cp_size, 2))
        else:
            gathered = kv_local.unsqueeze(0)
        # rank-major rows -> global order
        perm_G = cp_all_rank_indices_thd(cu_seqlens_local.long() * cp_size, cp_size).flatten().to(q.device)
        kv_rank_major = gathered.transpose(0, 1).flatten(1, 2)  # (2, R*T, Hkv, D)
        kv_global = kv_rank_major.index_select(1, inverse_permutation(perm_G))
        out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for block in blocks:
            block_attn_fwd_(q, kv_global[0], kv_global[1], block, out_acc, lse_acc, scale=scale)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, kv_global, out, lse_acc, perm_G)
        ctx.blocks, ctx.group, ctx.cp_size, ctx.scale = blocks, group, cp_size, scale
        ctx.k_dtype, ctx.v_dtype = k.dtype, v.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, kv_global, out, lse, perm_G = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_global = torch.zeros(kv_global.shape, dtype=torch.float32, device=q.device)
        for block in ctx.blocks:
            block_attn_bwd_(
                grad_out, q, kv_global[0], kv_global[1], out, lse, block,
                dq_acc, dkv_global[0], dkv_global[1], scale=ctx.scale,
            )  # fmt: skip
        cp_size, n_local = ctx.cp_size, q.shape[0]
        # global order -> rank-major (R, 2, T, Hkv, D), then sum every rank's share into its owner
        dkv_rank_major = dkv_global.index_select(1, perm_G).unflatten(1, (cp_size, n_local)).transpose(0, 1)
        if cp_size > 1:
            dkv_local = dkv_global.new_empty(dkv_rank_major.shape[1:])
            _reduce_scatter(dkv_local, dkv_rank_major.flatten(0, 1).contiguous(), ctx.group)
        else:
            dkv_local = dkv_rank_major[0]
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
    host_cu: list[int] | None = None,
) -> Tensor:
    """Same contract as :func:`parallel.ring_attention.ring_attention_thd`, via all-gather of K/V.

    q_THD [T, Hq, D], k_THD/v_THD [T, Hkv, D] in the ``cp_shard`` layout, local cu_seqlens.
    Returns out_THD [T, Hq, D] in q's dtype (fp32 accumulation); differentiable. ``host_cu``, the
    local boundaries as host integers (read once per micro-batch), spares a device sync per layer.
    """
    return _AllGatherAttention.apply(
        q_THD, k_THD, v_THD, cu_seqlens_local, group, cp_size, cp_rank, scale, causal, host_cu
    )
