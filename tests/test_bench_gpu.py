"""`speechlm bench gpu` (benchmarks/bench_gpu.py) on a CPU: the dry run's plan and budget, and the runner with
fake steps (a failure and a timeout are recorded and the later steps still run; results written per step)."""

from __future__ import annotations

import json
import sys

import pytest

from speechlm.cli import main as cli_main
from speechlm.preflight.bench import load_benchmark

bench = load_benchmark("gpu")


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_dry_run_prints_the_plan_in_order_with_its_budget(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--dry-run", "--budget-s", "270"]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    names = [s["name"] for s in data["steps"]]
    assert names == ["kit", "attention", "mfu", "recipe", "long-clip"]
    # the shares of the 540 s plan, halved for a 270 s budget
    assert [s["share_s"] for s in data["steps"]] == [45, 35, 75, 85, 30]
    assert data["budget_s"] == 270 and data["dry_run"] is True
    # every command exists in this build (the recipe may lack its wheels or config here: a skip, not a defect)
    statuses = {s["name"]: s["status"] for s in data["steps"]}
    assert all(statuses[n] == "ready" for n in ("kit", "attention", "mfu", "long-clip")), statuses
    assert statuses["recipe"] in ("ready", "would skip here")
    assert "total budget 270 s (shares 45 + 35 + 75 + 85 + 30)" in out
    for command in ("-m pytest -m gpu -n 0", "speechlm bench attention", "speechlm bench mfu --size 1b --device cuda",
                    "speechlm bench pretrained-lora --config", "--steps 500 --precision bf16",
                    "speechlm evaluate", "--ctc-weight 0", "speechlm bench long-clip 30 --contexts limited"):  # fmt: skip
        assert command in out, command
    assert out.index("[1] kit") < out.index("[2] attention") < out.index("[3] mfu") < out.index("[4] recipe")
    assert "| recipe |" in (tmp_path / "gpu_acceptance.md").read_text()


def test_dry_run_names_a_command_that_does_not_exist(tmp_path, capsys):
    steps = [
        bench.Step(
            "fine", "exists", 1.0, (bench.Command(py("0"), probes=(bench.probe_cli("bench", "mfu"),)),)
        ),
        bench.Step(
            "gone", "missing", 1.0, (bench.Command(py("0"), probes=(bench.probe_cli("no-such-command"),)),)
        ),
    ]
    assert bench.main(["--out", str(tmp_path), "--dry-run"], steps=steps) == 1
    out = capsys.readouterr().out
    assert "MISSING: `speechlm no-such-command --help` exits 2" in out
    statuses = [s["status"] for s in json.loads((tmp_path / "gpu_acceptance.json").read_text())["steps"]]
    assert statuses == ["ready", "missing"]


def test_without_cuda_the_run_is_refused_with_a_clear_error(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "gpu", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "sees no CUDA device here" in err and "--dry-run" in err
    assert not (tmp_path / "gpu_acceptance.json").exists()


def test_a_failing_and_a_timed_out_step_are_recorded_and_later_steps_still_run(tmp_path, capsys):
    snapshot = tmp_path / "seen_by_third.json"
    copy = f"import shutil; shutil.copy({str(tmp_path / 'gpu_acceptance.json')!r}, {str(snapshot)!r})"
    write = f"import json; json.dump({{'speed': 12.5}}, open({str(tmp_path / 'third.json')!r}, 'w'))"
    steps = [
        bench.Step("fails", "exits 3", 2.0, (bench.Command(py("import sys; print('boom'); sys.exit(3)")),)),
        bench.Step("hangs", "sleeps past its time", 2.0, (bench.Command(py("import time; time.sleep(60)")),)),
        bench.Step(
            "third", "runs after them", 20.0,
            (bench.Command(py(copy)), bench.Command(py(write))),
            figures=lambda out: json.loads((out / "third.json").read_text()),
        ),
        bench.Step("absent", "cannot run here", 1.0, (bench.Command(py("0")),), requires=lambda: "no wheel here"),
    ]  # fmt: skip
    head = {"date": "d", "device": "fake GPU", "torch": "t", "cuda": "c", "python": "p", "commit": "x",
            "dry_run": False}  # fmt: skip
    assert bench.run_plan(steps, tmp_path, 25.0, head) == 1
    data = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    rec = {s["name"]: s for s in data["steps"]}
    assert (rec["fails"]["status"], rec["fails"]["returncode"]) == ("failed", 3)
    assert "exited 3" in rec["fails"]["reason"]
    assert "boom" in (tmp_path / "logs/fails.log").read_text()
    assert rec["hangs"]["status"] == "timeout" and rec["hangs"]["seconds"] < 10
    # its own share of 2 s plus what the failing step left unused: 25 - 20 - 1 - (time of the first step)
    assert 2.0 <= rec["hangs"]["timeout_s"] <= 4.0
    assert rec["third"]["status"] == "ok" and rec["third"]["figures"] == {"speed": 12.5}
    assert rec["third"]["timeout_s"] >= 20.0
    assert (rec["absent"]["status"], rec["absent"]["reason"]) == ("skipped", "no wheel here")
    # the results were on disk before the third step ran: the first two finished, the rest pending
    seen = [s["status"] for s in json.loads(snapshot.read_text())["steps"]]
    assert seen == ["failed", "timeout", "pending", "pending"]
    md = (tmp_path / "gpu_acceptance.md").read_text()
    assert "| third | ok |" in md and "speed 12.5" in md and "| absent | skipped |" in md
    assert "fake GPU" in md and "budget 25 s" in md


def test_kit_figures_count_the_junit_results(tmp_path):
    (tmp_path / "kit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu_kit" name="test_a"/>'
        '<testcase classname="tests.test_gpu_kit" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu_kit" name="test_c"><skipped message="no flash"/></testcase>'
        '<testcase classname="tests.test_gpu_kit" name="test_d"><error message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert bench.kit_figures(tmp_path) == {
        "passed": 1,
        "failed": 2,
        "skipped": 1,
        "failed_tests": ["tests.test_gpu_kit::test_b", "tests.test_gpu_kit::test_d"],
    }


@pytest.mark.parametrize("budget", [540.0, 100.0])
def test_the_shares_add_up_to_the_budget(budget, tmp_path):
    shares = bench.step_timeouts(bench.gpu_steps(tmp_path), budget)
    assert sum(shares) == pytest.approx(budget)
