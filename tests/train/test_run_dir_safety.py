"""A run dir is never lost or mixed (issue 20 items 1, 6, 7, 8; audit O2a-O2d, O3b, O6f, K11, K12, K14,
K15, newcomer 65/67/127/133/161): smoke-sized runs through `python -m speechlm.train`."""

from __future__ import annotations

import csv
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from helpers import run_train, train_in_process

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")


def base(d: dict[str, str], run_dir: Path, *extra: str) -> list[str]:
    return [
        SMOKE,
        f"data.train_manifest={d['train']}",
        f"data.val_manifest={d['val']}",
        f"data.tokenizer={d['tok']}",
        "trainer.final_eval_split=val",
        "trainer.max_steps=4",
        "trainer.ckpt_every=2",
        f"trainer.run_dir={run_dir}",
        *extra,
    ]


@pytest.fixture(scope="module")
def finished_run(demo_data, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (tests copy it before changing it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    r = run_train(base(demo_data, run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*")) if f.is_file()}


def csv_steps(run_dir: Path) -> list[int]:
    with (run_dir / "csv/metrics.csv").open(newline="") as f:
        return [int(float(r["step"])) for r in csv.DictReader(f) if r.get("loss")]


def train_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r["step"] for r in rows if r.get("kind") == "train"]


def test_training_in_process_gives_the_callers_sigterm_handler_back(demo_data, tmp_path, capsys):
    """The run's SIGTERM handler only sets a flag: left installed after an in-process run, a later
    fork (a multiprocessing Pool) made workers that ignore SIGTERM, and the pool's exit hung."""
    import signal

    def callers(signum, frame):  # pragma: no cover - never signalled
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, callers)
    try:
        r = train_in_process(base(demo_data, tmp_path / "run", "trainer.max_steps=1",
                                  "trainer.final_eval_split=none"), capsys)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert "step" in (tmp_path / "run" / "metrics.jsonl").read_text()
        assert signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_new_run_refuses_a_used_run_dir_and_overwrite_moves_it_aside(
    demo_data, finished_run, tmp_path, capsys
):
    run_dir = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run_dir)
    r = train_in_process(base(demo_data, run_dir, "trainer.max_steps=2", "trainer.seed=7"), capsys)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "holds another run" in r.stderr and "trainer.resume=auto" in r.stderr
    assert "trainer.overwrite=true" in r.stderr and "Traceback" not in r.stderr
    assert "model:" not in r.stdout  # refused before the model is built
    assert snapshot(run_dir) == before  # nothing touched

    r = run_train(base(demo_data, run_dir, "trainer.max_steps=2", "trainer.overwrite=true"))
    assert r.returncode == 0, r.stderr[-3000:]
    (old,) = tmp_path.glob("run.old-*")
    assert f"moved the earlier run {run_dir} to {old}" in r.stdout
    assert snapshot(old) == before  # the earlier run, whole, under its new name
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000002"]
    assert (run_dir / "checkpoints/latest").read_text() == "step_000002"
    assert train_steps(run_dir) == [1, 2]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lr=0.0001", "optim.lr: 0.003 -> 0.0001"),  # K15
        ("model.llm.hidden_size=64", "model.llm.hidden_size: 32 -> 64"),  # K12
        ("trainer.max_steps=16", "trainer.max_steps: 4 -> 16 (the learning rate of step 5"),  # newcomer 161
    ],
)
def test_a_resume_that_changes_the_optimisation_is_refused(
    demo_data, finished_run, override, expected, capsys
):
    before = snapshot(finished_run)
    r = train_in_process(base(demo_data, finished_run, "trainer.resume=auto", override), capsys)
    assert r.returncode == 3, r.stderr[-3000:]
    assert expected in r.stderr and "restore these values" in r.stderr and "Traceback" not in r.stderr
    assert "model:" not in r.stdout  # before the model is built (K12: before DCP's size mismatch)
    assert snapshot(finished_run) == before


def test_resuming_a_finished_run_keeps_its_logs_and_reports_the_whole_training_time(
    demo_data, finished_run, tmp_path
):
    run_dir = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run_dir)
    r = run_train(base(demo_data, run_dir, "trainer.resume=auto", "trainer.val_every=5"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "config changes applied" in r.stdout and "trainer.val_every: 0 -> 5" in r.stdout
    after = snapshot(run_dir)
    # newcomer 65: the finished run's eval.json (and its train_minutes) is not rewritten by a launch
    # that trains nothing
    for name in ("csv/metrics.csv", "metrics.jsonl", "eval_decodes.jsonl", "eval.json"):
        assert after[name] == before[name], name
    assert "kept as it is" in r.stdout


class Payload:
    def __init__(self, marker: Path, md):
        self.marker, self.md = str(marker), md

    def __reduce__(self):
        return (eval, (f"(open({self.marker!r}, 'w').close(), md)[1]", {"md": self.md}))


def test_payload_in_latest_metadata_and_cut_short_metrics_line_resume_from_the_previous(
    demo_data, finished_run, tmp_path
):
    """O3b with complete.json made to match (sizes and hashes), plus K11; the resumed run keeps its CSV."""
    from speechlm.train.checkpoint import sha256_of

    run_dir = copy_run(finished_run, tmp_path / "run")
    latest = run_dir / "checkpoints/step_000004"
    marker = tmp_path / "PWNED_dcp"
    md = pickle.loads((latest / ".metadata").read_bytes())
    (latest / ".metadata").write_bytes(pickle.dumps(Payload(marker, md)))
    c = json.loads((latest / "complete.json").read_text())
    c["files"][".metadata"] = (latest / ".metadata").stat().st_size
    c["sha256"][".metadata"] = sha256_of(latest / ".metadata")
    (latest / "complete.json").write_text(json.dumps(c))
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 5, "loss": 1')
    r = run_train(base(demo_data, run_dir, "trainer.resume=auto"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not marker.exists()
    assert "global 'builtins.eval' is not allowed" in r.stdout
    assert f"falling back from {latest} to {run_dir / 'checkpoints/step_000002'}" in r.stdout
    assert "is cut short" in r.stdout
    assert train_steps(run_dir) == [1, 2, 3, 4]
    assert csv_steps(run_dir) == [0, 1, 2, 3]  # Lightning's step column is the optimizer step - 1


def test_evaluation_only_into_a_new_run_dir(demo_data, finished_run, tmp_path):
    run_dir = tmp_path / "eval_new"
    ckpt = finished_run / "checkpoints/step_000004"
    r = run_train(
        base(
            demo_data, run_dir, f"trainer.resume={ckpt}", "trainer.validate_only=true", "trainer.max_steps=20"
        )
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run_dir / "eval.json").read_text())["steps"] == 4


@pytest.mark.parametrize("what", ["run_dir", "checkpoints"])
def test_a_run_dir_or_checkpoints_that_is_a_file_is_refused_before_the_model(
    demo_data, tmp_path, what, capsys
):
    run_dir = tmp_path / "run"
    if what == "run_dir":
        run_dir.write_text("")
        bad = run_dir
    else:
        run_dir.mkdir()
        bad = run_dir / "checkpoints"
        bad.write_text("")
    r = train_in_process(base(demo_data, run_dir, "trainer.ckpt_every=3"), capsys)
    assert r.returncode == 3, r.stderr[-3000:]
    # the pre-flight (speechlm/preflight/checks.py) finds it first, before any manifest is opened
    assert f"{bad} exists and is not a directory" in r.stderr and "model:" not in r.stdout


# --- without training ----------------------------------------------------------------------------------
def test_what_a_start_that_died_before_step_one_leaves_is_reused(tmp_path):
    from speechlm.train.run_dir import holds_run

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints/.tmp-step_000002").mkdir(parents=True)
    (run_dir / "checkpoints/latest").write_text("step_000002")
    (run_dir / "csv").mkdir()
    (run_dir / "config.yaml").write_text("trainer: {}\n")
    (run_dir / "metrics.jsonl").write_text("")
    assert holds_run(run_dir) == []
    assert holds_run(tmp_path / "absent") == []
    (run_dir / "checkpoints/best").mkdir()
    assert holds_run(run_dir) == [f"{run_dir / 'checkpoints'}/ (best)"]


def test_a_run_dir_that_cannot_be_written_is_an_output_error(tmp_path, monkeypatch):
    from speechlm.errors import EXIT_OUTPUT, OutputError
    from speechlm.train.run_dir import check_writable

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(OutputError, match="is not writable") as e:
        check_writable(tmp_path / "run")
    assert e.value.exit_code == EXIT_OUTPUT


def smoke_config(run_dir: Path, *overrides: str):
    from speechlm.config import load_config

    return load_config(SMOKE, [f"trainer.run_dir={run_dir}", *overrides])


def test_resume_auto_without_a_checkpoint_restarts_a_killed_launch_but_not_a_finished_run(tmp_path):
    """A job requeued with resume=auto after a kill before its first checkpoint must start again; a run
    that finished without checkpoints (eval.json) is not silently restarted over."""
    from speechlm.errors import RunDirError
    from speechlm.train.run_dir import prepare_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    assert prepare_run_dir(smoke_config(run_dir, "trainer.resume=auto"), run_dir, 0) is None
    with pytest.raises(RunDirError, match="holds another run"):
        prepare_run_dir(smoke_config(run_dir), run_dir, 0)  # a new run: the records count
    (run_dir / "eval.json").write_text("{}")
    with pytest.raises(RunDirError, match="no checkpoint to continue it from") as e:
        prepare_run_dir(smoke_config(run_dir, "trainer.resume=auto"), run_dir, 0)
    assert "trainer.overwrite=true" in str(e.value)


def test_resume_from_another_runs_checkpoint_into_a_used_run_dir_is_refused(tmp_path):
    from test_checkpoint_safety import save  # a real (small) checkpoint, no training (same folder)

    from speechlm.errors import RunDirError
    from speechlm.train.run_dir import prepare_run_dir

    other = save(tmp_path / "other/checkpoints", 2)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "eval.json").write_text("{}")
    with pytest.raises(RunDirError, match="holds another run"):
        prepare_run_dir(smoke_config(run_dir, f"trainer.resume={other}"), run_dir, 0)


def test_an_explicit_resume_is_resolved_once_per_launch(tmp_path, monkeypatch):
    """The pre-flight resolves an explicit trainer.resume (`resolve_explicit_resume`) and `prepare_run_dir`
    takes that result instead of resolving (and verifying, hashing every file) the checkpoint again."""
    from test_checkpoint_safety import save  # a real (small) checkpoint, no training (same folder)

    from speechlm.train import run_dir as run_dir_module

    run_dir = tmp_path / "run"
    ckpt = save(run_dir / "checkpoints", 2)
    cfg = smoke_config(run_dir, f"trainer.resume={ckpt}")
    assert run_dir_module.resolve_explicit_resume("auto", run_dir) is None
    assert run_dir_module.resolve_explicit_resume(None, run_dir) is None
    resolved = run_dir_module.resolve_explicit_resume(str(ckpt), run_dir)
    assert resolved == ckpt

    def resolved_again(*args, **kwargs):
        raise AssertionError("trainer.resume resolved a second time in one launch")

    monkeypatch.setattr(run_dir_module, "resolve_resume", resolved_again)
    monkeypatch.setattr(run_dir_module, "check_resume_config", lambda *a, **k: None)
    assert run_dir_module.prepare_run_dir(cfg, run_dir, 0, resolved=resolved) == ckpt
