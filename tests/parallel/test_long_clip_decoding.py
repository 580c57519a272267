"""Greedy decoding under CP (issue 40, item 4): a long clip that the CP layout shards is encoded slice by
slice over the group (`speechlm.model.cp_audio.encode_for_decoding`), not whole on each rank, and every
rank's hypotheses equal one process's (gloo, cp 2, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import build_model, global_steps, tiny_config

from parallel.cp_layout import DynamicCPLayout
from parallel.testing import run_distributed

WINDOW = ("model.encoder.att_context_size=[6,4]",)
MAX_NEW = 6


def _model(extra: tuple[str, ...]):
    model = build_model(tiny_config(ctc_weight=0.3, overrides=WINDOW + extra))
    return model, spy_slices(model)


def spy_slices(model) -> list[tuple[int, int]]:
    """The bounds of every slice the encoder runs from now on."""
    calls: list[tuple[int, int]] = []
    inner = model.encoder.forward_with_slices

    def spy(feats, lens, slices):
        calls.extend(s.bounds for s in slices)
        return inner(feats, lens, slices)

    model.encoder.forward_with_slices = spy
    return calls


def _decode(model) -> dict:
    batch = global_steps(1, 1, batches="long")[0][0]
    return {
        "rows": model.generate_for_batch(batch, max_new_tokens=MAX_NEW),
        "clips": model.generate_greedy(batch.audio, batch.audio_lens, max_new_tokens=MAX_NEW),
    }


def _worker(rank: int, world: int, extra: tuple[str, ...]) -> dict:
    torch.set_num_threads(1)
    model, calls = _model(extra)
    group = dist.new_group(list(range(world)))
    model.set_cp_layout(DynamicCPLayout(group=group, cp_size=world, cp_rank=rank, kind="ring"))
    return {**_decode(model), "calls": calls}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "extra",
    [
        (),  # the LLM alone
        ("model.decode_ctc_weight=0.5",),  # joint CTC/attention decoding reads the gathered encoder frames
    ],
)
def test_a_long_clip_is_encoded_sharded_and_decodes_as_one_process(extra):
    ref_model, ref_calls = _model(extra)
    ref = _decode(ref_model)
    assert ref_calls == []  # one process: no slices
    got = run_distributed(_worker, 2, "gloo", extra)
    for r, res in enumerate(got):
        # each rank encoded one slice of the long clip per decode (generate_for_batch, generate_greedy)
        assert len(res["calls"]) == 2, f"rank {r}: {res['calls']}"
        assert res["rows"] == ref["rows"], f"rank {r}"
        assert res["clips"] == ref["clips"], f"rank {r}"
    (a0, b0), (a1, b1) = got[0]["calls"][0], got[1]["calls"][0]
    assert a0 == 0 and b0 == a1 and b1 > a1  # contiguous slices of one clip
    assert any(len(h) > 0 for h in ref["rows"])  # something was decoded


def _fsdp_worker(rank: int, world: int) -> dict:
    """Training's layout (`build_distributed_context`: FSDP2 over both ranks, dynamic CP over them): the
    decoding that validation runs, with its lockstep flag."""
    from parallel.mesh import ParallelDims
    from speechlm.train.distributed import build_distributed_context

    torch.set_num_threads(1)
    cfg = tiny_config(cp=world, ctc_weight=0.3, overrides=WINDOW)
    model = build_model(cfg)
    dims = ParallelDims(world, cp=world)
    dims.build_mesh("cpu")
    ctx = build_distributed_context(model, dims, cfg, torch.device("cpu"))
    calls = spy_slices(model)
    batch = global_steps(1, 1, batches="long")[0][0]
    rows = model.generate_for_batch(batch, max_new_tokens=MAX_NEW, keep_going=ctx.collectives.any)
    return {"rows": rows, "calls": calls}


@pytest.mark.multiproc
def test_validation_under_fsdp_and_cp_decodes_a_sharded_clip_as_one_process():
    ref_model, _ = _model(())
    ref = _decode(ref_model)
    got = run_distributed(_fsdp_worker, 2, "gloo", timeout_s=300)
    for r, res in enumerate(got):
        assert len(res["calls"]) == 1, f"rank {r}: {res['calls']}"
        assert res["rows"] == ref["rows"], f"rank {r}"
