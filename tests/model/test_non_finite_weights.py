"""Loaded weights with NaN (a safetensors file with 0xff bytes written in place: same size, it loads) are
refused naming the file and the tensor (issue 36 item 4, audit case PL06): a pretrained LLM, a pretrained
encoder; `speechlm train` on such an LLM exits 1 before training."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import SMOKE, train_in_process
from pretrained_helpers import make_tiny_pretrained

from speechlm.config import EncoderConfig, LLMConfig
from speechlm.errors import NonFiniteError


def corrupt_in_place(file: Path, tensor: str, n_bytes: int = 64) -> None:
    """Write `n_bytes` of 0xff into the data of `tensor` of the safetensors `file` (its size unchanged)."""
    raw = file.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_len])
    start, end = header[tensor]["data_offsets"]
    at = 8 + header_len + start
    n = min(n_bytes, end - start)
    with file.open("r+b") as f:
        f.seek(at)
        f.write(b"\xff" * n)
    assert file.stat().st_size == len(raw)


LLM_TENSOR = "model.layers.1.mlp.down_proj.weight"


def test_a_pretrained_llm_with_nan_weights_is_refused_naming_file_and_tensor(tmp_path):
    from speechlm.model.llm import build_llm

    llm = make_tiny_pretrained(tmp_path / "llm", langs=["en"])
    corrupt_in_place(llm / "model.safetensors", LLM_TENSOR)
    cfg = LLMConfig(pretrained=str(llm))
    with pytest.raises(NonFiniteError) as e:
        build_llm(
            cfg, vocab_size=10, pad_id=0, bos_id=None, eos_id=1, dropout=0.0, attn_implementation="sdpa"
        )
    msg = str(e.value)
    assert str(llm / "model.safetensors") in msg and LLM_TENSOR in msg and "NaN" in msg
    assert "model.llm.pretrained" in msg


def test_a_pretrained_encoder_with_nan_weights_is_refused_naming_file_and_tensor(tmp_path):
    from speechlm.model.encoders import build_encoder

    small = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                 subsampling_conv_channels=16, num_mel_bins=32, conv_norm="batch_norm")  # fmt: skip
    enc = build_encoder(EncoderConfig(**small), dropout=0.0)
    enc.model.save_pretrained(tmp_path / "enc")
    weights = tmp_path / "enc" / "model.safetensors"
    name = "layers.0.feed_forward1.linear1.weight"
    assert name in json.loads(weights.read_bytes()[8 : 8 + struct.unpack("<Q", weights.read_bytes()[:8])[0]])
    corrupt_in_place(weights, name)
    with pytest.raises(NonFiniteError) as e:
        build_encoder(EncoderConfig(**{**small, "pretrained": str(tmp_path / "enc")}), dropout=0.0)
    msg = str(e.value)
    assert str(weights) in msg and name in msg and "model.encoder.pretrained" in msg


def test_a_finite_model_passes_and_integers_are_not_checked():
    from speechlm.model.finite import first_non_finite

    named = [("a", torch.ones(3)), ("ids", torch.arange(4)), ("b", torch.tensor([1.0, float("inf")]))]
    assert first_non_finite(named[:2]) is None
    assert first_non_finite(named) == ("b", 1, 2)


def test_train_on_a_damaged_pretrained_llm_exits_1_before_training(demo_data, tmp_path, capsys):
    llm = make_tiny_pretrained(tmp_path / "llm", langs=["bn", "en", "hi", "ta", "te"])
    corrupt_in_place(llm / "model.safetensors", LLM_TENSOR, n_bytes=4096)
    run_dir = tmp_path / "run"
    r = train_in_process(
        [SMOKE, f"data.train_manifest={demo_data['train']}", f"data.val_manifest={demo_data['val']}",
         f"model.llm.pretrained={llm}", "trainer.max_steps=2", f"trainer.run_dir={run_dir}"],
        capsys,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and LLM_TENSOR in r.stderr and "model.safetensors" in r.stderr
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step_*"))
