"""benchmarks/bench_encoder_share.py runs on tiny saved models (a 1-layer 32-wide Whisper encoder, a 1-layer
Llama): both windows and the LLM timed in one process, the LLM's tokens those of the micro-batch described
(docs/pretrained.md has the recipe's figures)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_encoder_share  # noqa: E402


def test_bench_encoder_share_times_both_windows_and_the_llm(tmp_path, capsys) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    WhisperEncoder(
        WhisperConfig(
            d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80
        )
    ).save_pretrained(tmp_path / "enc")
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    ).save_pretrained(tmp_path / "llm")
    argv = ["--encoder", str(tmp_path / "enc"), "--llm", str(tmp_path / "llm"), "--clips", "1.0", "2.0"]
    assert (
        bench_encoder_share.main([*argv, "--repeats", "1", "--prompt-tokens", "10", "--text-tokens", "3"])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    # 1 s and 2 s: 100 and 200 feature frames -> 50 and 100 encoder frames -> 13 and 25 rows at stack 4
    assert out[0] == "micro-batch of 2 clips (3.0 s), 64 LLM tokens"
    assert re.fullmatch(
        r"encoder forward: full window [\d.]+ s, clip window [\d.]+ s; LLM fwd\+bwd \(LoRA\) [\d.]+ s", out[1]
    )
    assert re.fullmatch(r"encoder share of encoder \+ LLM: full \d+%, clip \d+%", out[2])
