"""Model tests: features, encoders, projector, LLM (THD vs separate runs), SpeechLLM losses and decoding.

Letters: B batch, N samples, T frames/tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import copy
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from parallel.cp_layout import DynamicCPLayout, NullCPLayout
from speechlm.config import EncoderConfig, LLMConfig, ModelConfig
from speechlm.model.attention import ensure_registered
from speechlm.model.encoders import (
    NemoAudioEncoder,
    build_encoder,
    build_whisper_encoder,
    configure_nemo_config,
    nemo_feature_settings,
)
from speechlm.model.features import FeatureSettings, LogMelFeatures
from speechlm.model.llm import build_llm
from speechlm.model.packed_encoder import PackedFrames
from speechlm.model.projector import FrameStackProjector
from speechlm.model.speech_llm import SpeechLLM

VOCAB, PAD, BOS, EOS, AUDIO, LANG = 48, 0, 2, 3, 4, 5


def tiny_encoder_cfg(**kw) -> EncoderConfig:
    base = dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        subsampling_conv_channels=16,
        num_mel_bins=32,
    )
    base.update(kw)
    return EncoderConfig(**base)


def tiny_llm_cfg(family: str = "llama", kv: int = 4) -> LLMConfig:
    return LLMConfig(
        family=family,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=kv,
        intermediate_size=128,
        max_position_embeddings=512,
    )


def tiny_model_cfg(**kw) -> ModelConfig:
    cfg = ModelConfig(encoder=tiny_encoder_cfg(), llm=tiny_llm_cfg(kv=2), projector_hidden=64)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def build_tiny_model(seed: int = 0, **kw) -> SpeechLLM:
    torch.manual_seed(seed)
    return SpeechLLM(
        tiny_model_cfg(**kw), vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, audio_id=AUDIO
    )


def make_audio(lens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    audio_BN = torch.zeros(len(lens), max(lens))
    for i, n in enumerate(lens):
        audio_BN[i, :n] = 0.1 * torch.randn(n, generator=g)
    return audio_BN, torch.tensor(lens)


def make_batch(seed: int = 0) -> SimpleNamespace:
    audio, audio_lens = make_audio([8000, 5000, 11000], seed)
    g = torch.Generator().manual_seed(seed + 1)
    token_lens = torch.tensor([5, 3, 7])
    tokens = torch.zeros(3, 7, dtype=torch.long)
    for i, n in enumerate(token_lens.tolist()):
        tokens[i, 0] = LANG
        tokens[i, 1:n] = torch.randint(10, VOCAB, (n - 1,), generator=g)
    return SimpleNamespace(audio=audio, audio_lens=audio_lens, tokens=tokens, token_lens=token_lens)


# ---------------------------------------------------------------------------------------------
# Features, encoder, projector
# ---------------------------------------------------------------------------------------------


def test_features_shape_lengths_and_batch_independence():
    feats = LogMelFeatures(FeatureSettings(n_mels=40))
    audio, lens = make_audio([16000, 9000, 12345])
    f_BTF, fl_B = feats(audio, lens)
    assert f_BTF.shape == (3, 100, 40) and fl_B.tolist() == [100, 56, 77]
    assert torch.all(f_BTF[1, 56:] == 0)
    for i in range(3):
        fi, fli = feats(audio[i : i + 1, : lens[i]], lens[i : i + 1])
        torch.testing.assert_close(fi[0], f_BTF[i, : fli[0]], atol=1e-5, rtol=1e-5)
    w_BTF, _ = LogMelFeatures(FeatureSettings(n_mels=40, log_style="whisper", n_fft=400, preemphasis=0.0))(
        audio, lens
    )
    assert torch.isfinite(w_BTF).all()


def test_features_match_transformers_parakeet_extractor():
    from transformers import ParakeetFeatureExtractor

    audio, lens = make_audio([16000, 7000])
    f_BTF, fl_B = LogMelFeatures()(audio, lens)
    ref = ParakeetFeatureExtractor()(
        [a[:n].numpy() for a, n in zip(audio, lens)], sampling_rate=16000, return_tensors="pt"
    )
    assert ref.attention_mask.sum(-1).tolist() == fl_B.tolist()
    torch.testing.assert_close(f_BTF, ref.input_features[:, : f_BTF.shape[1]], atol=1e-4, rtol=1e-4)


def test_parakeet_encoder_lengths_and_per_utterance_outputs():
    enc = build_encoder(tiny_encoder_cfg(), dropout=0.0)
    enc.train()  # BatchNorm stays on running statistics; dropout is 0
    assert enc.subsampling == 8 and enc.output_dim == 64
    feats = LogMelFeatures(enc.feature_settings)
    audio, lens = make_audio([16000, 9000, 12345])
    f_BTF, fl_B = feats(audio, lens)
    h_BUE, hl_B = enc(f_BTF, fl_B)
    assert hl_B.tolist() == [13, 7, 10] and h_BUE.shape == (3, 13, 64)
    assert torch.all(h_BUE[1, 7:] == 0)
    for i in range(3):
        hi, hli = enc(f_BTF[i : i + 1, : fl_B[i]], fl_B[i : i + 1])
        assert hli.tolist() == [hl_B[i].item()]
        torch.testing.assert_close(hi[0], h_BUE[i, : hli[0]], atol=1e-4, rtol=1e-4)


def test_whisper_encoder_pads_to_its_length_and_cuts_back():
    enc = build_whisper_encoder(tiny_encoder_cfg(num_mel_bins=80), dropout=0.0, max_source_positions=64)
    feats = LogMelFeatures(enc.feature_settings)
    audio, lens = make_audio([8000, 5000])
    f_BTF, fl_B = feats(audio, lens)
    h, hl = enc(f_BTF, fl_B)
    assert hl.tolist() == [(n - 1) // 2 + 1 for n in fl_B.tolist()] and h.shape[1] == int(hl.max())
    with pytest.raises(ValueError, match="at most 128 frames"):
        enc(torch.zeros(1, 200, 80), torch.tensor([200]))


def test_projector_stacks_frames_and_zeroes_the_tail():
    proj = FrameStackProjector(in_dim=3, out_dim=5, stack=2, hidden=7)
    x = torch.randn(2, 5, 3)
    lens = torch.tensor([5, 3])
    out, out_lens = proj(x, lens)
    assert out.shape == (2, 3, 5) and out_lens.tolist() == [3, 2]
    stacked = torch.cat([x[0, 4], torch.zeros(3)])  # last frame of clip 0, padded tail
    torch.testing.assert_close(out[0, 2], proj.fc2(proj.act(proj.fc1(stacked))))
    stacked = torch.cat([x[1, 2], torch.zeros(3)])  # clip 1's frame 3 lies past its length: zeroed
    torch.testing.assert_close(out[1, 1], proj.fc2(proj.act(proj.fc1(stacked))))


# ---------------------------------------------------------------------------------------------
# LLM with the reference backend: THD packing == separate runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,kv", [("llama", 4), ("qwen2", 2)])
def test_packed_thd_logits_equal_separate_runs(family, kv):
    torch.manual_seed(0)
    llm = build_llm(
        tiny_llm_cfg(family, kv),
        vocab_size=VOCAB,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        dropout=0.0,
        attn_implementation=ensure_registered("reference"),
    )
    lens = [5, 9, 4]
    xs = [torch.randn(n, 64) for n in lens]
    cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    packed = llm(
        inputs_embeds=torch.cat(xs)[None],
        position_ids=pos[None],
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=9,
        max_length_k=9,
    ).logits[0]
    for i, x in enumerate(xs):
        alone = llm(inputs_embeds=x[None], position_ids=torch.arange(lens[i])[None]).logits[0]
        torch.testing.assert_close(packed[cu[i] : cu[i + 1]], alone, atol=1e-5, rtol=1e-5)
    # without cu_seqlens the reference backend refuses a packed stream instead of attending across it
    with pytest.raises(ValueError, match="cu_seqlens"):
        llm(inputs_embeds=torch.cat(xs)[None], position_ids=pos[None])


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_padded_bshd_equals_separate_runs(backend):
    torch.manual_seed(0)
    llm = build_llm(
        tiny_llm_cfg("qwen2", 2),
        vocab_size=VOCAB,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        dropout=0.0,
        attn_implementation=ensure_registered(backend),
    )
    lens = [6, 3, 8]
    x = torch.randn(3, 8, 64)
    mask = (torch.arange(8)[None] < torch.tensor(lens)[:, None]).long()
    pos = torch.arange(8).expand(3, 8)
    logits = llm(inputs_embeds=x, attention_mask=mask, position_ids=pos).logits
    assert torch.isfinite(logits).all()
    for i, n in enumerate(lens):
        alone = llm(inputs_embeds=x[i : i + 1, :n], position_ids=torch.arange(n)[None]).logits[0]
        torch.testing.assert_close(logits[i, :n], alone, atol=1e-5, rtol=1e-5)


def test_llm_loads_from_local_pretrained_dir(tmp_path):
    torch.manual_seed(0)
    impl = ensure_registered("reference")
    llm = build_llm(
        tiny_llm_cfg(),
        vocab_size=VOCAB,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        dropout=0.0,
        attn_implementation=impl,
    )
    llm.save_pretrained(tmp_path / "llm")
    cfg = tiny_llm_cfg()
    cfg.pretrained = str(tmp_path / "llm")
    loaded = build_llm(
        cfg, vocab_size=VOCAB + 2, pad_id=PAD, bos_id=BOS, eos_id=EOS, dropout=0.0, attn_implementation=impl
    )
    assert loaded.config._attn_implementation == impl and loaded.config.use_cache is False
    assert loaded.get_input_embeddings().num_embeddings == VOCAB + 2  # resized for extra ids
    x = torch.randn(1, 6, 64)
    torch.testing.assert_close(loaded(inputs_embeds=x).logits[..., :VOCAB], llm(inputs_embeds=x).logits)


def test_parakeet_encoder_loads_from_local_pretrained_dir(tmp_path):
    torch.manual_seed(0)
    # a released Parakeet has BatchNorm in its conv modules (conv_norm=batch_norm), as pretrained loads expect
    enc = build_encoder(tiny_encoder_cfg(conv_norm="batch_norm"), dropout=0.0).eval()
    enc.model.save_pretrained(tmp_path / "enc")
    cfg = tiny_encoder_cfg(pretrained=str(tmp_path / "enc"), hidden_size=999)  # sizes come from the dir
    loaded = build_encoder(cfg, dropout=0.0).eval()
    assert loaded.output_dim == 64 and loaded.model.config.layerdrop == 0.0
    f = torch.randn(2, 50, 32)
    fl = torch.tensor([50, 31])
    torch.testing.assert_close(loaded(f, fl)[0], enc(f, fl)[0])


def test_whisper_encoder_loads_from_local_dir(tmp_path):
    from speechlm.model.encoders import load_whisper_encoder

    torch.manual_seed(0)
    enc = build_whisper_encoder(
        tiny_encoder_cfg(num_mel_bins=80), dropout=0.0, max_source_positions=32
    ).eval()
    enc.model.save_pretrained(tmp_path / "whisper")
    loaded = load_whisper_encoder(tmp_path / "whisper", dropout=0.0).eval()
    f, fl = torch.randn(1, 40, 80), torch.tensor([40])
    torch.testing.assert_close(loaded(f, fl)[0], enc(f, fl)[0])


# ---------------------------------------------------------------------------------------------
# NeMo (mocked module)
# ---------------------------------------------------------------------------------------------


class _Cfg(dict):
    """A dict with attribute access, standing in for an OmegaConf DictConfig."""

    __getattr__ = dict.__getitem__


def _fake_nemo(calls: list) -> dict[str, types.ModuleType]:
    class FakeConformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 48)

        def forward(self, audio_signal, length):
            calls.append(("encoder", tuple(audio_signal.shape), length.tolist()))
            x_BTF = audio_signal.transpose(1, 2)[:, ::8]
            out_lens = torch.div(length - 1, 8, rounding_mode="floor") + 1
            return self.proj(x_BTF).transpose(1, 2), out_lens

    class FakeASRModel:
        @classmethod
        def restore_from(
            cls, restore_path, override_config_path=None, map_location=None, return_config=False
        ):
            calls.append(
                ("restore", restore_path, return_config, override_config_path is not None, str(map_location))
            )
            if return_config:
                return _Cfg(
                    encoder=_Cfg(
                        d_model=48,
                        subsampling_factor=8,
                        dropout=0.1,
                        dropout_att=0.1,
                        stochastic_depth_drop_prob=0.2,
                    ),
                    preprocessor=_Cfg(
                        sample_rate=16000,
                        window_size=0.025,
                        window_stride=0.01,
                        features=64,
                        n_fft=512,
                        dither=1e-5,
                        pad_to=16,
                        normalize="per_feature",
                    ),
                    spec_augment=_Cfg(freq_masks=2),
                )
            assert override_config_path["encoder"]["dropout"] == 0.0
            return SimpleNamespace(encoder=FakeConformer())

    root, coll, asr = (types.ModuleType(n) for n in ("nemo", "nemo.collections", "nemo.collections.asr"))
    asr.models = SimpleNamespace(ASRModel=FakeASRModel)
    coll.asr = asr
    root.collections = coll
    return {"nemo": root, "nemo.collections": coll, "nemo.collections.asr": asr}


def test_nemo_encoder_restore_plumbing(tmp_path, monkeypatch):
    calls: list = []
    for name, mod in _fake_nemo(calls).items():
        monkeypatch.setitem(sys.modules, name, mod)
    ckpt = tmp_path / "asr.nemo"
    ckpt.write_bytes(b"x")
    enc = build_encoder(EncoderConfig(kind="nemo", pretrained=str(ckpt)), dropout=0.0)
    assert isinstance(enc, NemoAudioEncoder) and enc.output_dim == 48 and enc.subsampling == 8
    assert [c[2:] for c in calls] == [(True, False, "cpu"), (False, True, "cpu")]
    s = enc.feature_settings
    assert (s.n_mels, s.win_length, s.hop_length, s.n_fft, s.normalize) == (64, 400, 160, 512, True)
    feats, fl = LogMelFeatures(s)(*make_audio([8000, 4000]))
    h, hl = enc(feats, fl)
    assert h.shape == (2, 7, 48) and hl.tolist() == [7, 4] and torch.all(h[1, 4:] == 0)
    assert calls[-1] == ("encoder", (2, 64, 50), [50, 25])


def test_nemo_config_edits():
    cfg = _Cfg(
        encoder=_Cfg(dropout=0.1, dropout_emb=0.1, stochastic_depth_drop_prob=0.3),
        preprocessor=_Cfg(dither=1e-5),
        spec_augment=_Cfg(a=1),
    )
    configure_nemo_config(cfg, dropout=0.05)
    assert cfg["encoder"] == {"dropout": 0.05, "dropout_emb": 0.05, "stochastic_depth_drop_prob": 0.0}
    assert cfg["spec_augment"] is None and cfg["preprocessor"]["dither"] == 0.0
    with pytest.raises(ValueError, match="window"):
        nemo_feature_settings(_Cfg(window="hamming"))


def test_nemo_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo", None)
    monkeypatch.setitem(sys.modules, "nemo.collections", None)
    monkeypatch.setitem(sys.modules, "nemo.collections.asr", None)
    ckpt = tmp_path / "asr.nemo"
    ckpt.write_bytes(b"x")
    with pytest.raises(ImportError, match=r"pip install speechlm\[nemo\]"):
        build_encoder(EncoderConfig(kind="nemo", pretrained=str(ckpt)), dropout=0.0)


# ---------------------------------------------------------------------------------------------
# SpeechLLM
# ---------------------------------------------------------------------------------------------


def micro_losses(model: SpeechLLM, batch, *, packed: bool, cp: int = 1, tp: int = 1):
    """The training path (`SpeechLLM.forward`) with the decoder layout and the cp/tp rounding chosen."""
    model.cfg.packed_sequences = packed
    model.set_cp_layout(NullCPLayout(round_cp=cp, tp=tp))  # rounding only: one process holds every chunk
    return model(batch)


def test_packed_and_padded_losses_agree_and_gradients_reach_the_encoder():
    model = build_tiny_model()
    model.train()
    batch = make_batch()
    thd = micro_losses(model, batch, packed=True)
    bshd = micro_losses(model, batch, packed=False)
    thd_cp = micro_losses(model, batch, packed=True, cp=2, tp=2)  # rounding pads each sequence
    assert thd.n_labelled == bshd.n_labelled == thd_cp.n_labelled == 5 + 3 + 7 + 3  # targets + eos
    torch.testing.assert_close(thd.ce_sum, bshd.ce_sum, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(thd.ce_sum, thd_cp.ce_sum, atol=1e-4, rtol=1e-5)
    assert thd.n_clips == 3 and thd.ctc_sum > 0
    enc = model.encode_audio(batch.audio, batch.audio_lens)
    assert enc.enc_lens is enc.enc_lens_B  # the name the trainer uses
    assert isinstance(enc.enc_hidden, PackedFrames)  # the default parakeet encoder runs padding-free
    loss = thd.ce_sum / thd.n_labelled + 0.3 * thd.ctc_sum / thd.n_clips
    loss.backward()
    for name, module in (("encoder", model.encoder), ("projector", model.projector)):
        grads = [p.grad for p in module.parameters() if p.requires_grad]
        assert grads and all(g is not None for g in grads), name
        assert sum(float(g.abs().sum()) for g in grads) > 0, name


def test_a_model_starts_on_the_null_cp_layout_and_refuses_bshd_under_cp():
    model = build_tiny_model()
    assert model.cp_layout == NullCPLayout(tp=1, pad_to_multiple=model.cfg.pad_to_multiple)
    model.cfg.packed_sequences = False
    model.set_cp_layout(DynamicCPLayout(group=None, cp_size=2, cp_rank=0, kind="ring", threshold=0))
    with pytest.raises(ValueError, match="BSHD.* with cp > 1"):
        model(make_batch())


def test_ctc_loss_sum_drops_the_language_tag_and_sums_utterances():
    model = build_tiny_model()
    h = torch.randn(2, 10, 64)
    lens = torch.tensor([10, 6])
    tokens = torch.tensor([[LANG, 7, 8, 9], [LANG, 11, 12, 0]])
    t_lens = torch.tensor([4, 3])
    total, n = model.ctc_loss_sum(h, lens, tokens, t_lens)
    assert n == 2
    log_probs = model.ctc_head(h).log_softmax(-1)
    manual = sum(
        torch.nn.functional.ctc_loss(
            log_probs[i, : lens[i]],
            tokens[i, 1 : t_lens[i]],
            lens[i : i + 1],
            t_lens[i : i + 1] - 1,
            blank=PAD,
            reduction="sum",
        )
        for i in range(2)
    )
    torch.testing.assert_close(total, manual)
    # a tag-only transcript (e.g. the trainer's dummy clip) gives a finite loss
    only_tag, _ = model.ctc_loss_sum(h[:1], lens[:1], torch.tensor([[EOS]]), torch.tensor([1]))
    assert torch.isfinite(only_tag)


def test_dropout_zero_gives_identical_train_mode_passes():
    model = build_tiny_model()
    model.train()
    batch = make_batch()
    a = micro_losses(model, batch, packed=True)
    b = micro_losses(model, batch, packed=True)
    assert torch.equal(a.ce_sum, b.ce_sum) and torch.equal(a.ctc_sum, b.ctc_sum)


def test_no_ctc_head_when_weight_is_zero():
    model = build_tiny_model(ctc_weight=0.0)
    assert model.ctc_head is None
    out = micro_losses(model, make_batch(), packed=True)
    assert out.ctc_sum is None and out.ce_sum > 0


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_generate_greedy_returns_token_lists(backend):
    model = build_tiny_model(attention_backend=backend)
    model.train()
    audio, lens = make_audio([8000, 5000])
    out = model.generate_greedy(audio, lens, max_new_tokens=4)
    assert len(out) == 2 and all(isinstance(t, list) and len(t) <= 4 for t in out)
    assert all(isinstance(i, int) and i != EOS for t in out for i in t)
    forced = model.generate_greedy(audio, lens, max_new_tokens=3, lang_id=LANG)
    assert all(t[0] == LANG and len(t) <= 3 for t in forced)
    assert model.training  # mode restored


def test_generate_greedy_matches_a_single_utterance_run():
    model = build_tiny_model()
    audio, lens = make_audio([8000, 5000])
    both = model.generate_greedy(audio, lens, max_new_tokens=5)
    alone = model.generate_greedy(audio[1:, :5000], lens[1:], max_new_tokens=5)
    assert both[1] == alone[0]


def test_encoder_freeze_and_parameter_count():
    model = build_tiny_model()
    model.set_encoder_trainable(False)
    assert not any(p.requires_grad for p in model.encoder_parameters())
    n_enc = sum(p.numel() for p in model.encoder.parameters())
    assert model.num_parameters(trainable_only=True) == model.num_parameters() - n_enc
    model.set_encoder_trainable(True)
    assert all(p.requires_grad for p in model.encoder_parameters())


def test_default_model_size():
    torch.manual_seed(0)
    model = SpeechLLM(ModelConfig(), vocab_size=600, pad_id=PAD, bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    n = model.num_parameters()
    assert 5_500_000 < n < 7_000_000, n  # 6.31M: encoder 2.37M, projector 0.31M, LLM 3.52M, CTC 0.11M


def test_configs_are_not_mutated():
    cfg = tiny_model_cfg()
    before = copy.deepcopy(cfg)
    SpeechLLM(cfg, vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    assert cfg == before


def test_fresh_encoder_is_batch_invariant_without_calling_train():
    """BatchNorm is frozen at construction: a clip encodes the same alone or in a batch, train() or not."""
    from speechlm.config import EncoderConfig
    from speechlm.model.encoders import build_encoder
    from speechlm.model.features import LogMelFeatures

    torch.manual_seed(0)
    enc = build_encoder(
        EncoderConfig(
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            intermediate_size=64,
            subsampling_conv_channels=8,
            num_mel_bins=80,
            conv_norm="batch_norm",
        ),
        dropout=0.0,
    )
    assert enc.training  # a fresh module trains ...
    bns = [m for m in enc.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and not any(m.training for m in bns)  # ... but its BatchNorm layers use running statistics
    feats = LogMelFeatures()
    audio = torch.randn(2, 6000)
    lens = torch.tensor([6000, 4000])
    f, fl = feats(audio, lens)
    both, both_lens = enc(f, fl)
    f1, fl1 = feats(audio[1:, :4000], lens[1:])
    one, one_lens = enc(f1, fl1)
    n = int(one_lens[0])
    torch.testing.assert_close(both[1, :n], one[0, :n], rtol=1e-5, atol=1e-6)


def test_conv_norm_auto_uses_layer_norm_from_scratch_and_rejects_it_for_pretrained(tmp_path):
    from speechlm.config import EncoderConfig
    from speechlm.model.encoders import ChannelLayerNorm, build_encoder

    small = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, subsampling_conv_channels=8)
    enc = build_encoder(EncoderConfig(**small), dropout=0.0)
    mods = list(enc.modules())
    assert any(isinstance(m, ChannelLayerNorm) for m in mods)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in mods)
    x = torch.randn(2, 16, 40)
    torch.testing.assert_close(ChannelLayerNorm(16)(x)[1], ChannelLayerNorm(16)(x[1:])[0])  # batch-invariant
    with pytest.raises(ValueError, match="conv_norm=layer_norm cannot be used with a pretrained"):
        build_encoder(EncoderConfig(**small, pretrained=str(tmp_path), conv_norm="layer_norm"), dropout=0.0)
