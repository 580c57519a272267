"""The data position in a checkpoint is keyed by dp rank (issue 21 item 4): pure tests of what the
ranks write and read (no process group), and one 2-process run resumed in one process.

A checkpoint holds one data position per data-parallel rank, written by the first rank of that dp
group (its cp/tp peers train on the same batches); on resume every rank reads its dp rank's entry,
so the same dp size under another cp/tp continues exactly, and another dp size keeps the refusal
that names `trainer.resume_data=next_epoch`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from parallel.mesh import ParallelDims
from speechlm.train.callbacks import data_state_of
from speechlm.train.checkpoint import (
    COMPLETE_NAME,
    RANK_DIR,
    CheckpointError,
    layout_of,
    list_files,
    restore_training_state,
    save_checkpoint_atomic,
    write_rank_state,
)


def make_loader(dp_rank: int, dp_size: int, consumed: int = 0):
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings
    from speechlm.train.data import StepLoader

    durations = np.random.default_rng(0).uniform(1, 10, 200).astype(np.float32)
    settings = SamplerSettings(dp_size=dp_size, grad_accum=2, max_batch_duration=60.0, seed=0)
    sampler = DurationBucketBatchSampler(
        durations, np.zeros(200, np.int32), ["en"], settings, dp_rank=dp_rank
    )
    loader = StepLoader(sampler, None, grad_accum=2, seed=0, dp_rank=dp_rank)
    loader.mark_consumed({"epoch": 0, "position": consumed})
    return loader


def fake_trainer(dims: ParallelDims, rank: int, loader) -> SimpleNamespace:
    module = SimpleNamespace(dims=dims, data_pipeline=loader)
    return SimpleNamespace(
        lightning_module=module, global_rank=rank, strategy=SimpleNamespace(global_rank=rank)
    )


def save_ranks(
    ckpt: Path, dims: ParallelDims, consumed: dict[int, int], *, skip_dp: int | None = None
) -> None:
    """What every rank of `dims` writes of its state into `ckpt`, then complete.json as
    save_checkpoint_atomic writes it (no weights)."""
    ckpt.mkdir(parents=True)
    torch.save({"global_step": 3}, ckpt / "meta.pt")
    for rank in range(dims.world_size):
        dp_rank = dims.dp_rank(rank)
        state = data_state_of(fake_trainer(dims, rank, make_loader(dp_rank, dims.dp, consumed[dp_rank])))
        write_rank_state(ckpt, rank, None if dp_rank == skip_dp else state)
    manifest = {
        "step": 3,
        "world_size": dims.world_size,
        "layout": layout_of(dims),
        "files": list_files(ckpt),
    }
    (ckpt / COMPLETE_NAME).write_text(json.dumps(manifest))


def resume_rank(
    ckpt: Path, dims: ParallelDims, rank: int, resume_data: str = "exact", module: Any = None
) -> dict[str, int]:
    loader = make_loader(dims.dp_rank(rank), dims.dp)
    module = module or SimpleNamespace(pending_rng=None)
    _, pos = restore_training_state(
        ckpt, loader, module, resume_data=resume_data, rank=rank, world_size=dims.world_size, dims=dims
    )
    return pos


def data_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in (ckpt / RANK_DIR).glob("data_*.json"))


def test_one_position_per_dp_rank_written_by_the_first_rank_of_each_dp_group(tmp_path):
    dims = ParallelDims(4, cp=2)  # ranks 0, 1: dp rank 0; ranks 2, 3: dp rank 1
    save_ranks(tmp_path / "ckpt", dims, {0: 4, 1: 6})
    assert data_files(tmp_path / "ckpt") == ["data_dp00000.json", "data_dp00001.json"]
    saved = json.loads((tmp_path / "ckpt" / RANK_DIR / "data_dp00001.json").read_text())
    assert (saved["dp_rank"], saved["dp_size"], saved["position"]) == (1, 2, 6)
    # the RNG states stay per process: every rank has its own stream
    assert len(list((tmp_path / "ckpt" / RANK_DIR).glob("rng_rank*.pt"))) == 4


@pytest.mark.parametrize(
    "new", [ParallelDims(2), ParallelDims(4, cp=2), ParallelDims(4, tp=2), ParallelDims(8, cp=2, tp=2)]
)
def test_same_dp_size_under_another_cp_tp_resumes_each_dp_rank_at_its_own_position(tmp_path, new):
    save_ranks(tmp_path / "ckpt", ParallelDims(4, cp=2), {0: 4, 1: 6})  # saved at dp=2 x cp=2
    got = {rank: resume_rank(tmp_path / "ckpt", new, rank) for rank in range(new.world_size)}
    assert got == {rank: {"epoch": 0, "position": [4, 6][new.dp_rank(rank)]} for rank in got}


def test_a_missing_position_of_a_dp_rank_names_the_checkpoint_and_the_dp_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_ranks(ckpt, ParallelDims(2), {0: 4, 1: 4}, skip_dp=1)  # an altered or half-written checkpoint
    assert resume_rank(ckpt, ParallelDims(2), 0) == {"epoch": 0, "position": 4}
    with pytest.raises(CheckpointError) as e:
        resume_rank(ckpt, ParallelDims(2), 1)
    msg = str(e.value)
    assert str(ckpt) in msg and "no data position for dp rank 1" in msg and "data_dp00001.json" in msg
    assert "saved with 2 data-parallel ranks" in msg


def test_another_dp_size_is_still_refused_and_next_epoch_still_works(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_ranks(ckpt, ParallelDims(2, cp=2), {0: 4})  # dp=1
    for rank in (0, 1):  # dp rank 0 finds a position of another dp size, dp rank 1 none at all
        with pytest.raises(CheckpointError, match="trainer.resume_data=next_epoch"):
            resume_rank(ckpt, ParallelDims(2), rank)
    assert [resume_rank(ckpt, ParallelDims(2), r, "next_epoch") for r in (0, 1)] == [
        {"epoch": 1, "position": 0}
    ] * 2


def test_a_checkpoint_with_positions_per_global_rank_resumes_by_dp_rank(tmp_path):
    """Checkpoints saved before the dp keying have `data_rankRRRRR.json` per process; each holds its dp rank."""
    ckpt = tmp_path / "ckpt"
    (ckpt / RANK_DIR).mkdir(parents=True)
    torch.save({"global_step": 3}, ckpt / "meta.pt")
    old = ParallelDims(4, cp=2)
    for rank in range(4):
        state = make_loader(old.dp_rank(rank), 2, [4, 6][old.dp_rank(rank)]).state_dict()
        (ckpt / RANK_DIR / f"data_rank{rank:05d}.json").write_text(json.dumps(state))
    (ckpt / COMPLETE_NAME).write_text(json.dumps({"step": 3, "world_size": 4, "files": list_files(ckpt)}))
    assert [resume_rank(ckpt, ParallelDims(2), r)["position"] for r in (0, 1)] == [4, 6]


def test_rng_states_come_back_only_into_the_layout_they_were_saved_in(tmp_path):
    """Each rank's RNG stream belongs to its place in the layout (cp ranks draw for other tokens than tp
    peers, which must draw alike): under another cp/tp they are not handed to another rank's role."""
    save_ranks(tmp_path / "ckpt", ParallelDims(2, cp=2), {0: 4})
    for dims, restored in ((ParallelDims(2, cp=2), True), (ParallelDims(2, tp=2), False)):
        module = SimpleNamespace(pending_rng=None)
        resume_rank(tmp_path / "ckpt", dims, 1, module=module)
        assert (module.pending_rng is not None) is restored


class FakeStrategy:
    is_global_zero, global_rank, world_size = True, 0, 1

    def barrier(self, name: str) -> None:
        pass


class FakeTrainer:
    def __init__(self, step: int):
        self.strategy, self.global_step = FakeStrategy(), step

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        Path(path).mkdir(parents=True)
        torch.save({"global_step": self.global_step}, Path(path) / "meta.pt")


def test_the_layout_is_recorded_in_complete_json(tmp_path):
    dims = ParallelDims(1)
    state = make_loader(0, 1, 2).state_dict()
    ckpt = save_checkpoint_atomic(
        FakeTrainer(2), tmp_path, "step_000002", data_state=state, layout=layout_of(dims)
    )
    complete = json.loads((ckpt / COMPLETE_NAME).read_text())
    assert complete["layout"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    assert "speechlm/data_dp00000.json" in complete["sha256"]  # hashed like the weights
    assert resume_rank(ckpt, dims, 0) == {"epoch": 0, "position": 2}


@pytest.mark.multiproc
def test_cp2_checkpoint_resumes_exactly_in_one_process(demo_data, tmp_path):
    """Trained at dp=1 x cp=2 (2 gloo ranks) to step 3 of a 4-step epoch, resumed as one process
    (dp=1 x cp=1) to step 6: the same rows, learning rates and losses as an uninterrupted one-process run
    (losses to fp32 rounding: the first 3 steps ran under CP)."""
    from test_resume import base_args

    from speechlm.train.faults import build_command, launch, read_train_metrics

    config, *overrides = base_args(demo_data)
    overrides += ["trainer.final_eval_split=none"]
    log = tmp_path / "log.txt"
    steps = ["trainer.max_steps=6"]
    assert launch(build_command(config, [*overrides, *steps], 1, 1), tmp_path / "straight", [], log, 600) == 0
    run = tmp_path / "run"
    assert launch(build_command(config, [*overrides, "trainer.max_steps=3"], 2, 2), run, [], log, 600) == 0
    ckpt = run / "checkpoints/step_000003"
    assert data_files(ckpt) == ["data_dp00000.json"]  # written once for dp rank 0, not by its cp peer
    assert len(list((ckpt / RANK_DIR).glob("rng_rank*.pt"))) == 2
    resume = [*overrides, *steps, "trainer.resume=auto"]
    assert launch(build_command(config, resume, 1, 1), run, [], log, 600) == 0, log.read_text()[-3000:]
    assert "(optimizer step 3, epoch 0, micro-batch 6 of it; data: exact)" in log.read_text()
    a, b = read_train_metrics(tmp_path / "straight"), read_train_metrics(run)
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [m["epoch"] for m in b] == [m["epoch"] for m in a] == [0, 0, 0, 0, 1, 1]
    assert [m["rows_digest"] for m in b] == [m["rows_digest"] for m in a]
    assert [m["lr"] for m in b] == [m["lr"] for m in a]
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)
