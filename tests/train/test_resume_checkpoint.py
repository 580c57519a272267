"""Checkpoint files without training: completeness, safe loading, clear errors, per-rank state."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from speechlm.errors import OutputError
from speechlm.train.checkpoint import (
    COMPLETE_NAME,
    CheckpointError,
    capture_rng_state,
    latest_checkpoint,
    list_files,
    resolve_resume,
    restore_rng_state,
    verify_checkpoint,
    write_rank_state,
)


def make_checkpoint(root, step: int, *, complete: bool = True):
    d = root / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    torch.save({"global_step": step, "speechlm": {"dropped": {}}}, d / "meta.pt")
    (d / "__0_0.distcp").write_bytes(b"x" * 1000)
    write_rank_state(d, 0, {"epoch": 1, "position": 2})
    if complete:
        (d / COMPLETE_NAME).write_text(json.dumps({"step": step, "world_size": 1, "files": list_files(d)}))
    return d


class RunsCode:
    def __reduce__(self):
        return (print, ("this ran at load time",))


def test_tampered_meta_is_refused_without_running_code(tmp_path, capsys):
    d = make_checkpoint(tmp_path, 4)
    payload = pickle.dumps({"global_step": 4, "x": RunsCode()})
    (d / "meta.pt").write_bytes(payload)
    (d / COMPLETE_NAME).write_text(json.dumps({"step": 4, "files": list_files(d)}))  # sizes made to match
    with pytest.raises(CheckpointError, match=r"meta\.pt cannot be loaded safely \(weights_only=True\)"):
        verify_checkpoint(d)
    assert "this ran at load time" not in capsys.readouterr().out


def test_truncated_shard_is_named_and_previous_checkpoint_suggested(tmp_path):
    make_checkpoint(tmp_path, 2)
    d = make_checkpoint(tmp_path, 4)
    (d / "__0_0.distcp").write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is 10 bytes, 1000 when saved") as e:
        resolve_resume(str(d), tmp_path)
    assert "trainer.resume=" in str(e.value) and "step_000002" in str(e.value)


def test_auto_skips_incomplete_checkpoints_and_says_so(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, complete=False)  # killed before complete.json (a rename cannot half-happen)
    (tmp_path / "checkpoints/latest").write_text("step_000004")
    said: list[str] = []
    assert resolve_resume("auto", tmp_path, log=said.append).name == "step_000002"
    assert "step_000004" in said[0] and "incomplete" in said[0]
    assert len(said) == 2 and "falling back from" in said[1]  # names both (issue 20)


def test_auto_refuses_to_start_over_when_no_checkpoint_verifies(tmp_path):
    make_checkpoint(tmp_path, 2, complete=False)  # e.g. written by an older version, or altered
    with pytest.raises(CheckpointError, match=r"none of the 1 checkpoints .* can be resumed from"):
        resolve_resume("auto", tmp_path, log=lambda _m: None)
    assert resolve_resume("auto", tmp_path / "fresh") is None  # no checkpoints at all: a fresh start


def test_auto_prefers_the_latest_pointer(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 8)  # left by an earlier run in the same run dir
    (tmp_path / "checkpoints/latest").write_text("step_000002")
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_000002"


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def make_loader(dp_rank=0, dp_size=1, seed=0):
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings
    from speechlm.train.data import StepLoader

    rng = np.random.default_rng(0)
    durations = rng.uniform(1, 10, 200).astype(np.float32)
    settings = SamplerSettings(dp_size=dp_size, grad_accum=2, max_batch_duration=60.0, seed=seed)
    sampler = DurationBucketBatchSampler(
        durations, np.zeros(200, np.int32), ["en"], settings, dp_rank=dp_rank
    )
    return StepLoader(sampler, None, grad_accum=2, seed=seed, dp_rank=dp_rank)


def test_data_state_is_the_consumed_position_and_json():
    loader = make_loader()
    loader.sampler.seek(0, 6)  # the DataLoader has read ahead ...
    loader.mark_consumed({"epoch": 0, "position": 4})  # ... but training consumed 4 micro-batches
    state = json.loads(json.dumps(loader.state_dict()))
    assert (state["epoch"], state["position"], state["dp_rank"], state["dp_size"]) == (0, 4, 0, 1)
    assert state["manifest"]["rows"] == 200 and state["params"]["grad_accum"] == 2
    other = make_loader()
    other.restore(state)
    assert (other.sampler.epoch, other.sampler.position) == (0, 4)
    nxt = make_loader()
    nxt.restore(state, next_epoch=True)
    assert (nxt.sampler.epoch, nxt.sampler.position) == (1, 0)


def test_data_state_refuses_another_layout_or_seed():
    state = make_loader(dp_rank=0, dp_size=1).state_dict()
    with pytest.raises(ValueError, match="dp_size"):
        make_loader(dp_rank=0, dp_size=2).restore(state)
    with pytest.raises(ValueError, match="seed"):
        make_loader(seed=1).restore(state)


class FakeStrategy:
    is_global_zero, global_rank, world_size = True, 0, 1

    def barrier(self, name: str) -> None:
        pass


class FakeTrainer:
    """What save_checkpoint_atomic needs of a Lightning Trainer; `fail` simulates a full disk."""

    def __init__(self, step: int, fail: bool = False):
        self.strategy, self.global_step, self.fail = FakeStrategy(), step, fail

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        d = Path(path)
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x" * 100)
        if self.fail:
            raise OSError(28, "No space left on device")
        torch.save({"global_step": self.global_step}, d / "meta.pt")


def test_save_marks_complete_and_keeps_last(tmp_path):
    from speechlm.train.checkpoint import save_checkpoint_atomic

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save_checkpoint_atomic(
            FakeTrainer(step), root, f"step_{step:06d}", keep_last=2, data_state={"epoch": 0}, run_id="r"
        )
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000004", "step_000006"]
    assert verify_checkpoint(root / "step_000006")["step"] == 6
    assert (root / "latest").read_text() == "step_000006"


def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path):
    from speechlm.train.checkpoint import save_checkpoint_atomic

    root = tmp_path / "checkpoints"
    save_checkpoint_atomic(FakeTrainer(2), root, "step_000002", keep_last=1)
    with pytest.raises(OutputError, match="No space left"):  # exit 4, naming the kept one (issue 20)
        save_checkpoint_atomic(FakeTrainer(4, fail=True), root, "step_000004", keep_last=1)
    assert not (root / "step_000004").exists() and not (root / ".tmp-step_000004/complete.json").exists()
    assert (root / "latest").read_text() == "step_000002"
    assert resolve_resume("auto", tmp_path).name == "step_000002"
