"""One long clip's FastConformer forward on a contiguous slice of its encoder frames per CP rank, with
halo exchange: each rank's output equals its slice of the unsharded (padding-free) encoder's.

Letters: T feature frames of the clip, F mel bins, U encoder frames of this rank's slice ``[lo, hi)``,
E encoder width, C conv channels, l / r the attention window's left / right frames, p the depthwise
convolution's half-width ((K - 1) / 2), f the subsampling factor (2^n).

What each stage needs from outside the slice (its halo) and how it gets it:

| stage | halo | how |
| --- | --- | --- |
| features | the frames the subsampling window reads; the clip's per-bin statistics | computed by each rank for its window only, from the audio every CP peer holds (`LogMelFeatures.frames_of_clip`); the normalisation's sums over each rank's own frames all-reduced (2 x (F + 1) floats); no gradient |
| subsampling (n stride-2 convs, kernel 3) | 1 encoder frame each side, plus the conv zero-padding edge | recomputed locally from the features of ``[f (lo - m), f (hi + m))``, m = `SUBSAMPLING_MARGIN` encoder frames; no exchange |
| feed-forward, layer norms, projections | none | per frame |
| self-attention, window ``[l, r]`` | the previous rank's last l and the next rank's first r normalised frames, every layer | `HaloExchange` (all-gather of the edges; backward returns their gradients) |
| convolution module (depthwise, kernel K) | p GLU-output frames each side, every layer | `HaloExchange`; zeros at the clip's own ends, as the unsharded conv pads |

Subsampling by recomputation: a window that starts at a multiple of f keeps every level's frames at
their absolute positions (level k frame i is absolute ``start / 2^k + i``), frames past the clip are
zeroed after each conv as the packed path does, and only the window's outermost frame per level can
differ from the unsharded value (it reads the window's zero padding), so m frames of margin (4; two
suffice) leave the slice exact.

Full context cannot be sharded this way (a query would need every frame of the clip): the sharded
forward requires limited context (``model.encoder.att_context_size``); the validator's placement rule
and docs/parallelism.md say so. Model code: the exchange is a callable the training layer binds
(`parallel.halo.HaloExchange`); nothing here calls torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from parallel.halo import Exchange
from parallel.varlen_meta import build_varlen_meta
from speechlm.model.packed_encoder import (
    WindowContext,
    run_block,
    window_position_table,
    windowed_self_attention,
)

SUBSAMPLING_MARGIN = 4  # encoder frames recomputed on each side of a slice by the subsampling


@dataclass(frozen=True)
class ClipSlice:
    """One rank's slice of a clip sharded over the CP group, as the encoder takes it
    (`ParakeetAudioEncoder.forward_with_slices`): encoder frames ``bounds = (lo, hi)``, the clip's feature
    frames ``[feat_offset, feat_offset + len(feats_TF))`` of ``feat_total`` (at least `feature_span`), the
    halo exchange of the group, the encoder frames of every rank's slice of the clip, in rank order
    (what a gather of the whole clip's frames needs: CTC compression, `speechlm.model.compression`), and the
    group: ``(first, d)``, the CP ranks ``[first, first + d)`` it is sharded over
    (`parallel.clip_placement.ClipSharding.group`)."""

    feats_TF: Tensor
    bounds: tuple[int, int]
    exchange: Exchange
    feat_offset: int
    feat_total: int
    counts: tuple[int, ...] = ()
    group: tuple[int, int] = (0, 1)


def feature_span(lo: int, hi: int, n_convs: int, total: int) -> tuple[int, int]:
    """The feature frames ``[a, b)`` the subsampling of encoder frames ``[lo, hi)`` reads (`subsample_window`)
    in a clip of ``total`` feature frames."""
    f = 2**n_convs
    return max(0, f * (lo - SUBSAMPLING_MARGIN)), min(f * (hi + SUBSAMPLING_MARGIN), total)


def subsample_window(
    sub: Any,
    feats_TF: Tensor,
    lo: int,
    hi: int,
    n_convs: int,
    *,
    feat_offset: int = 0,
    feat_total: int | None = None,
) -> Tensor:
    """Encoder frames ``[lo, hi)`` ``[U, E]`` of one clip's subsampling, from the features around them only.
    ``feats_TF`` holds feature frames ``[feat_offset, feat_offset + len)`` of a clip of ``feat_total`` (default:
    the whole clip); it must cover `feature_span`."""
    f = 2**n_convs
    T = feats_TF.shape[0] + feat_offset if feat_total is None else feat_total
    end = f * (hi + SUBSAMPLING_MARGIN)  # the window's end before the clip's end cuts it
    a, b = feature_span(lo, hi, n_convs, T)
    start = a
    if feat_offset > a or feat_offset + feats_TF.shape[0] < b:
        raise ValueError(
            f"features [{feat_offset}, {feat_offset + feats_TF.shape[0]}) do not cover the frames [{a}, {b}) "
            f"that encoder frames [{lo}, {hi}) read"
        )
    window = feats_TF[a - feat_offset : b - feat_offset]
    x = F.pad(window, (0, 0, 0, end - a - window.shape[0]))[None, None]  # zeros past the clip
    length = T
    for layer in sub.layers:
        x = layer(x)
        if isinstance(layer, nn.Conv2d):
            if layer.stride[0] != 1:
                k, s, p = layer.kernel_size[0], layer.stride[0], int(layer.padding[0])
                length = (length + 2 * p - k) // s + 1
                start //= s
            absolute = torch.arange(x.shape[2], device=x.device) + start
            x = x * (absolute < length).to(x.dtype)[None, None, :, None]
    x_1SE = sub.linear(x.transpose(1, 2).reshape(1, x.shape[2], -1))
    return x_1SE[0, lo - start : hi - start]


def _convolve_sharded(conv: Any, y_UE: Tensor, exchange: Exchange) -> Tensor:
    """The conv module on a slice: pointwise + GLU here, the depthwise conv over the GLU output with its
    neighbours' p edge frames (zeros at the clip's ends), the rest per frame."""
    U = y_UE.shape[0]
    g_UC = nn.functional.glu(conv.pointwise_conv1(y_UE.t()[None]), dim=1)[0].t()
    p = (int(conv.depthwise_conv.kernel_size[0]) - 1) // 2
    g_ext, n_l, n_r = exchange(g_UC, p, p)
    g_ext = F.pad(g_ext, (0, 0, p - n_l, p - n_r))  # the unsharded conv's zero padding at the clip's ends
    z_1CU = conv.depthwise_conv(g_ext.t()[None])[..., p : p + U]  # the module pads p more: centred outputs
    return conv.pointwise_conv2(conv.activation(conv.norm(z_1CU)))[0].t()


def forward_sharded_parakeet(
    model: Any,
    feats_TF: Tensor,
    bounds: tuple[int, int],
    n_convs: int,
    att_context: tuple[int, int] | None,
    exchange: Exchange,
    *,
    feat_offset: int = 0,
    feat_total: int | None = None,
) -> Tensor:
    """``ParakeetEncoder`` hidden states ``[hi - lo, E]`` of encoder frames ``bounds = (lo, hi)`` of the one
    clip whose features are ``feats_TF``, this rank's share (`parallel.clip_placement.shard_bounds`).
    ``feats_TF`` may hold only the clip's feature frames from ``feat_offset`` on (of ``feat_total``): at
    least `feature_span` of the slice (`LogMelFeatures.frames_of_clip` computes just those)."""
    if att_context is None:
        raise ValueError(
            "a clip can be sharded over the CP group with limited-context attention only (each frame then "
            "needs a window of its neighbours, not the whole clip): set model.encoder.att_context_size"
        )
    batch_stats = [
        n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if batch_stats:
        raise ValueError(
            f"BatchNorm on batch statistics ({batch_stats[0]}) over a sharded clip: each rank would normalise its "
            "slice by its own statistics, not the clip's, so the result would depend on the sharding; keep "
            "BatchNorm on its running statistics (the encoders' freeze_batchnorm, the default) or use "
            "model.encoder.conv_norm=layer_norm"
        )
    lo, hi = bounds
    if not 0 <= lo < hi:
        raise ValueError(f"bounds={bounds}: a slice of encoder frames needs 0 <= lo < hi")
    left, right = att_context
    x_UE = subsample_window(
        model.subsampling, feats_TF, lo, hi, n_convs, feat_offset=feat_offset, feat_total=feat_total
    )
    x_UE = x_UE * model.input_scale
    x_UE = nn.functional.dropout(x_UE, p=model.dropout, training=model.training)
    pos_WE = window_position_table(model.encode_positions, left, right, x_UE)
    pos_WE = nn.functional.dropout(pos_WE, p=model.dropout_positions, training=model.training)

    def attend(attn: Any, h_UE: Tensor) -> Tensor:
        # the slice with its halos is one sequence: the halo frames' own outputs are computed and dropped,
        # every frame of the slice finds its whole window inside
        h_ext, n_l, _ = exchange(h_UE, left, right)
        meta = build_varlen_meta([0, h_ext.shape[0]], device=h_ext.device)
        out = windowed_self_attention(attn, h_ext, WindowContext(left, right, meta, pos_WE))
        return out[n_l : n_l + h_UE.shape[0]]

    def convolve(conv: Any, y_UE: Tensor) -> Tensor:
        return _convolve_sharded(conv, y_UE, exchange)

    for block in model.layers:
        x_UE = run_block(block, x_UE, attend, convolve)
    return x_UE
