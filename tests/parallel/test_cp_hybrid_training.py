"""Hybrid CP degrees in training (``parallel.cp_degrees=hybrid``, `parallel.hybrid_layout`): the layout's
plan, sharding and attention context without a process group, and layout equivalence through the real
training step (mesh, FSDP2, placed encoding, ring/all-gather attention per sub-group; 3 steps, fp32, 1e-5)
against one process: world 4 (cp 4: degrees 1, 2 and 4 in one micro-batch) in the default run, world 8
(cp 8, and dp 2 x cp 4) marked `slow`."""

from __future__ import annotations

import pytest
import torch
from parallel_harness import Layout, build_model, global_steps, rank_layouts, reference_run, tiny_config
from test_parallel_equivalence import N_STEPS, assert_layouts_match

from parallel.cp_placement import LocalPlacement, place_hybrid
from parallel.hybrid_layout import HybridCPLayout, local_segments
from parallel.testing import run_distributed
from parallel.varlen_meta import build_varlen_meta
from speechlm.model.flops import record_work

HYBRID = ("parallel.cp_degrees=hybrid",)


def _layout(cp: int, rank: int) -> HybridCPLayout:
    return HybridCPLayout(group=None, cp_size=cp, cp_rank=rank, kind="ring", subgroups={2: None})


def _harness_lengths() -> list[list[int]]:
    model = build_model(tiny_config())
    out = []
    for step in global_steps(N_STEPS, 1) + global_steps(N_STEPS, 2):
        for b in step:
            audio = model.audio_embed_lengths(b.audio_lens)
            out.append([2 + a + int(t) for a, t in zip(audio, b.token_lens.tolist())])
    return out


def test_harness_batches_mix_degrees_at_cp4():
    """The equivalence runs below see whole, degree-2 and degree-4 sequences in one micro-batch."""
    degrees = [set(place_hybrid(s, 4, pair_cost=1 / (6 * 32)).degree) for s in _harness_lengths()]
    assert {1, 2, 4} in degrees or any({2, 4} <= d for d in degrees)
    assert any(1 in d and len(d) > 1 for d in degrees)


def test_plan_and_shard_follow_the_segments():
    """Each rank's plan is its segments (largest degree first, whole last), and `shard` keeps 1/d of each
    degree-d sequence and every whole one: every padded row computed exactly once over the ranks."""
    lens = [8, 6, 6, 10]
    p = place_hybrid(lens, 4)
    assert sorted(set(p.degree)) == [1, 2, 4]
    seen = []
    for r in range(4):
        lay = _layout(4, r)
        plan = lay.place(lens)
        assert isinstance(plan, LocalPlacement)
        assert plan.local_degrees == sorted(plan.local_degrees, reverse=True)
        assert plan.n_split == sum(d > 1 for d in plan.local_degrees)
        total = sum(plan.padded_lengths)
        cu = torch.tensor([0, *torch.tensor(plan.padded_lengths).cumsum(0).tolist()], dtype=torch.int32)
        rows = torch.cat([torch.arange(p_i) + 100 * i for i, p_i in zip(plan.indices, plan.padded_lengths)])
        parts, cu_local, longest = lay.shard({"rows": rows}, cu, int(max(plan.padded_lengths)), plan)
        local = [n // d for n, d in zip(plan.padded_lengths, plan.local_degrees)]
        assert cu_local.tolist() == [0, *torch.tensor(local).cumsum(0).tolist()]
        assert longest == max(local)
        assert parts["rows"].shape[0] == sum(local) <= total
        seen += parts["rows"].tolist()
    want = [100 * i + k for i, n in enumerate(p.padded) for k in range(n)]
    assert sorted(seen) == sorted(want)


def test_attention_context_segments_from_the_local_stream():
    meta = build_varlen_meta(torch.tensor([0, 4, 6, 10, 15, 21], dtype=torch.int32))
    ctx = _layout(4, 1).attention_context(meta, 3, (4, 2, 2, 1, 1))
    assert ctx.segments == [(4, [0, 4]), (2, [0, 2, 6]), (1, [0, 5, 11])]
    assert ctx.group is None and set(ctx.groups) == {2, 4}
    prepared = ctx.prepared  # once per micro-batch: the ring plans and boundaries of each segment
    assert "plans" in prepared[0] and prepared[0]["cu_local"].tolist() == [0, 4]
    assert prepared[1]["cu_local"].tolist() == [0, 2, 6] and list(prepared[2]["meta"].cu_q) == [0, 5, 11]
    with pytest.raises(ValueError, match="degree"):
        _layout(4, 1).attention_context(meta, 3, ())
    with pytest.raises(ValueError, match="must not increase"):
        local_segments([1, 2], [4, 4])


def test_a_long_clip_is_sharded_over_its_sequences_sub_group():
    """`clip_sharding` through the layout: a clip is sharded over the group `sharding_groups` gives it (its
    sequence's sub-group when split, the whole CP group when whole), and only where every rank of that
    group gets at least ``min_slice`` frames."""
    frames = [4000, 4000, 4000, 10]
    kw = {"min_frames": 100, "min_slice": 8}
    got = _layout(4, 0).clip_sharding(frames, groups=[(2, 2), (0, 4), (0, 4), (0, 2)], **kw)
    assert got.sharded == (True, True, True, False)
    assert [list(got.ranks(c)) for c in range(3)] == [[2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert got.local_indices(0) == [1, 2] and got.local_indices(3) == [0, 1, 2]
    assert got.slices(3) == [(0, 2000, 4000), (1, 3000, 4000), (2, 3000, 4000)]
    # a slice shorter than the halo over 2 ranks, but not over 4: sharded over 4 only
    tight = _layout(4, 0).clip_sharding([50, 50], min_frames=10, min_slice=20, groups=[(0, 2), (0, 4)])
    assert tight.sharded == (True, False)
    with pytest.raises(ValueError, match="not an aligned group"):
        _layout(4, 0).clip_sharding(frames, groups=[(1, 2), (0, 4), (0, 4), (0, 4)], **kw)


@pytest.mark.multiproc
def test_a_long_clip_sharded_over_every_rank_trains_like_one_process():
    """cp 4, the long batch (`parallel_harness.make_long_clip_batch`): its long sequence over all four ranks,
    the short one whole on rank 0 (degrees 4 and 1); the long clip's slices on every rank; one forward and
    backward equal one process (fp32, 1e-5)."""
    from test_long_clip_training import _forward_worker, _reference

    ref = _reference()
    assert place_hybrid(ref["seq_lens"], 4, pair_cost=1 / (6 * 32)).degree == (4, 1)
    got = run_distributed(_forward_worker, 4, "gloo", "auto", (), "", True)
    for r, res in enumerate(got):
        assert len(res["calls"]) == 1, f"rank {r} must encode one slice of the long clip, got {res['calls']}"
        assert res["ce"] == pytest.approx(ref["ce"], rel=1e-5)
        assert res["ctc"] == pytest.approx(ref["ctc"], rel=1e-5)
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in ref["grads"].values()))
    for name, g in ref["grads"].items():
        err = (got[0]["grads"][name].double() - g.double()).norm()
        assert err <= 1e-5 * g.double().norm() + 1e-6 * total, (name, float(err), float(g.norm()))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "world, batches, degrees, groups",
    [
        # two long sequences, one over each pair of ranks: each pair shards its own clip
        (4, "two-long", (2, 2, 1, 1), [[(0, 2)]] * 2 + [[(2, 2)]] * 2),
        # one over all four ranks and one over each pair: every rank holds slices of two nested groups
        (4, "three-long", (4, 2, 2, 1, 1), [[(0, 4), (0, 2)]] * 2 + [[(0, 4), (2, 2)]] * 2),
        # cp 8: groups of four that are proper sub-groups, alone and nested in the whole group
        pytest.param(8, "two-long", (4, 4, 1, 2), [[(0, 4)]] * 4 + [[(4, 4)]] * 4, marks=pytest.mark.slow),
        pytest.param(
            8,
            "three-long",
            (4, 8, 4, 1, 1),
            [[(0, 4), (0, 8)]] * 4 + [[(0, 8), (4, 4)]] * 4,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_long_clip_is_sharded_over_its_sub_group_and_trains_like_one_process(
    world, batches, degrees, groups
):
    """Hybrid degrees: a long clip whose sequence spans a sub-group of ranks is sharded over that sub-group
    only (its slices, halos, feature statistics, hand-over and CTC gather stay there), also beside a clip
    sharded over a larger group that holds it; one forward and backward equal one process (fp32, 1e-5)."""
    from test_long_clip_training import _forward_worker, _reference

    ref = _reference(batches=batches)
    assert place_hybrid(ref["seq_lens"], world, pair_cost=1 / (6 * 32)).degree == degrees
    got = run_distributed(_forward_worker, world, "gloo", "auto", (), "", True, batches)
    assert [res["groups"] for res in got] == groups
    for r, res in enumerate(got):
        assert res["ce"] == pytest.approx(ref["ce"], rel=1e-5), f"rank {r}"
        assert res["ctc"] == pytest.approx(ref["ctc"], rel=1e-5), f"rank {r}"
    for first, d in {g for res in got for g in res["groups"]}:  # each group's slices tile its clip
        members = range(first, first + d)
        bounds = [got[r]["calls"][got[r]["groups"].index((first, d))] for r in members]
        assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), bounds
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in ref["grads"].values()))
    for name, g in ref["grads"].items():
        err = (got[0]["grads"][name].double() - g.double()).norm()
        assert err <= 1e-5 * g.double().norm() + 1e-6 * total, (name, float(err), float(g.norm()))


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
def test_three_training_steps_with_clips_sharded_over_nested_sub_groups_match_one_process():
    """The real step at cp 4 with hybrid degrees (mesh, FSDP2 over the four ranks, whose collectives run
    beside the sub-groups' halos, hand-overs and gathers): micro-batches whose long clips are sharded over all
    four ranks and over each pair, 3 steps' losses and the first step's gradients equal one process."""
    from test_long_clip_training import WINDOW, _assert_steps_match, _config

    steps = global_steps(N_STEPS, 1, batches="three-long")
    model = build_model(_config())
    for (b,) in steps:  # every step holds clips sharded over nested groups
        lens = [
            2 + a + int(t) for a, t in zip(model.audio_embed_lengths(b.audio_lens), b.token_lens.tolist())
        ]
        assert place_hybrid(lens, 4, pair_cost=1 / (6 * 32)).degree[:3] == (4, 2, 2), lens
    lay = Layout("cp4-hybrid-nested-long", 1, 4, 1, overrides=WINDOW + HYBRID, batches="three-long")
    got = run_distributed(rank_layouts, 4, "gloo", [lay], N_STEPS, "gloo", timeout_s=1100)
    _assert_steps_match(reference_run(_config(), steps), [per_rank[0] for per_rank in got])


def test_record_work_counts_each_sequence_by_its_degree():
    work = record_work(
        [10, 6, 4], [2, 2, 1], [2, 0, 1], 2, 4, clip_frames=[], computed_tokens=8, degrees=[4, 2, 1]
    )
    assert work.seq_shares == [0.25, 0.5, 1.0]
    assert work.labelled == pytest.approx(1 / 4 + 2 / 2 + 2)


# one process group per entry (one start); the default run holds world 4's ring (about a minute on two
# loaded cores), the all-gather and world 8 are `slow`
GROUPS = {
    "cp4-ring": [Layout("cp4-hybrid-ring", 1, 4, 1, split_threshold="auto", overrides=HYBRID)],
    "cp4-allgather": [
        Layout("cp4-hybrid-allgather", 1, 4, 1, "allgather", split_threshold="auto", overrides=HYBRID)
    ],
    "world8": [
        Layout("cp8-hybrid", 1, 8, 1, split_threshold="auto", overrides=HYBRID),
        Layout("dp2-cp4-hybrid", 2, 4, 1, "allgather", split_threshold="auto", overrides=HYBRID),
    ],
    # samples of several clips or none (`plan_for_clips` over a hybrid plan), and TP rounding of a degree
    "world4-mixed": [
        Layout("cp4-hybrid-conv", 1, 4, 1, split_threshold="auto", overrides=HYBRID, batches="conversations"),
        Layout("cp4-hybrid-text", 1, 4, 1, split_threshold="auto", overrides=HYBRID, batches="text+audio"),
        Layout("cp2-tp2-hybrid", 1, 2, 2, split_threshold="auto", overrides=HYBRID),
    ],
}


def _layout_reference(lay: Layout) -> dict:
    from test_multiclip_layouts import reference

    return reference(lay.dp, lay.batches)


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    "group",
    [
        "cp4-ring",
        pytest.param("cp4-allgather", marks=pytest.mark.slow),
        pytest.param("world8", marks=pytest.mark.slow),
        pytest.param("world4-mixed", marks=pytest.mark.slow),
    ],
)
def test_hybrid_layouts_match_single_process(group):
    layouts = GROUPS[group]
    got = run_distributed(rank_layouts, layouts[0].world, "gloo", layouts, N_STEPS, "gloo", timeout_s=1100)
    assert_layouts_match(layouts, got, _layout_reference)
