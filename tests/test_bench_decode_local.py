"""`speechlm bench decode-local` runs end to end: per CP rank, every clip decoded vs its own clips only."""

from __future__ import annotations

import json

import pytest

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


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_bench_decode_local_gloo_ranks_in_lockstep_each_decode_their_own_clips(demo_data, tmp_path):
    out = tmp_path / "decode_local_gloo.json"
    argv = ["--cp", "2", "--steps", "2", "--manifest", demo_data["train"], "--tokenizer", demo_data["tok"]]
    assert load_benchmark("decode-local").main([*argv, "--gloo", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"cp2 every clip", "cp2 its clips"}
    for r in results.values():
        assert len(r["ranks"]) == 2
        for x in r["ranks"]:
            assert (
                x["cpu_s"] > 0 and x["data_wait_s"] > 0 and x["agree_wait_s"] >= 0 and len(x["per_step"]) == 2
            )
            assert x["wall_s"] >= x["data_wait_s"]
        # the ranks read the same micro-batches (one sampler, lockstep)
        steps = [[(s["clips"], s["read_again"]) for s in x["per_step"]] for x in r["ranks"]]
        assert steps[0] == steps[1]
    for x in results["cp2 every clip"]["ranks"]:  # before: every rank decodes every clip of every step
        assert all(s["decoded"] == s["clips"] > 0 for s in x["per_step"]) and x["redecoded_steps"] == 0
    own = results["cp2 its clips"]["ranks"]
    # the demo's broken FLAC (header reads, stream does not) is in the first two micro-batches: the rank that
    # decoded it failed, the agreement had both ranks read that step again whole
    assert [x["redecoded_steps"] for x in own] == [1, 1]
    for k in range(2):
        steps = [x["per_step"][k] for x in own]
        if steps[0]["read_again"]:
            assert all(s["decoded"] == s["clips"] for s in steps)
        else:  # each clip decoded on exactly one rank (one clip per row, none sharded), no rank all of them
            assert sum(s["decoded"] for s in steps) == steps[0]["clips"]
            assert all(0 < s["decoded"] < s["clips"] for s in steps)
