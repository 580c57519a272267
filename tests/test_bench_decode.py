"""`speechlm bench decode` runs end to end and reports the three decodings side by side."""

from __future__ import annotations

import json

from speechlm.preflight.bench import load_benchmark


def test_bench_decode_reports_llm_alone_every_token_and_candidates(tmp_path):
    out = tmp_path / "decode.json"
    argv = ["--vocab", "400", "--utterances", "2", "--seconds", "0.5", "1", "--max-new-tokens", "3"]
    argv += ["--repeats", "1", "--candidates", "399", "--json", str(out)]
    assert load_benchmark("decode").main(argv) == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert set(results) == {"llm alone", "joint, every token", "joint, K=399"}
    assert results["llm alone"]["ratio_to_llm_alone"] == 1.0
    for r in results.values():
        assert r["seconds"] > 0 and r["ratio_to_llm_alone"] == r["seconds"] / results["llm alone"]["seconds"]
    assert payload["ctc_head_seconds"] > 0
    assert payload["same_hypotheses"] == 2  # K covers the vocabulary: the every-token hypotheses
