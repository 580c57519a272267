"""``whisper``: transformers' ``WhisperEncoder``. It only accepts exactly ``2 * max_source_positions``
frames (3000 = 30 s by default), so the features are padded to that length with each clip's floor
value and the output is cut back to ``(L - 1) // 2 + 1`` frames (2x subsampling). Whisper has no
padding mask: pad frames are attended to, as in Whisper's own training. Clips over 30 s are errors.

Letters: B batch, T feature frames, F mel bins, U encoder frames (T / 2), E encoder width.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from parallel.frames import ENCODER_SUBSAMPLING, HOP_SAMPLES, SAMPLE_RATE
from speechlm.config import EncoderConfig
from speechlm.model.encoders.base import (
    AudioEncoder,
    lengths_to_mask,
    read_preprocessor_json,
    stride2_conv_lengths,
)
from speechlm.model.features import FeatureSettings


class WhisperAudioEncoder(AudioEncoder):
    kind = "whisper"

    def __init__(self, model: nn.Module, feature_settings: FeatureSettings):
        cfg: Any = model.config
        super().__init__(
            output_dim=int(cfg.d_model),
            subsampling=ENCODER_SUBSAMPLING["whisper"],
            feature_settings=feature_settings,
            freeze_batchnorm=False,
        )
        self.model = model
        self.input_frames = 2 * int(cfg.max_source_positions)

    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        return stride2_conv_lengths(feat_lens_B, 1)

    def forward(
        self, feats_BTF: Tensor, feat_lens_B: Tensor, *, packed: bool = False
    ) -> tuple[Tensor, Tensor]:
        self._refuse_packed(packed)
        B, T, F = feats_BTF.shape
        if T > self.input_frames:
            raise ValueError(
                f"whisper encoder takes at most {self.input_frames} frames "
                f"({self.input_frames * self.feature_settings.hop_length / self.feature_settings.sample_rate:.0f} s)"
                f", got {T}; drop longer clips in the manifest or use encoder.kind='parakeet'"
            )
        lens_B = feat_lens_B.to(feats_BTF.device)
        valid_BT1 = lengths_to_mask(lens_B, T).unsqueeze(-1)
        floor_B11 = feats_BTF.masked_fill(~valid_BT1, float("inf")).amin(dim=(1, 2), keepdim=True)
        floor_B11 = torch.where(torch.isfinite(floor_B11), floor_B11, torch.zeros_like(floor_B11))
        x_BTF = torch.where(valid_BT1, feats_BTF, floor_B11)
        pad_B_F = floor_B11.expand(B, self.input_frames - T, F)
        x_BFT = torch.cat([x_BTF, pad_B_F], dim=1).transpose(1, 2)
        hidden = self.model(input_features=x_BFT).last_hidden_state
        out_lens_B = self.output_lengths(lens_B)
        hidden = hidden[:, : int(self.output_lengths(torch.tensor([T]))[0])]
        return self._finish(hidden, out_lens_B, T)


def _set_whisper_dropout(cfg: Any, dropout: float) -> None:
    cfg.dropout = dropout
    cfg.attention_dropout = dropout
    cfg.activation_dropout = dropout
    cfg.encoder_layerdrop = 0.0
    cfg.apply_spec_augment = False


def _whisper_feature_settings(n_mels: int, pre: dict[str, Any]) -> FeatureSettings:
    return FeatureSettings(
        n_mels=int(pre.get("feature_size", n_mels)),
        sample_rate=int(pre.get("sampling_rate", SAMPLE_RATE)),
        n_fft=int(pre.get("n_fft", 400)),
        win_length=int(pre.get("n_fft", 400)),
        hop_length=int(pre.get("hop_length", HOP_SAMPLES)),
        preemphasis=0.0,
        log_style="whisper",
        normalize=False,
        window_periodic=True,
    )


def build_whisper_encoder(
    enc_cfg: EncoderConfig, *, dropout: float, max_source_positions: int = 1500
) -> WhisperAudioEncoder:

    from transformers import (
        WhisperConfig,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )
    from transformers.models.whisper.modeling_whisper import (
        WhisperEncoder,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )

    cfg = WhisperConfig(
        d_model=enc_cfg.hidden_size,
        encoder_layers=enc_cfg.num_layers,
        encoder_attention_heads=enc_cfg.num_heads,
        encoder_ffn_dim=enc_cfg.intermediate_size,
        num_mel_bins=enc_cfg.num_mel_bins,
        max_source_positions=max_source_positions,
    )
    _set_whisper_dropout(cfg, dropout)
    model = WhisperEncoder._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float32)
    return WhisperAudioEncoder(model, _whisper_feature_settings(enc_cfg.num_mel_bins, {}))


_ENCODER_PREFIXES = ("model.encoder.", "encoder.")  # WhisperForConditionalGeneration, WhisperModel


def _full_model_encoder_weights(path: Path) -> dict[str, Tensor] | None:
    """The encoder tensors of a full Whisper checkpoint (``model.encoder.*`` in ``model.safetensors``, as
    `speechlm encoder import` and transformers' ``WhisperForConditionalGeneration`` save it; ``encoder.*`` for a
    ``WhisperModel``), as float32, with the prefix removed; None for an encoder-only directory (or a sharded /
    non-safetensors one, which transformers loads)."""
    from safetensors import safe_open  # lazy: comes with transformers

    file = path / "model.safetensors"
    if not file.is_file():
        return None
    with safe_open(str(file), framework="pt") as f:
        names = list(f.keys())
        for prefix in _ENCODER_PREFIXES:
            keys = [k for k in names if k.startswith(prefix)]
            if keys:
                return {k[len(prefix) :]: f.get_tensor(k).float() for k in keys}
    return None


def load_whisper_encoder(path: str | Path, *, dropout: float) -> WhisperAudioEncoder:
    """Load the encoder of a local Whisper directory (a saved ``WhisperEncoder`` or a full Whisper model)."""
    from transformers import (
        AutoConfig,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )
    from transformers.models.whisper.modeling_whisper import (
        WhisperEncoder,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"encoder.pretrained={str(path)!r} is not a directory (a local save_pretrained dir)"
        )
    cfg = AutoConfig.from_pretrained(path)
    if cfg.model_type != "whisper":
        raise ValueError(f"{path}: model_type {cfg.model_type!r} is not 'whisper'")
    _set_whisper_dropout(cfg, dropout)
    full = _full_model_encoder_weights(path)
    if full is not None:  # an encoder-decoder checkpoint: only its model.encoder.* tensors are read
        model = WhisperEncoder._from_config(
            copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float32
        )
        missing, unexpected = model.load_state_dict(full, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path}: its model.encoder.* tensors do not fit a Whisper encoder of its config.json "
                f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
            )
    else:
        loaded: Any = WhisperEncoder.from_pretrained(
            path, config=cfg, attn_implementation="sdpa", dtype=torch.float32, output_loading_info=True
        )
        model, info = loaded
        if info.get("missing_keys"):  # never train on an encoder left partly at random
            raise ValueError(
                f"{path}: has no weights for {sorted(info['missing_keys'])[:4]} of the Whisper encoder; give a "
                "directory saved from a WhisperEncoder, WhisperModel or WhisperForConditionalGeneration"
            )
    return WhisperAudioEncoder(
        model, _whisper_feature_settings(cfg.num_mel_bins, read_preprocessor_json(path))
    )


# ---------------------------------------------------------------------------------------------
# NeMo
# ---------------------------------------------------------------------------------------------
