"""``whisper``: transformers' ``WhisperEncoder``, in one of two windows (``model.encoder.whisper_window``).

``full`` (the default; Whisper as trained): the encoder reads exactly ``2 * max_source_positions`` frames
(3000 = 30 s). `window_input` builds that input from the front end's frames, which are Whisper's own
(`speechlm.model.features`: each clip's frames, its tail, then its floor) followed by the floor value up to
the window (the value Whisper's zero-padded audio gives there), so the encoder sees what it sees behind
transformers' ``WhisperFeatureExtractor``. Whisper has no padding mask: every clip attends to its 30 s,
silence included. The output is cut back to ``(L - 1) // 2 + 1`` frames per clip (2x subsampling).

``clip`` (opt-in, whisper.cpp's ``audio_ctx``): the convolutions run on the clip's frames, the positional
embedding is sliced to the clip's ``U`` encoder frames, and each clip attends to its own ``U`` frames only
(a key mask, so a clip's output does not depend on its batch). Far cheaper on short clips, but not what the
encoder was trained on: docs/pretrained.md has the measured difference. Clips over 30 s are errors in both.

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
from speechlm.model.encoders.base import AudioEncoder, read_preprocessor_json, stride2_conv_lengths
from speechlm.model.features import FeatureSettings

WHISPER_WINDOWS = ("full", "clip")


class WhisperAudioEncoder(AudioEncoder):
    kind = "whisper"

    def __init__(self, model: nn.Module, feature_settings: FeatureSettings, *, window: str = "full"):
        cfg: Any = model.config
        super().__init__(
            output_dim=int(cfg.d_model),
            subsampling=ENCODER_SUBSAMPLING["whisper"],
            feature_settings=feature_settings,
            freeze_batchnorm=False,
        )
        if window not in WHISPER_WINDOWS:
            raise ValueError(f"whisper window {window!r} is not known; use one of {WHISPER_WINDOWS}")
        self.model = model
        self.window = window
        self.input_frames = 2 * int(cfg.max_source_positions)

    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        return stride2_conv_lengths(feat_lens_B, 1)

    def _clip_frames(self, feat_lens_B: Tensor) -> int:
        """The longest clip's frames (one host read), refused past the window."""
        n = int(feat_lens_B.max()) if feat_lens_B.numel() else 0
        if n > self.input_frames:
            s = self.feature_settings
            raise ValueError(
                f"whisper encoder takes at most {self.input_frames} frames "
                f"({self.input_frames * s.hop_length / s.sample_rate:.0f} s), got {n}; drop longer clips in "
                "the manifest or use encoder.kind='parakeet'"
            )
        return n

    def window_input(self, feats_BTF: Tensor, feat_lens_B: Tensor) -> Tensor:
        """``[B, F, input_frames]``: what the ``full`` window feeds ``WhisperEncoder``: the front end's frames
        (each clip's own, its tail, its floor), then each clip's floor (the row's minimum: the front end's
        last frame reads only zeros) up to the window, as Whisper's zero-padded 30 s give."""
        self._clip_frames(feat_lens_B)
        return self._window(feats_BTF)

    def _window(self, feats_BTF: Tensor) -> Tensor:
        B, _, F = feats_BTF.shape
        x_BTF = feats_BTF[:, : self.input_frames]
        floor_B11 = x_BTF.amin(dim=(1, 2), keepdim=True)
        pad_BTF = floor_B11.expand(B, self.input_frames - x_BTF.shape[1], F)
        return torch.cat([x_BTF, pad_BTF], dim=1).transpose(1, 2)

    def forward(
        self, feats_BTF: Tensor, feat_lens_B: Tensor, *, packed: bool = False
    ) -> tuple[Tensor, Tensor]:
        self._refuse_packed(packed)
        lens_B = feat_lens_B.to(feats_BTF.device)
        n = self._clip_frames(lens_B)
        out_lens_B = self.output_lengths(lens_B)
        U = int(self.output_lengths(torch.tensor([n]))[0])
        if self.window == "clip":
            hidden = self._forward_clip(feats_BTF, out_lens_B, U)
        else:
            hidden = self.model(input_features=self._window(feats_BTF)).last_hidden_state[:, :U]
        return self._finish(hidden, out_lens_B, n)

    def _forward_clip(self, feats_BTF: Tensor, out_lens_B: Tensor, U: int) -> Tensor:
        """``WhisperEncoder.forward`` on the clips' own ``U`` encoder frames: the convolutions read the
        front end's frames (the tail frames included, so the clip's frames get what the full window gives
        them), positions ``0..U-1``, attention over each clip's own frames."""
        m: Any = self.model
        x_BFT = feats_BTF[:, : self.input_frames].transpose(1, 2)
        x_BEU = nn.functional.gelu(m.conv2(nn.functional.gelu(m.conv1(x_BFT))))
        h_BUE = x_BEU.transpose(1, 2)[:, :U] + m.embed_positions.weight[:U]
        h_BUE = nn.functional.dropout(h_BUE, p=m.dropout, training=self.training)
        # a clip of no frame keeps key 0 (its output is zeroed by _finish): a fully masked row would be NaN
        keep_BU = torch.arange(U, device=h_BUE.device)[None, :] < out_lens_B.clamp(min=1)[:, None]
        mask_B11U = torch.zeros(keep_BU.shape, dtype=h_BUE.dtype, device=h_BUE.device)
        mask_B11U = mask_B11U.masked_fill(~keep_BU, torch.finfo(h_BUE.dtype).min)[:, None, None, :]
        for layer in m.layers:
            h_BUE = layer(h_BUE, mask_B11U)
        return m.layer_norm(h_BUE)


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
    return WhisperAudioEncoder(
        model, _whisper_feature_settings(enc_cfg.num_mel_bins, {}), window=enc_cfg.whisper_window
    )


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


def load_whisper_encoder(path: str | Path, *, dropout: float, window: str = "full") -> WhisperAudioEncoder:
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
        model, _whisper_feature_settings(cfg.num_mel_bins, read_preprocessor_json(path)), window=window
    )


# ---------------------------------------------------------------------------------------------
# NeMo
# ---------------------------------------------------------------------------------------------
