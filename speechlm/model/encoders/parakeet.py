"""``parakeet``: transformers' ``ParakeetEncoder`` (FastConformer, 8x subsampling by three stride-2
convolutions), built from the config or loaded from a local directory holding a saved
``ParakeetEncoder`` or ``ParakeetForCTC``. Output length per conv: ``(L - 1) // 2 + 1``. The only
kind with a padding-free path (``packed=True``, `speechlm.model.packed_encoder`).

Letters: B batch, T feature frames, F mel bins, U encoder frames (T / 8), E encoder width.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from parallel.clip_placement import slice_halo
from parallel.frames import ENCODER_SUBSAMPLING, HOP_SAMPLES, PADDING_FREE_KINDS, SAMPLE_RATE
from speechlm.config import EncoderConfig
from speechlm.model.encoders.base import (
    AudioEncoder,
    lengths_to_mask,
    read_preprocessor_json,
    replace_conv_batchnorm,
    stride2_conv_lengths,
)
from speechlm.model.features import FeatureSettings
from speechlm.model.packed_encoder import forward_packed_parakeet
from speechlm.model.sharded_encoder import forward_sharded_parakeet

DEFAULT_SUBSAMPLING = ENCODER_SUBSAMPLING[
    "parakeet"
]  # FastConformer's 80 ms (encoder.subsampling_factor: null)


class ParakeetAudioEncoder(AudioEncoder):
    kind = "parakeet"
    supports_packed = "parakeet" in PADDING_FREE_KINDS

    def __init__(self, model: nn.Module, feature_settings: FeatureSettings, *, freeze_batchnorm: bool = True):
        cfg: Any = model.config
        n_convs = (int(cfg.subsampling_factor) - 1).bit_length()
        if (
            2**n_convs != cfg.subsampling_factor
            or cfg.subsampling_conv_kernel_size != 3
            or cfg.subsampling_conv_stride != 2
        ):
            raise ValueError(
                "only kernel-3, stride-2 Parakeet subsampling with a power-of-two factor is supported, got "
                f"factor={cfg.subsampling_factor}, kernel={cfg.subsampling_conv_kernel_size}, "
                f"stride={cfg.subsampling_conv_stride}"
            )
        super().__init__(
            output_dim=int(cfg.hidden_size),
            subsampling=int(cfg.subsampling_factor),
            feature_settings=feature_settings,
            freeze_batchnorm=freeze_batchnorm,
        )
        self.n_convs = n_convs
        self.model = model
        # (left, right) frames of limited-context attention (model.encoder.att_context_size); None: full
        self.att_context: tuple[int, int] | None = None

    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        return stride2_conv_lengths(feat_lens_B, self.n_convs)

    @property
    def slice_halo(self) -> int | None:
        """The frames a slice of a sharded clip must at least hold (the widest halo it sends: the attention
        window's sides, the depthwise convolution's half-width), or None: this encoder cannot shard a clip
        (full-context attention needs every frame of the clip; `speechlm.model.sharded_encoder`)."""
        if self.att_context is None:
            return None
        cfg: Any = self.model.config
        return slice_halo(self.att_context, int(cfg.conv_kernel_size))

    def forward_slice(
        self,
        feats_TF: Tensor,
        bounds: tuple[int, int],
        exchange: Any,
        *,
        feat_offset: int = 0,
        feat_total: int | None = None,
    ) -> Tensor:
        """Encoder frames ``bounds = (lo, hi)`` ``[hi - lo, E]`` of one clip whose features (frames from
        ``feat_offset`` on, of ``feat_total``; default: all of them) are ``feats_TF``, with ``exchange``
        bringing the neighbouring slices' halos (`speechlm.model.sharded_encoder`). Training calls it through
        `forward_with_slices` (one encoder call per micro-batch); called alone it needs the parameters
        gathered (no FSDP, or inside another entry)."""
        return forward_sharded_parakeet(
            self.model,
            feats_TF,
            bounds,
            self.n_convs,
            self.att_context,
            exchange,
            feat_offset=feat_offset,
            feat_total=feat_total,
        )

    def forward_with_slices(
        self, feats_TF: Tensor, feat_lens_B: Tensor, slices: Any
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The padding-free forward of the packed clips ``feats_TF`` (``forward(..., packed=True)``) and, in
        the same call, this rank's slice of each clip sharded over the CP group (``slices``: `ClipSlice`,
        `forward_slice`): ``(hidden_UE, enc_lens_B, [slice frames [hi - lo, E]])``. One call per micro-batch
        whatever it holds, an FSDP entry of its own (registered by the training layer), so that the
        encoder's FSDP collectives run as often on a data-parallel rank that shards a clip as on one that
        does not."""
        hidden_UE, lens_B = self.forward(feats_TF, feat_lens_B, packed=True)
        outs = [
            self.forward_slice(
                s.feats_TF, s.bounds, s.exchange, feat_offset=s.feat_offset, feat_total=s.feat_total
            )
            for s in slices
        ]
        return hidden_UE, lens_B, outs

    def forward(
        self, feats_BTF: Tensor, feat_lens_B: Tensor, *, packed: bool = False
    ) -> tuple[Tensor, Tensor]:
        if packed:
            feats_TF = feats_BTF
            if feats_TF.dim() != 2 or feats_TF.shape[0] != int(feat_lens_B.sum()):
                raise ValueError(
                    f"packed features must be [sum of feat_lens, F] = [{int(feat_lens_B.sum())}, F], "
                    f"got shape {tuple(feats_TF.shape)}"
                )
            return forward_packed_parakeet(
                self.model, feats_TF, feat_lens_B.to(feats_TF.device), self.n_convs, self.att_context
            )
        if self.att_context is not None:
            raise ValueError(
                f"model.encoder.att_context_size={list(self.att_context)} runs on the padding-free encoder only: "
                "leave model.encoder.packed unset (or true), or use full context (att_context_size=null)"
            )
        T = feats_BTF.shape[1]
        mask_BT = lengths_to_mask(feat_lens_B.to(feats_BTF.device), T)
        out = self.model(input_features=feats_BTF, attention_mask=mask_BT.long())
        return self._finish(out.last_hidden_state, self.output_lengths(feat_lens_B.to(feats_BTF.device)), T)


def _set_parakeet_dropout(cfg: Any, dropout: float) -> None:
    cfg.dropout = dropout
    cfg.attention_dropout = dropout
    cfg.activation_dropout = dropout
    cfg.dropout_positions = 0.0
    cfg.layerdrop = 0.0


def build_parakeet_config(enc_cfg: EncoderConfig, *, dropout: float) -> Any:

    from transformers import (
        ParakeetEncoderConfig,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )

    cfg = ParakeetEncoderConfig(
        hidden_size=enc_cfg.hidden_size,
        num_hidden_layers=enc_cfg.num_layers,
        num_attention_heads=enc_cfg.num_heads,
        intermediate_size=enc_cfg.intermediate_size,
        subsampling_conv_channels=enc_cfg.subsampling_conv_channels,
        num_mel_bins=enc_cfg.num_mel_bins,
        subsampling_factor=enc_cfg.subsampling_factor or DEFAULT_SUBSAMPLING,
    )
    _set_parakeet_dropout(cfg, dropout)
    return cfg


def _parakeet_feature_settings(n_mels: int, pre: dict[str, Any]) -> FeatureSettings:
    return FeatureSettings(
        n_mels=int(pre.get("feature_size", n_mels)),
        sample_rate=int(pre.get("sampling_rate", SAMPLE_RATE)),
        n_fft=int(pre.get("n_fft", 512)),
        win_length=int(pre.get("win_length", 400)),
        hop_length=int(pre.get("hop_length", HOP_SAMPLES)),
        preemphasis=float(pre.get("preemphasis", 0.97) or 0.0),
        log_style="ln",
    )


def load_parakeet_encoder(
    path: str | Path, *, dropout: float, freeze_batchnorm: bool = True
) -> ParakeetAudioEncoder:
    """Load a saved ``ParakeetEncoder`` (or the encoder of a ``ParakeetForCTC``) from a local directory."""
    from transformers import (  # lazy: transformers (seconds to import; commands that build no model skip it)
        AutoConfig,
        ParakeetEncoder,
        ParakeetForCTC,
    )

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"encoder.pretrained={str(path)!r} is not a directory (a local save_pretrained dir)"
        )
    cfg = AutoConfig.from_pretrained(path)
    if cfg.model_type == "parakeet_encoder":
        _set_parakeet_dropout(cfg, dropout)
        model = ParakeetEncoder.from_pretrained(
            path, config=cfg, attn_implementation="sdpa", dtype=torch.float32
        )
    elif cfg.model_type == "parakeet_ctc":
        _set_parakeet_dropout(cfg.encoder_config, dropout)
        model = ParakeetForCTC.from_pretrained(
            path, config=cfg, attn_implementation="sdpa", dtype=torch.float32
        ).encoder
    else:
        raise ValueError(
            f"{path}: model_type {cfg.model_type!r} is not a Parakeet model; use encoder.kind="
            "'whisper' or 'nemo' for other checkpoints"
        )
    settings = _parakeet_feature_settings(model.config.num_mel_bins, read_preprocessor_json(path))
    if settings.n_mels != model.config.num_mel_bins:
        raise ValueError(
            f"{path}: preprocessor has {settings.n_mels} mel bins, the encoder expects "
            f"{model.config.num_mel_bins}"
        )
    return ParakeetAudioEncoder(model, settings, freeze_batchnorm=freeze_batchnorm)


# ---------------------------------------------------------------------------------------------
# Whisper
# ---------------------------------------------------------------------------------------------


def build_parakeet_encoder(
    enc_cfg: EncoderConfig, *, dropout: float, freeze_batchnorm: bool = True
) -> ParakeetAudioEncoder:
    """A from-scratch FastConformer from ``enc_cfg``, or the one saved at ``enc_cfg.pretrained``."""
    from transformers import (
        ParakeetEncoder,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )

    if enc_cfg.pretrained:
        encoder = load_parakeet_encoder(
            enc_cfg.pretrained, dropout=dropout, freeze_batchnorm=freeze_batchnorm
        )
        encoder.att_context = enc_cfg.limited_context()
        return encoder

    cfg = build_parakeet_config(enc_cfg, dropout=dropout)
    model = ParakeetEncoder._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float32)
    if enc_cfg.conv_norm in ("auto", "layer_norm"):
        replace_conv_batchnorm(model)
    settings = FeatureSettings(n_mels=enc_cfg.num_mel_bins)
    encoder = ParakeetAudioEncoder(model, settings, freeze_batchnorm=freeze_batchnorm)
    encoder.att_context = enc_cfg.limited_context()
    return encoder
