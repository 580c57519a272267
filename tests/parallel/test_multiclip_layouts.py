"""Layout equivalence with multi-clip samples (conversation batches), and where their clips are encoded.

The multi-process test runs the harness' conversation batches (rows of 1-3 clips, one or two answers,
CTC transcripts on some clips; `parallel_harness.make_conversation_batch`) through the real training
step at dp2 and cp2 (dynamic CP with a mix of whole and split samples, every sample split, every
sample whole; ring and all-gather attention) and compares the losses of 3 steps and the gradients
after the first with one process, as `test_parallel_equivalence` does for one clip per sample.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from helpers import BACKENDS, skip_unless_backend
from parallel_harness import (
    VOCAB,
    Layout,
    build_model,
    global_steps,
    make_conversation_batch,
    rank_layouts,
    reference_run,
    tiny_config,
)
from test_parallel_equivalence import assert_matches

from parallel.cp_layout import NullCPLayout, WholePlan, plan_for_clips
from parallel.cp_placement import place_sequences
from parallel.testing import run_distributed
from speechlm.model.conversation_inputs import clips_per_sample, conversation_prompts, conversation_seq_lens

N_STEPS = 3
THRESHOLD = 14  # the conversation samples are 8-20 tokens: whole and split ones in one micro-batch

CONV_LAYOUTS = [
    Layout("dp2-conv", 2, 1, 1, batches="conversations"),
    Layout("cp2-ring-conv", 1, 2, 1, split_threshold=THRESHOLD, batches="conversations"),
    Layout("cp2-allgather-conv", 1, 2, 1, "allgather", THRESHOLD, batches="conversations"),
    Layout("cp2-split-all-conv", 1, 2, 1, split_threshold=0, batches="conversations"),
    Layout("cp2-all-whole-conv", 1, 2, 1, split_threshold=1000, batches="conversations"),
    # a row without audio first: at cp2 all whole a rank owns only it (its dummy clip reaches no exchange)
    Layout("cp2-all-whole-text", 1, 2, 1, split_threshold=1000, batches="text+audio"),
    Layout("cp2-ring-text", 1, 2, 1, split_threshold=THRESHOLD, batches="text+audio"),
    # no clip of any sample has a transcript (QA data, multi-clip ShareGPT): CE only, every step (issue 35)
    Layout("dp2-untranscribed", 2, 1, 1, batches="untranscribed"),
    Layout("cp2-ring-untranscribed", 1, 2, 1, split_threshold=THRESHOLD, batches="untranscribed"),
]


# four processes: TP rounding and dp x cp with multi-clip samples (slow: run with -m slow)
CONV_LAYOUTS_4 = [
    Layout("cp2-tp2-conv", 1, 2, 2, split_threshold=THRESHOLD, batches="conversations"),
    Layout("dp2-cp2-conv", 2, 2, 1, split_threshold=THRESHOLD, batches="conversations"),
    Layout("cp4-conv", 1, 4, 1, split_threshold=THRESHOLD, batches="text+audio"),
    Layout("dp2-cp2-untranscribed", 2, 2, 1, split_threshold=THRESHOLD, batches="untranscribed"),
]


@functools.cache
def reference(dp: int, batches: str) -> dict:
    return reference_run(tiny_config(), global_steps(N_STEPS, dp, batches=batches))


def _sample_lengths(batches: str = "conversations") -> list[tuple[list[int], list[int], list[int]]]:
    """(packed length per sample, clip_sample, frames per clip) of every micro-batch of the steps."""
    model = build_model(tiny_config())
    out = []
    for step in global_steps(N_STEPS, 2, batches=batches):
        for b in step:
            prompts, clip_sample = conversation_prompts(b, model.audio_id)
            counts = clips_per_sample(clip_sample, len(prompts))
            frames = model.audio_embed_lengths(b.audio_lens)
            out.append((conversation_seq_lens(prompts, counts, frames), clip_sample, frames))
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_multiclip_layouts_match_single_process(world, backend):
    skip_unless_backend(backend, world)
    layouts = CONV_LAYOUTS if world == 2 else CONV_LAYOUTS_4
    got = run_distributed(rank_layouts, world, backend, layouts, N_STEPS, backend, timeout_s=1100)
    failed = []
    for i, lay in enumerate(layouts):
        try:
            assert_matches(reference(lay.dp, lay.batches), [per_rank[i] for per_rank in got])
        except AssertionError as e:
            failed.append(f"{lay.id} (dp={lay.dp}, cp={lay.cp}, tp={lay.tp}, {lay.cp_attention}): {e}")
    assert not failed, "\n".join(failed)


def test_conversation_batches_cover_the_dynamic_cp_cases():
    """The conversation steps hold several clips per sample, and at cp2 with THRESHOLD a micro-batch
    with whole and split samples, and a whole sample of several clips (its clips stay on one rank)."""
    cases = _sample_lengths()
    assert any(len(cs) > len(set(cs)) for _, cs, _ in cases)
    placements = [(place_sequences(lens, 2, threshold=THRESHOLD), cs) for lens, cs, _ in cases]
    assert any(any(p.split) and not all(p.split) for p, _ in placements)
    assert any(not p.split[s] and cs.count(s) > 1 for p, cs in placements for s in set(cs))
    # the text+audio steps, all whole: a CP rank that encodes no clip and gathers none (its dummy's
    # embeddings reach no exchange); at THRESHOLD a split sample's clips are dealt over both encoders
    views = [
        plan_for_clips(place_sequences(lens, 2, threshold=1000).local(0), cs, frames, 2)
        for lens, cs, frames in _sample_lengths("text+audio")
    ]
    assert any(r not in v.clip_owners and not any(v.gathered) for v in views for r in range(2))
    views = [
        plan_for_clips(place_sequences(lens, 2, threshold=THRESHOLD).local(0), cs, frames, 2)
        for lens, cs, frames in _sample_lengths("conversations")
    ]
    assert any(
        len({o for o, g, s in zip(v.clip_owners, v.gathered, v.clip_sample) if g and s == split}) == 2
        for v in views
        for split in set(v.clip_sample)
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_clip_owners_follow_their_sample_and_are_identical_on_every_rank(cp):
    for lens, clip_sample, frames in _sample_lengths():
        placement = place_sequences(lens, cp, threshold=THRESHOLD)
        views = [plan_for_clips(placement.local(r), clip_sample, frames, cp) for r in range(cp)]
        owners, gathered = views[0].clip_owners, views[0].gathered
        assert all(v.clip_owners == owners and v.gathered == gathered for v in views)
        assert gathered == [placement.split[s] for s in clip_sample]
        for c, s in enumerate(clip_sample):  # a whole sample's clips are encoded where it is decoded
            if not placement.split[s]:
                assert owners[c] == placement.owner[s] and s in views[owners[c]].indices
        # without clip lengths: each clip goes to its sample's clip owner
        seq_owner = placement.clip_owners()
        assert plan_for_clips(placement.local(0), clip_sample).clip_owners == [
            seq_owner[s] for s in clip_sample
        ]


def test_a_split_samples_clips_are_dealt_over_the_encoders():
    """One long conversation of 3 clips split over cp2 (and a short whole one on rank 0): its clips go,
    longest first, to the rank with the least encoding work, not all to one rank."""
    placement = place_sequences([40, 6], 2, threshold=10)
    assert placement.split == (True, False) and placement.owner[1] in (0, 1)
    whole_rank = placement.owner[1]
    view = plan_for_clips(placement.local(0), [0, 0, 0, 1], [9, 7, 5, 4], 2)
    owners = view.clip_owners
    assert owners[3] == whole_rank
    work = [0, 0]
    work[whole_rank] += 4
    for c in (0, 1, 2):  # longest first to the least loaded
        r = min((0, 1), key=lambda r: (work[r], r))
        assert owners[c] == r
        work[r] += [9, 7, 5][c]
    assert set(owners[:3]) == {0, 1} and view.gathered == [True, True, True, False]
    assert (
        plan_for_clips(placement.local(0), [0, 0, 0, 1]).clip_owners[:3] == [placement.clip_owners()[0]] * 3
    )


def test_plan_for_clips_rejects_a_clip_of_no_sample():
    with pytest.raises(ValueError, match="clip 1 belongs to sequence 2, but the plan has 2 sequences"):
        plan_for_clips(WholePlan([4, 6]), [0, 2])


def test_null_layout_reports_every_clip_it_encoded():
    calls = []

    def encode_fn(audio, lens):
        calls.append(audio.shape[0])
        return [audio[i, :1] for i in range(audio.shape[0])], "extra"

    audio = torch.zeros(3, 4)
    res = NullCPLayout().encode(
        encode_fn, audio, torch.tensor([4, 4, 4]), plan_for_clips(WholePlan([5, 9]), [0, 0, 1])
    )
    assert calls == [3] and res.clips == [0, 1, 2] and len(res.embeds) == 3


# ------------------------------------------------------------------------------------------------
# Greedy answers of conversation batches under FSDP2 (sharded evaluation's lockstep)
# ------------------------------------------------------------------------------------------------

GEN_BATCHES = 4


def _gen_model(stop: int):
    model = build_model(tiny_config())
    model.prompt = dataclasses.replace(model.prompt, stop=(stop,))
    return model


def _gen_single(stop: int) -> list[list[list[int]]]:
    model = _gen_model(stop)
    batches = [make_conversation_batch(50 + k, 2 + k % 2) for k in range(GEN_BATCHES)]
    return [model.generate_for_batch(b, max_new_tokens=8) for b in batches]


def _pick_stop() -> int:
    """A stop token the rows reach at different steps (so that the ranks' lockstep really matters)."""
    hyps = [h for out in _gen_single(VOCAB) for h in out]  # VOCAB: never generated
    return max(
        sorted({t for h in hyps for t in h}), key=lambda t: len({h.index(t) if t in h else 8 for h in hyps})
    )


def _gen_worker(rank: int, world: int, stop: int) -> list[list[list[int]]]:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from parallel.mesh import ParallelDims
    from speechlm.train.distributed import FSDP_ENTRY_METHODS

    torch.set_num_threads(1)
    model = _gen_model(stop)
    for unit in (*model.llm.model.layers, model.encoder, model.projector):
        fully_shard(unit)  # every forward all-gathers over both ranks: unequal step counts would hang
    fully_shard(model)
    for name in FSDP_ENTRY_METHODS:
        register_fsdp_forward_method(model, name)
    comm = ParallelDims(world).collectives(rank)
    batches = [make_conversation_batch(50 + k, 2 + k % 2) for k in range(GEN_BATCHES)]
    return [model.generate_for_batch(b, max_new_tokens=8, keep_going=comm.any) for b in batches[rank::world]]


@pytest.mark.multiproc
def test_generate_for_batch_under_fsdp_equals_one_process():
    """Each rank decodes other conversation batches (rows stopping at different steps) through the
    FSDP-registered `generate_for_batch`; the answers equal one process's."""
    stop = _pick_stop()
    want = _gen_single(stop)
    assert len({len(h) for out in want for h in out}) > 1
    got = run_distributed(_gen_worker, 2, "gloo", stop, timeout_s=300)
    assert got[0] == want[0::2] and got[1] == want[1::2]
