"""FlexAttention backend: a document-causal block mask built from cu_seqlens (THD), or padding-causal (BSHD).

Letters: B batch, H query heads, G key/value heads, T packed tokens, S padded length, D head dim.

THD: token ``t`` belongs to document ``doc_T[t]`` (from cu_seqlens); ``q`` may see ``kv`` iff both
are in the same document and ``kv <= q``. Block masks are cached per (device, T, cu_seqlens), since
every layer of a forward pass asks for the same one. BSHD: ``kv <= q`` and ``kv`` is a real token
(rebuilt per call; padded rows differ between batches).

On CUDA the kernel is compiled once with dynamic shapes (``torch.compile(flex_attention,
dynamic=True)``): every micro-batch has another packed length, and a static compile recompiles for
each new length until dynamo's limit (8), after which flex silently falls back to an unfused kernel
that materialises the T x T scores (measured on an H100, docs/benchmarks.md). Block masks are built
compiled on CUDA (``create_block_mask(..., _compile=True)``), so no dense T x T mask is materialised
either; the padded (BSHD) mask is built once per forward pass (every layer passes the same mask
tensor) instead of once per layer. On CPU eager flex runs forward only (no backward), so it is a GPU
backend (see ``parallel.backend_caps``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from speechlm.model.attention.layouts import read_varlen_args
from speechlm.model.attention.registry import attention_backend

_MASK_CACHE: OrderedDict[tuple[str, int, tuple[int, ...]], Any] = OrderedDict()
_MASK_CACHE_SIZE = 16
_COMPILED: dict[str, Any] = {}


def build_document_block_mask(cu_seqlens: Tensor, total: int, device: torch.device) -> Any:
    """Block mask for causal attention inside each ``[cu[i], cu[i+1])`` of a ``total``-token stream."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    doc_T = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1])

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc_T[q_idx] == doc_T[kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(
        document_causal, None, None, total, total, device=device, _compile=device.type == "cuda"
    )


def get_document_block_mask(cu_seqlens: Tensor, total: int, device: torch.device) -> Any:
    key = (str(device), total, tuple(int(x) for x in cu_seqlens.tolist()))
    mask = _MASK_CACHE.get(key)
    if mask is None:
        mask = build_document_block_mask(cu_seqlens, total, device)
        _MASK_CACHE[key] = mask
        while len(_MASK_CACHE) > _MASK_CACHE_SIZE:
            _MASK_CACHE.popitem(last=False)
    else:
        _MASK_CACHE.move_to_end(key)
    return mask


def build_padding_block_mask(padding_mask_BS: Tensor) -> Any:

    valid_BS = padding_mask_BS.to(torch.bool)
    B, S = valid_BS.shape

    def padding_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (valid_BS[b, kv_idx] | (kv_idx == q_idx))

    cuda = valid_BS.device.type == "cuda"
    return create_block_mask(padding_causal, B, None, S, S, device=valid_BS.device, _compile=cuda)


_LAST_PADDING_MASK: list[tuple[Tensor, int, Any]] = []  # (mask tensor, its version, block mask)


def get_padding_block_mask(padding_mask_BS: Tensor) -> Any:
    """The block mask of this padding mask, reused while every layer of a forward passes the same tensor."""
    if _LAST_PADDING_MASK:
        mask, version, block = _LAST_PADDING_MASK[0]
        if mask is padding_mask_BS and version == padding_mask_BS._version:
            return block
    block = build_padding_block_mask(padding_mask_BS)
    _LAST_PADDING_MASK[:] = [(padding_mask_BS, padding_mask_BS._version, block)]
    return block


def _flex_fn(device: torch.device) -> Any:

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["cuda"]


@attention_backend("flex", has_dropout=False)
def attend_flex(
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
    device = query_BHSD.device
    varlen = read_varlen_args(kwargs, device)
    if varlen is not None:
        if query_BHSD.shape[0] != 1:
            raise ValueError(f"THD attention needs batch size 1, got q of shape {tuple(query_BHSD.shape)}")
        if not torch.equal(varlen.cu_seqlens_q, varlen.cu_seqlens_k):
            raise ValueError("flex THD attention is self-attention: cu_seq_lens_q must equal cu_seq_lens_k")
        block_mask = get_document_block_mask(varlen.cu_seqlens_q, query_BHSD.shape[2], device)
    else:
        B, _, S, _ = query_BHSD.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.bool, device=device)
        if attention_mask.dim() != 2:
            raise ValueError(f"flex takes a [B, S] padding mask, got shape {tuple(attention_mask.shape)}")
        block_mask = get_padding_block_mask(attention_mask)
    out_BHSD = _flex_fn(device)(
        query_BHSD,
        key_BGSD,
        value_BGSD,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=query_BHSD.shape[1] != key_BGSD.shape[1],
    )
    return out_BHSD.transpose(1, 2), None
