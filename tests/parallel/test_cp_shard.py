"""Pure CP sharding: the published example, random packings, round trips, BSHD pairing, errors.

Letters: T global tokens, t local tokens, B batch, S sequence length, H hidden.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.cp_shard import (
    bshd_cp_multiple,
    cp_all_rank_indices_thd,
    cp_shard_indices_thd,
    inverse_permutation,
    pad_bshd_for_cp,
    shard_bshd,
    shard_thd,
    unshard_bshd,
    unshard_thd,
)


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
def test_shard_unshard_round_trip(packing: tuple[int, list[int]], seed: int) -> None:
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
    for name, x in batch.items():
        assert torch.equal(unshard_thd([p[0][name] for p in pieces], cu, cp), x)
    # (position, label) pairs survive sharding unchanged: labels are shifted globally, before
    pairs = {(int(p), int(lab)) for p, lab in zip(batch["position_ids"], batch["labels"])}
    sharded_pairs = {
        (int(p), int(lab)) for s in pieces for p, lab in zip(s[0]["position_ids"], s[0]["labels"])
    }
    assert sharded_pairs == pairs


def test_unshard_is_differentiable() -> None:
    cu = torch.tensor([0, 4, 12])
    pieces = [torch.randn(6, 2, requires_grad=True) for _ in range(2)]
    unshard_thd(pieces, cu, 2).sum().backward()
    assert all(torch.equal(p.grad, torch.ones(6, 2)) for p in pieces)


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


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [1, -2, 0])
def test_bshd_pairing_matches_thd_and_round_trips(cp: int, dim: int) -> None:
    x = torch.randn(2, 4 * cp, 3) if dim != 0 else torch.randn(4 * cp, 2, 3)
    seq_dim = dim % x.dim()
    s = x.shape[seq_dim]
    pieces = [shard_bshd(x, cp, r, dim=dim) for r in range(cp)]
    for r, piece in enumerate(pieces):
        idx = cp_shard_indices_thd(torch.tensor([0, s]), cp, r)  # one row = one sequence
        assert torch.equal(piece, x.index_select(seq_dim, idx))
    assert torch.equal(unshard_bshd(pieces, cp, dim=dim), x)


def test_bshd_rejects_illegal_length() -> None:
    with pytest.raises(ValueError, match="BSHD sequence length 6 .* not a multiple of 2\\*cp = 4"):
        shard_bshd(torch.zeros(2, 6, 3), 2, 0)


@pytest.mark.parametrize("cp, tp", [(1, 1), (2, 1), (2, 2), (2, 3), (4, 2), (3, 4)])
def test_pad_bshd_for_cp(cp: int, tp: int) -> None:
    m = bshd_cp_multiple(cp, tp)
    assert m == math.lcm(2 * cp, cp * tp) and (2 * cp * tp) % m == 0
    x = torch.ones(2, 5, 3)
    padded = pad_bshd_for_cp(x, cp, tp, dim=1, value=-100)
    s = padded.shape[1]
    assert s % m == 0 and s - 5 < m
    assert torch.equal(padded[:, :5], x) and (padded[:, 5:] == -100).all()
    assert (s // cp) % tp == 0 and s % (2 * cp) == 0  # invariant 3: legal for CP and for TP after CP
    assert pad_bshd_for_cp(padded, cp, tp) is padded
