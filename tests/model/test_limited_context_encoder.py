"""Limited-context self-attention in the FastConformer (`model.encoder.att_context_size: [left, right]`, issue
25 item 2): the padding-free encoder with a sliding window on the packed frames equals transformers' padded
encoder whose attention mask is ANDed with the dense [left, right] band (outputs and every gradient), equals
full context when the window covers every clip, and is refused where it cannot run."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from speechlm.config import ConfigError, EncoderConfig, load_config
from speechlm.model.encoders import build_encoder
from speechlm.model.features import LogMelFeatures

AUDIO_LENS = [16000, 3200, 800, 16000, 170, 9123, 12000]  # 1 s .. 10 ms: at most 26 encoder frames (4x)


def enc_cfg(**kw: Any) -> EncoderConfig:
    base: dict[str, Any] = dict(
        hidden_size=48, num_layers=2, num_heads=4, intermediate_size=96, subsampling_conv_channels=8,
        num_mel_bins=80, subsampling_factor=4,
    )  # fmt: skip
    base.update(kw)
    return EncoderConfig(**base)


def features(lens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(len(lens), max(lens), generator=g) * 0.1
    for i, n in enumerate(lens):
        audio[i, n:] = 0.0
    return LogMelFeatures().forward(audio, torch.tensor(lens))


def band_masked_reference(enc: Any, left: int, right: int) -> Any:
    """A copy of `enc` (full context, padded) whose every attention mask is ANDed with the dense window."""
    ref = copy.deepcopy(enc)
    ref.att_context = None
    for layer in ref.model.layers:
        attn = layer.self_attn

        def forward(hidden_states, position_embeddings=None, attention_mask=None, _orig=attn.forward, **kw):
            t = torch.arange(hidden_states.shape[1])
            band = ((t[:, None] - t[None, :]) <= left) & ((t[None, :] - t[:, None]) <= right)
            return _orig(hidden_states, position_embeddings, attention_mask & band, **kw)

        attn.forward = forward
    return ref


def split_rows(x_BT_: torch.Tensor, lens: torch.Tensor) -> list[torch.Tensor]:
    return [x_BT_[b, : int(n)] for b, n in enumerate(lens)]


def grads(out: torch.Tensor, w: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    return torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)


def assert_grad_close(got: torch.Tensor | None, want: torch.Tensor, name: str) -> None:
    got = got if got is not None else torch.zeros_like(want)
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(
        got, want, rtol=1e-5, atol=1e-5 * max(1.0, scale), msg=lambda m: f"{name}: {m}"
    )


@pytest.mark.parametrize("window", [(2, 2), (3, 0), (0, 1), (5, 3)])
@pytest.mark.parametrize("conv_norm", ["layer_norm", "batch_norm"])
def test_limited_context_encoder_equals_the_dense_band_masked_encoder(window, conv_norm):
    torch.manual_seed(0)
    enc = build_encoder(enc_cfg(att_context_size=list(window), conv_norm=conv_norm), dropout=0.0)
    assert enc.att_context == window
    ref = band_masked_reference(enc, *window)
    feats_BTF, feat_lens = features(AUDIO_LENS)
    padded_in = feats_BTF.clone().requires_grad_(True)
    h_BUE, out_lens = ref(padded_in, feat_lens)
    packed_in = torch.cat(split_rows(feats_BTF, feat_lens)).requires_grad_(True)
    h_UE, packed_lens = enc(packed_in, feat_lens, packed=True)
    assert torch.equal(out_lens, packed_lens)
    want = torch.cat(split_rows(h_BUE, out_lens))
    torch.testing.assert_close(h_UE, want, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(want)
    g_ref = grads(want, w, [padded_in, *ref.parameters()])
    g_got = grads(h_UE, w, [packed_in, *enc.parameters()])
    torch.testing.assert_close(g_got[0], torch.cat(split_rows(g_ref[0], feat_lens)), rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(enc.named_parameters(), g_got[1:], g_ref[1:], strict=True):
        assert_grad_close(a, b if b is not None else torch.zeros_like(_), name)


def test_the_window_changes_the_output_and_one_wider_than_every_clip_is_full_context():
    torch.manual_seed(0)
    full = build_encoder(enc_cfg(), dropout=0.0)
    wide = copy.deepcopy(full)
    wide.att_context = (40, 40)  # every clip has at most 40 frames at 4x
    narrow = copy.deepcopy(full)
    narrow.att_context = (1, 1)
    feats_BTF, feat_lens = features(AUDIO_LENS)
    packed = torch.cat(split_rows(feats_BTF, feat_lens))
    h_full, _ = full(packed, feat_lens, packed=True)
    h_wide, _ = wide(packed, feat_lens, packed=True)
    h_narrow, _ = narrow(packed, feat_lens, packed=True)
    torch.testing.assert_close(h_wide, h_full, rtol=1e-5, atol=1e-5)
    assert (h_narrow - h_full).abs().max() > 1e-3


def test_att_context_size_config_key():
    assert load_config(None).model.encoder.limited_context() is None
    assert (
        load_config(None, ["model.encoder.att_context_size=[-1,-1]"]).model.encoder.limited_context() is None
    )
    cfg = load_config(None, ["model.encoder.att_context_size=[128,64]"])
    assert cfg.model.encoder.limited_context() == (128, 64)
    for bad, match in [
        ("[-1,64]", "one unlimited side is not supported"),
        ("[128]", "must have 2 items"),
        ("[-2,3]", "att_context_size"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [f"model.encoder.att_context_size={bad}"])
    for other in (["model.encoder.kind=whisper"], ["model.encoder.packed=false"]):
        with pytest.raises(ConfigError, match="needs the padding-free Parakeet encoder"):
            load_config(None, ["model.encoder.att_context_size=[8,8]", *other])


def test_the_padded_path_refuses_limited_context():
    enc = build_encoder(enc_cfg(att_context_size=[2, 2]), dropout=0.0)
    feats_BTF, feat_lens = features([3200, 1600])
    with pytest.raises(ValueError, match="runs on the padding-free encoder only"):
        enc(feats_BTF, feat_lens)


def test_the_speech_llm_builds_its_encoder_with_the_configured_window():
    """model.encoder.att_context_size reaches the encoder SpeechLLM builds, and its packed path uses it: the
    embeddings differ from a full-context twin with the same weights, and gradients reach the encoder."""
    from speechlm.config import LLMConfig, ModelConfig
    from speechlm.model.speech_llm import SpeechLLM

    llm = LLMConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    args = dict(vocab_size=40, pad_id=0, bos_id=2, eos_id=3, audio_id=4)
    torch.manual_seed(0)
    limited = SpeechLLM(
        ModelConfig(encoder=enc_cfg(att_context_size=[1, 1]), llm=llm, projector_hidden=32), **args
    )
    full = SpeechLLM(ModelConfig(encoder=enc_cfg(), llm=llm, projector_hidden=32), **args)
    full.load_state_dict(limited.state_dict())
    assert limited.encoder.att_context == (1, 1) and full.encoder.att_context is None
    audio = torch.randn(2, 16000, generator=torch.Generator().manual_seed(0)) * 0.1
    lens = torch.tensor([16000, 12000])
    e_limited = limited.encode_audio(audio, lens).embeds
    e_full = full.encode_audio(audio, lens).embeds
    assert max(float((a - b).detach().abs().max()) for a, b in zip(e_limited, e_full)) > 1e-4
    sum(e.square().sum() for e in e_limited).backward()
    assert all(p.grad is not None for p in limited.encoder.parameters() if p.requires_grad)
