"""torch varlen backend: ``torch.nn.attention.varlen.varlen_attn`` (flash kernels, CUDA only), THD only.

Letters: T packed tokens, H query heads, G key/value heads, D head dim.

Causal masking is ``window_size=(-1, 0)``. No dropout, no CP.

The signature moved between torch releases: 2.10 and 2.11 have ``varlen_attn(q, k, v, cu_seq_q,
cu_seq_k, max_q, max_k, *, return_aux, scale, window_size)`` with no GQA support, 2.13 added
``enable_gqa`` (and more). `varlen_call_kwargs` inspects the installed function once and passes
only what it accepts; where ``enable_gqa`` is missing, K/V heads are repeated to the query heads
(the gradients flow back through the repeat and are summed per K/V head).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from speechlm.model.attention.layouts import read_varlen_args, to_thd
from speechlm.model.attention.registry import BackendUnavailableError, attention_backend


def _import_varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn  # lazy: torch >= 2.9 only
    except ImportError as e:
        raise BackendUnavailableError(
            f"attention backend 'torch_varlen' needs torch.nn.attention.varlen (torch >= 2.9): {e}"
        ) from e
    return varlen_attn


@functools.cache
def accepted_keywords(fn: Any) -> frozenset[str]:
    """Keyword names `fn` accepts (inspected once per function object)."""
    return frozenset(inspect.signature(fn).parameters)


def varlen_call_kwargs(
    fn: Any, *, scale: float, n_heads: int, n_kv_heads: int
) -> tuple[dict[str, Any], bool]:
    """(keywords for this torch's varlen_attn, whether K/V must be repeated to the query heads)."""
    kw: dict[str, Any] = {"scale": scale, "window_size": (-1, 0)}
    gqa = n_heads != n_kv_heads
    if "enable_gqa" in accepted_keywords(fn):
        kw["enable_gqa"] = gqa
        return kw, False
    return kw, gqa


def check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"attention backend 'torch_varlen' runs on CUDA only, got tensors on {device}; "
            "use the reference backend on CPU"
        )


@attention_backend("torch_varlen", has_dropout=False)
def attend_torch_varlen(
    module: nn.Module,
    query_BHSD: Tensor,
    key_BGSD: Tensor,
    value_BGSD: Tensor,
    attention_mask: Tensor | None,
    *,
    scale: float,
    dropout: float,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    varlen = read_varlen_args(kwargs, query_BHSD.device)
    if varlen is None:
        raise ValueError(
            "torch_varlen has no padded (BSHD) path; pass cu_seq_lens_q/k (THD) or use sdpa/reference"
        )
    check_device(query_BHSD.device)
    varlen_attn = _import_varlen_attn()
    q_THD, k_TGD, v_TGD = to_thd(query_BHSD), to_thd(key_BGSD), to_thd(value_BGSD)
    kw, repeat_kv = varlen_call_kwargs(
        varlen_attn,
        scale=scale,
        n_heads=q_THD.shape[1],
        n_kv_heads=k_TGD.shape[1],
    )
    if repeat_kv:  # this torch has no enable_gqa: K/V head g serves query heads g*rep .. g*rep+rep-1
        rep = q_THD.shape[1] // k_TGD.shape[1]
        k_TGD, v_TGD = k_TGD.repeat_interleave(rep, dim=1), v_TGD.repeat_interleave(rep, dim=1)
    out_THD = varlen_attn(
        q_THD.contiguous(),
        k_TGD.contiguous(),
        v_TGD.contiguous(),
        varlen.cu_seqlens_q,
        varlen.cu_seqlens_k,
        varlen.max_seqlen_q,
        varlen.max_seqlen_k,
        **kw,
    )
    return out_THD.unsqueeze(0), None
