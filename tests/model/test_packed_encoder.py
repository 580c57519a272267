"""Padding-free encoder path: features, subsampling, conformer layers, projector and CTC on packed frames
are EXACT against the padded path per utterance (fp32: 1e-5, relative to the tensor's scale for
deep activations and gradients; fp64: 1e-10), forward and backward, frozen and
trainable, and under distributed encoding over CP ranks.

Letters: B clips, N samples, T feature frames, U encoder frames, E encoder width, H LLM hidden.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from parallel.dist_encode import encode_placed
from parallel.testing import run_distributed
from speechlm.config import EncoderConfig, LLMConfig, ModelConfig
from speechlm.model.encoders import build_encoder, build_whisper_encoder
from speechlm.model.features import LogMelFeatures
from speechlm.model.packed_encoder import PackedFrames, plan_subsampling_segments
from speechlm.model.projector import FrameStackProjector
from speechlm.model.speech_llm import SpeechLLM

VOCAB, PAD, BOS, EOS, AUDIO = 40, 0, 2, 3, 4
TOL = dict(rtol=1e-5, atol=1e-5)


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """1e-5 relative to the tensor's scale: a weight gradient sums thousands of fp32 products, whose
    order differs between the layouts (elementwise rtol alone would flag 1e-7-level rounding)."""
    scale = float(want.detach().abs().max()) or 1.0
    torch.testing.assert_close(
        got, want, rtol=1e-5, atol=1e-5 * max(1.0, scale), msg=lambda m: f"{name}: {m}"
    )


# mixed lengths in samples: equal lengths (one attention group), 1-frame encoder outputs, a clip too
# short for one feature frame, a long one
AUDIO_LENS = [16000, 3200, 800, 16000, 170, 9123, 100, 12000]


def make_audio(lens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(len(lens), max(lens), generator=g) * 0.1
    for i, n in enumerate(lens):
        audio[i, n:] = 0.0
    return audio, torch.tensor(lens)


def encoder_cfg(**kw: Any) -> EncoderConfig:
    base: dict[str, Any] = dict(
        hidden_size=48,
        num_layers=2,
        num_heads=4,
        intermediate_size=96,
        subsampling_conv_channels=8,
        num_mel_bins=32,
    )
    base.update(kw)
    return EncoderConfig(**base)


def model_cfg(packed: bool | None, **kw: Any) -> ModelConfig:
    llm = LLMConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    return ModelConfig(encoder=encoder_cfg(packed=packed, **kw), llm=llm, projector_hidden=32, ctc_weight=0.3)


def build_pair(**kw: Any) -> tuple[SpeechLLM, SpeechLLM]:
    """The same weights twice: padding-free and padded encoder."""
    torch.manual_seed(0)
    args = dict(vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    packed = SpeechLLM(model_cfg(True, **kw), **args)
    padded = SpeechLLM(model_cfg(False, **kw), **args)
    padded.load_state_dict(packed.state_dict())
    assert packed.encoder_packed and not padded.encoder_packed
    return packed, padded


def split_packed(x: torch.Tensor, lens: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(x, [int(n) for n in lens]))


def test_packed_features_equal_padded_per_clip():
    feats = LogMelFeatures()
    audio, lens = make_audio(AUDIO_LENS)
    pad_BTF, pad_lens = feats(audio, lens)
    packed_TF, packed_lens = feats.packed(audio, lens)
    assert torch.equal(pad_lens, packed_lens)
    assert packed_TF.shape[0] == int(packed_lens.sum())  # real frames only
    for b, got in enumerate(split_packed(packed_TF, packed_lens)):
        torch.testing.assert_close(got, pad_BTF[b, : pad_lens[b]], **TOL)


def test_subsampling_segments_leave_a_zero_frame_after_every_clip_at_every_level():
    lens = torch.arange(0, 300)
    seg = plan_subsampling_segments(lens, 3)
    assert torch.all(seg % 8 == 0) and torch.all(seg >= 8)
    lk = lens.clone()
    for k in range(3):
        assert torch.all(seg // 2**k >= lk + 1), k
        lk = (lk - 1) // 2 + 1
    assert int((seg - lens).max()) <= 16  # at most two output frames of gap per clip


@pytest.mark.parametrize(
    ("conv_norm", "factor"),
    [("layer_norm", None), ("batch_norm", None), ("layer_norm", 4), ("layer_norm", 16)],
)
def test_packed_encoder_equals_padded_forward_and_backward(conv_norm, factor):
    torch.manual_seed(0)
    enc = build_encoder(
        encoder_cfg(conv_norm=conv_norm, num_mel_bins=80, subsampling_factor=factor), dropout=0.0
    )
    assert enc.subsampling == (factor or 8) and enc.n_convs == (factor or 8).bit_length() - 1
    enc.train()
    audio, lens = make_audio(AUDIO_LENS)
    feats_BTF, feat_lens = LogMelFeatures().forward(audio, lens)
    padded_in = feats_BTF.clone().requires_grad_(True)
    h_BUE, out_lens = enc(padded_in, feat_lens)
    packed_in = torch.cat(split_rows(feats_BTF, feat_lens)).requires_grad_(True)
    h_UE, packed_lens = enc(packed_in, feat_lens, packed=True)
    assert torch.equal(out_lens, packed_lens) and h_UE.shape[0] == int(out_lens.sum())
    ref = torch.cat(split_rows(h_BUE, out_lens))
    torch.testing.assert_close(h_UE, ref, **TOL)
    w = torch.randn_like(ref)
    grads_padded = torch.autograd.grad((ref * w).sum(), [padded_in, *enc.parameters()])
    grads_packed = torch.autograd.grad((h_UE * w).sum(), [packed_in, *enc.parameters()], allow_unused=True)
    torch.testing.assert_close(grads_packed[0], torch.cat(split_rows(grads_padded[0], feat_lens)), **TOL)
    names = [k for k, _ in enc.named_parameters()]
    for k, gp, gq in zip(names, grads_padded[1:], grads_packed[1:], strict=True):
        assert_grad_close(gq if gq is not None else torch.zeros_like(gp), gp, k)


def split_rows(x_BT_: torch.Tensor, lens: torch.Tensor) -> list[torch.Tensor]:
    return [x_BT_[b, : int(n)] for b, n in enumerate(lens)]


def test_packed_projector_equals_padded():
    torch.manual_seed(0)
    proj = FrameStackProjector(6, 5, stack=3, hidden=7)
    lens = torch.tensor([7, 1, 3, 0, 5])
    x_BUE = torch.randn(5, 7, 6)
    out_BVH, vl = proj(x_BUE, lens)
    out_VH, vl2 = proj(torch.cat(split_rows(x_BUE, lens)), lens)
    assert torch.equal(vl, vl2) and out_VH.shape[0] == int(vl.sum())
    torch.testing.assert_close(out_VH, torch.cat(split_rows(out_BVH, vl)), **TOL)


def ctc_targets() -> tuple[torch.Tensor, torch.Tensor]:
    """CTC targets for the first five clips of AUDIO_LENS (padded with 0, and their lengths)."""
    tokens = torch.tensor([[5, 6, 7, 8], [5, 9, 0, 0], [5, 7, 7, 0], [5, 6, 0, 0], [5, 0, 0, 0]])
    return tokens, torch.tensor([4, 2, 3, 2, 1])


@pytest.mark.parametrize("frozen", [False, True])
def test_speech_llm_packed_encoder_embeds_ctc_and_gradients_equal_padded(frozen):
    packed, padded = build_pair()
    audio, lens = make_audio(AUDIO_LENS[:5])
    tokens, token_lens = ctc_targets()
    results = []
    for model in (packed, padded):
        model.train()
        enc = model.encode_audio(audio, lens, freeze_encoder=frozen)
        assert isinstance(enc.enc_hidden, PackedFrames) == (model is packed)
        ctc, n = model.ctc_loss_sum(enc.enc_hidden, enc.enc_lens, tokens, token_lens)
        w = [
            torch.randn(e.shape, generator=torch.Generator().manual_seed(i)) for i, e in enumerate(enc.embeds)
        ]
        loss = sum((e * wi).sum() for e, wi in zip(enc.embeds, w)) + ctc
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((enc, ctc, n, grads))
    (e1, c1, n1, g1), (e2, c2, n2, g2) = results
    for a, b in zip(e1.embeds, e2.embeds, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    # the conformer stack's output (|h| up to ~3): 1e-5 of its scale, like the gradients; the fp64 test
    # below shows the remaining fp32 difference is rounding order, not a different computation
    assert_grad_close(e1.enc_hidden.to_padded(), e2.enc_hidden[:, : int(e2.enc_lens.max())], "enc_hidden")
    torch.testing.assert_close(c1, c2, **TOL)
    assert n1 == n2 == 5
    assert g1.keys() == g2.keys()
    assert any(k.startswith("encoder.") for k in g1) != frozen  # frozen: no encoder gradients at all
    for k in g1:
        assert_grad_close(g1[k], g2[k], k)


def test_speech_llm_packed_encoder_is_exact_in_fp64():
    """In fp64 the two paths agree to rounding (1e-10): the padding-free encoder computes the same function,
    and fp32 differences of ~1e-5 on deep activations come from summation order only."""
    packed, padded = (m.double() for m in build_pair())
    audio, lens = make_audio(AUDIO_LENS[:5])
    tokens, token_lens = ctc_targets()
    results = []
    for model in (packed, padded):
        model.train()
        enc = model.encode_audio(audio.double(), lens)
        ctc, _ = model.ctc_loss_sum(enc.enc_hidden, enc.enc_lens, tokens, token_lens)
        (sum(e.sum() for e in enc.embeds) + ctc).backward()
        hidden = (
            enc.enc_hidden.to_padded() if model is packed else enc.enc_hidden[:, : int(enc.enc_lens.max())]
        )
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((hidden, ctc, grads))
    (h1, c1, g1), (h2, c2, g2) = results
    exact = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h1, h2, **exact)
    torch.testing.assert_close(c1, c2, **exact)
    assert g1.keys() == g2.keys() and any(k.startswith("encoder.") for k in g1)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-10, atol=1e-10 * max(1.0, float(g2[k].abs().max())))


def test_whole_loss_equal_with_packed_and_padded_encoder():
    packed, padded = build_pair()
    audio, lens = make_audio([8000, 5000, 12000])
    batch = dict(
        audio=audio,
        audio_lens=lens,
        tokens=torch.tensor([[5, 6, 7], [5, 8, 0], [5, 6, 9]]),
        token_lens=torch.tensor([3, 2, 3]),
    )
    a, b = packed(batch), padded(batch)  # the training path (SpeechLLM.forward), THD decoder
    assert packed.cfg.packed_sequences and padded.cfg.packed_sequences
    torch.testing.assert_close(a.ce_sum, b.ce_sum, **TOL)
    torch.testing.assert_close(a.ctc_sum, b.ctc_sum, **TOL)


def test_packed_true_is_refused_where_unsupported():
    whisper = build_whisper_encoder(encoder_cfg(kind="whisper"), dropout=0.0, max_source_positions=64)
    assert not whisper.supports_packed
    with pytest.raises(ValueError, match="model.encoder.packed=false"):
        whisper(torch.zeros(1, 10, 32), torch.tensor([10]), packed=True)
    cfg = model_cfg(True)
    cfg.encoder.kind = "whisper"
    with pytest.raises(ValueError, match="no padding-free path"):
        SpeechLLM(cfg, vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    cfg.encoder.packed = None  # default: padded for whisper
    assert not SpeechLLM(
        cfg, vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, audio_id=AUDIO
    ).encoder_packed


# ------------------------------------------------------------------------ distributed encoding, cp=2


def _cp_worker(rank: int, world_size: int, frozen: bool) -> dict[str, Any]:
    packed, _ = build_pair()
    packed.train()
    audio, lens = make_audio(AUDIO_LENS[:5])
    tokens = torch.tensor([[5, 6, 7], [5, 9, 0], [5, 7, 7], [5, 6, 0], [5, 8, 0]])
    token_lens = torch.tensor([3, 2, 3, 2, 2])

    def encode_fn(a: torch.Tensor, n: torch.Tensor) -> Any:
        out = packed.encode_audio(a, n, freeze_encoder=frozen)
        return out.embeds, (out.enc_hidden, out.enc_lens)

    owners = [0, 0, 0, 1, 1]  # every clip gathered (every sequence split over CP)
    res = encode_placed(
        encode_fn,
        audio,
        lens,
        owners=owners,
        gathered=[True] * 5,
        group=dist.group.WORLD,
        cp_rank=rank,
        cp_size=world_size,
    )
    hidden, enc_lens = res.extra
    ctc, _ = packed.ctc_loss_sum(hidden, enc_lens, tokens[res.clips], token_lens[res.clips])
    embed_loss = sum((e * (i + 1)).sum() for i, e in enumerate(res.embeds)) / world_size
    (embed_loss + ctc).backward()
    return {k: p.grad.clone() for k, p in packed.named_parameters() if p.grad is not None}


@pytest.mark.multiproc
@pytest.mark.parametrize("frozen", [False, True])
def test_packed_encoder_under_cp2_gives_the_padded_single_process_gradients(frozen):
    per_rank = run_distributed(_cp_worker, 2, "gloo", frozen)
    _, padded = build_pair()
    padded.train()
    audio, lens = make_audio(AUDIO_LENS[:5])
    enc = padded.encode_audio(audio, lens, freeze_encoder=frozen)
    tokens = torch.tensor([[5, 6, 7], [5, 9, 0], [5, 7, 7], [5, 6, 0], [5, 8, 0]])
    ctc, _ = padded.ctc_loss_sum(enc.enc_hidden, enc.enc_lens, tokens, torch.tensor([3, 2, 3, 2, 2]))
    (sum((e * (i + 1)).sum() for i, e in enumerate(enc.embeds)) + ctc).backward()
    want = {k: p.grad for k, p in padded.named_parameters() if p.grad is not None}
    summed = copy.deepcopy(per_rank[0])
    for k in summed:
        summed[k] = sum(g[k] for g in per_rank if k in g)
    assert summed.keys() == want.keys()
    for k, g in want.items():
        assert_grad_close(summed[k], g, k)


def test_subsampling_factor_sets_the_encoder_frames_the_sampler_cost_and_is_checked():
    """model.encoder.subsampling_factor: 4 gives 40 ms frames (room for CTC on subword pieces spoken fast);
    the sampler's token cost follows it; a non power of two, or a pretrained / non-Parakeet encoder, is refused."""
    from speechlm.config import ConfigError, load_config
    from speechlm.data.sampler.build import token_cost_of

    enc = build_encoder(encoder_cfg(subsampling_factor=4), dropout=0.0)
    assert enc.output_lengths(torch.tensor([400, 401, 7])).tolist() == [100, 101, 2]
    cfg = load_config(None, ["model.encoder.subsampling_factor=4"])
    assert token_cost_of(cfg.model).encoder_subsampling == 4
    assert token_cost_of(load_config(None, []).model).encoder_subsampling == 8
    for bad, why in [
        (["model.encoder.subsampling_factor=6"], "power of two"),
        (["model.encoder.subsampling_factor=1"], "subsampling_factor"),
        (["model.encoder.subsampling_factor=4", "model.encoder.kind=whisper"], "built from sizes only"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(None, bad)
