"""`evaluate` / `export` of a damaged checkpoint, and `evaluate --metric` (issue 36: UE04, UE05, UE06, EX04, EV05).

A command that only reads a checkpoint says which checkpoint, what is wrong with it and what to do (an
earlier checkpoint that verifies, by path; or restore the file, or train again): never training's
resume advice ("remove .../checkpoints to start over"). The checkpoints are written by the real atomic
save (`save_checkpoint_atomic`, a real DCP save of a small state) and then damaged as the audit did; the
refusal comes before any model is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SMOKE

from speechlm.train.checkpoint import COMPLETE_NAME, save_checkpoint_atomic


class OneProcess:
    is_global_zero, global_rank, world_size = True, 0, 1

    def barrier(self, name: str) -> None:
        pass


class SmallTrainer:
    """What `save_checkpoint_atomic` needs of a Lightning Trainer."""

    strategy = OneProcess()

    def __init__(self, step: int) -> None:
        self.global_step = step

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        from torch.distributed.checkpoint import save

        Path(path).mkdir(parents=True)
        save({"state_dict": {"w": torch.ones(256, 256)}}, checkpoint_id=path, no_dist=True)
        torch.save({"global_step": self.global_step}, Path(path) / "meta.pt")


def make_run(tmp_path: Path, *steps: int) -> Path:
    run = tmp_path / "run"
    for step in steps:
        save_checkpoint_atomic(SmallTrainer(step), run / "checkpoints", f"step_{step:06d}", data_state={})
    return run


def damage(ckpt: Path, how: str) -> str:
    """Damage `ckpt` as the audit did; the words the refusal must use for it."""
    if how == "interrupted":  # UE04 / EX04: the save never finished
        (ckpt / COMPLETE_NAME).unlink()
        return "no complete.json (the save was interrupted)"
    if how == "truncated":  # UE05
        shard = next(ckpt.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:1000])
        return "the file was truncated or altered"
    (ckpt / "meta.pt").unlink()  # UE06: a file of the checkpoint is gone
    return "meta.pt is missing: the checkpoint is incomplete"


def refusal(args: list[str], capsys) -> str:
    from speechlm.cli import main

    assert main(args) == 3
    return capsys.readouterr().err


@pytest.mark.parametrize("how", ["interrupted", "truncated", "missing"])
def test_evaluate_and_export_of_a_run_whose_only_checkpoint_is_damaged(tmp_path, capsys, how):
    run = make_run(tmp_path, 2)
    ckpt = run / "checkpoints" / "step_000002"
    what = damage(ckpt, how)
    before = sorted(p.name for p in ckpt.iterdir())
    for args in (
        ["evaluate", str(run), "--manifest", str(tmp_path / "val.parquet")],
        ["export", str(run), "--out", str(tmp_path / "export")],
    ):
        err = refusal(args, capsys)
        assert f"checkpoint {ckpt} cannot be used" in err and what in err
        assert (
            "What to do:" in err
            and "train again" in err
            and "Nothing in the run directory was changed" in err
        )
        assert "remove" not in err and "resume=auto" not in err and "Start over" not in err
    assert sorted(p.name for p in ckpt.iterdir()) == before and not (tmp_path / "export").exists()


def test_a_damaged_checkpoint_given_by_path_names_the_earlier_one_that_verifies(tmp_path, capsys):
    from speechlm.use.checkpoint import resolve_checkpoint

    run = make_run(tmp_path, 1, 2)
    good, bad = run / "checkpoints" / "step_000001", run / "checkpoints" / "step_000002"
    damage(bad, "truncated")
    err = refusal(["evaluate", str(bad), "--manifest", str(tmp_path / "val.parquet")], capsys)
    assert f"give the earlier checkpoint {good} (it verifies) by its path instead" in err
    damage(
        bad, "interrupted"
    )  # a half-written one given by path: the same, not "neither a checkpoint nor ..."
    err = refusal(["export", str(bad), "--out", str(tmp_path / "x")], capsys)
    assert "no complete.json (the save was interrupted)" in err and str(good) in err
    said: list[str] = []
    assert resolve_checkpoint(run, log=said.append) == good  # the run dir falls back by itself (UE09)
    assert any("falling back from" in m for m in said)


def test_evaluate_metric_gives_a_task_without_one_a_metric():
    """EV05: the advice named trainer.eval_metrics, which evaluate does not take; --metric is evaluate's."""
    import pyarrow as pa

    from speechlm.cli import build_parser
    from speechlm.config import load_config
    from speechlm.errors import UsageError
    from speechlm.metrics import MetricSpec
    from speechlm.use.evaluate_cli import parse_metric_arguments
    from speechlm.use.evaluation import check_tasks_have_metrics

    manifest = "caption.parquet"
    table = pa.table({"lang": ["en", "en"], "task": ["asr", "caption"]})  # what the check reads of it
    cfg = load_config(SMOKE)
    with pytest.raises(UsageError) as e:
        check_tasks_have_metrics(cfg, table, manifest)
    assert "give it one with --metric, e.g. `speechlm evaluate ... --metric caption=accuracy`" in str(e.value)
    assert "trainer.eval_metrics" not in str(e.value)

    args = build_parser().parse_args(
        ["evaluate", "run", "--manifest", manifest, "--metric", "caption=accuracy,chrf"]
    )
    cfg.trainer.eval_metrics = {**cfg.trainer.eval_metrics, **parse_metric_arguments(args.metric)}
    check_tasks_have_metrics(cfg, table, manifest)  # now it has one
    assert MetricSpec.from_config(cfg).metrics["caption"] == ("accuracy", "chrf")
    for bad in ("caption", "caption=", "caption=foo", "=wer"):
        with pytest.raises(UsageError, match="give TASK=METRIC"):
            parse_metric_arguments([bad])
