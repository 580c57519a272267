"""End-to-end training through `speechlm train`: the runs that train are subprocesses (each gets a fresh
process group); the launches refused before any model is built, and --dry-run, call the same `main` in
this process.

Covers: resume gives the same batches and losses as an uninterrupted run; SIGTERM saves a checkpoint
and exits 143; packed and padded layouts give the same per-step losses with dropout 0; the validator
stops a bad layout before any model loads; unknown overrides are rejected; the outputs a run writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import read_train_metrics as read_metrics
from helpers import run_train, train_in_process

from speechlm.config import load_config

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")


def data_overrides(d: dict[str, str]) -> list[str]:
    return [
        f"data.train_manifest={d['train']}",
        f"data.val_manifest={d['val']}",
        f"data.tokenizer={d['tok']}",
    ]


# runs whose losses are compared end without the greedy decode of a final evaluation
NO_FINAL_EVAL = ["trainer.final_eval_split=none"]


def test_resume_continues_with_same_batches_and_losses(demo_data, tmp_path):
    base = [SMOKE, *data_overrides(demo_data), "trainer.ckpt_every=3", *NO_FINAL_EVAL]
    full = run_train([*base, "trainer.max_steps=6", f"trainer.run_dir={tmp_path / 'full'}"])
    assert full.returncode == 0, full.stderr[-3000:]
    first = run_train([*base, "trainer.max_steps=3", f"trainer.run_dir={tmp_path / 'part'}"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "part/checkpoints/step_000003").is_dir()
    assert (tmp_path / "part/checkpoints/latest").read_text().strip() == "step_000003"
    resumed = run_train(
        [*base, "trainer.max_steps=6", f"trainer.run_dir={tmp_path / 'part'}", "trainer.resume=auto"]
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert [m["step"] for m in a] == [1, 2, 3, 4, 5, 6] == [m["step"] for m in b]
    for ma, mb in zip(a, b):
        assert ma["rows_digest"] == mb["rows_digest"], f"step {ma['step']}: different batches"
        assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-6), f"step {ma['step']}"
    assert b[-1]["audio_hours"] == pytest.approx(a[-1]["audio_hours"])  # counters restored too

    # evaluation only: restores the latest checkpoint, takes no optimizer step
    ev = run_train(
        [
            *base,
            "trainer.max_steps=100",
            f"trainer.run_dir={tmp_path / 'part'}",
            "trainer.resume=auto",
            "trainer.validate_only=true",
            "trainer.final_eval_split=val",
        ]
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads((tmp_path / "part/eval.json").read_text())["steps"] == 6
    assert [m["step"] for m in read_metrics(tmp_path / "part")][-1] == 6


# a constant LR after warmup: the resume below shortens max_steps, which a decaying schedule refuses (the LR
# would jump); with this one the steps trained so far had the same rates under either max_steps
FLAT_LR = ["optim.min_lr_ratio=1.0"]


def test_sigterm_saves_checkpoint_and_exits_143(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speechlm.train",
            SMOKE,
            *data_overrides(demo_data),
            "trainer.max_steps=500",
            f"trainer.run_dir={run_dir}",
            *FLAT_LR,
            *NO_FINAL_EVAL,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:]  # EXIT_SIGTERM: a scheduler sees "preempted", not success
    assert "SIGTERM: saved checkpoint" in out and "Traceback" not in out
    step = int((run_dir / "checkpoints/latest").read_text().strip().split("_")[1])
    assert 2 <= step < 500
    assert read_metrics(run_dir)[-1]["step"] == step  # the checkpoint holds the last finished step
    resumed = run_train(
        [
            SMOKE,
            *data_overrides(demo_data),
            f"trainer.max_steps={step + 2}",
            f"trainer.run_dir={run_dir}",
            "trainer.resume=auto",
            *FLAT_LR,
            *NO_FINAL_EVAL,
        ]
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)][-3:] == [step, step + 1, step + 2]


def test_packed_and_padded_give_the_same_losses(demo_data, tmp_path):
    losses = {}
    for packed in ("true", "false"):
        run_dir = tmp_path / f"packed_{packed}"
        r = run_train(
            [
                SMOKE,
                *data_overrides(demo_data),
                "trainer.max_steps=8",
                "trainer.grad_accum=1",
                "model.dropout=0",
                f"model.packed_sequences={packed}",
                f"trainer.run_dir={run_dir}",
                *NO_FINAL_EVAL,
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        losses[packed] = [m["loss"] for m in read_metrics(run_dir)]
    assert len(losses["true"]) == 8
    assert losses["false"] == pytest.approx(losses["true"], rel=1e-4)


def test_run_writes_metrics_eval_and_curve(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    r = run_train(
        [
            SMOKE,
            *data_overrides(demo_data),
            "trainer.max_steps=2",
            "trainer.val_every=1",
            "trainer.val_max_batches=1",
            "trainer.final_eval_split=val",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    train = read_metrics(run_dir)
    assert {"step", "loss", "ce", "ctc", "lr", "utt_per_s", "audio_hours", "grad_norm"} <= set(train[-1])
    assert {"tokens_per_s", "mfu", "real_token_share", "rss_gib", "data_wait_s", "optim_s", "step_s"} <= set(
        train[-1]
    )
    assert train[-1]["tokens_per_s"] * train[-1]["step_s"] == pytest.approx(train[-1]["real_tokens"])
    vals = [
        json.loads(ln)
        for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(ln).get("kind") == "val"
    ]
    assert [v["step"] for v in vals] == [1, 2] and all("wer" in v for v in vals)
    ev = json.loads((run_dir / "eval.json").read_text())
    assert ev["split"] == "val" and "wer" in ev and any(k.startswith("wer_") for k in ev)
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert (run_dir / "eval_decodes.jsonl").read_text().count("\n") == 12  # every val utterance decoded
    assert (run_dir / "checkpoints/best").is_dir()
    assert "final greedy WER" in r.stdout


def test_validator_stops_bad_layout_before_model_load(demo_data, capsys):
    r = train_in_process(
        [SMOKE, *data_overrides(demo_data), "model.packed_sequences=false", "--cp-size", "2"], capsys
    )
    assert r.returncode == 1
    assert "bshd-with-cp" in r.stdout + r.stderr
    assert "parameters" not in r.stdout  # no model was built


def test_unknown_override_is_rejected(demo_data, capsys):
    r = train_in_process([SMOKE, "trainer.max_stepz=3"], capsys)
    assert r.returncode == 2
    assert "trainer.max_stepz" in r.stderr


def test_dry_run_prints_layout_and_config(demo_data, capsys):
    r = train_in_process([SMOKE, *data_overrides(demo_data), "--dry-run"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layout: world=1" in r.stdout and "optimizer steps per epoch" in r.stdout
    assert "packed_sequences: true" in r.stdout


def test_launch_warns_when_the_lockstep_trims_drop_much(demo_data, capsys):
    """newcomer 40/136: training at a layout that leaves out a large part of every epoch says so."""
    r = train_in_process([SMOKE, *data_overrides(demo_data), "trainer.grad_accum=16", "--dry-run"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "WARNING: the lockstep trims drop" in r.stderr and "trainer.grad_accum" in r.stderr
    r = train_in_process([SMOKE, *data_overrides(demo_data), "trainer.grad_accum=1", "--dry-run"], capsys)
    assert r.returncode == 0 and "lockstep trims" not in r.stderr


@pytest.mark.slow
def test_short_demo_loss_falls(demo_data, tmp_path):
    """A shortened demo (the demo model, 300 steps, past the CTC blank plateau): the loss falls substantially."""
    run_dir = tmp_path / "demo"
    r = run_train(
        [
            str(REPO / "configs/demo.yaml"),
            *data_overrides(demo_data),
            "trainer.max_steps=300",
            "trainer.val_every=0",
            "trainer.ckpt_every=0",
            "trainer.final_eval_split=val",
            f"trainer.run_dir={run_dir}",
        ],
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_metrics(run_dir)

    def mean(key: str, part: list[dict]) -> float:
        return sum(x[key] for x in part) / len(part)

    # measured: text CE 5.6 -> 0.5 and total loss 38 -> 24 (CTC still on its blank plateau at step 300)
    assert mean("ce", m[-10:]) < 0.25 * mean("ce", m[:5])
    assert mean("loss", m[-10:]) < 0.75 * mean("loss", m[:5])


def test_max_minutes_stops_training(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    r = run_train(
        [
            SMOKE,
            *data_overrides(demo_data),
            "trainer.max_steps=100000",
            "trainer.max_minutes=0.05",
            "trainer.final_eval_split=val",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert 1 <= len(steps) < 100000 and steps == list(range(1, len(steps) + 1))
    assert json.loads((run_dir / "eval.json").read_text())["steps"] == len(steps)


def test_run_logs_the_lr_each_step_used_and_no_known_notices(demo_data, tmp_path):
    """newcomer: every run printed Lightning's litlogger tip, "TPU available", torch's LeafSpec deprecation
    and DCP's one-process note; and the logged lr of step n is the rate step n used (docs/training.md)."""
    run_dir = tmp_path / "run"
    r = run_train(
        [SMOKE, *data_overrides(demo_data), "trainer.max_steps=3", "trainer.ckpt_every=2",
         "optim.warmup_steps=4", f"trainer.run_dir={run_dir}", *NO_FINAL_EVAL]
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "checkpoints/step_000002").is_dir()  # a one-process DCP save happened
    output = r.stdout + r.stderr
    for notice in ("litlogger", "TPU available", "LeafSpec", "assuming the intent is to save"):
        assert notice not in output, notice
    assert "GPU available" in output  # other Lightning lines stay
    base = load_config(SMOKE).optim.lr
    assert [m["lr"] for m in read_metrics(run_dir)] == pytest.approx([base * n / 4 for n in (1, 2, 3)])
