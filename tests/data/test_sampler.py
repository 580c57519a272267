"""Epoch plan: each step of the exhaustive algorithm, the temperature mode's language mix, the packing,
lockstep over ranks, determinism, and the sampler's resume state."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speechlm.data.sampler import (
    DEFAULT_BUCKET_BOUNDARIES,
    DurationBucketBatchSampler,
    EpochPlan,
    SamplerSettings,
    TokenCostModel,
    batching,
    build_epoch_plan,
    check_arrays,
    ordering,
)
from speechlm.preflight.bench import load_benchmark

bench = load_benchmark("sampler")


def skewed(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    durations, lang_codes, _ = bench.make_synthetic_manifest(n, seed)
    return durations, lang_codes


def all_batches(plan: EpochPlan) -> list[list[list[int]]]:
    return [[plan.batch(r, j).tolist() for j in range(plan.batches_per_rank)] for r in range(plan.dp_size)]


def sequential_starts(costs: list[int], budget: int, segment_starts: list[int]) -> list[int]:
    """Oracle for step 4: one row at a time."""
    forced = set(segment_starts) | {0}
    starts, total = [], 0
    for i, c in enumerate(costs):
        if i in forced or total + c > budget:
            starts.append(i)
            total = c
        else:
            total += c
    return starts


# --------------------------------------------------------------------------------------------- step 1


def test_buckets_are_half_open_intervals_of_the_boundaries():
    durations = np.array([0.0, 2.99, 3.0, 4.99, 5.0, 15.99, 16.0, 40.0], dtype=np.float32)
    assert ordering.assign_buckets(durations, (3, 5, 8, 12, 16)).tolist() == [0, 0, 1, 1, 2, 4, 5, 5]


def test_buckets_reject_unsorted_boundaries():
    with pytest.raises(ValueError, match="strictly increasing"):
        ordering.assign_buckets(np.ones(3, np.float32), (5, 3))


# --------------------------------------------------------------------------------------------- step 2


def test_language_targets_follow_the_temperature_formula():
    counts = np.array([900, 90, 10, 0])
    t = ordering.compute_language_targets(counts, 0.5)
    expected = np.array([30.0, math.sqrt(90), math.sqrt(10), 0.0])
    np.testing.assert_allclose(t, expected / expected.sum())
    np.testing.assert_allclose(ordering.compute_language_targets(counts, 1.0), counts / counts.sum())
    for temperature in (0.0, -1.0):
        np.testing.assert_allclose(
            ordering.compute_language_targets(counts, temperature), [1 / 3, 1 / 3, 1 / 3, 0]
        )


def test_language_weights_are_target_over_actual():
    counts = np.array([900, 100, 0])
    targets = ordering.compute_language_targets(counts, 0.0)
    np.testing.assert_allclose(
        ordering.compute_language_weights(counts, targets), [0.5 / 0.9, 0.5 / 0.1, 0.0]
    )


def test_counts_sum_exactly_by_largest_remainder():
    counts = ordering.allocate_counts(np.array([1 / 3, 1 / 3, 1 / 3]), 100)
    assert counts.tolist() == [34, 33, 33]
    counts = ordering.allocate_counts(np.array([0.555, 0.445, 0.0]), 7)
    assert counts.sum() == 7 and counts[2] == 0 and counts.tolist() == [4, 3, 0]


# --------------------------------------------------------------------------------------------- step 3


def test_order_groups_buckets_and_sorts_by_weighted_key_descending():
    rng = np.random.default_rng(0)
    n = 5000
    buckets = rng.integers(0, 4, n).astype(np.int8)
    langs = rng.integers(0, 3, n).astype(np.int32)
    weights = np.array([0.5, 1.0, 4.0])
    order, starts, keys = ordering.order_by_weighted_keys(
        buckets, langs, weights, ordering.make_generator(3, "order", 0), return_keys=True
    )
    assert sorted(order.tolist()) == list(range(n))
    assert np.all(np.diff(buckets[order]) >= 0)
    assert starts.tolist() == np.flatnonzero(np.diff(buckets[order], prepend=-1)).tolist()
    u = np.exp(-keys)  # the per-row uniform draw
    key = u[order] ** (1 / weights[langs[order]])
    for a, b in zip(starts, [*starts[1:], n]):
        assert np.all(np.diff(key[a:b]) <= 0)
    assert abs(keys.mean() - 1.0) < 0.05  # the E draws are Exp(1)


def test_first_of_a_bucket_is_drawn_in_proportion_to_its_weight():
    """Efraimidis-Spirakis: P(row i comes first) = w_i / sum(w)."""
    buckets = np.zeros(3, np.int8)
    langs = np.arange(3, dtype=np.int32)
    weights = np.array([1.0, 2.0, 3.0])
    trials = 3000
    firsts = np.zeros(3)
    for t in range(trials):
        order, _, _ = ordering.order_by_weighted_keys(buckets, langs, weights, np.random.default_rng(t))
        firsts[order[0]] += 1
    expected = weights / weights.sum() * trials
    assert np.all(np.abs(firsts - expected) < 4 * np.sqrt(expected))


# --------------------------------------------------------------------------------------------- step 4


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(0, 60), min_size=1, max_size=120),
    budget=st.integers(1, 150),
    cuts=st.lists(st.integers(0, 119), max_size=4),
    block=st.integers(1, 9),
    jump_log2=st.integers(0, 3),
    piece_rows=st.integers(1, 9),  # the pointer doubling, in place piece by piece
)
def test_packing_matches_the_row_by_row_greedy(costs, budget, cuts, block, jump_log2, piece_rows):
    segments = sorted({c for c in cuts if c < len(costs)})
    got = batching.pack_greedy(
        np.array(costs),
        budget,
        np.array(segments, dtype=np.int64),
        block=block,
        jump_log2=jump_log2,
        piece_rows=piece_rows,
    )
    assert got.tolist() == sequential_starts(costs, budget, segments)


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.integers(0, 200), min_size=1, max_size=200), budget=st.integers(1, 300))
def test_packed_batches_fit_the_budget_and_are_maximal(costs, budget):
    starts = batching.pack_greedy(np.array(costs), budget).tolist()
    ends = [*starts[1:], len(costs)]
    for a, b in zip(starts, ends):
        total = sum(costs[a:b])
        assert total <= budget or b - a == 1  # only a lone row may exceed
        if b < len(costs):
            assert total + costs[b] > budget  # greedy: the next row did not fit


def test_packing_keeps_equal_costs_exact_and_handles_oversized_rows():
    costs = np.full(10_000, 10)
    costs[[5, 777]] = 1000
    starts = batching.pack_greedy(costs, 90, np.array([0, 4321]), block=64)
    assert starts.tolist() == sequential_starts(costs.tolist(), 90, [4321])


# --------------------------------------------------------------------------------------------- steps 5-6


def test_ranks_take_cost_sorted_batches_round_robin_after_dropping_the_tail():
    ranks = batching.assign_to_ranks(np.array([5.0, 1.0, 4.0, 3.0, 2.0]), dp_size=2)
    assert ranks.tolist() == [[0, 3], [2, 4]]  # order 0,2,3,4 (1 dropped); rank r takes r, r+2


def test_trim_keeps_a_multiple_of_grad_accum_and_shuffles_all_ranks_alike():
    ranks = np.arange(14).reshape(2, 7)
    out = batching.trim_and_shuffle(ranks, 3, np.random.default_rng(0))
    assert out.shape == (2, 6)
    assert sorted(out[0].tolist()) == list(range(6)) and sorted(out[1].tolist()) == list(range(7, 13))
    assert (out[1] - out[0]).tolist() == [7] * 6  # the same permutation on every rank


# --------------------------------------------------------------------------------------------- whole plan


@pytest.mark.parametrize(
    ("n", "seed", "dp", "accum", "temperature", "epoch"),
    [(3000, 0, 2, 2, 0.3, 0), (5000, 3, 4, 1, 0.0, 2), (800, 7, 1, 3, 1.0, 1), (20000, 1, 8, 4, 0.3, 5)],
)
def test_exhaustive_mode_equals_the_per_row_reference(n, seed, dp, accum, temperature, epoch):
    durations, langs = skewed(n, seed)
    settings = SamplerSettings(
        dp_size=dp, grad_accum=accum, mode="exhaustive", temperature=temperature, seed=seed
    )
    plan = build_epoch_plan(durations, langs, settings, epoch)
    # replay the plan's own draws: the Exp(1) keys of step 3 and the permutation of step 6
    dur, codes, _, n_langs = check_arrays(durations, langs)
    counts = np.bincount(codes, minlength=n_langs)
    weights = ordering.compute_language_weights(
        counts, ordering.compute_language_targets(counts, temperature)
    )
    _, _, keys = ordering.order_by_weighted_keys(
        ordering.assign_buckets(dur, DEFAULT_BUCKET_BOUNDARIES),
        codes,
        weights,
        ordering.make_generator(seed, "order", epoch),
        return_keys=True,
    )
    perm = ordering.make_generator(seed, "ranks", epoch).permutation(plan.batches_per_rank)
    expected = bench.reference_epoch_plan(
        durations.tolist(),
        langs.tolist(),
        dp_size=dp,
        grad_accum=accum,
        temperature=temperature,
        uniforms=np.exp(-keys).tolist(),
        rank_permutation=perm.tolist(),
    )
    assert all_batches(plan) == expected


@pytest.mark.parametrize(
    "budget", [{"max_batch_duration": 90.0}, {"max_batch_tokens": 3000, "length_penalty": 1e-4}]
)
def test_temperature_mode_delivers_the_target_mix_within_one_point(budget):
    durations, langs = skewed(100_000, 1)
    tokens = np.random.default_rng(0).integers(5, 80, len(durations))
    settings = SamplerSettings(dp_size=8, grad_accum=4, temperature=0.3, seed=2, **budget)
    plan = build_epoch_plan(durations, langs, settings, token_lengths=tokens)
    counts = np.bincount(langs, minlength=6)
    target = ordering.compute_language_targets(counts, 0.3)
    used = np.concatenate([plan.rank_rows(r)[0] for r in range(plan.dp_size)])
    achieved = np.bincount(langs[used], minlength=6) / len(used)
    assert np.abs(achieved - target).max() < 0.01, (achieved, target)
    natural = counts / counts.sum()
    assert np.abs(natural - target).max() > 0.2  # the test would be vacuous on a balanced manifest


def test_exhaustive_mode_keeps_the_natural_mix():
    durations, langs = skewed(100_000, 1)
    plan = build_epoch_plan(
        durations, langs, SamplerSettings(dp_size=8, grad_accum=4, mode="exhaustive", temperature=0.3)
    )
    used = np.concatenate([plan.rank_rows(r)[0] for r in range(plan.dp_size)])
    natural = np.bincount(langs, minlength=6) / len(langs)
    assert np.abs(np.bincount(langs[used], minlength=6) / len(used) - natural).max() < 0.01


def test_non_positive_temperature_is_uniform_over_languages():
    durations, langs = skewed(60_000, 2)
    settings = SamplerSettings(dp_size=2, grad_accum=2, temperature=0.0, epoch_size=30_000)
    plan = build_epoch_plan(durations, langs, settings)
    used = np.concatenate([plan.rank_rows(r)[0] for r in range(plan.dp_size)])
    assert np.abs(np.bincount(langs[used], minlength=6) / len(used) - 1 / 6).max() < 0.01


def test_temperature_streams_cover_a_language_before_repeating_it():
    """A sub-sampled language is drawn without replacement across epochs; an up-sampled one in full cycles."""
    langs = np.array([0] * 1000 + [1] * 100)
    counts = np.bincount(langs)
    draw = ordering.allocate_counts(ordering.compute_language_targets(counts, 0.0), 400)  # 200 each
    seen = [ordering.draw_temperature_rows(langs, counts, draw, seed=5, epoch=e) for e in range(5)]
    big = np.concatenate([s[s < 1000] for s in seen])
    assert sorted(big.tolist()) == list(range(1000))  # epochs 0-4 = one full cycle of language 0
    small = seen[0][seen[0] >= 1000]
    assert np.bincount(small - 1000, minlength=100).tolist() == [2] * 100  # two cycles per epoch
    assert not np.array_equal(np.sort(seen[0][seen[0] < 1000]), np.sort(seen[1][seen[1] < 1000]))


@pytest.mark.parametrize("mode", ["temperature", "exhaustive"])
def test_plan_invariants(mode):
    durations, langs = skewed(30_000, 4)
    durations[::997] = 120.0  # a few rows longer than the whole budget
    settings = SamplerSettings(dp_size=4, grad_accum=3, mode=mode, seed=9)
    plan = build_epoch_plan(durations, langs, settings, 1)
    counts = [len(list(plan.iter_rank(r))) for r in range(4)]
    assert len(set(counts)) == 1 and counts[0] % 3 == 0 and counts[0] > 0
    rows = []
    for r in range(4):
        for batch in plan.iter_rank(r):
            total = float(np.sum(durations[batch], dtype=np.float64))
            assert total <= 90.0 + 1e-9 or len(batch) == 1
            buckets = ordering.assign_buckets(durations[batch], DEFAULT_BUCKET_BOUNDARIES)
            assert len(set(buckets.tolist())) == 1  # a batch never mixes buckets
            rows.extend(batch)
    assert all(0 <= i < len(durations) for i in rows)
    if mode == "exhaustive":
        assert len(rows) == len(set(rows))
        assert len(rows) > 0.99 * len(durations)  # only the lockstep trims drop rows
    same = build_epoch_plan(durations, langs, settings, 1)
    assert all_batches(same) == all_batches(plan)
    other = build_epoch_plan(durations, langs, settings, 2)
    assert all_batches(other) != all_batches(plan)


def test_token_budget_is_respected():
    durations, langs = skewed(20_000, 3)
    tokens = np.random.default_rng(1).integers(0, 200, len(durations))
    model = TokenCostModel(
        audio_frames_per_second=100, encoder_subsampling=8, projector_stack=2, prompt_tokens=4
    )
    settings = SamplerSettings(
        dp_size=2, grad_accum=2, max_batch_tokens=1500, length_penalty=1e-3, token_cost=model
    )
    plan = build_epoch_plan(durations, langs, settings, token_lengths=tokens)
    per_row = np.ceil(np.ceil(np.ceil(durations.astype(np.float64) * 100) / 8) / 2) + tokens + 4
    assert per_row[0] == model.count_tokens(durations[:1], tokens[:1])[0]
    cost = per_row + 1e-3 * per_row**2
    sizes = []
    for r in range(2):
        for batch in plan.iter_rank(r):
            assert cost[batch].sum() <= 1500 + 1e-6 or len(batch) == 1
            sizes.append(cost[batch].sum())
    assert np.mean(sizes) > 1200  # and the batches are well filled


def test_too_small_a_manifest_for_the_layout_is_an_error():
    with pytest.raises(ValueError, match="fewer than dp_size"):
        build_epoch_plan(np.full(10, 5.0), np.zeros(10, np.int32), SamplerSettings(dp_size=4, grad_accum=4))


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match=r"durations\[2\] = nan"):
        build_epoch_plan(np.array([1.0, 2.0, np.nan]), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="mode='random'"):
        build_epoch_plan(np.ones(3), np.zeros(3, np.int32), SamplerSettings(mode="random"))
    with pytest.raises(ValueError, match="lang_codes span"):
        DurationBucketBatchSampler(np.ones(3), np.array([0, 1, 2]), ["en", "de"])


# --------------------------------------------------------------------------------------------- sampler


def make_sampler(durations, langs, *, dp_rank=0, epoch=0, **kw):
    settings = SamplerSettings(**{"dp_size": 4, "grad_accum": 2, "seed": 3, **kw})
    names = ["en", "de", "fr", "es", "sw", "yo"]
    return DurationBucketBatchSampler(durations, langs, names, settings, dp_rank=dp_rank, epoch=epoch)


def test_cp_and_tp_peers_get_identical_batches_and_dp_ranks_disjoint_ones():
    durations, langs = skewed(20_000, 5)
    peers = [list(make_sampler(durations, langs, dp_rank=1, mode="exhaustive")) for _ in range(2)]
    assert peers[0] == peers[1]
    ranks = [list(make_sampler(durations, langs, dp_rank=r, mode="exhaustive")) for r in range(4)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) % 2 == 0
    flat = [i for rank in ranks for batch in rank for i in batch]
    assert len(flat) == len(set(flat))


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    durations, langs = skewed(20_000, 6)
    full = make_sampler(durations, langs, dp_rank=2)
    full.set_epoch(3)
    expected = list(full)
    assert len(full) == len(expected) and full.remaining() == 0

    run = make_sampler(durations, langs, dp_rank=2)
    run.set_epoch(3)
    it = iter(run)
    head = [next(it) for _ in range(7)]
    state = run.state_dict()
    assert state["epoch"] == 3 and state["position"] == 7

    resumed = make_sampler(durations, langs, dp_rank=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # Lightning calls this after a resume: it must not rewind
    assert resumed.remaining() == len(expected) - 7
    assert head + list(resumed) == expected
    # the epoch is used up: the next iteration is epoch 4 from its start
    nxt = list(resumed)
    assert resumed.epoch == 4 and nxt == list(make_sampler(durations, langs, dp_rank=2, epoch=4))


def test_seek_and_set_epoch_positions():
    durations, langs = skewed(20_000, 6)
    s = make_sampler(durations, langs)
    expected = list(make_sampler(durations, langs, epoch=1))
    s.seek(1, 5)
    assert list(s) == expected[5:]
    s.set_epoch(1)  # same epoch: position kept (at the end)
    assert s.remaining() == 0
    s.set_epoch(0)
    assert s.position == 0 and s.remaining() == len(s)
    with pytest.raises(ValueError, match="position=999999"):
        s.seek(0, 999_999)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"dp_size": 8}, "dp_size"),
        ({"seed": 4}, "seed"),
        ({"mode": "exhaustive"}, "mode"),
        ({"grad_accum": 4}, "params.grad_accum"),
        ({"temperature": 0.5}, "params.temperature"),
        ({"max_batch_duration": 60.0}, "params.max_batch_duration"),
    ],
)
def test_load_state_dict_refuses_another_layout(change, field):
    durations, langs = skewed(20_000, 7)
    state = make_sampler(durations, langs).state_dict()
    other = make_sampler(durations, langs, **change)
    with pytest.raises(ValueError, match=f"'{field}': saved"):
        other.load_state_dict(state)


def test_load_state_dict_refuses_another_manifest():
    durations, langs = skewed(20_000, 7)
    state = make_sampler(durations, langs).state_dict()
    changed = durations.copy()
    changed[123] += 0.5
    with pytest.raises(ValueError, match="'manifest'"):
        make_sampler(changed, langs).load_state_dict(state)
    # the fingerprint does not depend on the dtype the codes come in
    make_sampler(durations, langs.astype(np.int64)).load_state_dict(state)


def test_settings_from_config_use_the_config_fields():
    from speechlm.config import SamplerConfig

    durations, langs = skewed(20_000, 8)
    cfg = SamplerConfig(mode="exhaustive", max_batch_duration=45.0, seed=11)
    settings = SamplerSettings.from_config(cfg, dp_size=2, grad_accum=2, projector_stack=3)
    assert settings == SamplerSettings(
        dp_size=2,
        grad_accum=2,
        mode="exhaustive",
        max_batch_duration=45.0,
        bucket_boundaries=None,  # the config's default: estimated from the durations (issue 26)
        token_cost=TokenCostModel(projector_stack=3),
        seed=11,
    )
    s = DurationBucketBatchSampler(durations, langs, None, settings, dp_rank=0)
    assert list(s) == list(build_epoch_plan(durations, langs, settings).iter_rank(0))


def test_settings_are_frozen_and_the_sampler_resolves_them_for_its_manifest():
    import dataclasses

    settings = SamplerSettings(bucket_boundaries=[2, 4], max_batch_tokens=900, epoch_size=0)
    assert settings.bucket_boundaries == (2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 1  # type: ignore[misc]
    durations, langs = skewed(5_000, 9)
    s = DurationBucketBatchSampler(durations, langs, None, settings)
    assert (s.settings.epoch_size, s.settings.max_batch_duration) == (5_000, None)
    assert s.params["bucket_boundaries"] == [2.0, 4.0] and s.dp_size == 1 and s.seed == 0
    with pytest.raises(ValueError, match="epoch_size=0 must be >= 1"):
        build_epoch_plan(durations, langs, settings)  # only the sampler reads 0 as the manifest size
