"""flash-attn backend: ``flash_attn.flash_attn_varlen_func`` for THD, and for BSHD after unpadding.

Letters: B batch, S padded length, T packed tokens, M real tokens of a padded batch, H query heads,
G key/value heads, D head dim.

GQA is native in flash-attn (G divides H). Padded batches are unpadded to a THD stream with
cu_seqlens from the padding mask and scattered back (zeros at padding). fp16/bf16 inputs on CUDA.
Install with ``pip install speechlm[flash]``.
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


def _import_flash_attn() -> Any:
    try:
        import flash_attn  # type: ignore[import-not-found]
    except ImportError as e:
        raise BackendUnavailableError(
            f"attention backend 'flash' needs flash-attn, which is not installed ({e}): "
            "run `pip install speechlm[flash]` or choose another backend"
        ) from e
    return flash_attn


def attend_flash(
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
    refuse_cp_context("flash", kwargs)
    flash_attn = _import_flash_attn()
    scale = default_scale(query_BHSD, scaling)
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
            raise ValueError(f"flash takes a [B, S] padding mask, got shape {tuple(attention_mask.shape)}")
        B, _, S, _ = query_BHSD.shape
        if attention_mask is None:
            attention_mask = query_BHSD.new_ones(B, S, dtype=torch.bool)
        plan = plan_unpad(attention_mask)
        q, k, v = gather_thd(query_BHSD, plan), gather_thd(key_BGSD, plan), gather_thd(value_BGSD, plan)
        cu_q = cu_k = plan.cu_seqlens
        max_q = max_k = plan.max_seqlen
    out_THD = flash_attn.flash_attn_varlen_func(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )
    if plan is not None:
        return scatter_bshd(out_THD, plan), None
    return out_THD.unsqueeze(0), None
