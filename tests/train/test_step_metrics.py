"""A short smoke run logs the step figures (throughput, MFU, memory, times) in metrics.jsonl and the CSV
log, consistent with the step's tokens, audio and time (`speechlm.train.throughput`)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from helpers import read_train_metrics, run_train

from speechlm.train.throughput import STEP_METRIC_KEYS

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")


@pytest.mark.slow  # ~26 s; tests/train/test_training.py checks the keys in its run of the default suite
def test_smoke_run_logs_throughput_mfu_and_memory(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    r = run_train(
        [
            SMOKE,
            f"data.train_manifest={demo_data['train']}",
            f"data.tokenizer={demo_data['tok']}",
            "trainer.max_steps=3",
            "trainer.final_eval_split=none",
            "trainer.peak_tflops=0.5",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_train_metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3]
    prev_audio_h = 0.0
    for row in rows:
        assert set(STEP_METRIC_KEYS) <= set(row), set(STEP_METRIC_KEYS) - set(row)
        step_s = row["step_s"]
        assert 0 < row["data_wait_s"] < step_s and 0 < row["optim_s"] < step_s
        # one process: the rank's figures are the totals
        assert row["tokens_per_s"] * step_s == pytest.approx(row["real_tokens"], rel=1e-9)
        assert row["tokens_per_s_rank"] == pytest.approx(row["tokens_per_s"], rel=1e-9)
        audio_s = (row["audio_hours"] - prev_audio_h) * 3600
        prev_audio_h = row["audio_hours"]
        assert row["audio_s_per_s"] * step_s == pytest.approx(audio_s, rel=1e-6)
        # every utterance contributes its labelled tokens and ~6.25 audio embeddings per second (100
        # frames/s, 8x subsampling, stack 2) to the real tokens; THD at cp 1 computes no padding
        assert row["real_tokens"] > row["tokens"] + 6 * audio_s
        assert row["real_tokens"] < row["tokens"] + 7 * audio_s + 20 * row["utterances"]
        assert row["real_token_share"] == pytest.approx(1.0)
        # FLOPs: at least 6 FLOPs per LLM weight per real token; TFLOP/s and MFU follow from them
        assert row["step_tflop"] * 1e12 > 6 * LLM_LINEAR_WEIGHTS * row["real_tokens"]
        assert row["tflops_per_s"] == pytest.approx(row["step_tflop"] / step_s, rel=1e-9)
        assert row["mfu"] == pytest.approx(row["tflops_per_s"] / 0.5, rel=1e-9)  # trainer.peak_tflops
        assert row["mem_cuda_alloc_gib"] is None and row["mem_cuda_reserved_gib"] is None  # no CUDA here
        assert 0.1 < row["rss_gib"] < 64
    logged = list(csv.DictReader(next((run_dir / "csv").rglob("metrics.csv")).open()))
    assert any(rec.get("mfu") for rec in logged) and any(rec.get("tokens_per_s") for rec in logged)


# configs/smoke.yaml's LLM: 2 layers of width 32, 4 heads, 2 KV heads (G = 16), FFN 64
LLM_LINEAR_WEIGHTS = 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64)
