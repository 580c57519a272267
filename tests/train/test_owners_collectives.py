"""One collectives object on `ParallelDims` (issue 21, item 2): the step, evaluation and the CTC counts
use it, and the step's small all-reduces (target counts, clip counts, utterances, drops, the SIGTERM
and data-error flags) are one all-reduce before the first forward."""

from __future__ import annotations

import pytest

from parallel.collectives import Collectives
from parallel.mesh import ParallelDims


def test_one_process_collectives_issue_nothing(monkeypatch):
    import torch.distributed as dist

    def boom(*a, **k):
        raise AssertionError("a one-process run issued a collective")

    monkeypatch.setattr(dist, "all_reduce", boom)
    monkeypatch.setattr(dist, "all_gather_object", boom)
    c = Collectives()
    assert c.agree([3.0, 1.5], [False, True]) == ([3.0, 1.5], [False, True])
    assert c.sum_shards([2.0, 0.5]) == [2.0, 0.5]
    assert c.any(True) and not c.any(False)
    assert c.gather_objects("x") == ["x"]
    assert (c.dp_rank, c.dp_size, c.primary) == (0, 1, True)


def test_roles_come_from_the_layout_without_a_process_group():
    dims = ParallelDims(8, dp_shard=2, cp=2, tp=2)
    roles = [dims.collectives(r) for r in range(8)]
    assert [c.dp_rank for c in roles] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {c.dp_size for c in roles} == {2}
    # one member per dp rank speaks for its batch (cp = tp = 0), one per CP shard for its losses (tp = 0)
    assert [c.primary for c in roles] == [True, False, False, False, True, False, False, False]
    assert [c.shard_primary for c in roles] == [True, False, True, False, True, False, True, False]


def test_agreement_payloads_sum_counts_over_dp_and_or_the_flags():
    """What every rank puts in the one all-reduce, summed as the all-reduce does (no process group)."""
    dims = ParallelDims(8, dp_shard=2, cp=2, tp=2)
    counts = {0: [10.0, 2.0], 1: [7.0, 1.0]}  # per dp rank: labelled tokens, clips (same on its peers)
    total = sum(
        dims.collectives(r).agreement_payload(counts[dims.dp_rank(r)], [r == 6, False]) for r in range(8)
    )
    assert Collectives.read_agreement(total, 2) == ([17.0, 3.0], [True, False])
    shards = sum(dims.collectives(r).shard_payload([1.0 + r]) for r in range(8))
    assert shards.tolist() == [1.0 + 3.0 + 5.0 + 7.0]  # tp peers hold the same loss: counted once


def _count_step_worker(rank: int, world: int, sigterm_rank: int) -> dict:
    import torch.distributed as dist
    from parallel_harness import dp_only_step

    from speechlm.train.step import agree_step, run_optimizer_step

    model, ctx, opt, sched, micro, cfg = dp_only_step(rank, world)

    calls: list[str] = []
    real_all_reduce, real_gather = dist.all_reduce, dist.all_gather_object

    def counting_all_reduce(*a, **k):
        calls.append("all_reduce")
        return real_all_reduce(*a, **k)

    def counting_gather(*a, **k):
        calls.append("all_gather_object")
        return real_gather(*a, **k)

    dist.all_reduce, dist.all_gather_object = counting_all_reduce, counting_gather
    first_forward: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda *_: first_forward.append(len(calls)) if not first_forward else None
    )
    try:
        agreed = agree_step(model, micro, ctx, extra=[float(rank + 1)], flags=[rank == sigterm_rank])
        run_optimizer_step(model, micro, ctx, opt, sched, cfg, step=0, counts=agreed.counts)
    finally:
        dist.all_reduce, dist.all_gather_object = real_all_reduce, real_gather
        hook.remove()
    return {
        "before_forward": calls[: first_forward[0]],
        "all": calls,
        "tokens": agreed.counts.tokens,
        "clips": agreed.counts.clips,
        "extra": agreed.extra,
        "flags": agreed.flags,
    }


@pytest.mark.multiproc
def test_one_small_all_reduce_per_optimizer_step_before_the_forward():
    from parallel_harness import build_model, global_steps, tiny_config

    from parallel.testing import run_distributed
    from speechlm.model.micro_losses import count_targets

    per_rank = run_distributed(_count_step_worker, 2, "gloo", 1, timeout_s=240)
    model = build_model(tiny_config())
    step = global_steps(1, 2)[0]
    want_tokens = sum(count_targets(b, model) for b in step)
    for got in per_rank:
        # the agreement: target counts, clip counts, the caller's extras and flags, in one all-reduce
        assert got["before_forward"] == ["all_reduce"]
        # after the backwards, one more: the step's CE/CTC sums (the log and the finite-loss check)
        assert got["all"] == ["all_reduce", "all_reduce"]
        assert (got["tokens"], got["clips"]) == (want_tokens, sum(len(b) for b in step))
        assert got["extra"] == [3.0] and got["flags"] == [True]


def test_time_limit_is_agreed_in_the_step_agreement_not_by_a_collective_of_its_own():
    """`trainer.max_minutes` rides in the step's one all-reduce (a flag) instead of Lightning's
    `reduce_boolean_decision` after every step; the step that finds it passed is the last one."""
    import lightning as L
    from parallel_harness import TOK, make_batch, tiny_config

    from speechlm.train.callbacks import TimeLimit
    from speechlm.train.data import StepBatch
    from speechlm.train.module import SpeechLLMModule

    assert TimeLimit.on_train_batch_end is L.Callback.on_train_batch_end  # no per-step collective
    module = SpeechLLMModule(tiny_config(), TOK)
    module.configure_model()
    step_batch = StepBatch(micro_batches=[make_batch(0, 3)], position={"epoch": 0, "position": 1})
    totals, sigterm, time_up = module._agree_step(step_batch)
    assert (totals.utterances, sigterm, time_up) == (3, False, False)  # no limit
    TimeLimit(minutes=10).on_train_start(None, module)
    assert module._agree_step(step_batch)[2] is False
    TimeLimit(minutes=0).on_train_start(None, module)
    assert module._agree_step(step_batch)[2] is True
    assert totals.counts.clips == 3 and totals.counts.tokens > 0


def test_a_step_of_conversations_without_transcripts_counts_its_samples_and_trains():
    """Issue 35: a step whose clips have no transcript of their own read every sample (none dropped);
    its utterances are the samples, its CTC clips 0, and it is not refused as 'nothing read'."""
    from multiclip_helpers import make_conv_batch
    from parallel_harness import TOK, VOCAB, tiny_config

    from speechlm.train.data import StepBatch
    from speechlm.train.module import SpeechLLMModule

    module = SpeechLLMModule(tiny_config(), TOK)
    module.configure_model()
    batch = make_conv_batch(3, 4, VOCAB, transcripts=False)
    totals, _, _ = module._agree_step(StepBatch(micro_batches=[batch], position={"epoch": 0, "position": 1}))
    assert totals.utterances == 4 and totals.counts.samples == 4
    assert totals.counts.audio_clips == batch.audio.shape[0] > 4 and totals.counts.clips == 0


def test_a_step_whose_every_sample_was_dropped_names_the_rows_and_advice_that_fits():
    from parallel_harness import TOK, tiny_config

    from speechlm.data.dataset import Batch
    from speechlm.errors import DataError
    from speechlm.train.data import StepBatch
    from speechlm.train.module import SpeechLLMModule

    module = SpeechLLMModule(tiny_config(), TOK)
    module.configure_model()
    empty = Batch.empty(
        {"too_many_tokens": 2}, ["a.flac (too_many_tokens): 90 tokens", "b.flac (too_many_tokens): 80"]
    )
    with pytest.raises(DataError) as e:
        module._agree_step(
            StepBatch(
                micro_batches=[empty], position={"epoch": 0, "position": 1}, dropped=dict(empty.dropped)
            )
        )
    msg = str(e.value)
    assert "every one of its 2 samples was dropped" in msg and "too_many_tokens 2" in msg
    assert "a.flac (too_many_tokens)" in msg and "data.max_tokens" in msg and "restore" not in msg.lower()
