"""SDPA backend: torch ``scaled_dot_product_attention`` on padded (BSHD) batches only.

Letters: B batch, H query heads, G key/value heads, S padded length, D head dim.

There is no THD path: a packed stream needs per-sequence masking that SDPA's fused kernels do not
take without an O(T^2) dense mask. Use it with ``model.packed_sequences=false``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from speechlm.model.attention.layouts import attend_padded_sdpa, read_attention_context
from speechlm.model.attention.registry import attention_backend


@attention_backend("sdpa")
def attend_sdpa(
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
    if (
        kwargs.get("cu_seq_lens_q") is not None
        or kwargs.get("cu_seq_lens_k") is not None
        or read_attention_context(kwargs).cp is not None
    ):
        raise ValueError(
            "sdpa has no THD path; use reference/flash/te/torch_varlen/flex for packed sequences, or set "
            "model.packed_sequences=false"
        )
    out = attend_padded_sdpa(
        query_BHSD,
        key_BGSD,
        value_BGSD,
        attention_mask,
        scale=scale,
        dropout=dropout,
    )
    return out, None
