"""torch varlen backend: ``torch.nn.attention.varlen.varlen_attn`` (flash kernels, CUDA only), THD only.

Letters: T packed tokens, H query heads, G key/value heads, D head dim.

Causal masking is ``window_size=(-1, 0)``; GQA is native (``enable_gqa``). No dropout, no CP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from speechlm.model.attention.registry import (
    BackendUnavailableError,
    check_no_dropout,
    default_scale,
    match_dtypes,
    read_varlen_args,
    refuse_cp_context,
    to_thd,
)


def _import_varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise BackendUnavailableError(
            f"attention backend 'torch_varlen' needs torch.nn.attention.varlen (torch >= 2.9): {e}"
        ) from e
    return varlen_attn


def check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"attention backend 'torch_varlen' runs on CUDA only, got tensors on {device}; "
            "use the reference backend on CPU"
        )


def attend_torch_varlen(
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
    varlen = read_varlen_args(kwargs, query_BHSD.device)
    if varlen is None:
        raise ValueError(
            "torch_varlen has no padded (BSHD) path; pass cu_seq_lens_q/k (THD) or use sdpa/reference"
        )
    refuse_cp_context("torch_varlen", kwargs)
    check_no_dropout("torch_varlen", dropout)
    check_device(query_BHSD.device)
    varlen_attn = _import_varlen_attn()
    q_THD, k_TGD, v_TGD = to_thd(query_BHSD), to_thd(key_BGSD), to_thd(value_BGSD)
    out_THD = varlen_attn(
        q_THD.contiguous(),
        k_TGD.contiguous(),
        v_TGD.contiguous(),
        varlen.cu_seqlens_q,
        varlen.cu_seqlens_k,
        varlen.max_seqlen_q,
        varlen.max_seqlen_k,
        scale=default_scale(query_BHSD, scaling),
        window_size=(-1, 0),
        enable_gqa=q_THD.shape[1] != k_TGD.shape[1],
    )
    return out_THD.unsqueeze(0), None
