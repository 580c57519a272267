"""Layout helpers the attention backends share: THD views of q/k/v, unpadding a padded batch and
putting the output back, the padded causal mask, the cu_seqlens arguments transformers passes, the
declared attention context (`AttentionContext`: boundaries read once, CP attention), dtype and scale
defaults.

Letters: B batch, H query heads, G key/value heads (GQA: H % G == 0), S padded row length,
T packed tokens, M real tokens of a padded batch, D head dim, N sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parallel.cp_attention import CPAttentionContext
from parallel.varlen_meta import VarlenMeta


@dataclass
class VarlenArgs:
    cu_seqlens_q: Tensor  # int32 [N + 1] on the queries' device
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _max_len(cu: Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


@dataclass
class ThdView:
    """q/k/v as one THD stream for a varlen kernel, and how to put its output back."""

    q_THD: Tensor
    k_TGD: Tensor
    v_TGD: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    plan: Any  # UnpadPlan of a padded batch, None for a packed one

    def restore(self, out_THD: Tensor) -> tuple[Tensor, None]:
        """The kernel's THD output in the layout transformers expects back ([B, S, H, D])."""
        if self.plan is not None:
            return scatter_bshd(out_THD, self.plan), None
        return out_THD.unsqueeze(0), None


def as_thd(
    backend: str,
    query_BHSD: Tensor,
    key_BGSD: Tensor,
    value_BGSD: Tensor,
    attention_mask: Tensor | None,
    kwargs: Mapping[str, Any],
) -> ThdView:
    """Packed batch (cu_seqlens given): the stream as is. Padded batch: unpad it with its [B, S] mask."""
    varlen = read_varlen_args(kwargs, query_BHSD.device)
    if varlen is not None:
        return ThdView(
            to_thd(query_BHSD),
            to_thd(key_BGSD),
            to_thd(value_BGSD),
            varlen.cu_seqlens_q,
            varlen.cu_seqlens_k,
            varlen.max_seqlen_q,
            varlen.max_seqlen_k,
            None,
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"{backend} takes a [B, S] padding mask, got shape {tuple(attention_mask.shape)}")
    B, _, S, _ = query_BHSD.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, S, dtype=torch.bool, device=query_BHSD.device)
    plan = plan_unpad(attention_mask)
    return ThdView(
        gather_thd(query_BHSD, plan),
        gather_thd(key_BGSD, plan),
        gather_thd(value_BGSD, plan),
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_seqlen,
        plan.max_seqlen,
        plan,
    )


def read_varlen_args(kwargs: Mapping[str, Any], device: torch.device) -> VarlenArgs | None:
    """Read ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the forward kwargs; None when absent."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError("pass both cu_seq_lens_q and cu_seq_lens_k (THD attention), or neither (padded)")
    cu_q = cu_q.to(device=device, dtype=torch.int32)
    cu_k = cu_k.to(device=device, dtype=torch.int32)
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    return VarlenArgs(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(max_q) if max_q is not None else _max_len(cu_q),
        max_seqlen_k=int(max_k) if max_k is not None else _max_len(cu_k),
    )


def to_thd(x_1HTD: Tensor) -> Tensor:
    """``[1, H, T, D]`` (transformers' layout of a packed batch) -> ``[T, H, D]``."""
    if x_1HTD.dim() != 4 or x_1HTD.shape[0] != 1:
        raise ValueError(
            f"THD attention needs batch size 1 (one packed stream), got q/k/v of shape {tuple(x_1HTD.shape)}"
        )
    return x_1HTD[0].transpose(0, 1)


def check_thd_lengths(varlen: VarlenArgs, t_q: int, t_k: int) -> None:
    """Cheap shape checks (no device sync beyond reading the last offset)."""
    if varlen.cu_seqlens_q.dim() != 1 or varlen.cu_seqlens_q.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries, got {tuple(varlen.cu_seqlens_q.shape)}"
        )
    if int(varlen.cu_seqlens_q[-1]) != t_q or int(varlen.cu_seqlens_k[-1]) != t_k:
        raise ValueError(
            f"cu_seqlens end at {int(varlen.cu_seqlens_q[-1])}/{int(varlen.cu_seqlens_k[-1])} but the packed "
            f"stream has {t_q}/{t_k} tokens (q/k)"
        )


@dataclass
class Unpadded:
    """Index plan to turn a right/left-padded ``[B, S]`` batch into a THD stream and back."""

    index_M: Tensor  # int64 positions of real tokens in the flattened B*S
    cu_seqlens: Tensor  # int32 [B + 1]
    max_seqlen: int
    batch: int
    seqlen: int


def plan_unpad(padding_mask_BS: Tensor) -> Unpadded:
    valid_BS = padding_mask_BS.to(torch.bool)
    lens_B = valid_BS.sum(dim=1, dtype=torch.int32)
    cu = torch.zeros(lens_B.numel() + 1, dtype=torch.int32, device=valid_BS.device)
    cu[1:] = torch.cumsum(lens_B, 0)
    index_M = torch.nonzero(valid_BS.flatten()).flatten()
    B, S = valid_BS.shape
    return Unpadded(index_M, cu, int(lens_B.max()) if B else 0, B, S)


def gather_thd(x_BHSD: Tensor, plan: Unpadded) -> Tensor:
    """``[B, H, S, D]`` -> ``[M, H, D]`` (real tokens only, row-major order)."""
    B, H, S, D = x_BHSD.shape
    return x_BHSD.transpose(1, 2).reshape(B * S, H, D).index_select(0, plan.index_M)


def scatter_bshd(out_MHD: Tensor, plan: Unpadded) -> Tensor:
    """``[M, H, D]`` -> ``[B, S, H, D]`` with zeros at padding."""
    M, H, D = out_MHD.shape
    full = out_MHD.new_zeros(plan.batch * plan.seqlen, H, D).index_copy(0, plan.index_M, out_MHD)
    return full.view(plan.batch, plan.seqlen, H, D)


def build_padded_causal_mask(padding_mask_BS: Tensor, q_len: int) -> Tensor:
    """Bool ``[B, 1, Sq, Sk]``: causal (queries aligned to the last keys) and real keys only.

    Each query may always see its own position, so a padded query row is never fully masked (that
    would give NaN); real queries never see padded keys either way.
    """
    k_len = padding_mask_BS.shape[1]
    device = padding_mask_BS.device
    q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len, device=device)[None, :]
    causal_QK = k_pos <= q_pos
    mask_BQK = causal_QK[None] & padding_mask_BS.to(torch.bool)[:, None, :]
    mask_BQK = mask_BQK | (k_pos == q_pos)[None]
    return mask_BQK[:, None]


def attend_padded_sdpa(
    query_BHSD: Tensor,
    key_BGSD: Tensor,
    value_BGSD: Tensor,
    attention_mask: Tensor | None,
    *,
    scale: float,
    dropout: float = 0.0,
) -> Tensor:
    """Causal attention on a padded batch with torch SDPA; returns ``[B, S, H, D]``."""
    gqa = query_BHSD.shape[1] != key_BGSD.shape[1]
    if attention_mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query_BHSD, key_BGSD, value_BGSD, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
        return out.transpose(1, 2)
    if attention_mask.dim() == 2:
        mask = build_padded_causal_mask(attention_mask, query_BHSD.shape[2])
    elif attention_mask.dim() == 4:
        mask = attention_mask  # a prepared 4-D mask (bool, or additive float): used as given
    else:
        raise ValueError(
            f"attention_mask must be [B, S] or [B, 1, Sq, Sk], got {tuple(attention_mask.shape)}"
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query_BHSD, key_BGSD, value_BGSD, attn_mask=mask, scale=scale, dropout_p=dropout, enable_gqa=gqa
    )
    return out.transpose(1, 2)


def match_dtypes(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Bring q/k/v to one dtype, as SDPA's autocast rule would: the autocast dtype when autocast is on.

    Under autocast, transformers' rotary embedding can leave q/k in fp32 (cos/sin follow the fp32
    input embeddings) while v is bf16; raw attention ops and kernels need a single dtype.
    """
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = q.dtype
    return q.to(dtype), k.to(dtype), v.to(dtype)


def default_scale(query: Tensor, scaling: float | None) -> float:
    return float(scaling) if scaling is not None else query.shape[-1] ** -0.5


@dataclass(frozen=True)
class AttentionContext:
    """What `SpeechLLM.forward_packed` hands every attention layer of a THD micro-batch beside the
    tensors (keyword arguments ``varlen_meta`` and ``cp_context`` through the model's forward):

    - ``meta``: the pack's boundaries on the device and the host (`parallel.varlen_meta.VarlenMeta`),
      read once per micro-batch; None when the caller did not pass them (a backend then builds them);
    - ``cp``: the micro-batch's CP attention (`parallel.cp_attention.CPAttentionContext`: ring or
      all-gather over the split sequences, local attention over the whole ones); None without CP
      (`parallel.cp_layout.NullCPLayout`). Only backends whose capability row has CP accept one.
    """

    meta: VarlenMeta | None
    cp: CPAttentionContext | None


def read_attention_context(kwargs: Mapping[str, Any]) -> AttentionContext:
    """The declared context out of the attention call's keyword arguments."""
    return AttentionContext(kwargs.get("varlen_meta"), kwargs.get("cp_context"))
