"""flash-attn backend: ``flash_attn.flash_attn_varlen_func`` for THD, and for BSHD after unpadding.

Letters: B batch, S padded length, T packed tokens, M real tokens of a padded batch, H query heads,
G key/value heads, D head dim.

GQA is native in flash-attn (G divides H). Padded batches are unpadded to a THD stream with
cu_seqlens from the padding mask and scattered back (zeros at padding). fp16/bf16 inputs on CUDA.
Install with ``pip install speechlm[flash]``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from speechlm.model.attention.layouts import as_thd
from speechlm.model.attention.registry import BackendUnavailableError, attention_backend


def _import_flash_attn() -> Any:
    try:
        import flash_attn  # type: ignore[import-not-found]  # lazy: flash-attn (optional)
    except ImportError as e:
        raise BackendUnavailableError(
            f"attention backend 'flash' needs flash-attn, which is not installed ({e}): "
            "run `pip install speechlm[flash]` or choose another backend"
        ) from e
    return flash_attn


@attention_backend("flash")
def attend_flash(
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
    flash_attn = _import_flash_attn()
    t = as_thd("flash", query_BHSD, key_BGSD, value_BGSD, attention_mask, kwargs)
    out_THD = flash_attn.flash_attn_varlen_func(
        t.q_THD.contiguous(),
        t.k_TGD.contiguous(),
        t.v_TGD.contiguous(),
        cu_seqlens_q=t.cu_seqlens_q,
        cu_seqlens_k=t.cu_seqlens_k,
        max_seqlen_q=t.max_seqlen_q,
        max_seqlen_k=t.max_seqlen_k,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )
    return t.restore(out_THD)
