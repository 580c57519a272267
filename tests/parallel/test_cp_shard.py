"""Pure CP sharding: the published example, random packings, round trips, errors.

Letters: T global tokens, t local tokens, H hidden.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.cp_shard import cp_all_rank_indices_thd, cp_shard_indices_thd, inverse_permutation, shard_thd


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_published_example(dtype: torch.dtype) -> None:
    cu = torch.tensor([0, 8, 16], dtype=dtype)
    assert cp_shard_indices_thd(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cp_shard_indices_thd(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    _, cu_local, max_local = shard_thd(torch.zeros(16), cu, 2, 1)
    assert cu_local.tolist() == [0, 4, 8] and max_local == 4


@st.composite
def packings(draw: st.DrawFn) -> tuple[int, list[int]]:
    cp = draw(st.sampled_from([1, 2, 3, 4]))
    chunks = draw(st.lists(st.integers(0, 4), min_size=1, max_size=6))  # c = 1 gives length 2*cp
    return cp, [2 * cp * c for c in chunks]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()])


@settings(max_examples=40, deadline=None)
@given(packings())
def test_every_token_on_exactly_one_rank_with_the_paired_chunks(packing: tuple[int, list[int]]) -> None:
    cp, lengths = packing
    cu = _cu(lengths)
    total = int(cu[-1])
    per_rank = cp_all_rank_indices_thd(cu, cp)
    assert per_rank.shape == (cp, total // cp)
    assert torch.equal(per_rank.flatten().sort().values, torch.arange(total))
    for r in range(cp):
        idx = per_rank[r]
        assert torch.equal(idx, cp_shard_indices_thd(cu, cp, r))
        pos = 0
        for n, length in enumerate(lengths):  # local sequence n = chunk r then chunk 2cp-1-r
            c = length // (2 * cp)
            start = int(cu[n])
            expected = [start + r * c + p for p in range(c)] + [
                start + (2 * cp - 1 - r) * c + p for p in range(c)
            ]
            assert idx[pos : pos + 2 * c].tolist() == expected
            pos += 2 * c


@settings(max_examples=40, deadline=None)
@given(packings(), st.integers(0, 2**31 - 1))
def test_shard_round_trip(packing: tuple[int, list[int]], seed: int) -> None:
    cp, lengths = packing
    cu = _cu(lengths)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(seed)
    positions = [torch.arange(n) for n in lengths]
    batch = {
        "inputs_embeds": torch.randn(total, 3, generator=g),
        "labels": torch.randint(0, 100, (total,), generator=g),
        "position_ids": torch.cat(positions),
    }
    pieces = [shard_thd(batch, cu, cp, r) for r in range(cp)]
    for local, cu_local, max_local in pieces:
        assert torch.equal(cu_local, cu // cp)
        assert max_local == max(lengths) // cp
        assert all(x.shape[0] == total // cp for x in local.values())
    back_T = inverse_permutation(cp_all_rank_indices_thd(cu, cp).flatten())  # rank-major pieces -> global
    for name, x in batch.items():
        assert torch.equal(torch.cat([p[0][name] for p in pieces])[back_T], x)
    # (position, label) pairs survive sharding unchanged: labels are shifted globally, before
    pairs = {(int(p), int(lab)) for p, lab in zip(batch["position_ids"], batch["labels"])}
    sharded_pairs = {
        (int(p), int(lab)) for s in pieces for p, lab in zip(s[0]["position_ids"], s[0]["labels"])
    }
    assert sharded_pairs == pairs


def test_inverse_permutation() -> None:
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    inv = inverse_permutation(perm)
    assert torch.equal(perm[inv], torch.arange(50)) and torch.equal(inv[perm], torch.arange(50))


def test_illegal_length_names_the_sequence() -> None:
    with pytest.raises(ValueError, match=r"sequence 1 has length 6, which is not a multiple of 4"):
        cp_shard_indices_thd(torch.tensor([0, 8, 14, 22]), 2, 0)


@pytest.mark.parametrize(
    "cu, cp, rank, match",
    [
        ([0, 8], 2, 2, "cp_rank"),
        ([0, 8], 0, 0, "cp_size"),
        ([1, 8], 1, 0, "start at 0"),
        ([0, 8, 4], 1, 0, "non-decreasing"),
    ],
)
def test_bad_arguments(cu: list[int], cp: int, rank: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cp_shard_indices_thd(torch.tensor(cu), cp, rank)


def test_shard_thd_checks_row_count() -> None:
    with pytest.raises(ValueError, match="labels has 15 rows"):
        shard_thd({"labels": torch.zeros(15)}, torch.tensor([0, 8, 16]), 2, 0)
