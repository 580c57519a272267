"""The epoch plan and `speechlm plan`'s summary work on 10M rows a piece at a time: the same results as
in one pass, without 10M-row temporaries (numpy's allocations, as tracemalloc counts them)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import speechlm.data.plan.figures as plan_module
from speechlm.data.sampler import SamplerSettings, build_epoch_plan
from speechlm.data.sampler.batching import pack_greedy
from speechlm.data.sampler.build import SamplerInputs
from speechlm.data.sampler.cost import SECOND_UNITS, TOKEN_UNITS, quantize_costs


def peak_bytes(fn, *args, **kwargs):
    """What `fn` returns and the most memory it held at once beyond what it was given."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = fn(*args, **kwargs)
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_quantize_costs_in_pieces_is_exact_and_makes_no_float64_copy():
    rng = np.random.default_rng(0)
    sizes = rng.uniform(0.5, 20, 1_000_003).astype(np.float32)
    whole = np.ceil(sizes.astype(np.float64) * SECOND_UNITS).astype(np.int32)  # the one-pass rounding
    for piece_rows in (1, 7, 1 << 16, 1 << 20):
        some = sizes[:5000] if piece_rows < 10 else sizes
        costs, budget = quantize_costs(some, 90.0, SECOND_UNITS, piece_rows=piece_rows)
        np.testing.assert_array_equal(costs, whole[: len(costs)])
        assert costs.dtype == np.int32 and budget == 90 * SECOND_UNITS
    (costs, _), peak = peak_bytes(quantize_costs, sizes, 90.0, SECOND_UNITS, piece_rows=1 << 16)
    assert peak < costs.nbytes + 4 * 8 * (1 << 16)  # the int32 costs and float64 pieces: not an 8 MB copy
    big, _ = quantize_costs(np.array([1.0, 3e6, 2.5]), 1e7, TOKEN_UNITS, piece_rows=2)  # over int32
    assert big.dtype == np.int64 and big.tolist() == [1000, 3_000_000_000, 2500]
    assert quantize_costs(np.zeros(0, np.float32), 1.0, SECOND_UNITS)[0].dtype == np.int32


def test_pack_greedy_doubles_its_pointers_in_place():
    n = 2_000_000
    costs = np.random.default_rng(2).integers(1, 3_000_000, n).astype(np.int32)  # ~60 rows a batch
    buckets = np.arange(0, n, 100_000)  # segments, as the plan's duration buckets
    starts, peak = peak_bytes(pack_greedy, costs, 90_000_000, buckets, piece_rows=1 << 16)
    np.testing.assert_array_equal(starts, pack_greedy(costs, 90_000_000, buckets, piece_rows=999))
    np.testing.assert_array_equal(starts, pack_greedy(costs, 90_000_000, buckets, piece_rows=4 * n))
    # next and jump (int32, 4n bytes each) and small pieces; doubling by jump = jump[jump] held next, the
    # old jump and the new one at once (12n bytes: 120 MB of 10M rows)
    assert peak < 10 * n


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_summary_in_pieces_equals_the_summary_in_one_piece(cp, monkeypatch):
    rng = np.random.default_rng(3)
    n = 20_000
    durations = np.clip(rng.lognormal(np.log(5), 0.8, n), 0.5, 200).astype(np.float32)  # long clips shard
    codes = rng.integers(0, 3, n).astype(np.int16)
    inputs = SamplerInputs(durations, codes, ["de", "en", "sw"], rng.integers(0, 400, n).astype(np.int32))
    settings = SamplerSettings(dp_size=2, max_batch_duration=200.0)
    plan = build_epoch_plan(durations, codes, settings)

    def summary():
        return plan_module.summarize_plan(plan, inputs, settings, cp_size=cp, tp_size=2)

    whole = summary()
    monkeypatch.setattr(plan_module, "CHUNK", 97)  # pieces of ~97 rows: micro-batches cut across them
    pieces = summary()
    assert pieces.keys() == whole.keys()
    for key in whole:
        if key in ("padding", "encoder_sharding", "over_budget"):
            assert pieces[key] == pytest.approx(whole[key], rel=1e-12), key
        else:
            assert pieces[key] == whole[key], key
    if cp > 1:
        assert whole["encoder_sharding"]["clips"] > 0
