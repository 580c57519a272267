"""transformer-engine backend: ``transformer_engine.pytorch.DotProductAttention`` with ``qkv_format="thd"``.

Letters: B batch, S padded length, T packed tokens, M real tokens of a padded batch, H query heads,
G key/value heads, D head dim.

One ``DotProductAttention`` per (heads, KV groups, head dim, scale, dropout) is cached outside the
model (it holds no parameters), configured with ``attn_mask_type="padding_causal"`` and GQA
(``num_gqa_groups=G``). THD streams use the given cu_seqlens; padded batches are unpadded first.
TE's THD output is ``[T, H * D]``. Install with ``pip install speechlm[te]``; set
``NVTE_FUSED_ATTN=0`` where the validator says so. The cached core's training mode follows the
calling module's (``module.training``; grad mode when called without a module).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from speechlm.model.attention.layouts import as_thd
from speechlm.model.attention.registry import BackendUnavailableError, attention_backend

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


@attention_backend("te")
def attend_te(
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
    te = _import_te()
    H, G, D = query_BHSD.shape[1], key_BGSD.shape[1], query_BHSD.shape[3]
    core = get_core_attention(te, heads=H, groups=G, head_dim=D, scale=scale, dropout=dropout)
    # TE picks its kernels by training mode too: follow the model, never the dropout rate (dropout=0
    # in inference mode would let TE choose backends that have no backward)
    core.train(bool(getattr(module, "training", torch.is_grad_enabled())))
    t = as_thd("te", query_BHSD, key_BGSD, value_BGSD, attention_mask, kwargs)
    out = core(
        t.q_THD.contiguous(),
        t.k_TGD.contiguous(),
        t.v_TGD.contiguous(),
        qkv_format="thd",
        attn_mask_type="padding_causal",
        cu_seqlens_q=t.cu_seqlens_q,
        cu_seqlens_kv=t.cu_seqlens_k,
        max_seqlen_q=t.max_seqlen_q,
        max_seqlen_kv=t.max_seqlen_k,
    )
    return t.restore(out.reshape(t.q_THD.shape[0], H, D))
