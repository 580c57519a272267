"""transformer-engine backend: ``transformer_engine.pytorch.DotProductAttention`` with ``qkv_format="thd"``.

Letters: B batch, S padded length, T packed tokens, M real tokens of a padded batch, H query heads,
G key/value heads, D head dim.

One ``DotProductAttention`` per (heads, KV groups, head dim, scale, dropout) is cached outside the
model (it holds no parameters), configured with ``attn_mask_type="padding_causal"`` and GQA
(``num_gqa_groups=G``). THD streams use the given cu_seqlens; padded batches are unpadded first.
TE's THD output is ``[T, H * D]``. Install with ``pip install speechlm[te]``; set
``NVTE_FUSED_ATTN=0`` where the validator says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from speechlm.model.attention.registry import (
    BackendUnavailableError,
    default_scale,
    gather_thd,
    match_dtypes,
    plan_unpad,
    read_varlen_args,
    refuse_cp_context,
    scatter_bshd,
    to_thd,
)

_CORES: dict[tuple[int, int, int, float, float], Any] = {}


def _import_te() -> Any:
    try:
        import transformer_engine.pytorch as te  # type: ignore[import-not-found]
    except ImportError as e:
        raise BackendUnavailableError(
            f"attention backend 'te' needs transformer-engine, which is not installed ({e}): "
            "run `pip install speechlm[te]` or choose another backend"
        ) from e
    return te


def get_core_attention(
    te: Any, *, heads: int, groups: int, head_dim: int, scale: float, dropout: float
) -> Any:
    key = (heads, groups, head_dim, float(scale), float(dropout))
    core = _CORES.get(key)
    if core is None:
        core = te.DotProductAttention(
            num_attention_heads=heads,
            kv_channels=head_dim,
            num_gqa_groups=groups,
            attention_dropout=dropout,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            softmax_scale=scale,
        )
        _CORES[key] = core
    return core


def attend_te(
    module: nn.Module,
    query_BHSD: Tensor,
    key_BGSD: Tensor,
    value_BGSD: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    query_BHSD, key_BGSD, value_BGSD = match_dtypes(query_BHSD, key_BGSD, value_BGSD)
    refuse_cp_context("te", kwargs)
    te = _import_te()
    H, G, D = query_BHSD.shape[1], key_BGSD.shape[1], query_BHSD.shape[3]
    core = get_core_attention(
        te, heads=H, groups=G, head_dim=D, scale=default_scale(query_BHSD, scaling), dropout=dropout
    )
    core.train(dropout > 0)
    varlen = read_varlen_args(kwargs, query_BHSD.device)
    if varlen is not None:
        q, k, v = to_thd(query_BHSD), to_thd(key_BGSD), to_thd(value_BGSD)
        cu_q, cu_k, max_q, max_k = (
            varlen.cu_seqlens_q,
            varlen.cu_seqlens_k,
            varlen.max_seqlen_q,
            varlen.max_seqlen_k,
        )
        plan = None
    else:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"te takes a [B, S] padding mask, got shape {tuple(attention_mask.shape)}")
        B, _, S, _ = query_BHSD.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.bool, device=query_BHSD.device)
        plan = plan_unpad(attention_mask)
        q, k, v = gather_thd(query_BHSD, plan), gather_thd(key_BGSD, plan), gather_thd(value_BGSD, plan)
        cu_q = cu_k = plan.cu_seqlens
        max_q = max_k = plan.max_seqlen
    out = core(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        qkv_format="thd",
        attn_mask_type="padding_causal",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_k,
    )
    out_THD = out.reshape(q.shape[0], H, D)
    if plan is not None:
        return scatter_bshd(out_THD, plan), None
    return out_THD.unsqueeze(0), None
