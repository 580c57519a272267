"""Sliding-window (limited-context) attention on packed sequences: the varlen interface's local form.

Letters: T packed tokens (encoder frames), H heads, D head dim, W window width (left + 1 + right),
C queries per block, K keys per block (C + W - 1), N blocks, S sequences.

    varlen_window_attention(q_THD, k_THD, v_THD, meta, window=(left, right), bias_THW=None) -> out_THD

Query t of sequence n (rows ``cu[n]:cu[n+1]`` of `VarlenMeta`, as for `parallel.varlen`) sees the keys s
of the same sequence with ``t - left <= s <= t + right``, bidirectionally: NeMo's ``att_context_size``
[left, right] in frames, the limited context FastConformer (Parakeet) uses for long-form audio. The
optional additive bias depends on the query and the key's offset in the window: ``bias_THW[t, h, o]``
is added to the score of key ``s = t - left + o`` (o in [0, W)), i.e. of distance ``t - s = left - o``.
That is the form of a relative-position term (FastConformer's Transformer-XL bias ``(q_t + v) . R_{t-s}``),
computed for W distances instead of a table of every pair.

Algorithm (exact, no approximation; memory O(T * (C + W)) instead of O(L^2) per sequence): the stream
is cut into N blocks of C queries. Block b's queries ``[bC, bC + C)`` can only see keys in
``[bC - left, bC + C - 1 + right]``, K = C + W - 1 of them: one strided view (``unfold``) of the key
stream padded with ``left`` frames in front and ``right`` (plus the last block's tail) behind. In the
block, query i and key j are offset ``o = j - i`` apart in the window; the score is kept when
``0 <= o < W`` and both frames belong to the same sequence (padding frames belong to none, so a padded
query only sees padding and a real query never does), else masked to -inf. The bias enters by a gather
of ``bias_THW`` at ``o``. Then one SDPA call over ``[N, H, C, K]``.

Block size: C = max(W, 16) by default (K <= 2C: at most twice the keys a query needs are scored).
Pure torch; no process group. The dense masked attention per sequence is the reference it is tested
against (tests/parallel/test_varlen_window.py).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from parallel.varlen_meta import VarlenMeta

__all__ = ["check_window", "varlen_window_attention", "window_mask"]


def check_window(window: tuple[int, int]) -> tuple[int, int]:
    """(left, right) as ints; ValueError unless both are >= 0 (use full attention for unlimited context)."""
    left, right = (int(w) for w in window)
    if left < 0 or right < 0:
        raise ValueError(
            f"window={tuple(window)}: left and right context must be >= 0 frames; -1 (unlimited) means full "
            "attention, which is not this function (call the full varlen attention instead)"
        )
    return left, right


def _sequence_ids(meta: VarlenMeta, device: torch.device) -> Tensor:
    """Sequence index of every token of the pack (int64 [T])."""
    cu = meta.cu_q
    lens = torch.tensor([b - a for a, b in zip(cu, cu[1:], strict=False)], dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens, output_size=cu[-1])


def window_mask(seq_T: Tensor, left: int, right: int, block: int) -> Tensor:
    """Boolean ``[N, C, K]``: query i of block b may see key j of the block's key window (module docstring)."""
    T, C = seq_T.shape[0], block
    W, n_blocks = left + right + 1, -(-seq_T.shape[0] // block)
    K = C + W - 1
    tail = n_blocks * C - T
    pad = seq_T.new_full((1,), -1)
    seq_pad = torch.cat([pad.expand(left), seq_T, pad.expand(right + tail)])  # padding: sequence -1
    seq_q = seq_pad[left : left + n_blocks * C].view(n_blocks, C)
    seq_k = seq_pad.unfold(0, K, C)  # [N, K]
    offset = torch.arange(K, device=seq_T.device)[None, :] - torch.arange(C, device=seq_T.device)[:, None]
    band = (offset >= 0) & (offset < W)
    return band[None] & (seq_q[:, :, None] == seq_k[:, None, :])


def varlen_window_attention(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    meta: VarlenMeta,
    *,
    window: tuple[int, int],
    scale: float | None = None,
    bias_THW: Tensor | None = None,
    dropout_p: float = 0.0,
    block: int | None = None,
) -> Tensor:
    """Bidirectional attention of every query over its window of its own sequence (module docstring);
    differentiable in q, k, v and the bias (autograd through one SDPA call)."""
    left, right = check_window(window)
    T, H, D = q_THD.shape
    if k_THD.shape != (T, H, D) or v_THD.shape[:2] != (T, H):
        raise ValueError(
            f"window attention takes q, k (T, H, D) of one shape and v (T, H, Dv); got {tuple(q_THD.shape)}, "
            f"{tuple(k_THD.shape)}, {tuple(v_THD.shape)} (expand grouped K/V heads first)"
        )
    if meta.cu_q != meta.cu_k or meta.cu_q[-1] != T:
        raise ValueError(
            f"cu_seqlens end at ({meta.cu_q[-1]}, {meta.cu_k[-1]}) but the pack has {T} tokens, or queries and "
            "keys differ: window attention is self-attention over one pack; build the VarlenMeta from it"
        )
    W = left + right + 1
    if bias_THW is not None and bias_THW.shape != (T, H, W):
        raise ValueError(
            f"bias_THW must be (T, H, left + right + 1) = {(T, H, W)}, got {tuple(bias_THW.shape)}"
        )
    if T == 0:
        return q_THD.new_zeros(0, H, v_THD.shape[2])
    C = block or max(W, 16)
    n_blocks = -(-T // C)
    K, tail = C + W - 1, n_blocks * C - T
    valid_NCK = window_mask(_sequence_ids(meta, q_THD.device), left, right, C)

    q_NHCD = F.pad(q_THD, (0, 0, 0, 0, 0, tail)).reshape(n_blocks, C, H, D).transpose(1, 2)
    kv_pad = (0, 0, 0, 0, left, right + tail)
    k_NHKD = F.pad(k_THD, kv_pad).unfold(0, K, C).permute(0, 1, 3, 2)  # unfold: [N, H, D, K]
    v_NHKD = F.pad(v_THD, kv_pad).unfold(0, K, C).permute(0, 1, 3, 2)
    neg_inf = torch.finfo(q_THD.dtype).min if q_THD.dtype.is_floating_point else float("-inf")
    mask_N1CK = torch.zeros(valid_NCK.shape, dtype=q_THD.dtype, device=q_THD.device)
    mask_N1CK = mask_N1CK.masked_fill(~valid_NCK, neg_inf)[:, None]
    if bias_THW is not None:
        b_NHCW = F.pad(bias_THW, (0, 0, 0, 0, 0, tail)).reshape(n_blocks, C, H, W).permute(0, 2, 1, 3)
        offset_CK = (
            torch.arange(K, device=q_THD.device)[None, :] - torch.arange(C, device=q_THD.device)[:, None]
        )
        index = offset_CK.clamp(0, W - 1).expand(n_blocks, H, C, K)
        attn_bias = b_NHCW.gather(3, index) + mask_N1CK
    else:
        attn_bias = mask_N1CK
    out_NHCD = F.scaled_dot_product_attention(
        q_NHCD, k_NHKD, v_NHKD, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale
    )
    return out_NHCD.transpose(1, 2).reshape(n_blocks * C, H, -1)[:T]
