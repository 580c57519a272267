"""`speechlm bench decode-local` runs end to end: per CP rank, every clip decoded vs its own clips only."""

from __future__ import annotations

import json

from speechlm.preflight.bench import load_benchmark


def test_bench_decode_local_reports_each_rank_decoding_its_share(demo_data, tmp_path):
    out = tmp_path / "decode_local.json"
    argv = [
        "--cp",
        "1",
        "2",
        "--steps",
        "2",
        "--manifest",
        demo_data["train"],
        "--tokenizer",
        demo_data["tok"],
    ]
    assert load_benchmark("decode-local").main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"cp1 every clip", "cp1 its clips", "cp2 every clip", "cp2 its clips"}
    for r in results.values():
        assert len(r["ranks"]) == r["cp"] and all(x["cpu_s"] > 0 and x["data_wait_s"] > 0 for x in r["ranks"])
    every, own = results["cp2 every clip"]["ranks"], results["cp2 its clips"]["ranks"]
    assert all(x["decoded"] == x["clips"] for x in every)
    assert own[0]["redecoded_steps"] == 0  # the demo's broken clip is not in the first two micro-batches
    # each clip on one rank: the ranks' shares add up to the micro-batches'
    assert (
        sum(x["decoded"] for x in own) == own[0]["clips"] and max(x["decoded"] for x in own) < own[0]["clips"]
    )
