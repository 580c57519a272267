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
    # the demo's broken FLAC (its header reads, its stream does not) is in one of the first micro-batches:
    # that step is read again whole on every rank (the agreement); the others, each clip on one rank only
    assert [x["redecoded_steps"] for x in own] == [1, 1]
    assert all(x["decoded"] < x["clips"] for x in own) and sum(x["decoded"] for x in own) > own[0]["clips"]
