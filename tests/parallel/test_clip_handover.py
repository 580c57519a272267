"""The hand-over of a sharded clip's rows from the encoder's slices to the LLM's CP layout (issue 25 item 4):
`parallel.clip_handover` (pure) against `parallel.cp_shard`'s chunks and `speechlm.packing.thd`'s layout, and
`parallel.sharded_clip`'s exchanges (forward and backward) on gloo ranks."""

from __future__ import annotations

import pytest
import torch

from parallel.clip_handover import Handover, chunk_ranges, clip_needs
from parallel.clip_placement import shard_bounds
from parallel.cp_shard import cp_shard_indices_thd
from parallel.sharded_clip import gather_slices, hand_over
from parallel.testing import run_distributed
from speechlm.packing.thd import clip_offsets, plan_thd


def _rows(intervals):
    return [i for lo, hi in intervals for i in range(lo, hi)]


@pytest.mark.parametrize("cp, padded", [(2, 16), (3, 42), (4, 64)])
def test_chunk_ranges_are_the_rows_cp_shard_keeps(cp, padded):
    for r in range(cp):
        kept = cp_shard_indices_thd(torch.tensor([0, padded]), cp, r).tolist()
        assert _rows(chunk_ranges(padded, cp, r)) == kept


@pytest.mark.parametrize("cp, frames, offset, padded", [(2, 101, 3, 120), (3, 250, 1, 258), (4, 97, 20, 120)])
def test_every_row_of_a_split_sequences_clip_is_needed_by_exactly_one_rank(cp, frames, offset, padded):
    need = clip_needs(frames, offset, cp, split=True, padded_len=padded)
    rows = sorted(i for n in need for i in _rows(n))
    assert rows == list(range(frames))
    for r in range(cp):  # rank r needs the clip rows inside its chunks, nothing else
        mine = {i - offset for i in _rows(chunk_ranges(padded, cp, r)) if offset <= i < offset + frames}
        assert set(_rows(need[r])) == mine


def test_a_whole_sequences_clip_goes_to_its_owner_only():
    assert clip_needs(50, 4, 3, split=False, owner=1) == [[], [(0, 50)], []]
    with pytest.raises(ValueError, match="owner=3"):
        clip_needs(50, 4, 3, split=False, owner=3)
    with pytest.raises(ValueError, match="overrun"):
        clip_needs(50, 80, 2, split=True, padded_len=120)


@pytest.mark.parametrize(
    "cp, frames, stack, offset, text", [(2, 301, 2, 3, 40), (4, 1001, 2, 5, 400), (3, 77, 3, 1, 2)]
)
def test_the_handover_moves_each_needed_row_once_from_the_rank_that_has_it(cp, frames, stack, offset, text):
    bounds = shard_bounds(frames * stack, cp, align=stack)
    have = [(a // stack, -(-b // stack)) for a, b in bounds]
    padded = -(-(offset + frames + text) // (2 * cp)) * (2 * cp)
    h = Handover.build(frames, have, clip_needs(frames, offset, cp, split=True, padded_len=padded))
    moved = 0
    for d in range(cp):
        got = _rows(h.kept(d)) + [i for s in range(cp) for i in _rows(h.moves(s, d))]
        assert sorted(got) == _rows(h.need[d]) and len(set(got)) == len(got)
        for s in range(cp):
            assert all(have[s][0] <= i < have[s][1] for i in _rows(h.moves(s, d)))
            moved += len(_rows(h.moves(s, d)))
    assert h.volume() == moved
    assert moved == sum(len(set(_rows(h.need[r])) - set(range(*have[r]))) for r in range(cp))
    assert moved < frames * (cp - 1)  # fewer rows than an all-gather of the slices moves


def test_a_handover_needs_slices_that_tile_the_clip():
    with pytest.raises(ValueError, match="do not tile"):
        Handover.build(10, [(0, 4), (5, 10)], [[], []])


def test_clip_offsets_are_where_the_packer_puts_each_clip():
    audio_id = 9
    prompts = [
        (torch.tensor([1, 2, audio_id, 3]), torch.tensor([0, 0, 0, 1], dtype=torch.bool)),
        (torch.tensor([1, audio_id, 4, audio_id, 5]), torch.tensor([0, 0, 0, 0, 1], dtype=torch.bool)),
    ]
    seq_of_clip, lens = [0, 1, 1], [5, 3, 4]
    layout = plan_thd(prompts, lens, audio_id=audio_id, clip_counts=[1, 2])
    starts = layout.cu_seqlens.tolist()
    audio_rows = torch.nonzero(layout.audio_mask_T).flatten().tolist()
    firsts, k = [], 0
    for n in lens:
        firsts.append(audio_rows[k])
        k += n
    expected = [f - starts[s] for f, s in zip(firsts, seq_of_clip)]
    assert clip_offsets(prompts, seq_of_clip, lens, audio_id) == expected == [2, 1, 5]


def _exchange_worker(rank: int, world: int, frames: int, stack: int) -> tuple[float, float, float, float]:
    torch.manual_seed(0)
    H = 6
    whole = torch.randn(frames, H, dtype=torch.float64)
    w = torch.randn(frames, H, dtype=torch.float64)
    bounds = shard_bounds(frames * stack, world, align=stack)
    have = [(a // stack, -(-b // stack)) for a, b in bounds]
    need = clip_needs(frames, 2, world, split=True, padded_len=-(-(frames + 9) // (2 * world)) * 2 * world)
    h = Handover.build(frames, have, need)
    lo, hi = have[rank]
    x = whole[lo:hi].clone().requires_grad_(True)
    out = hand_over(x, h, rank, None)
    mask = torch.zeros(frames, 1, dtype=torch.float64)
    mask[_rows(need[rank])] = 1.0
    fwd_err = float(((out - whole * mask).abs()).max())
    (out * w).sum().backward()
    # the gradient of a row reaches the rank that computed it: the weight of the row, once (one rank needs it)
    bwd_err = float((x.grad - w[lo:hi]).abs().max())
    y = whole[lo:hi].clone().requires_grad_(True)
    full = gather_slices(y, [b - a for a, b in have], rank, None)
    gather_err = float((full - whole).abs().max())
    (full * w).sum().backward()
    return fwd_err, bwd_err, gather_err, float((y.grad - world * w[lo:hi]).abs().max())


@pytest.mark.multiproc
@pytest.mark.parametrize("world, frames, stack", [(2, 37, 2), (3, 50, 3)])
def test_the_exchanges_deliver_rows_forward_and_gradients_back(world, frames, stack):
    for errs in run_distributed(_exchange_worker, world, "gloo", frames, stack):
        assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("cp, moved", [(2, 500), (4, 750)])
def test_the_volume_the_docs_quote_for_a_clip_that_fills_its_sequence(cp, moved):
    frames, stack = 1000, 2
    have = [(a // stack, -(-b // stack)) for a, b in shard_bounds(frames * stack, cp, align=stack)]
    h = Handover.build(frames, have, clip_needs(frames, 0, cp, split=True, padded_len=frames))
    assert h.volume() == moved  # A / 2 at cp 2, 3A / 4 at cp 4; an all-gather moves A (cp - 1)
