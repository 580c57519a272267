"""Audio encoders behind one interface: ``forward(feats_BTF, feat_lens_B) -> (hidden_BTE, out_lens_B)``.

Encoders with ``supports_packed`` (Parakeet) also take packed features: ``forward(feats_TF,
feat_lens_B, packed=True) -> (hidden_UE, out_lens_B)``, every clip's frames one after the other, no
padding computed (`speechlm.model.packed_encoder`); the hidden states equal the padded ones per clip.

Letters: B batch, T feature frames, F mel bins, U encoder frames (T / subsampling), E encoder width.

Kinds (``EncoderConfig.kind``):
- ``parakeet``: transformers' ``ParakeetEncoder`` (FastConformer, 8x subsampling by three stride-2
  convolutions), built from the config or loaded from a local directory holding a saved
  ``ParakeetEncoder`` or ``ParakeetForCTC``. Output length per conv: ``(L - 1) // 2 + 1``.
- ``whisper``: transformers' ``WhisperEncoder``. It only accepts exactly ``2 * max_source_positions``
  frames (3000 = 30 s by default), so the features are padded to that length with each clip's floor
  value and the output is cut back to ``(L - 1) // 2 + 1`` frames (2x subsampling). Whisper has no
  padding mask: pad frames are attended to, as in Whisper's own training. Clips over 30 s are errors.
- ``nemo``: a NeMo ASR checkpoint (``.nemo``); its encoder and its preprocessor settings (which
  configure our `LogMelFeatures`) are restored lazily (``pip install speechlm[nemo]``).

Determinism. ``dropout`` sets every dropout probability of the encoder; layer drop, positional
dropout and SpecAugment are always off. FastConformer's convolution module uses BatchNorm; with
``freeze_batchnorm=True`` (default) BatchNorm always uses its running statistics, also in train
mode. Batch statistics would make an utterance's encoding depend on the other clips in the batch
(and on the padding), so encoding 1/cp of the clips per CP rank, or splitting a batch over dp
ranks, would change the gradients.
"""

from __future__ import annotations

import abc
import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechlm.config import EncoderConfig
from speechlm.model.features import FeatureSettings

NEMO_INSTALL_HINT = "pip install speechlm[nemo]"


def _stride2_conv_lengths(lens_B: Tensor, n_convs: int) -> Tensor:
    """Output length of ``n_convs`` convolutions with kernel 3, stride 2, padding 1."""
    out = lens_B.to(torch.long)
    for _ in range(n_convs):
        out = torch.div(out - 1, 2, rounding_mode="floor") + 1
    return out.clamp(min=0)


def _lengths_to_mask(lens_B: Tensor, max_len: int) -> Tensor:
    return torch.arange(max_len, device=lens_B.device)[None, :] < lens_B[:, None]


class AudioEncoder(nn.Module, abc.ABC):
    """Base class: a wrapped encoder with its output width, subsampling and front-end settings.

    Subclasses (Parakeet, Whisper, NeMo) implement `output_lengths` and `forward`."""

    supports_packed: bool = False
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
        valid_BU1 = _lengths_to_mask(out_lens_B, hidden_BUE.shape[1]).unsqueeze(-1)
        return hidden_BUE.masked_fill(~valid_BU1, 0.0), out_lens_B


# ---------------------------------------------------------------------------------------------
# Parakeet (FastConformer)
# ---------------------------------------------------------------------------------------------


class ParakeetAudioEncoder(AudioEncoder):
    supports_packed = True

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

    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        return _stride2_conv_lengths(feat_lens_B, self.n_convs)

    def forward(
        self, feats_BTF: Tensor, feat_lens_B: Tensor, *, packed: bool = False
    ) -> tuple[Tensor, Tensor]:
        if packed:
            from speechlm.model.packed_encoder import forward_packed_parakeet

            feats_TF = feats_BTF
            if feats_TF.dim() != 2 or feats_TF.shape[0] != int(feat_lens_B.sum()):
                raise ValueError(
                    f"packed features must be [sum of feat_lens, F] = [{int(feat_lens_B.sum())}, F], "
                    f"got shape {tuple(feats_TF.shape)}"
                )
            return forward_packed_parakeet(
                self.model, feats_TF, feat_lens_B.to(feats_TF.device), self.n_convs
            )
        T = feats_BTF.shape[1]
        mask_BT = _lengths_to_mask(feat_lens_B.to(feats_BTF.device), T)
        out = self.model(input_features=feats_BTF, attention_mask=mask_BT.long())
        return self._finish(out.last_hidden_state, self.output_lengths(feat_lens_B.to(feats_BTF.device)), T)


def _set_parakeet_dropout(cfg: Any, dropout: float) -> None:
    cfg.dropout = dropout
    cfg.attention_dropout = dropout
    cfg.activation_dropout = dropout
    cfg.dropout_positions = 0.0
    cfg.layerdrop = 0.0


def build_parakeet_config(enc_cfg: EncoderConfig, *, dropout: float) -> Any:
    from transformers import ParakeetEncoderConfig

    cfg = ParakeetEncoderConfig(
        hidden_size=enc_cfg.hidden_size,
        num_hidden_layers=enc_cfg.num_layers,
        num_attention_heads=enc_cfg.num_heads,
        intermediate_size=enc_cfg.intermediate_size,
        subsampling_conv_channels=enc_cfg.subsampling_conv_channels,
        num_mel_bins=enc_cfg.num_mel_bins,
    )
    _set_parakeet_dropout(cfg, dropout)
    return cfg


def _read_preprocessor_json(path: Path) -> dict[str, Any]:
    f = path / "preprocessor_config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _parakeet_feature_settings(n_mels: int, pre: dict[str, Any]) -> FeatureSettings:
    return FeatureSettings(
        n_mels=int(pre.get("feature_size", n_mels)),
        sample_rate=int(pre.get("sampling_rate", 16000)),
        n_fft=int(pre.get("n_fft", 512)),
        win_length=int(pre.get("win_length", 400)),
        hop_length=int(pre.get("hop_length", 160)),
        preemphasis=float(pre.get("preemphasis", 0.97) or 0.0),
        log_style="ln",
    )


def load_parakeet_encoder(
    path: str | Path, *, dropout: float, freeze_batchnorm: bool = True
) -> ParakeetAudioEncoder:
    """Load a saved ``ParakeetEncoder`` (or the encoder of a ``ParakeetForCTC``) from a local directory."""
    from transformers import AutoConfig, ParakeetEncoder, ParakeetForCTC

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
    settings = _parakeet_feature_settings(model.config.num_mel_bins, _read_preprocessor_json(path))
    if settings.n_mels != model.config.num_mel_bins:
        raise ValueError(
            f"{path}: preprocessor has {settings.n_mels} mel bins, the encoder expects "
            f"{model.config.num_mel_bins}"
        )
    return ParakeetAudioEncoder(model, settings, freeze_batchnorm=freeze_batchnorm)


# ---------------------------------------------------------------------------------------------
# Whisper
# ---------------------------------------------------------------------------------------------


class WhisperAudioEncoder(AudioEncoder):
    def __init__(self, model: nn.Module, feature_settings: FeatureSettings):
        cfg: Any = model.config
        super().__init__(
            output_dim=int(cfg.d_model),
            subsampling=2,
            feature_settings=feature_settings,
            freeze_batchnorm=False,
        )
        self.model = model
        self.input_frames = 2 * int(cfg.max_source_positions)

    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        return _stride2_conv_lengths(feat_lens_B, 1)

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
        valid_BT1 = _lengths_to_mask(lens_B, T).unsqueeze(-1)
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
        sample_rate=int(pre.get("sampling_rate", 16000)),
        n_fft=int(pre.get("n_fft", 400)),
        win_length=int(pre.get("n_fft", 400)),
        hop_length=int(pre.get("hop_length", 160)),
        preemphasis=0.0,
        log_style="whisper",
        normalize=False,
        window_periodic=True,
    )


def build_whisper_encoder(
    enc_cfg: EncoderConfig, *, dropout: float, max_source_positions: int = 1500
) -> WhisperAudioEncoder:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

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


def load_whisper_encoder(path: str | Path, *, dropout: float) -> WhisperAudioEncoder:
    """Load the encoder of a local Whisper directory (a saved ``WhisperEncoder`` or a full Whisper model)."""
    from transformers import AutoConfig, WhisperModel
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"encoder.pretrained={str(path)!r} is not a directory (a local save_pretrained dir)"
        )
    cfg = AutoConfig.from_pretrained(path)
    if cfg.model_type != "whisper":
        raise ValueError(f"{path}: model_type {cfg.model_type!r} is not 'whisper'")
    _set_whisper_dropout(cfg, dropout)
    loaded: Any = WhisperEncoder.from_pretrained(
        path, config=cfg, attn_implementation="sdpa", dtype=torch.float32, output_loading_info=True
    )
    model, info = loaded
    if info.get("missing_keys"):  # a full encoder-decoder checkpoint: keys live under model.encoder.*
        model = WhisperModel.from_pretrained(
            path, config=cfg, attn_implementation="sdpa", dtype=torch.float32
        ).get_encoder()
    return WhisperAudioEncoder(
        model, _whisper_feature_settings(cfg.num_mel_bins, _read_preprocessor_json(path))
    )


# ---------------------------------------------------------------------------------------------
# NeMo
# ---------------------------------------------------------------------------------------------


class NemoAudioEncoder(AudioEncoder):
    """A NeMo ``ConformerEncoder``-like module: ``encoder(audio_signal=[B, F, T], length=[B]) -> ([B, E, U], [B])``."""

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
        return _stride2_conv_lengths(feat_lens_B, n_convs)

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
        valid_BU1 = _lengths_to_mask(out_lens_B, hidden_BUE.shape[1]).unsqueeze(-1)
        return hidden_BUE.masked_fill(~valid_BU1, 0.0), out_lens_B


def import_nemo_asr() -> Any:
    try:
        import nemo.collections.asr as nemo_asr  # type: ignore[import-not-found]
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

    sr = int(get("sample_rate", 16000))
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
    subsampling = int(enc_cfg["subsampling_factor"]) if "subsampling_factor" in enc_cfg else 8
    return NemoAudioEncoder(
        asr.encoder,
        nemo_feature_settings(cfg["preprocessor"]),
        output_dim=output_dim,
        subsampling=subsampling,
        freeze_batchnorm=freeze_batchnorm,
    )


# ---------------------------------------------------------------------------------------------


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


def build_encoder(enc_cfg: EncoderConfig, *, dropout: float, freeze_batchnorm: bool = True) -> AudioEncoder:
    """Build the configured encoder from its config, or load it from ``enc_cfg.pretrained``.

    The BatchNorm freeze is applied here, at construction: a fresh module is in training mode without
    `train()` ever being called, and BatchNorm on batch statistics makes a clip's encoding depend on the
    other clips of its batch (which breaks CP/DP equivalence and lets a dummy clip change results).
    """
    if enc_cfg.pretrained and enc_cfg.conv_norm == "layer_norm":
        raise ValueError(
            f"model.encoder.conv_norm=layer_norm cannot be used with a pretrained encoder "
            f"({enc_cfg.pretrained}): its BatchNorm weights would be discarded; use conv_norm=auto or batch_norm"
        )
    encoder = _build_encoder(enc_cfg, dropout=dropout, freeze_batchnorm=freeze_batchnorm)
    return encoder.train(encoder.training)


def _build_encoder(enc_cfg: EncoderConfig, *, dropout: float, freeze_batchnorm: bool) -> AudioEncoder:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    kind = enc_cfg.kind
    if kind == "parakeet":
        if enc_cfg.pretrained:
            return load_parakeet_encoder(
                enc_cfg.pretrained, dropout=dropout, freeze_batchnorm=freeze_batchnorm
            )
        from transformers import ParakeetEncoder

        cfg = build_parakeet_config(enc_cfg, dropout=dropout)
        model = ParakeetEncoder._from_config(
            copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float32
        )
        if enc_cfg.conv_norm in ("auto", "layer_norm"):
            replace_conv_batchnorm(model)
        settings = FeatureSettings(n_mels=enc_cfg.num_mel_bins)
        return ParakeetAudioEncoder(model, settings, freeze_batchnorm=freeze_batchnorm)
    if kind == "whisper":
        if enc_cfg.pretrained:
            return load_whisper_encoder(enc_cfg.pretrained, dropout=dropout)
        return build_whisper_encoder(enc_cfg, dropout=dropout)
    if kind == "nemo":
        if not enc_cfg.pretrained:
            raise ValueError("encoder.kind='nemo' needs encoder.pretrained=<path to a .nemo file>")
        return load_nemo_encoder(enc_cfg.pretrained, dropout=dropout, freeze_batchnorm=freeze_batchnorm)
    raise ValueError(f"encoder.kind={kind!r} is not known; use 'parakeet', 'whisper' or 'nemo'")
