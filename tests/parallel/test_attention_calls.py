"""Calls into the varlen kernel interface per attention layer stay at most 2·cp, whatever the number of
utterances in the pack (`speechlm bench attention-calls` measures the same; docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from parallel.testing import run_distributed
from speechlm.preflight.bench import load_benchmark

bench = load_benchmark("attention-calls")


@pytest.mark.parametrize("n", [20, 200])
def test_one_process_makes_one_call_each_way(n):
    assert bench.one_layer(0, 1, bench.pack_lengths(n), "-") == {"fwd": 1, "bwd": 1}


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["ring", "allgather"])
@pytest.mark.parametrize("threshold", [0, "auto"])
def test_cp2_stays_within_two_cp_calls_for_20_and_200_utterances(kind, threshold):
    for n in (20, 200):
        per_rank = run_distributed(
            bench.one_layer, 2, "gloo", bench.pack_lengths(n), threshold, kind, timeout_s=300
        )
        for counts in per_rank:
            assert 1 <= counts["fwd"] <= 4 and 1 <= counts["bwd"] <= 4, (n, counts)
            if threshold == 0:  # every utterance split: the ring makes cp calls, the all-gather two
                assert counts["fwd"] == counts["bwd"] == 2, (kind, n, counts)
