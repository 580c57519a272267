"""Audio encoders behind one interface: ``forward(feats_BTF, feat_lens_B) -> (hidden_BTE, out_lens_B)``.

Encoders with ``supports_packed`` (Parakeet) also take packed features: ``forward(feats_TF,
feat_lens_B, packed=True) -> (hidden_UE, out_lens_B)``, every clip's frames one after the other, no
padding computed (`speechlm.model.packed_encoder`); the hidden states equal the padded ones per clip.

Letters: B batch, T feature frames, F mel bins, U encoder frames (T / subsampling), E encoder width.

Kinds (``EncoderConfig.kind``), one module each, built by `build_encoder` (the shared interface and
helpers are in `speechlm.model.encoders.base`):
- ``parakeet`` (`.parakeet`): transformers' ``ParakeetEncoder`` (FastConformer, 8x subsampling by three stride-2
  convolutions), built from the config or loaded from a local directory holding a saved
  ``ParakeetEncoder`` or ``ParakeetForCTC``. Output length per conv: ``(L - 1) // 2 + 1``.
- ``whisper`` (`.whisper`): transformers' ``WhisperEncoder``. It only accepts exactly ``2 * max_source_positions``
  frames (3000 = 30 s by default), so the features are padded to that length with each clip's floor
  value and the output is cut back to ``(L - 1) // 2 + 1`` frames (2x subsampling). Whisper has no
  padding mask: pad frames are attended to, as in Whisper's own training. Clips over 30 s are errors.
- ``nemo`` (`.nemo`): a NeMo ASR checkpoint (``.nemo``); its encoder and its preprocessor settings (which
  configure our `LogMelFeatures`) are restored lazily (``pip install speechlm[nemo]``).

Determinism. ``dropout`` sets every dropout probability of the encoder; layer drop, positional
dropout and SpecAugment are always off. FastConformer's convolution module uses BatchNorm; with
``freeze_batchnorm=True`` (default) BatchNorm always uses its running statistics, also in train
mode. Batch statistics would make an utterance's encoding depend on the other clips in the batch
(and on the padding), so encoding each clip on one CP rank (placed encoding), or splitting a batch
over dp ranks, would change the gradients.
"""

from __future__ import annotations

from speechlm.config import EncoderConfig, ModelConfig
from speechlm.model.encoders.base import AudioEncoder, ChannelLayerNorm, replace_conv_batchnorm
from speechlm.model.encoders.nemo import (
    NemoAudioEncoder,
    configure_nemo_config,
    import_nemo_asr,
    load_nemo_encoder,
    nemo_feature_settings,
)
from speechlm.model.encoders.parakeet import (
    ParakeetAudioEncoder,
    build_parakeet_config,
    build_parakeet_encoder,
    load_parakeet_encoder,
)
from speechlm.model.encoders.whisper import WhisperAudioEncoder, build_whisper_encoder, load_whisper_encoder
from speechlm.model.finite import check_loaded_weights

__all__ = [
    "AudioEncoder",
    "ChannelLayerNorm",
    "NemoAudioEncoder",
    "ParakeetAudioEncoder",
    "WhisperAudioEncoder",
    "build_encoder",
    "resolve_encoder_packed",
    "build_parakeet_config",
    "build_parakeet_encoder",
    "build_whisper_encoder",
    "configure_nemo_config",
    "import_nemo_asr",
    "load_nemo_encoder",
    "load_parakeet_encoder",
    "load_whisper_encoder",
    "nemo_feature_settings",
    "replace_conv_batchnorm",
]


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
    if enc_cfg.pretrained:  # NaN/inf weights (a file damaged in place): refused, file and tensor named
        check_loaded_weights(encoder, enc_cfg.pretrained, "model.encoder.pretrained")
    return encoder.train(encoder.training)


def _build_encoder(enc_cfg: EncoderConfig, *, dropout: float, freeze_batchnorm: bool) -> AudioEncoder:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    kind = enc_cfg.kind
    if kind == "parakeet":
        return build_parakeet_encoder(enc_cfg, dropout=dropout, freeze_batchnorm=freeze_batchnorm)
    if kind == "whisper":
        if enc_cfg.pretrained:
            return load_whisper_encoder(enc_cfg.pretrained, dropout=dropout, window=enc_cfg.whisper_window)
        return build_whisper_encoder(enc_cfg, dropout=dropout)
    if kind == "nemo":
        if not enc_cfg.pretrained:
            raise ValueError("encoder.kind='nemo' needs encoder.pretrained=<path to a .nemo file>")
        return load_nemo_encoder(enc_cfg.pretrained, dropout=dropout, freeze_batchnorm=freeze_batchnorm)
    raise ValueError(f"encoder.kind={kind!r} is not known; use 'parakeet', 'whisper' or 'nemo'")


def resolve_encoder_packed(model_cfg: ModelConfig, supports_packed: bool) -> bool:
    """``model.encoder.packed``: None means on where the encoder supports it; true where it does not
    is an error (the validator reports it before a run starts)."""
    want = model_cfg.encoder.packed
    if want is None:
        return supports_packed
    if want and not supports_packed:
        raise ValueError(
            f"model.encoder.packed=true but encoder.kind={model_cfg.encoder.kind!r} has no padding-free "
            "path; set model.encoder.packed=false (or leave it unset)"
        )
    return bool(want)
