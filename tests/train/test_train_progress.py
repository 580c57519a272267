"""What `train` shows while it runs and when it ends (issue 26, item 2): the step display on a terminal,
plain lines in logs, the end-of-run summary; and the displays of `transcribe`/`evaluate` on its checkpoint.

The smoke runs are subprocesses (configs/smoke.yaml, a few steps): one with pipes (a log), one on a
pseudo-terminal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import read_train_metrics, run_train
from test_progress_display import run_in_pty

import speechlm.progress as progress
from speechlm.train.progress import format_step_line, run_summary, step_fields

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")
STEPS = 4


def smoke_args(d: dict[str, str], run_dir: Path, steps: int = STEPS) -> list[str]:
    return [
        SMOKE,
        f"data.train_manifest={d['train']}",
        f"data.val_manifest={d['val']}",
        f"data.tokenizer={d['tok']}",
        f"trainer.max_steps={steps}",
        "trainer.val_every=2",
        "trainer.val_max_batches=1",
        "trainer.ckpt_every=2",
        f"trainer.run_dir={run_dir}",
    ]


@pytest.fixture(scope="module")
def logged_run(demo_data, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("progress") / "run"
    r = run_train(smoke_args(demo_data, run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r.stdout + r.stderr


def test_without_a_terminal_the_log_has_step_lines_and_no_display(logged_run):
    run_dir, out = logged_run
    assert "\r" not in out and "\x1b[" not in out  # no redraws in a log
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)]
    last = read_train_metrics(run_dir)[-1]
    assert f"loss {last['loss']:.4f}" in lines[-1] and f"lr {last['lr']:.3g}" in lines[-1]
    assert "ETA 0:00" in lines[-1]


def test_summary_of_a_smoke_run(logged_run):
    run_dir, out = logged_run
    summary = out[out.index(f"run summary ({run_dir})") :]
    train = read_train_metrics(run_dir)
    val = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if '"val"' in ln]
    assert f"steps: {STEPS}\n" in summary
    assert f"audio: {train[-1]['audio_hours']:.3f} h seen" in summary
    assert "wall time: " in summary and "min in all launches" in summary

    def mean(key: str) -> float:
        values = [m[key] for m in train if m.get(key) is not None]
        assert values, key  # the steps log throughput and MFU (speechlm/train/throughput.py)
        return sum(values) / len(values)

    throughput = (
        f"{mean('tokens_per_s'):,.0f} tokens/s, {mean('audio_s_per_s'):,.1f} audio s/s, "
        f"{mean('utt_per_s'):,.1f} utterances/s"
    )
    assert f"mean throughput: {throughput} (over {STEPS} logged steps)" in summary
    assert f"mean MFU: {100 * mean('mfu'):.1f}% ({mean('tflops_per_s'):.3g} TFLOP/s)" in summary
    best = min(val, key=lambda r: r["wer"])
    assert f"best validation: wer {best['wer']:.4g} at step {best['step']}" in summary
    for line in (
        f"checkpoint (latest): {run_dir / 'checkpoints' / f'step_{STEPS:06d}'}",
        f"checkpoint (best validation): {run_dir / 'checkpoints' / 'best'}",
        f"metrics: {run_dir / 'metrics.jsonl'}",
        f"final evaluation: {run_dir / 'eval.json'}",
        f"config: {run_dir / 'config.yaml'}",
    ):
        assert line in summary


@pytest.mark.slow  # a second smoke run, on a pseudo-terminal (~25 s)
def test_on_a_terminal_steps_and_final_decode_are_displayed(demo_data, tmp_path):
    rc, drawn = run_in_pty(["train", *smoke_args(demo_data, tmp_path / "run", steps=3)])
    assert rc == 0, drawn[-3000:]
    assert "\r\x1b[Ktrain [" in drawn and "3/3 steps 100%" in drawn and "ETA" in drawn
    assert "\r\x1b[Kevaluating val [" in drawn  # the final decode
    assert "\nstep 1/3" not in drawn  # no plain step lines when the display is on
    assert "run summary (" in drawn


def test_transcribe_and_evaluate_display_on_a_terminal(logged_run, demo_data, monkeypatch, capsys):
    from speechlm.cli import main

    run_dir, _ = logged_run
    monkeypatch.setattr(progress, "progress_enabled", lambda rank=0: rank == 0)
    capsys.readouterr()
    args = ["--manifest", demo_data["val"], "--max-new-tokens", "2", "--device", "cpu"]
    assert main(["transcribe", str(run_dir), *args, "--batch-size", "4"]) == 0
    out, err = capsys.readouterr()
    assert "\r\x1b[Ktranscribing [" in err and "\r" not in out  # JSON lines on stdout stay clean
    assert main(["evaluate", str(run_dir), *args]) == 0
    assert "\r\x1b[Kevaluating val [" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ pure parts
def write_metrics(run_dir: Path, lines: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines))


def test_summary_shows_throughput_and_mfu_when_the_steps_logged_them(tmp_path):
    recs = [
        {"kind": "train", "step": 1, "tokens_per_s": 1000.0, "audio_s_per_s": 20.0, "mfu": 0.30,
         "tflops_per_s": 300.0, "audio_hours": 0.5},
        {"kind": "train", "step": 2, "tokens_per_s": 3000.0, "audio_s_per_s": 40.0, "mfu": 0.40,
         "tflops_per_s": 400.0, "audio_hours": 1.25},
        {"kind": "val", "step": 2, "loss": 2.0, "wer": 0.5},
    ]  # fmt: skip
    write_metrics(tmp_path, [json.dumps(r) for r in recs])
    s = run_summary(
        tmp_path, steps=2, wall_seconds=75, train_minutes=1.0, best_metric="loss", lower_is_better=True
    )
    assert "mean throughput: 2,000 tokens/s, 30.0 audio s/s (over 2 logged steps)" in s
    assert "mean MFU: 35.0% (350 TFLOP/s)" in s
    assert "audio: 1.250 h seen" in s and "wall time: 1:15 this launch" in s
    assert "best validation: loss 2 at step 2" in s


def test_summary_skips_a_line_cut_short_by_a_kill_and_says_so(tmp_path):
    write_metrics(tmp_path, [json.dumps({"kind": "train", "step": 1, "audio_hours": 0.1}), '{"kind": "tra'])
    s = run_summary(
        tmp_path,
        steps=1,
        wall_seconds=1,
        train_minutes=0.0,
        best_metric="wer",
        lower_is_better=True,
        preempted=True,
    )
    assert "stopped by SIGTERM, resume with trainer.resume=auto" in s
    assert "audio: 0.100 h seen" in s and "best validation: none" in s
    assert f"note: 1 line(s) of {tmp_path / 'metrics.jsonl'} are not JSON records; skipped" in s


def test_step_fields_keep_small_rates_readable_and_prefer_tokens_per_s():
    f = step_fields({"loss": 3.14159, "lr": 4e-05, "tokens_per_s": 12345.6, "utt_per_s": 3.0, "mfu": 0.123})
    assert f == {"loss": "3.1416", "lr": "4e-05", "tok/s": "12,346", "MFU": "12.3%"}
    assert step_fields({"utt_per_s": None, "loss": float("nan")}) == {}
    assert format_step_line(5, 10, {"lr": 1e-3}, 50.0) == "step 5/10 (50%) · ETA 0:50 · lr 0.001"


def test_an_mfu_above_100_percent_is_flagged_not_printed_as_a_figure(tmp_path, capsys):
    """Audit PT04t: trainer.peak_tflops=1e-9 (a peak in the wrong unit) printed MFU 109185997%."""
    from speechlm.model.flops import MFU_FLAG, implausible_peak
    from speechlm.train.throughput import warn_implausible_peak

    assert step_fields({"mfu": 1091859.973}) == {"MFU": "n/a: above 100%, check trainer.peak_tflops"}
    assert step_fields({"mfu": 1.0}) == {"MFU": "100.0%"}
    write_metrics(
        tmp_path, [json.dumps({"kind": "train", "step": 1, "mfu": 1237666.794, "tflops_per_s": 0.01})]
    )
    s = run_summary(
        tmp_path, steps=1, wall_seconds=1, train_minutes=0.0, best_metric="loss", lower_is_better=True
    )
    assert f"mean MFU: {MFU_FLAG} (123766679.4%) (0.01 TFLOP/s)" in s
    # the fit-start warning: a peak no device has (given in FLOP/s or GFLOP/s), and none for real ones
    assert warn_implausible_peak(1e-9) and "trainer.peak_tflops=1e-09 TFLOP/s" in capsys.readouterr().err
    assert implausible_peak(2e15) is not None
    assert not any(warn_implausible_peak(p) for p in (None, 0.096, 989.0, 2250.0))
    assert capsys.readouterr().err == ""
