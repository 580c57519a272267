"""Checkpoint safety without training: rotation limited to this run, atomic re-save of `best`, DCP
metadata that cannot run code, SHA-256 verification with fallback, disk full, metrics.jsonl cut short,
and the config comparison of a resume (issue 20 items 1, 4, 6, 7)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from speechlm.errors import EXIT_OUTPUT, EXIT_RUN_DIR, OutputError
from speechlm.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    resolve_resume,
    rotate_checkpoints,
    save_checkpoint_atomic,
    verify_checkpoint,
)


class FakeStrategy:
    is_global_zero, global_rank, world_size = True, 0, 1

    def barrier(self, name: str) -> None:
        pass


class FakeTrainer:
    """What save_checkpoint_atomic needs of a Lightning Trainer: a real DCP save of a small state."""

    def __init__(self, step: int, fail: BaseException | None = None):
        self.strategy, self.global_step, self.fail = FakeStrategy(), step, fail

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        from torch.distributed.checkpoint import save

        d = Path(path)
        d.mkdir(parents=True)
        state = {"state_dict": {"w": torch.full((64, 64), float(self.global_step))}}
        save(state, checkpoint_id=d, no_dist=True)
        if self.fail is not None:
            raise self.fail
        torch.save({"global_step": self.global_step}, d / "meta.pt")


def save(root: Path, step: int, run_id: str | None = "run-a", keep_last: int | None = None) -> Path:
    return save_checkpoint_atomic(
        FakeTrainer(step),
        root,
        f"step_{step:06d}",
        keep_last=keep_last,
        data_state={"epoch": 0},
        run_id=run_id,
    )


# --- rotation (item 2, TC07) ---------------------------------------------------------------------------
def test_rotation_deletes_only_this_runs_checkpoints_and_keeps_its_highest(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 10, run_id="other-run")  # an earlier run's checkpoints, higher steps than ours
    save(root, 12, run_id="other-run")
    save(root, 8, run_id=None)  # written before checkpoints carried a run id
    for step in (2, 4, 6):
        save(root, step, run_id="ours", keep_last=2)
    names = sorted(p.name for p in root.glob("step_*"))
    assert names == ["step_000004", "step_000006", "step_000008", "step_000010", "step_000012"]
    assert (root / "latest").read_text() == "step_000006"


def test_rotation_never_deletes_what_latest_names(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save(root, step, run_id="ours")
    (root / "latest").write_text("step_000002")
    assert rotate_checkpoints(root, 1, "ours") == [root / "step_000004"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000006"]


@pytest.mark.parametrize("keep_last", [0, -1, None])
def test_keep_last_below_one_keeps_every_checkpoint(tmp_path, keep_last):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        save(root, step, keep_last=keep_last)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]


# --- atomic re-save of best (item 3) ---------------------------------------------------------------------
def test_best_survives_a_kill_between_its_two_renames(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint_atomic(FakeTrainer(2), root, "best", update_latest=False, run_id="r")
    real_replace, calls = os.replace, []

    def killed_at_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_second_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint_atomic(FakeTrainer(4), root, "best", update_latest=False, run_id="r")
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (root / "best").exists()  # the state the kill left: old best renamed away, new not in
    found = resolve_resume(str(root / "best"), tmp_path)  # a reader still finds a complete best
    assert verify_checkpoint(found)["step"] == 2
    # and the next save of best does not delete the only complete one before writing the new one
    save_checkpoint_atomic(FakeTrainer(6), root, "best", update_latest=False, run_id="r")
    assert verify_checkpoint(root / "best")["step"] == 6
    assert not (root / ".old-best").exists()


# --- DCP metadata loads no code (item 4, O3b) ---------------------------------------------------------
class Payload:
    def __init__(self, marker: Path, md):
        self.marker, self.md = str(marker), md

    def __reduce__(self):
        return (eval, (f"(open({self.marker!r}, 'w').close(), md)[1]", {"md": self.md}))


def plant_payload(ckpt: Path, marker: Path) -> None:
    """What audits/repro/o3b_payload.py does, with complete.json (sizes and hashes) made to match."""
    from speechlm.train.checkpoint import COMPLETE_NAME, sha256_of

    md = pickle.loads((ckpt / ".metadata").read_bytes())
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker, md)))
    c = json.loads((ckpt / COMPLETE_NAME).read_text())
    c["files"][".metadata"] = (ckpt / ".metadata").stat().st_size
    c["sha256"][".metadata"] = sha256_of(ckpt / ".metadata")
    (ckpt / COMPLETE_NAME).write_text(json.dumps(c))


def test_dcp_metadata_payload_does_not_run_and_auto_falls_back(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 2)
    bad = save(root, 4)
    marker = tmp_path / "PWNED_dcp"
    plant_payload(bad, marker)
    said: list[str] = []
    assert latest_checkpoint(root, log=said.append) == root / "step_000002"
    assert not marker.exists()
    assert any(".metadata cannot be loaded safely" in m and "builtins.eval" in m for m in said)
    assert any("falling back from" in m and "step_000004" in m and "step_000002" in m for m in said)


def test_dcp_load_through_the_safe_reader_refuses_a_payload(tmp_path):
    import torch.distributed.checkpoint as dcp

    from speechlm.train.checkpoint import safe_storage_reader

    ckpt = save(tmp_path / "checkpoints", 2)
    state = {"state_dict": {"w": torch.zeros(64, 64)}}
    dcp.load(state, storage_reader=safe_storage_reader(ckpt), no_dist=True)  # an honest one loads
    assert float(state["state_dict"]["w"][0, 0]) == 2.0
    marker = tmp_path / "PWNED_dcp"
    plant_payload(ckpt, marker)
    with pytest.raises(BaseException) as e:  # DCP wraps it in its CheckpointException (a BaseException)
        dcp.load(state, storage_reader=safe_storage_reader(ckpt), no_dist=True)
    assert ".metadata cannot be loaded safely" in str(e.value) + repr(getattr(e.value, "failures", ""))
    assert not marker.exists()


# --- SHA-256 verification and fallback (item 5, O6b, K17) -----------------------------------------------
def corrupt_same_size(f: Path) -> None:
    b = bytearray(f.read_bytes())
    for i in range(len(b) // 3, len(b) // 2):
        b[i] ^= 0xFF
    f.write_bytes(bytes(b))


@pytest.mark.parametrize(
    "victim", ["__0_0.distcp", "speechlm/data_dp00000.json", "speechlm/rng_rank00000.pt"]
)
def test_same_size_corruption_is_found_and_auto_falls_back_naming_both(tmp_path, victim):
    root = tmp_path / "checkpoints"
    save(root, 2)
    bad = save(root, 4)
    corrupt_same_size(bad / victim)
    said: list[str] = []
    assert resolve_resume("auto", tmp_path, log=said.append) == root / "step_000002"
    assert any(f"{victim} does not match the SHA-256" in m for m in said)
    assert any("falling back from" in m and "step_000004" in m and "step_000002" in m for m in said)


def test_explicit_resume_that_fails_verification_names_the_previous_complete_one(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 2)
    incomplete = save(root, 4)
    (incomplete / "complete.json").unlink()
    bad = save(root, 6)
    corrupt_same_size(bad / "__0_0.distcp")
    with pytest.raises(CheckpointError) as e:
        resolve_resume(str(bad), tmp_path)
    assert e.value.exit_code == EXIT_RUN_DIR
    assert "does not match the SHA-256" in str(e.value) and f"trainer.resume={root / 'step_000002'}" in str(
        e.value
    )


def test_missing_resume_path_is_a_run_dir_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint directory there"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


# --- disk full during a save (item 8, K16) ----------------------------------------------------------------
def test_disk_full_is_an_output_error_naming_the_checkpoint_and_keeping_the_previous(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    root = tmp_path / "checkpoints"
    save(root, 2)
    enospc = OSError(28, "No space left on device")
    for fail in (enospc, CheckpointException("save", {0: (enospc, "tb")})):  # plain, and as DCP wraps it
        with pytest.raises(OutputError) as e:
            save_checkpoint_atomic(FakeTrainer(4, fail=fail), root, "step_000004", run_id="run-a")
        msg = str(e.value)
        assert e.value.exit_code == EXIT_OUTPUT
        assert "step_000004" in msg and "No space left" in msg and f"{root / 'step_000002'} is kept" in msg
        assert not (root / ".tmp-step_000004").exists() and not (root / "step_000004").exists()
    assert resolve_resume("auto", tmp_path).name == "step_000002"


def test_a_bug_during_save_is_not_disguised_as_an_output_error(tmp_path):
    with pytest.raises(ZeroDivisionError):
        save_checkpoint_atomic(FakeTrainer(2, fail=ZeroDivisionError()), tmp_path / "c", "step_000002")


# --- metrics.jsonl cut short (K11) ---------------------------------------------------------------------------
def test_a_cut_short_last_metrics_line_is_dropped_with_a_note(tmp_path, capsys):
    from speechlm.train.callbacks import MetricsWriter

    w = MetricsWriter(tmp_path)
    for step in (1, 2, 3):
        w.write({"kind": "train", "step": step, "loss": 1.0})
    with w.path.open("a") as f:
        f.write('{"kind": "train", "step": 4, "loss": 1')
    w.truncate_after(2)
    assert [json.loads(ln)["step"] for ln in w.path.read_text().splitlines()] == [1, 2]
    assert "line 4 is cut short" in capsys.readouterr().out


def test_a_bad_metrics_line_in_the_middle_is_a_clear_error(tmp_path):
    from speechlm.errors import RunDirError
    from speechlm.train.callbacks import MetricsWriter

    w = MetricsWriter(tmp_path)
    w.path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(RunDirError, match=r"metrics\.jsonl line 2 is not a metrics record"):
        w.truncate_after(2)


# --- the config of a resume (item 6, K15, K12, newcomer 161) -----------------------------------------------
def test_config_changes_that_alter_the_optimisation_are_refused_others_applied():
    from speechlm.config import ExperimentConfig, to_dict
    from speechlm.train.run_dir import compare_resume_config

    old = to_dict(ExperimentConfig())
    new = to_dict(ExperimentConfig())
    new["optim"]["lr"] = old["optim"]["lr"] / 30
    new["trainer"]["max_steps"] = 16
    new["model"]["llm"]["hidden_size"] = 64
    new["trainer"]["val_every"] = 7
    new["trainer"]["run_dir"] = "runs/elsewhere"
    new["data"]["num_workers"] = 3
    refused, applied = compare_resume_config(old, new, validate_only=False, resume_data="exact")
    assert [r.split(":")[0] for r in refused] == ["model.llm.hidden_size", "optim.lr", "trainer.max_steps"]
    assert f"optim.lr: {old['optim']['lr']!r} -> {new['optim']['lr']!r}" in refused
    assert sorted(a.split(":")[0] for a in applied) == [
        "data.num_workers",
        "trainer.run_dir",
        "trainer.val_every",
    ]
    # evaluation only: only the model must match
    refused, _ = compare_resume_config(old, new, validate_only=True, resume_data="exact")
    assert [r.split(":")[0] for r in refused] == ["model.llm.hidden_size"]


def test_data_plan_changes_are_accepted_with_next_epoch_only():
    from speechlm.config import ExperimentConfig, to_dict
    from speechlm.train.run_dir import compare_resume_config

    old = to_dict(ExperimentConfig())
    new = to_dict(ExperimentConfig())
    new["sampler"]["seed"] = 7
    assert compare_resume_config(old, new, validate_only=False, resume_data="exact")[0] == [
        "sampler.seed: 0 -> 7"
    ]
    assert compare_resume_config(old, new, validate_only=False, resume_data="next_epoch")[0] == []


# --- eval.json's train_minutes on resume (newcomer 65) ----------------------------------------------------
def test_training_time_is_carried_across_launches(tmp_path):
    from types import SimpleNamespace

    from speechlm.train.callbacks import CheckpointCallback
    from speechlm.train.recipe import total_train_minutes

    cb = CheckpointCallback(tmp_path, every=0)
    cb.load_state_dict({"train_seconds": 120.0})  # what the resumed checkpoint's meta.pt holds
    cb.on_train_start(SimpleNamespace(global_step=0), None)
    assert cb.state_dict()["train_seconds"] >= 120.0
    assert total_train_minutes(SimpleNamespace(callbacks=[cb]), 60.0) == pytest.approx(3.0)
    fresh = CheckpointCallback(tmp_path, every=0)
    assert fresh.state_dict() == {"train_seconds": 0.0}
