"""`speechlm bench pretrained-lora`'s summary: throughput over the steps after the warm-up, from metrics.jsonl
rows (the training run itself needs the recipe's keys and a device: run by hand, docs/pretrained.md)."""

from __future__ import annotations

import pytest

from speechlm.preflight.bench import load_benchmark


def _rows(n: int) -> list[dict]:
    # step k ends at time 100 + 2k (step 1 took 30 s: compilation), 50 labelled tokens, 4 utts, 20 s audio each
    rows = [
        {"kind": "train", "step": k, "time": 100.0 + 2 * k + (28 if k >= 1 else 0), "tokens": 50,
         "utterances": 4, "audio_hours": 20 * k / 3600, "loss": 5.0 - 0.1 * k}
        for k in range(1, n + 1)
    ]  # fmt: skip
    return [{"kind": "val", "step": 3, "wer": 0.5}, *reversed(rows)]


def test_summary_times_the_steps_after_the_warmup():
    bench = load_benchmark("pretrained-lora")
    s = bench.summarize(_rows(10), warmup=2)
    assert s["steps"] == "3-10" and s["seconds"] == pytest.approx(16.0)  # 8 steps of 2 s
    assert s["tokens_per_s"] == pytest.approx(25.0) and s["utterances_per_s"] == pytest.approx(2.0)
    assert s["audio_s_per_s"] == pytest.approx(10.0) and s["step_s"] == pytest.approx(2.0)
    assert (s["loss_first"], s["loss_last"]) == (pytest.approx(4.9), pytest.approx(4.0))
    line = bench.docs_line(
        {**s, "peak_gib": 3.25, "peak_what": "device memory allocated", "device": "1x H100"},
        llm="smollm2-135m-instruct", encoder="demo encoder", precision="bf16", attention="flex",
    )  # fmt: skip
    assert line.startswith(
        "smollm2-135m-instruct LoRA + demo encoder, bf16, flex attention, 1x H100: 25 labelled"
    )
    assert "2000 ms/step (steps 3-10)" in line and "peak 3.2 GiB" in line and "loss 4.90 -> 4.00" in line


def test_summary_with_fewer_steps_than_the_warmup_times_all_but_the_first():
    s = load_benchmark("pretrained-lora").summarize(_rows(3), warmup=20)
    assert s["steps"] == "2-3" and s["seconds"] == pytest.approx(4.0)


def test_summary_refuses_a_run_without_two_steps():
    with pytest.raises(SystemExit, match="1 logged training step"):
        load_benchmark("pretrained-lora").summarize(_rows(1), warmup=0)
