"""The placement rule of the sharded encoder (`parallel.clip_placement`, issue 25 item 3): which clips are
sharded over the CP group (long ones) and which stay whole on a rank, deterministic on every rank, the
contiguous slices of a sharded clip, and `speechlm plan`'s report of it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parallel.clip_placement import place_clips, shard_bounds, short_clip_frames
from parallel.frames import planned_encoder_frames as encoder_frames
from speechlm.cli import main


def test_short_clips_stay_whole_and_a_long_one_is_sharded():
    short = short_clip_frames(8)  # 30 s at 80 ms frames
    assert short == 375 and encoder_frames(3600, 8) == 45_000
    p = place_clips([120, 45_000, 300, 90], 4, min_frames=short)
    assert p.sharded == (False, True, False, False)
    assert p.sharded_indices == [1] and p.whole_indices == [0, 2, 3]
    # a micro-batch of many short clips: none is sharded, whatever cp
    assert not any(place_clips([375] * 8 + [370], 8, min_frames=short).sharded)
    # cp = 1: nothing to shard over
    assert not any(place_clips([45_000], 1, min_frames=short).sharded)


def test_a_clip_within_its_fair_share_stays_whole():
    """Two 40-minute clips at cp 2: each is exactly one rank's share, so each stays whole (dealt as today);
    at cp 4 each is twice a rank's share and both are sharded."""
    n = encoder_frames(2400, 8)
    assert place_clips([n, n], 2, min_frames=375).sharded == (False, False)
    assert place_clips([n, n], 4, min_frames=375).sharded == (True, True)
    assert place_clips([n, n - 1], 2, min_frames=375).sharded == (True, False)


@pytest.mark.parametrize("length", [0, 1, 7, 45_001, 45_003])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_bounds_are_contiguous_cover_the_clip_and_differ_by_at_most_one(length, cp):
    bounds = shard_bounds(length, cp)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_the_decision_is_the_same_on_every_rank():
    """A pure function of the frames: each rank computes it alone (here: in fresh calls, in rank order
    and reversed) and the ranks' slices tile every sharded clip exactly once."""
    rng = np.random.default_rng(0)
    frames = rng.integers(1, 60_000, 12).tolist()
    cp = 4
    per_rank = [place_clips(list(frames), cp, min_frames=375) for _ in range(cp)]
    assert all(p == per_rank[0] for p in per_rank)
    p = per_rank[0]
    for clip in p.sharded_indices:
        got = sorted((lo, hi) for r in reversed(range(cp)) for c, lo, hi in p.slices(r) if c == clip)
        assert got == shard_bounds(frames[clip], cp)
    assert p.sharded_frames() == sum(frames[i] for i in p.sharded_indices)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cp=0"):
        place_clips([10], 0, min_frames=1)
    with pytest.raises(ValueError, match="must be >= 0"):
        place_clips([-1], 2, min_frames=1)
    with pytest.raises(ValueError, match="rank=2"):
        place_clips([10], 2, min_frames=1).slices(2)


def test_plan_reports_the_clips_the_rule_shards(tmp_path, capsys):
    rng = np.random.default_rng(0)
    durations = np.concatenate([rng.uniform(2, 20, 400), [600.0, 1800.0, 3600.0]]).astype(np.float32)
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"duration": pa.array(durations), "lang": ["en"] * len(durations)}), path)
    out = tmp_path / "plan.json"
    args = ["plan", "--manifest", str(path), "--mode", "exhaustive", "--max-batch-duration", "90"]
    assert main([*args, "--cp-size", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "encoder sharding (cp 2): 3 clips (1.67 h)" in text
    assert "full context (model.encoder.att_context_size unset), so each is encoded whole" in text
    plan = json.loads(out.read_text())
    # the plan's vectorised count equals the rule applied micro-batch by micro-batch
    expected = 0
    for batch in (b for rank in plan["ranks"] for b in rank):
        frames = [encoder_frames(float(durations[i]), 8) for i in batch]
        expected += len(place_clips(frames, 2, min_frames=short_clip_frames(8)).sharded_indices)
    assert plan["encoder_sharding"]["clips"] == expected == 3
    assert plan["encoder_sharding"]["sharded_in_training"] is False
    assert main([*args, "--cp-size", "1"]) == 0
    assert "encoder sharding" not in capsys.readouterr().out


def test_plan_says_a_limited_context_encoder_shards_them(tmp_path, capsys):
    """With model.encoder.att_context_size the plan reports what training does: the clips are sharded; a
    window wider than a cp-th of a clip keeps that clip whole (its slices could not carry the halo)."""
    durations = np.array([5.0, 7.0, 40.0, 600.0], dtype=np.float32)
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"duration": pa.array(durations), "lang": ["en"] * 4}), path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  encoder:\n    att_context_size: [128, 128]\n")
    args = [
        "plan",
        "--config",
        str(cfg),
        "--manifest",
        str(path),
        "--max-batch-duration",
        "30",
        "--cp-size",
        "2",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    # 600 s: 7,500 encoder frames; 40 s: 500, i.e. 250 per rank, at least the window's 128 + the stack's 2
    assert "encoder sharding (cp 2): 2 clips" in text and "the encoder shards each over the CP group" in text
    assert main([*args[:-1], "4"]) == 0  # 40 s at cp 4: 125 frames per rank, fewer than the window's 128 + 2
    assert "encoder sharding (cp 4): 1 clip (0.17 h) longer" in capsys.readouterr().out


@pytest.mark.parametrize("length, cp, align", [(45_003, 2, 2), (101, 3, 2), (97, 4, 3), (10, 4, 4)])
def test_aligned_shard_bounds_cut_on_multiples_of_the_stack(length, cp, align):
    bounds = shard_bounds(length, cp, align)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(bounds, bounds[1:]))
    assert all(lo % align == 0 for lo, _ in bounds)
    assert all(abs((hi - lo) - length / cp) < align + 1 for lo, hi in bounds) or length < cp * align
