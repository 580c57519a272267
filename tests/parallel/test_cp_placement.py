"""Dynamic CP placement (`parallel.cp_placement`) and its sharding (`parallel.cp_shard.shard_placed_thd`):
pure functions, no process group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parallel.cp_placement import place_auto, place_sequences, sequence_cost
from parallel.cp_shard import shard_placed_thd, shard_thd
from parallel.rounding import rounding_unit
from speechlm.packing.thd import round_lengths


def lognormal_lengths(n: int, seed: int = 0, hi_s: float = 20.0) -> list[int]:
    """Packed lengths of speech utterances: log-normal 0.5-hi_s s (median 5 s), 6.25 audio positions/s
    (100 frames/s, 8x subsampling, stack 2) plus ~3 text tokens/s and a 4-token prompt."""
    rng = np.random.default_rng(seed)
    d = np.clip(rng.lognormal(np.log(5.0), 0.6, n), 0.5, hi_s)
    return [int(np.ceil(x * 6.25) + np.ceil(x * 3) + 4) for x in d]


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (4, 1), (2, 2), (8, 2)])
def test_threshold_zero_is_todays_split_everything(cp, tp):
    lengths = [50, 7, 130, 33, 12]
    p = place_sequences(lengths, cp, threshold=0, tp=tp)
    assert all(p.split) and set(p.owner) == {-1}
    assert list(p.padded) == round_lengths(lengths, cp=cp, tp=tp)


def test_short_sequences_live_whole_and_only_split_ones_are_padded():
    lengths = [50, 7, 130, 33, 12, 41]
    p = place_sequences(lengths, 2, threshold=60, tp=2, pair_cost=1e-3)
    assert p.split == (False, False, True, False, False, False)
    assert p.padded[2] % 4 == 0 and p.split_total % rounding_unit(2, 2) == 0
    for r in range(2):
        whole = p.whole_indices(r)
        assert sum(p.padded[i] for i in whole) % 2 == 0  # each rank's whole part divides by tp
        assert all(p.padded[i] == p.lengths[i] for i in whole[:-1])  # only the last one is padded, for tp
    assert sorted(i for r in range(2) for i in p.whole_indices(r)) == [0, 1, 3, 4, 5]


def test_greedy_deal_is_longest_first_and_deterministic():
    p = place_sequences([10, 40, 30, 20], 2, threshold=100)
    assert p.owner == (0, 0, 1, 1)  # 40 -> r0, 30 -> r1, 20 -> r1 (30 < 40), 10 -> r0 (40 < 50)
    assert p.loads == (50.0, 50.0) and p.max_over_mean() == 1.0
    assert p == place_sequences([10, 40, 30, 20], 2, threshold=100)
    # with attention pairs in the cost, one long sequence outweighs several short ones of the same tokens
    q = place_sequences([100, 25, 25, 25, 25], 2, threshold=1000, pair_cost=0.05)
    assert q.owner == (0, 1, 1, 1, 1) and sequence_cost(100, 0.05) > 4 * sequence_cost(25, 0.05)


def test_no_rank_is_left_without_tokens():
    p = place_sequences([9, 5], 4, threshold=100)  # fewer sequences than ranks: the longest is split
    assert p.split == (True, False)
    assert all(p.local_tokens(r) > 0 for r in range(4))
    p = place_sequences([9, 5, 4, 3], 4, threshold=100)  # one each
    assert not any(p.split) and sorted(p.owner) == [0, 1, 2, 3]


@pytest.mark.parametrize(("cp", "tp", "threshold"), [(2, 1, 60), (4, 2, 40), (4, 1, 0), (8, 1, 10_000)])
def test_every_token_is_computed_once_across_ranks(cp, tp, threshold):
    lengths = [50, 7, 130, 33, 12, 41, 300, 9]
    p = place_sequences(lengths, cp, threshold=threshold, tp=tp, pair_cost=1e-3)
    seen: list[tuple[int, int]] = []
    for r in range(cp):
        loc = p.local(r)
        padded = loc.padded_lengths
        cu = torch.tensor([0, *np.cumsum(padded)], dtype=torch.int32)
        # global (sequence, offset) of every row of this rank's stream before sharding
        tags = torch.tensor([[i, k] for i, n in zip(loc.indices, padded) for k in range(n)]).reshape(-1, 2)
        out, cu_local, max_local = shard_placed_thd({"tag": tags}, cu, loc.n_split, cp, r)
        assert int(cu_local[-1]) == out["tag"].shape[0] == p.local_tokens(r)
        if tp > 1:
            assert p.local_tokens(r) % tp == 0
        seen += [tuple(t) for t in out["tag"].tolist()]
    real = [(i, k) for i, n in enumerate(lengths) for k in range(n)]
    assert len(seen) == len(set(seen))  # no token computed twice
    assert set(real) <= set(seen)
    assert len(seen) == p.computed_tokens()


def test_all_split_sharding_is_shard_thd():
    x = torch.arange(24)
    cu = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    for r in range(2):
        a, cu_a, m_a = shard_placed_thd({"x": x}, cu, 3, 2, r)
        b, cu_b, m_b = shard_thd({"x": x}, cu, 2, r)
        assert torch.equal(a["x"], b["x"]) and torch.equal(cu_a, cu_b) and m_a == m_b


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("hi_s", [20.0, 600.0])
def test_speech_mix_wastes_under_one_percent_and_balances(cp, hi_s):
    lengths = lognormal_lengths(4000, seed=cp, hi_s=hi_s)
    budget = 4096
    batches, cur = [], []  # greedy micro-batches of at most `budget` tokens (one long one alone)
    for n in lengths:
        if cur and sum(cur) + n > budget:
            batches.append(cur)
            cur = []
        cur.append(n)
    batches.append(cur)
    real = computed = 0
    worst = mean = 0.0
    for b in batches:
        p = place_sequences(b, cp, threshold="auto", pair_cost=1 / (6 * 1024))
        real += p.real_tokens()
        computed += p.computed_tokens()
        worst += max(p.loads)
        mean += sum(p.loads) / cp
        old = place_sequences(b, cp, threshold=0)
        assert p.computed_tokens() <= old.computed_tokens()
    assert real / computed >= 0.99
    assert worst / mean <= 1.05


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        place_sequences([3], 2, threshold=-1)
    with pytest.raises(ValueError, match="at least one token"):
        place_sequences([3, 0], 2, threshold=5)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        place_sequences([3], 2, threshold=0, pad_to_multiple=6)
    with pytest.raises(ValueError, match="threshold"):
        place_sequences([3], 2, threshold="sometimes")


def test_auto_splits_the_fewest_longest_sequences_within_the_tolerance():
    lengths = [400, 30, 35, 28, 33, 31, 29, 300, 27, 34]
    p = place_auto(lengths, 4, pair_cost=1e-3)
    assert p.max_over_mean() <= 1.05
    k = sum(p.split)
    assert set(p.split_indices) == {0, 7}  # the two long ones, nothing else
    assert k == 2 and place_sequences(lengths, 4, threshold=100, pair_cost=1e-3).split == p.split
    # one fewer split (only the longest) is out of balance, which is why auto split the second one
    only_longest = place_sequences(lengths, 4, threshold=350, pair_cost=1e-3)
    assert only_longest.max_over_mean() > 1.05
    assert place_auto([30, 30, 30, 30], 4).split == (False,) * 4  # one each, balanced: nothing to split
    assert all(place_auto([30, 31, 29, 33], 4).split)  # 33 / 30.75 > 1.05: only splitting balances
