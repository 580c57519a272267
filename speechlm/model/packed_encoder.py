"""Padding-free FastConformer (Parakeet) forward: every layer sees the real frames of each clip only.

Letters: B clips, T feature frames (all clips, packed), F mel bins, S frames of the gapped
subsampling layout, C conv channels, U encoder frames (all clips, packed), E encoder width,
H heads, D head width, L frames of one clip, P relative positions (2 L - 1).

The padded encoder (transformers' ``ParakeetEncoder`` with an attention mask) computes every clip
at the length of the longest one. This forward reuses the same modules and weights on packed
frames and gives the same hidden states per clip (fp32 to ~1e-6), by construction:

1. Subsampling (three kernel-3 stride-2 ``Conv2d`` over time x mel). Convolutions must not mix
   neighbouring clips, so clip b gets its own segment of ``S_b`` frames, a multiple of ``2**n``
   (n convs), with the clip first and zeros after it. After each conv the frames past the clip's
   length are zeroed (as the padded encoder does with its mask), and ``S_b`` is the smallest
   multiple of ``2**n`` that leaves at least one zero frame after the clip at every level k < n
   (``S_b / 2**k >= L_k + 1``): a stride-2 output's window ``[2j-1, 2j+1]`` then sees zeros where
   the padded encoder sees zeros. Segment starts are multiples of ``2**n``, so a segment starting
   at s maps to ``s / 2**k`` at level k. Cost: at most one or two extra output frames per clip.
2. The subsampling's output is cut to the real frames; from here on nothing is computed for
   padding. Feed-forward modules and layer norms act per frame.
3. Convolution module: pointwise conv, GLU, then the depthwise conv (kernel K, half-width
   ``p = (K-1)//2``) on a copy of the frames with ``p`` zero frames between clips (and at both
   ends), read back at the real frames; then norm (frozen BatchNorm or per-frame LayerNorm),
   activation, pointwise conv.
4. Self-attention with Transformer-XL relative positions: scores
   ``((q_a + u) . k_b + rel_shift((q_a + v) . R)_ab) * scale`` where ``R`` is ``relative_k_proj`` of
   the sinusoidal table at distances ``L-1 .. -(L-1)``. The position term depends on the clip's
   length, so attention runs per length group (`attend_packed_relpos`): clips of equal length are
   batched, each group gets its bias from a slice of one table built for the longest clip. That
   function is the single place to switch to a varlen kernel that takes an additive bias.
5. Limited context (``model.encoder.att_context_size: [left, right]``, NeMo's long-form setting): query
   frame t of a clip sees the frames t - left .. t + right of its clip only, through
   `parallel.varlen_window.varlen_window_attention` on the packed frames (a sliding-window mask, no
   per-length groups). The position term needs the W = left + 1 + right distances of the window only:
   ``bias[t, o] = (q_t + v) . R_{left - o}`` (`window_position_table`), one ``[U, H, W]`` tensor per layer
   instead of a ``[L, L]`` table per clip, so memory grows with U * W, not with L^2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from parallel.varlen_meta import VarlenMeta, build_varlen_meta
from parallel.varlen_window import varlen_window_attention

# -------------------------------------------------------------------------------------- index math


def cumsum_exclusive(lens_B: Tensor) -> Tensor:
    """Start offsets of consecutive segments of lengths ``lens_B``."""
    return torch.cumsum(lens_B, 0) - lens_B


def segment_rows(starts_B: Tensor, lens_B: Tensor) -> Tensor:
    """Flat index of positions ``starts_B[b] + [0, lens_B[b])``, clip after clip."""
    total = int(lens_B.sum())
    offsets = torch.repeat_interleave(starts_B - cumsum_exclusive(lens_B), lens_B, output_size=total)
    return offsets + torch.arange(total, device=lens_B.device)


def plan_subsampling_segments(feat_lens_B: Tensor, n_convs: int) -> Tensor:
    """Segment length per clip for the gapped subsampling layout (module docstring, step 1)."""
    factor = 2**n_convs
    seg_B = torch.div(feat_lens_B + factor - 1, factor, rounding_mode="floor") * factor
    lens_k = feat_lens_B.clone()
    for k in range(n_convs):
        need_B = (lens_k + 1) * (2**k)  # level k needs S / 2**k >= L_k + 1
        seg_B = torch.maximum(seg_B, torch.div(need_B + factor - 1, factor, rounding_mode="floor") * factor)
        lens_k = torch.div(lens_k - 1, 2, rounding_mode="floor") + 1
    return seg_B


@dataclass
class PackedLayout:
    """Where each clip's encoder frames live in the packed stream, with the per-layer indices."""

    lens_B: Tensor  # encoder frames per clip (int64)
    cu_B1: Tensor  # cumulative offsets [B + 1]
    groups: list[tuple[int, int]]  # (L, g): g clips of length L, in group order
    group_perm_U: Tensor  # frames in group order (group after group, clip after clip)
    group_inv_U: Tensor  # inverse of group_perm_U
    conv_rows_U: Tensor  # frame u -> its place in the gapped conv buffer
    conv_width: int  # length of the gapped conv buffer
    max_len: int

    @staticmethod
    def build(lens_B: Tensor, conv_half_width: int) -> PackedLayout:
        device = lens_B.device
        lens_B = lens_B.to(torch.long)
        cu_B1 = torch.zeros(lens_B.numel() + 1, dtype=torch.long, device=device)
        cu_B1[1:] = torch.cumsum(lens_B, 0)
        by_len: dict[int, list[int]] = {}
        for b, n in enumerate(lens_B.tolist()):
            if n > 0:
                by_len.setdefault(int(n), []).append(b)
        groups, rows = [], []
        for n, clips in sorted(by_len.items()):
            starts = cu_B1[torch.tensor(clips, device=device)]
            groups.append((n, len(clips)))
            rows.append((starts[:, None] + torch.arange(n, device=device)).flatten())
        perm_U = torch.cat(rows) if rows else lens_B.new_zeros(0)
        p = conv_half_width
        idx_B = torch.arange(lens_B.numel(), device=device)
        conv_starts_B = cu_B1[:-1] + (idx_B + 1) * p
        conv_rows_U = segment_rows(conv_starts_B, lens_B)
        width = int(cu_B1[-1]) + (lens_B.numel() + 1) * p
        max_len = int(lens_B.max()) if lens_B.numel() else 0
        return PackedLayout(lens_B, cu_B1, groups, perm_U, torch.argsort(perm_U), conv_rows_U, width, max_len)

    def split_groups(self, x_U_: Tensor) -> list[Tensor]:
        """``x`` (frames first) as one ``[g, L, ...]`` tensor per length group: one gather in all, so
        autograd scatters the gradient back once (a gather per group would cost a full-size zero
        tensor per group and layer in backward)."""
        parts = x_U_.index_select(0, self.group_perm_U).split([n * g for n, g in self.groups])
        return [part.view(g, n, *x_U_.shape[1:]) for part, (n, g) in zip(parts, self.groups)]


# -------------------------------------------------------------------------------------- attention


def attend_packed_relpos(
    q_UHD: Tensor,
    k_UHD: Tensor,
    v_UHD: Tensor,
    layout: PackedLayout,
    bias_fn: Callable[[int, int], Tensor],
    *,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """Bidirectional attention within each clip, plus an additive bias that depends on the clip length.

    ``bias_fn(i, L) -> bias_gHLL`` (already scaled) for group i of ``layout.groups`` (g clips of length L).
    Per-length groups through torch SDPA: the one function to replace by a varlen kernel that takes
    an additive bias (e.g. from ``parallel/``, issue 11).
    """
    outs = []
    q_groups, k_groups, v_groups = (
        layout.split_groups(q_UHD),
        layout.split_groups(k_UHD),
        layout.split_groups(v_UHD),
    )
    for i, (n, _) in enumerate(layout.groups):
        out = nn.functional.scaled_dot_product_attention(
            q_groups[i].transpose(1, 2),  # [g, H, L, D]
            k_groups[i].transpose(1, 2),
            v_groups[i].transpose(1, 2),
            attn_mask=bias_fn(i, n),
            dropout_p=dropout_p,
            scale=scale,
        )
        outs.append(out.transpose(1, 2).flatten(0, 1))
    if not outs:
        return q_UHD.new_zeros(q_UHD.shape[0], q_UHD.shape[1], v_UHD.shape[-1])
    return torch.cat(outs).index_select(0, layout.group_inv_U)


def relative_position_table(encode_positions: nn.Module, max_len: int, like: Tensor) -> Tensor:
    """Sinusoidal embeddings ``[2 max_len - 1, E]`` of distances ``max_len-1 .. -(max_len-1)``."""
    return encode_positions(like.new_zeros(1, max_len, 1).expand(1, max_len, like.shape[-1]))[0]


def _project_qkv(attn: Any, h_UE: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``[U, H, D]`` of a Parakeet attention module (grouped K/V heads expanded to H)."""
    U = h_UE.shape[0]
    n_heads, D = int(attn.config.num_attention_heads), int(attn.head_dim)
    q = attn.q_proj(h_UE).view(U, n_heads, D)
    k = attn.k_proj(h_UE).view(U, -1, D)
    v = attn.v_proj(h_UE).view(U, -1, D)
    if k.shape[1] != n_heads:  # grouped-query attention
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    return q, k, v


def _self_attention(attn: Any, h_UE: Tensor, layout: PackedLayout, pos_PE: Tensor) -> Tensor:
    q, k, v = _project_qkv(attn, h_UE)
    U, n_heads, D = q.shape
    rel_PHD = attn.relative_k_proj(pos_PE).view(-1, n_heads, D)
    q_v_groups = layout.split_groups(q + attn.bias_v.view(1, n_heads, D))  # position term
    centre = layout.max_len - 1

    def position_bias(i: int, n: int) -> Tensor:
        rel_HDP = rel_PHD[centre - (n - 1) : centre + n].permute(1, 2, 0)  # distances n-1 .. -(n-1)
        bd = attn._rel_shift(q_v_groups[i].transpose(1, 2) @ rel_HDP)[..., :n]
        return bd * attn.scaling

    out_UHD = attend_packed_relpos(
        q + attn.bias_u.view(1, n_heads, D),  # content term
        k,
        v,
        layout,
        position_bias,
        scale=attn.scaling,
        dropout_p=float(attn.attention_dropout) if attn.training else 0.0,
    )
    return attn.o_proj(out_UHD.reshape(U, n_heads * D))


# ------------------------------------------------------------------------------ limited context


@dataclass
class WindowContext:
    """Limited-context attention of one forward: the window, the clips' boundaries, the window's distances."""

    left: int
    right: int
    meta: VarlenMeta  # the clips as sequences of the packed frames
    pos_WE: Tensor  # sinusoidal embeddings of the distances left, left - 1, .., -right


def window_position_table(encode_positions: nn.Module, left: int, right: int, like: Tensor) -> Tensor:
    """Sinusoidal embeddings ``[left + 1 + right, E]`` of distances ``left .. -right`` (a slice of
    `relative_position_table`, whose row p is distance ``M - 1 - p``)."""
    M = max(left, right) + 1
    return relative_position_table(encode_positions, M, like)[M - 1 - left : M + right]


def window_context(model: Any, att_context: tuple[int, int], cu_B1: Any, like: Tensor) -> WindowContext:
    """The `WindowContext` of a forward: clips with boundaries `cu_B1`, the window's position table."""
    left, right = att_context
    pos_WE = window_position_table(model.encode_positions, left, right, like)
    pos_WE = nn.functional.dropout(pos_WE, p=model.dropout_positions, training=model.training)
    return WindowContext(left, right, build_varlen_meta(cu_B1, device=like.device), pos_WE)


def windowed_self_attention(attn: Any, h_UE: Tensor, ctx: WindowContext) -> Tensor:
    """The relative-position self-attention of `_self_attention`, each frame over its window only."""
    q, k, v = _project_qkv(attn, h_UE)
    U, n_heads, D = q.shape
    rel_WHD = attn.relative_k_proj(ctx.pos_WE).view(-1, n_heads, D)
    bias_UHW = torch.einsum("uhd,whd->uhw", q + attn.bias_v.view(1, n_heads, D), rel_WHD) * attn.scaling
    out_UHD = varlen_window_attention(
        q + attn.bias_u.view(1, n_heads, D),
        k,
        v,
        ctx.meta,
        window=(ctx.left, ctx.right),
        scale=attn.scaling,
        bias_THW=bias_UHW,
        dropout_p=float(attn.attention_dropout) if attn.training else 0.0,
    )
    return attn.o_proj(out_UHD.reshape(U, n_heads * D))


# -------------------------------------------------------------------------------------- conv module


def _conv_module(conv: Any, x_UE: Tensor, layout: PackedLayout) -> Tensor:
    x_1CU = conv.pointwise_conv1(x_UE.t()[None])
    x_1CU = nn.functional.glu(x_1CU, dim=1)
    C = x_1CU.shape[1]
    buf = x_1CU.new_zeros(1, C, layout.conv_width).index_copy(2, layout.conv_rows_U, x_1CU)
    y_1CU = conv.depthwise_conv(buf).index_select(2, layout.conv_rows_U)
    y_1CU = conv.pointwise_conv2(conv.activation(conv.norm(y_1CU)))
    return y_1CU[0].t()


SubLayer = Callable[[Any, Tensor], Tensor]  # (attention or conv module, its normalised input) -> its output


def run_block(block: Any, x_UE: Tensor, attend: SubLayer, convolve: SubLayer) -> Tensor:
    """One conformer block on frames ``x_UE``; how its self-attention and convolution see the other frames
    (packed clips, a window, a slice with halos) is `attend` and `convolve`'s."""
    x_UE = x_UE + 0.5 * block.feed_forward1(block.norm_feed_forward1(x_UE))
    x_UE = x_UE + attend(block.self_attn, block.norm_self_att(x_UE))
    x_UE = x_UE + convolve(block.conv, block.norm_conv(x_UE))
    x_UE = x_UE + 0.5 * block.feed_forward2(block.norm_feed_forward2(x_UE))
    return block.norm_out(x_UE)


# -------------------------------------------------------------------------------------- subsampling


def _subsample(sub: Any, feats_TF: Tensor, feat_lens_B: Tensor, n_convs: int) -> tuple[Tensor, Tensor]:
    """Gapped-segment subsampling (module docstring, step 1): ``(x_UE, enc_lens_B)``."""
    lens = feat_lens_B.to(device=feats_TF.device, dtype=torch.long)
    seg_B = plan_subsampling_segments(lens, n_convs)
    starts = cumsum_exclusive(seg_B)
    buf_SF = feats_TF.new_zeros(int(seg_B.sum()), feats_TF.shape[1])
    x = buf_SF.index_copy(0, segment_rows(starts, lens), feats_TF)[None, None]  # [1, 1, S, F]
    for layer in sub.layers:
        x = layer(x)
        if isinstance(layer, nn.Conv2d):
            if layer.stride[0] != 1:
                k, s, p = layer.kernel_size[0], layer.stride[0], int(layer.padding[0])
                lens = torch.div(lens + 2 * p - k, s, rounding_mode="floor") + 1
                starts = torch.div(starts, s, rounding_mode="floor")
            valid_S = torch.zeros(x.shape[2], dtype=x.dtype, device=x.device)
            valid_S[segment_rows(starts, lens)] = 1.0
            x = x * valid_S[None, None, :, None]
    x_1SE = sub.linear(x.transpose(1, 2).reshape(1, x.shape[2], -1))
    return x_1SE[0].index_select(0, segment_rows(starts, lens)), lens


def forward_packed_parakeet(
    model: Any,
    feats_TF: Tensor,
    feat_lens_B: Tensor,
    n_convs: int,
    att_context: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """``ParakeetEncoder`` on packed features ``[sum T_b, F]``: ``(hidden_UE, enc_lens_B)`` packed.
    ``att_context``: (left, right) frames of limited-context attention (step 5); None: full context."""
    x_UE, lens_B = _subsample(model.subsampling, feats_TF, feat_lens_B, n_convs)
    x_UE = x_UE * model.input_scale
    x_UE = nn.functional.dropout(x_UE, p=model.dropout, training=model.training)
    conv_k = int(model.config.conv_kernel_size)
    layout = PackedLayout.build(lens_B, (conv_k - 1) // 2)
    if layout.max_len == 0:
        return x_UE, lens_B
    if att_context is None:
        pos_PE = relative_position_table(model.encode_positions, layout.max_len, x_UE)
        pos_PE = nn.functional.dropout(pos_PE, p=model.dropout_positions, training=model.training)

        def attend(attn: Any, h_UE: Tensor) -> Tensor:
            return _self_attention(attn, h_UE, layout, pos_PE)

    else:
        ctx = window_context(model, att_context, layout.cu_B1, x_UE)

        def attend(attn: Any, h_UE: Tensor) -> Tensor:
            return windowed_self_attention(attn, h_UE, ctx)

    def convolve(conv: Any, y_UE: Tensor) -> Tensor:
        return _conv_module(conv, y_UE, layout)

    for block in model.layers:
        x_UE = run_block(block, x_UE, attend, convolve)
    return x_UE, lens_B


# -------------------------------------------------------------------------------------- output type


@dataclass
class PackedFrames:
    """Encoder frames of B clips packed one after the other: ``data_UE`` [sum U_b, E], ``lens_B``."""

    data_UE: Tensor
    lens_B: Tensor

    def __len__(self) -> int:
        return int(self.lens_B.numel())

    def split(self) -> list[Tensor]:
        return list(torch.split(self.data_UE, [int(n) for n in self.lens_B.tolist()]))

    def to_padded(self) -> Tensor:
        """``[B, max U_b, E]`` with zeros past each clip (for tests and diagnostics)."""
        return nn.utils.rnn.pad_sequence(self.split(), batch_first=True)
