"""Decode only what you encode (issue 40 item 2) through the real training step, under gloo.

Each rank's conversation micro-batches keep the audio of the clips its `ClipPlanner` says it encodes; every
other clip's row is cut to nothing and filled with NaN where it still has samples (a clip read there would
turn the loss NaN), as `speechlm.data.local_decode.LocalCollator` leaves them. The losses of 3 steps and the
gradients after the first must be those of one process with every clip (`parallel_harness.reference_run`),
at cp 2 and cp 2 x tp 2; each clip is decoded by exactly one CP rank (and by its TP peers), a long clip the
encoder shards over the group (limited context) by every rank. A clip decoded
on one rank only that fails there makes every rank read the step whole (`module._agree_step`): the row is
dropped and counted on every rank, or, past ``data.max_dropped_fraction``, the step fails on every rank
with the row named."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from parallel_harness import COMPRESSED, build_model, global_steps, reference_run, run_steps, tiny_config
from test_long_clip_training import _assert_steps_match as assert_steps_match
from test_parallel_equivalence import assert_matches

from parallel.testing import run_distributed
from speechlm.data.batch import Batch
from speechlm.model.clip_planner import ClipPlanner

N_STEPS = 3
THRESHOLD = 14  # tokens: the conversation samples are 8-20, whole and split ones in one micro-batch


def localize(batch: Batch, needed: list[bool]) -> Batch:
    """``batch`` as a rank decoding only the ``needed`` clips holds it (module docstring)."""
    lens = batch.audio_lens.tolist()
    width = max((n for n, w in zip(lens, needed) if w), default=0)
    audio = batch.audio[:, :width].clone()
    for c, w in enumerate(needed):
        if not w:
            audio[c] = float("nan")
    present = torch.tensor(needed, dtype=torch.bool)
    return dataclasses.replace(batch, audio=audio, audio_present=present)


WINDOW = ("model.encoder.att_context_size=[6,4]",)  # limited context: a 33-37 s clip is sharded over CP
CASES = {  # name -> (config overrides, harness batches, split threshold, model tweak)
    "conversations": ((), "conversations", THRESHOLD, ""),
    "long": (WINDOW, "long", "auto", ""),
    # CTC-compressed audio: every clip's rows gathered, the clips dealt over the encoders (`encoding_plan`)
    "compressed": (COMPRESSED, "clips", 8, "ctc-mixed"),
}


def _rank(rank: int, world: int, cp: int, tp: int, case: str = "conversations") -> dict:
    from parallel.mesh import ParallelDims
    from speechlm.train.distributed import build_distributed_context

    torch.set_num_threads(1)
    dims = ParallelDims(world, 1, -1, cp, tp)
    dims.build_mesh("cpu")
    overrides, batches, threshold, tweak = CASES[case]
    cfg = tiny_config(cp, tp, "ring", 0.3, threshold, overrides)
    model = build_model(cfg, tweak=tweak)
    ctx = build_distributed_context(model, dims, cfg, torch.device("cpu"))
    planner = ClipPlanner.of(model, model.cp_layout.for_planning())
    steps = global_steps(N_STEPS, 1, batches=batches)
    needed = [planner(s[0]) for s in steps]
    out = run_steps(model, ctx, cfg, [[localize(s[0], w)] for s, w in zip(steps, needed)])
    out["needed"] = needed
    out["cp_rank"] = dims.cp_rank(rank)
    return out if rank == 0 else {k: v for k, v in out.items() if k != "grads"}


@functools.cache
def _reference(case: str) -> dict:
    overrides, batches, _, tweak = CASES[case]
    cfg = tiny_config(overrides=overrides)
    return reference_run(cfg, global_steps(N_STEPS, 1, batches=batches), tweak=tweak)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "cp, tp, case",
    [(2, 1, "conversations"), (2, 2, "conversations"), (2, 1, "long"), (2, 1, "compressed")],
)
def test_each_rank_decoding_its_clips_gives_the_losses_and_gradients_of_one_process(cp, tp, case):
    got = run_distributed(_rank, cp * tp, "gloo", cp, tp, case, timeout_s=800)
    if case == "long":  # later steps to 1e-4, as test_long_clip_training holds them (Adam on rounding noise)
        assert_steps_match(_reference(case), got)
    else:
        assert_matches(_reference(case), got)
    for step in range(N_STEPS):
        by_cp: dict[int, list[bool]] = {}
        for res in got:  # TP peers decode the same clips
            assert by_cp.setdefault(res["cp_rank"], res["needed"][step]) == res["needed"][step]
        per_clip = [sum(col) for col in zip(*by_cp.values())]
        # each clip decoded on one CP rank only; a long clip sharded over the group (the first of a "long"
        # micro-batch) on every rank, each encoding its slice
        assert per_clip == [cp if case == "long" and c == 0 else 1 for c in range(len(per_clip))]
        if case != "long":  # no rank decodes the whole micro-batch (a long one has few short clips to deal)
            assert all(not all(w) for w in by_cp.values())
        assert sum(per_clip) < cp * len(per_clip)  # fewer decodes than every peer decoding everything


def test_a_clip_the_rank_did_not_decode_is_never_encoded_as_silence():
    from parallel_harness import make_conversation_batch

    model = build_model(tiny_config())
    batch = make_conversation_batch(0, 3)
    needed = [True] * batch.num_clips
    needed[1] = False
    with pytest.raises(RuntimeError, match=r"clip 1 \(manifest row \d+\) is encoded on CP rank 0"):
        model(localize(batch, needed))
    model(localize(batch, [True] * batch.num_clips))  # every clip here: it trains as before


def _agree_rank(rank: int, world: int, table, tok_path: str, limit: float) -> dict:
    from types import SimpleNamespace

    from parallel.mesh import ParallelDims
    from speechlm.data.dataset import SpeechDataset
    from speechlm.data.local_decode import LocalCollator
    from speechlm.data.run_inputs import TokenizerInfo
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.packing.prompt import ConversationRenderer
    from speechlm.train.data import DroppedDataError, StepBatch, StepLoader
    from speechlm.train.module import SpeechLLMModule

    torch.set_num_threads(1)
    tok = Tokenizer(tok_path)
    info = TokenizerInfo(len(tok), tok.pad_id, tok.bos_id, tok.eos_id, tok.audio_id)
    dims = ParallelDims(world, 1, -1, world, 1)
    dims.build_mesh("cpu")
    ds = SpeechDataset(table, tok, renderer=ConversationRenderer(tok), defer_audio=True)
    loader = StepLoader(SimpleNamespace(epoch=0, position=0), ds, grad_accum=1, max_dropped_fraction=limit)
    module = SpeechLLMModule(tiny_config(cp=world, split_threshold=60), info, dims=dims, data_pipeline=loader)
    module.configure_model()
    planner = ClipPlanner.of(module.model, module.model.cp_layout.for_planning())
    batch = LocalCollator(tok.pad_id, planner)(ds.__getitems__([0, 5, 9, 14]))
    step = StepBatch([batch], {"epoch": 0, "position": 1})
    failed_here = batch.local_failure is not None
    try:
        totals, _, _ = module._agree_step(step)
    except DroppedDataError as e:
        return {"failed_here": failed_here, "error": str(e)}
    mb = step.micro_batches[0]
    return {
        "failed_here": failed_here,
        "dropped": totals.dropped,
        "rows": mb.indices,
        "whole": mb.audio_present is None,
    }


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_clip_failing_on_the_one_rank_that_decodes_it_is_agreed_by_every_rank(demo_data, tmp_path):
    from local_decode_helpers import nan_clip_table

    table = nan_clip_table(demo_data, tmp_path)
    got = run_distributed(_agree_rank, 2, "gloo", table, demo_data["tok"], 1.0, timeout_s=500)
    assert sorted(g["failed_here"] for g in got) == [False, True]  # one rank read the broken clip
    for g in got:  # every rank read the step whole: the row dropped and counted, as with every clip decoded
        assert g["whole"] and g["dropped"] == {"undecodable": 1} and 0 not in g["rows"]
    assert got[0]["rows"] == got[1]["rows"]
    got = run_distributed(_agree_rank, 2, "gloo", table, demo_data["tok"], 0.1, timeout_s=500)
    for g in got:  # too much unreadable: the step fails on every rank, naming the row
        assert "nan.wav (undecodable)" in g["error"] and "data.max_dropped_fraction=0.1" in g["error"]
