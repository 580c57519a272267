"""What every audio encoder kind shares: the `AudioEncoder` interface, length and mask helpers, the
preprocessor file reader, and the batch-invariant conv norm of from-scratch encoders.

Letters: B batch, T feature frames, F mel bins, U encoder frames (T / subsampling), E encoder width,
C channels.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechlm.model.features import FeatureSettings


def stride2_conv_lengths(lens_B: Tensor, n_convs: int) -> Tensor:
    """Output length of ``n_convs`` convolutions with kernel 3, stride 2, padding 1: per clip what
    `parallel.frames.encoder_frames` computes for ``2 ** n_convs`` (tests/test_frames.py holds them equal)."""
    out = lens_B.to(torch.long)
    for _ in range(n_convs):
        out = torch.div(out - 1, 2, rounding_mode="floor") + 1
    return out.clamp(min=0)


def lengths_to_mask(lens_B: Tensor, max_len: int) -> Tensor:
    return torch.arange(max_len, device=lens_B.device)[None, :] < lens_B[:, None]


class AudioEncoder(nn.Module, abc.ABC):
    """Base class: a wrapped encoder with its output width, subsampling and front-end settings.

    Subclasses (Parakeet, Whisper, NeMo) implement `output_lengths` and `forward`."""

    kind: str = "custom"  # the EncoderConfig.kind it implements (`parallel.frames` keeps each kind's facts)
    supports_packed: bool = False  # a padding-free path (`parallel.frames.PADDING_FREE_KINDS`)
    output_dim: int
    subsampling: int
    feature_settings: FeatureSettings

    def __init__(
        self,
        *,
        output_dim: int,
        subsampling: int,
        feature_settings: FeatureSettings,
        freeze_batchnorm: bool = True,
    ) -> None:
        super().__init__()
        self.output_dim = output_dim
        self.subsampling = subsampling
        self.feature_settings = feature_settings
        self.freeze_batchnorm = freeze_batchnorm

    def train(self, mode: bool = True) -> AudioEncoder:
        super().train(mode)
        if self.freeze_batchnorm:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self

    @property
    def slice_halo(self) -> int | None:
        """The fewest frames a slice of a clip sharded over the CP group may hold; None: this encoder
        encodes every clip whole (the default; `ParakeetAudioEncoder` with limited context shards)."""
        return None

    def forward_with_slices(
        self, feats_TF: Tensor, feat_lens_B: Tensor, slices: Any
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Packed clips and slices of sharded clips in one call (where `slice_halo` is set)."""
        raise NotImplementedError(
            f"{type(self).__name__} encodes every clip whole (slice_halo is None): only a padding-free "
            "Parakeet encoder with model.encoder.att_context_size shards a clip over the CP group"
        )

    @abc.abstractmethod
    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        """Encoder frames per clip for `feat_lens_B` feature frames."""

    @abc.abstractmethod
    def forward(
        self, feats_BTF: Tensor, feat_lens_B: Tensor, *, packed: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(hidden_BUE, out_lens_B) for features [B, T, F]; with ``packed`` (hidden_UE, out_lens_B) for
        packed features [sum T_b, F] (only where ``supports_packed``)."""

    def _refuse_packed(self, packed: bool) -> None:
        if packed:
            raise ValueError(
                f"{type(self).__name__} has no padding-free path; set model.encoder.packed=false "
                "(only encoder.kind='parakeet' runs packed)"
            )

    def _finish(self, hidden_BUE: Tensor, out_lens_B: Tensor, n_frames: int) -> tuple[Tensor, Tensor]:
        """Check the arithmetic against the real output, zero the frames past each clip."""
        expected = int(self.output_lengths(torch.tensor([n_frames]))[0])
        if hidden_BUE.shape[1] != expected:
            raise RuntimeError(
                f"{type(self).__name__}: {n_frames} input frames gave {hidden_BUE.shape[1]} output frames, "
                f"but the subsampling arithmetic says {expected}; the length formula is out of date"
            )
        valid_BU1 = lengths_to_mask(out_lens_B, hidden_BUE.shape[1]).unsqueeze(-1)
        return hidden_BUE.masked_fill(~valid_BU1, 0.0), out_lens_B


# ---------------------------------------------------------------------------------------------
# Parakeet (FastConformer)
# ---------------------------------------------------------------------------------------------


def read_preprocessor_json(path: Path) -> dict[str, Any]:
    f = path / "preprocessor_config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels of each frame of a `[B, C, T]` tensor (a drop-in for BatchNorm1d).

    Batch-invariant like a frozen BatchNorm, but it normalises: a frozen BatchNorm at its initial running
    statistics (mean 0, variance 1) is the identity, which left a from-scratch Conformer's conv module
    without normalisation and slowed the demo's CTC learning markedly.
    """

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=eps)

    def forward(self, x_BCT: Tensor) -> Tensor:
        return self.norm(x_BCT.transpose(1, 2)).transpose(1, 2)


def replace_conv_batchnorm(model: nn.Module) -> int:
    """Swap every BatchNorm1d of a from-scratch encoder for `ChannelLayerNorm`; returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.BatchNorm1d):
                setattr(parent, name, ChannelLayerNorm(child.num_features, eps=child.eps))
                n += 1
    return n
