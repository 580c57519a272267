"""Reference attention backend: plain torch ops, CPU and GPU, THD and BSHD, and the CP hook.

Letters: H query heads, G key/value heads, T packed tokens, D head dim, B batch, S padded length.

THD (``cu_seq_lens_q/k`` given, batch 1): causal attention inside each sequence.
- Under context parallelism the model passes its CP layout's attention context (``cp_context``,
  `parallel.cp_attention.CPAttentionContext`, read with `layouts.read_attention_context`); its
  ``attention(q_THD, k_THD, v_THD, cu_seqlens_local, scale) -> out_THD`` (ring or all-gather-KV over
  the split sequences, local over the whole ones; K/V may have G < H heads) does the work.
- Otherwise ``parallel.attention_ops.varlen_attention_reference`` does the work (pure torch ops,
  GQA-aware, autograd works; that module never touches ``torch.distributed``).

BSHD (no cu_seqlens): causal attention with the ``[B, S]`` padding mask through torch SDPA.
A ``[1, S]`` batch whose position ids restart (a packed stream) without cu_seqlens is an error:
without them this backend would attend across utterances.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from parallel.varlen import varlen_attention
from parallel.varlen_meta import build_varlen_meta
from speechlm.model.attention.layouts import (
    attend_padded_sdpa,
    check_thd_lengths,
    read_attention_context,
    read_varlen_args,
    to_thd,
)
from speechlm.model.attention.registry import attention_backend, check_no_dropout


def _looks_packed(position_ids: Any) -> bool:
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return False
    return bool((position_ids[0, 1:] < position_ids[0, :-1]).any())


@attention_backend("reference")
def attend_reference(
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
    context = read_attention_context(kwargs)
    if varlen is None:
        if context.cp is not None:
            raise ValueError(
                "cp_context (context parallelism) needs a THD batch: pass cu_seq_lens_q/k to the model"
            )
        if attention_mask is None and _looks_packed(kwargs.get("position_ids")):
            raise ValueError(
                "position ids restart inside a batch of one row (a packed THD stream) but no cu_seq_lens_q/k "
                "were passed; the reference backend never guesses sequence boundaries - pass cu_seqlens"
            )
        out = attend_padded_sdpa(
            query_BHSD, key_BGSD, value_BGSD, attention_mask, scale=scale, dropout=dropout
        )
        return out, None
    check_no_dropout("reference", dropout)
    q_THD, k_TGD, v_TGD = to_thd(query_BHSD), to_thd(key_BGSD), to_thd(value_BGSD)
    if context.cp is not None:
        out_THD = context.cp.attention(q_THD, k_TGD, v_TGD, varlen.cu_seqlens_q, scale)
    else:
        check_thd_lengths(varlen, q_THD.shape[0], k_TGD.shape[0])
        meta = context.meta  # host boundaries read once per micro-batch (SpeechLLM.forward_packed)
        if meta is None:
            meta = build_varlen_meta(varlen.cu_seqlens_q, varlen.cu_seqlens_k, device=q_THD.device)
        out_THD = varlen_attention(q_THD, k_TGD, v_TGD, meta, causal=True, scale=scale)
    return out_THD.unsqueeze(0), None
