"""``nemo``: a NeMo ASR checkpoint (``.nemo``); its encoder and its preprocessor settings (which
configure our `LogMelFeatures`) are restored lazily (``pip install speechlm[nemo]``).

Letters: B batch, T feature frames, F mel bins, U encoder frames, E encoder width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from parallel.frames import ENCODER_SUBSAMPLING, SAMPLE_RATE
from speechlm.model.encoders.base import AudioEncoder, lengths_to_mask, stride2_conv_lengths
from speechlm.model.features import FeatureSettings

NEMO_INSTALL_HINT = "pip install speechlm[nemo]"


class NemoAudioEncoder(AudioEncoder):
    """A NeMo ``ConformerEncoder``-like module: ``encoder(audio_signal=[B, F, T], length=[B]) -> ([B, E, U], [B])``."""

    kind = "nemo"

    def __init__(
        self,
        encoder: nn.Module,
        feature_settings: FeatureSettings,
        *,
        output_dim: int,
        subsampling: int,
        freeze_batchnorm: bool = True,
    ):
        super().__init__(
            output_dim=output_dim,
            subsampling=subsampling,
            feature_settings=feature_settings,
            freeze_batchnorm=freeze_batchnorm,
        )
        self.encoder = encoder

    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        n_convs = (self.subsampling - 1).bit_length()
        return stride2_conv_lengths(feat_lens_B, n_convs)

    def forward(
        self, feats_BTF: Tensor, feat_lens_B: Tensor, *, packed: bool = False
    ) -> tuple[Tensor, Tensor]:
        self._refuse_packed(packed)
        lens_B = feat_lens_B.to(device=feats_BTF.device, dtype=torch.long)
        hidden_BEU, out_lens_B = self.encoder(audio_signal=feats_BTF.transpose(1, 2), length=lens_B)
        hidden_BUE = hidden_BEU.transpose(1, 2)
        out_lens_B = out_lens_B.to(torch.long)
        if out_lens_B.numel() and int(out_lens_B.max()) > hidden_BUE.shape[1]:
            raise RuntimeError(
                f"NeMo encoder returned lengths up to {int(out_lens_B.max())} for {hidden_BUE.shape[1]} frames"
            )
        valid_BU1 = lengths_to_mask(out_lens_B, hidden_BUE.shape[1]).unsqueeze(-1)
        return hidden_BUE.masked_fill(~valid_BU1, 0.0), out_lens_B


def import_nemo_asr() -> Any:
    try:
        import nemo.collections.asr as nemo_asr  # type: ignore[import-not-found]  # lazy: nemo (optional)
    except ImportError as e:
        raise ImportError(
            f"encoder.kind='nemo' needs the NeMo toolkit, which is not installed ({e}); run "
            f"`{NEMO_INSTALL_HINT}`, or use encoder.kind='parakeet' with a transformers checkpoint"
        ) from e
    return nemo_asr


_NEMO_DROPOUT_KEYS = ("dropout", "dropout_pre_encoder", "dropout_emb", "dropout_att")


def configure_nemo_config(cfg: Any, *, dropout: float) -> None:
    """Edit a restored NeMo model config in place: dropouts, no stochastic depth/SpecAugment/dither.

    Only keys that exist are set (NeMo configs are struct-mode OmegaConf objects).
    """
    enc = cfg["encoder"]
    for key in _NEMO_DROPOUT_KEYS:
        if key in enc:
            enc[key] = dropout
    if "stochastic_depth_drop_prob" in enc:
        enc["stochastic_depth_drop_prob"] = 0.0
    if "spec_augment" in cfg:
        cfg["spec_augment"] = None
    pre = cfg["preprocessor"]
    for key, value in (("dither", 0.0), ("pad_to", 0)):
        if key in pre:
            pre[key] = value


def nemo_feature_settings(pre: Any) -> FeatureSettings:
    """Map a NeMo ``AudioToMelSpectrogramPreprocessor`` config onto `FeatureSettings`."""

    def get(key: str, default: Any) -> Any:
        value = pre[key] if key in pre else None
        return default if value is None else value

    sr = int(get("sample_rate", SAMPLE_RATE))
    win = int(get("n_window_size", round(float(get("window_size", 0.02)) * sr)))
    hop = int(get("n_window_stride", round(float(get("window_stride", 0.01)) * sr)))
    n_fft = int(get("n_fft", 1 << (win - 1).bit_length()))
    normalize = get("normalize", "per_feature")
    if normalize not in ("per_feature", "NA", "none", False):
        raise ValueError(
            f"NeMo preprocessor normalize={normalize!r} is not supported; only 'per_feature' or 'NA'"
        )
    window = get("window", "hann")
    if window != "hann":
        raise ValueError(f"NeMo preprocessor window={window!r} is not supported; only 'hann'")
    if not get("log", True):
        raise ValueError("NeMo preprocessor log=False is not supported")
    if float(get("mag_power", 2.0)) != 2.0:
        raise ValueError(f"NeMo preprocessor mag_power={get('mag_power', 2.0)} is not supported; only 2.0")
    return FeatureSettings(
        n_mels=int(get("features", 64)),
        sample_rate=sr,
        n_fft=n_fft,
        win_length=win,
        hop_length=hop,
        preemphasis=float(get("preemph", 0.97) or 0.0),
        log_style="ln",
        normalize=normalize == "per_feature",
        mel_norm=get("mel_norm", "slaney"),
        f_min=float(get("lowfreq", 0.0)),
        f_max=get("highfreq", None),
    )


def load_nemo_encoder(path: str | Path, *, dropout: float, freeze_batchnorm: bool = True) -> NemoAudioEncoder:
    """Restore the encoder and the preprocessor settings of a ``.nemo`` ASR checkpoint (CPU first)."""
    path = Path(path)
    if path.suffix != ".nemo" or not path.is_file():
        raise FileNotFoundError(
            f"encoder.pretrained={str(path)!r} must be an existing .nemo file for kind='nemo'"
        )
    nemo_asr = import_nemo_asr()
    asr_cls = nemo_asr.models.ASRModel
    cfg = asr_cls.restore_from(restore_path=str(path), return_config=True, map_location=torch.device("cpu"))
    configure_nemo_config(cfg, dropout=dropout)
    asr = asr_cls.restore_from(
        restore_path=str(path), override_config_path=cfg, map_location=torch.device("cpu")
    )
    enc_cfg = cfg["encoder"]
    output_dim = int(enc_cfg["d_model"])
    default = ENCODER_SUBSAMPLING["nemo"]
    subsampling = int(enc_cfg["subsampling_factor"]) if "subsampling_factor" in enc_cfg else default
    return NemoAudioEncoder(
        asr.encoder,
        nemo_feature_settings(cfg["preprocessor"]),
        output_dim=output_dim,
        subsampling=subsampling,
        freeze_batchnorm=freeze_batchnorm,
    )
