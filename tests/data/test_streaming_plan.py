"""The streaming epoch plan (`speechlm.data.sampler.streaming`), simulated for several ranks in one process.

Covers: every row in exactly one micro-batch except the lockstep trim (< dp_size * grad_accum
micro-batches); equal counts per rank, a multiple of grad_accum; each worker's micro-batches come
from its own shards, read front to back within the shuffle buffer; temperature mode draws the same
rows as indexed mode; the plan is deterministic and changes with the epoch; the stateful sampler
resumes mid-epoch with the same next batches and refuses state from another worker count.
"""

from __future__ import annotations

import numpy as np
import pytest

from speechlm.data.sampler import (
    DurationBucketBatchSampler,
    SamplerSettings,
    StreamingLayout,
    build_epoch_plan,
    build_streaming_plan,
)

N, PER_SHARD = 6000, 250


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(1)
    durations = rng.lognormal(np.log(5), 0.6, N).clip(0.5, 20).astype(np.float32)
    langs = rng.choice(4, N, p=[0.6, 0.25, 0.1, 0.05])
    shards = np.arange(N) // PER_SHARD
    positions = (np.arange(N) % PER_SHARD) * 50_000
    return durations, langs, shards, positions


@pytest.mark.parametrize("dp,ga,workers", [(1, 1, 1), (4, 2, 2), (3, 4, 3)])
def test_every_row_once_and_lockstep(corpus, dp, ga, workers):
    d, lang, shards, pos = corpus
    s = SamplerSettings(dp_size=dp, grad_accum=ga, mode="exhaustive", max_batch_duration=60.0)
    plan = build_streaming_plan(d, lang, shards, pos, s, 0, streams_per_rank=workers, shuffle_buffer=100)
    assert plan.rank_batches.shape[1] % ga == 0 and plan.rank_batches.shape[1] > 0
    used = np.concatenate([plan.rank_rows(r)[0] for r in range(dp)])
    assert len(np.unique(used)) == len(used)  # no duplicates
    n_batches = len(plan.batch_offsets) - 1
    left_out = n_batches - plan.rank_batches.size
    assert 0 <= left_out < dp * ga  # the lockstep trim only
    assert (
        len(used)
        + sum(
            plan.batch_offsets[b + 1] - plan.batch_offsets[b]
            for b in set(range(n_batches)) - set(plan.rank_batches.ravel())
        )
        == N
    )
    for r in range(dp):
        for k in range(plan.batches_per_rank):
            b = plan.batch(r, k)
            assert len(b) == 1 or d[b].sum() <= 60.0 + 1e-3


def test_workers_read_their_own_shards_front_to_back(corpus):
    d, lang, shards, pos = corpus
    dp, workers, buffer = 2, 2, 100
    s = SamplerSettings(dp_size=dp, grad_accum=1, mode="exhaustive", max_batch_duration=60.0)
    plan = build_streaming_plan(d, lang, shards, pos, s, 0, streams_per_rank=workers, shuffle_buffer=buffer)
    seen_by_worker: dict[tuple[int, int], set[int]] = {}
    for r in range(dp):
        # the first half of the epoch: while all of a rank's streams still have batches, batch k is
        # worker k % W's (the tail may be moved to balance ranks)
        for k in range(plan.batches_per_rank // 2):
            seen_by_worker.setdefault((r, k % workers), set()).update(shards[plan.batch(r, k)].tolist())
    owners: dict[int, tuple[int, int]] = {}
    for who, shard_set in seen_by_worker.items():
        for sh in shard_set:
            assert owners.setdefault(sh, who) == who, f"shard {sh} read by two workers"
    # within one worker, the shard positions advance: at most ~buffer + sort window rows back
    r, w = 0, 0
    rows = np.concatenate([plan.batch(r, k) for k in range(w, plan.batches_per_rank // 2, workers)])
    _, first = np.unique(shards[rows], return_index=True)  # shards in the order the worker meets them
    shard_order = np.empty(shards.max() + 1, np.int64)
    shard_order[shards[rows][np.sort(first)]] = np.arange(len(first))
    order_key = np.argsort(np.argsort(shard_order[shards[rows]] * 10**9 + pos[rows], kind="stable"))
    assert np.max(np.arange(len(rows)) - order_key) <= buffer + 500


def test_temperature_mode_draws_the_same_rows_as_indexed(corpus):
    d, lang, shards, pos = corpus
    s = SamplerSettings(dp_size=1, grad_accum=1, mode="temperature", temperature=0.3, max_batch_duration=60.0)
    streaming = build_streaming_plan(d, lang, shards, pos, s, 2)
    indexed = build_epoch_plan(d, lang, s, 2)
    a = np.sort(streaming.rank_rows(0)[0])
    b = np.sort(indexed.rank_rows(0)[0])
    drawn_a, drawn_b = np.bincount(lang[a], minlength=4), np.bincount(lang[b], minlength=4)
    # the same draws; each plan may leave out its last partial grad-accum group, nothing more
    assert np.abs(drawn_a - drawn_b).sum() <= 2 * 40


def test_deterministic_and_reshuffled_per_epoch(corpus):
    d, lang, shards, pos = corpus
    s = SamplerSettings(dp_size=2, grad_accum=1, mode="exhaustive", max_batch_duration=60.0)
    p0 = build_streaming_plan(d, lang, shards, pos, s, 0)
    again = build_streaming_plan(d, lang, shards, pos, s, 0)
    p1 = build_streaming_plan(d, lang, shards, pos, s, 1)
    assert np.array_equal(p0.rows, again.rows) and np.array_equal(p0.rank_batches, again.rank_batches)
    assert not np.array_equal(p0.batch(0, 0), p1.batch(0, 0))


def test_rows_without_a_shard_are_spread(corpus):
    d, lang, _, _ = corpus
    s = SamplerSettings(dp_size=2, grad_accum=1, mode="exhaustive", max_batch_duration=60.0)
    plan = build_streaming_plan(d, lang, np.full(N, -1), np.zeros(N, np.int64), s, 0)
    used = np.concatenate([plan.rank_rows(r)[0] for r in range(2)])
    assert len(np.unique(used)) == len(used) > N * 0.95


def _sampler(corpus, workers=2, rank=0):
    d, lang, shards, pos = corpus
    s = SamplerSettings(dp_size=2, grad_accum=2, mode="temperature", max_batch_duration=60.0)
    layout = StreamingLayout(shards, pos, streams_per_rank=workers, shuffle_buffer=300, sort_buffer=200)
    return DurationBucketBatchSampler(d, lang, ["a", "b", "c", "d"], s, dp_rank=rank, streaming=layout)


def test_sampler_resumes_mid_epoch(corpus):
    straight = list(_sampler(corpus))
    first = _sampler(corpus)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    resumed = _sampler(corpus)
    resumed.load_state_dict(state)
    assert list(resumed) == straight[7:]
    assert state["params"]["streaming"]["streams_per_rank"] == 2
    other = _sampler(corpus, workers=3)
    with pytest.raises(ValueError, match="params.streaming"):
        other.load_state_dict(state)


def test_bad_buffers_are_refused(corpus):
    d, lang, shards, pos = corpus
    with pytest.raises(ValueError, match="shuffle_buffer=0"):
        build_streaming_plan(d, lang, shards, pos, SamplerSettings(), 0, shuffle_buffer=0)
