"""`speechlm bench packing` runs end to end (it crashed once when `StepContext` lost `prompts`)."""

from __future__ import annotations

import json

from speechlm.bench import load_benchmark


def test_bench_packing_runs_one_batch(tmp_path):
    out = tmp_path / "packing.json"
    assert load_benchmark("packing").main(["--batches", "1", "--repeats", "1", "--json", str(out)]) == 0
    layouts = json.loads(out.read_text())["layouts"]
    assert set(layouts) == {"bshd", "thd_padded_encoder", "thd"}
    assert layouts["thd"]["decoder_token_efficiency"] == 1.0
