"""Every command's help and user errors are clear (issue 20, item 3; newcomer rows 13, 15, 25-28, 35, 41,
125/162), user errors raised inside Lightning's fit reach `run_guarded` as themselves, and
docs/errors.md lists exactly the exit codes of `speechlm.errors`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from speechlm.cli import main
from speechlm.errors import EXIT_CODES, DataError

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code in (0, None)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return out


def test_bench_manifest_memory_help_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """newcomer 25/35: its main() took no argv, so `speechlm bench manifest-memory` was a TypeError."""
    out = help_text(capsys, "bench", "manifest-memory", "--help")
    assert out.startswith("usage: speechlm bench manifest-memory")
    assert "--rows" in out


@pytest.mark.parametrize("name", ["index-memory", "plan-memory", "read-throughput", "sampler"])
def test_bench_usage_names_the_subcommand(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """newcomer 26-28: the usage line said `speechlm [-h]`."""
    out = help_text(capsys, "bench", name, "--help")
    assert out.startswith(f"usage: speechlm bench {name}"), out.splitlines()[0]


def test_bench_manifest_memory_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    """newcomer 35: the README's small run finishes (it failed before doing anything)."""
    assert main(["bench", "manifest-memory", "--rows", "2000", "--dict-rows", "200"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_faults_help_shows_the_whole_description(capsys: pytest.CaptureFixture[str]) -> None:
    """newcomer 13: the description ended mid-sentence; the fault kinds and defaults were missing."""
    out = help_text(capsys, "faults", "--help")
    for kind in ("sigterm@N", "sigkill@N", "sigkill_in_save@N", "sigterm_in_val@N"):
        assert kind in out
    assert "straight/" in out and "interrupted/" in out
    assert "runs/faults" in out  # the --run-root default


def test_demo_help_has_a_description_and_option_help(capsys: pytest.CaptureFixture[str]) -> None:
    """newcomer 15: no description; --shards/--config had no help."""
    out = help_text(capsys, "demo", "--help")
    assert "Quick start" in out and "tokenizer" in out
    flat = " ".join(out.split())
    assert re.search(r"--shards SHARDS\s+\S", out) and re.search(r"--config CONFIG\s+\S", out)
    assert "demo.yaml" in flat and "data/demo/shards" in flat


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_plan_into_a_closed_pipe_prints_no_traceback(demo_data: dict[str, str]) -> None:
    """newcomer 125/162: `speechlm plan ... | head -3` gave a BrokenPipeError traceback."""
    cmd = [sys.executable, "-m", "speechlm", "plan", "--config", SMOKE, "--manifest", demo_data["train"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as `head -1` does
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert first, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert rc == 0, err


def test_readme_input_cfg_example_names_a_file_that_exists() -> None:
    """newcomer 41: the README's `--input-cfg mix.yaml` named a file that neither ships nor is shown."""
    readme = (REPO / "README.md").read_text()
    names = re.findall(r"--input-cfg\s+(\S+)", readme)
    assert names
    for name in names:
        assert (REPO / name).is_file(), f"README's --input-cfg {name} does not exist"


def test_the_example_mix_loads(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    entries = yaml.safe_load((REPO / "configs" / "mix_example.yaml").read_text())
    assert isinstance(entries, list) and all("path" in e and "weight" in e for e in entries)


def test_user_error_inside_fit_reaches_run_guarded(
    demo_data: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A DataError raised inside Lightning's fit (e.g. by the loader) is printed as itself, exit 1."""
    from speechlm.train.module import SpeechLLMModule

    def bad_step(self, batch, batch_idx):  # noqa: ANN001, ANN202
        raise DataError("manifest m.parquet, row 3: a bad clip; fix the row")

    monkeypatch.setattr(SpeechLLMModule, "training_step", bad_step)
    rc = main(
        [
            "train",
            SMOKE,
            f"data.train_manifest={demo_data['train']}",
            f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.max_steps=1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "error: manifest m.parquet, row 3: a bad clip; fix the row" in err
    assert "Traceback" not in err and "internal error" not in err


def test_errors_doc_lists_exactly_the_exit_codes() -> None:
    """docs/errors.md's table of exit codes is speechlm.errors.EXIT_CODES, no more, no less."""
    text = (REPO / "docs" / "errors.md").read_text()
    rows = re.findall(r"^\|\s*(\d+)\s*\|", text, flags=re.MULTILINE)
    assert sorted(int(r) for r in rows) == sorted(EXIT_CODES)
    assert "SPEECHLM_DEBUG" in text and "--debug" in text
    readme = (REPO / "README.md").read_text()
    assert "docs/errors.md" in readme


def test_faults_never_deletes_a_run_root_it_did_not_write(tmp_path: Path, capsys) -> None:
    """`speechlm faults --run-root DIR` used to rmtree DIR whatever it held (another run's checkpoints)."""
    from speechlm.cli import main

    root = tmp_path / "precious"
    (root / "checkpoints" / "step_000010").mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    rc = main(["faults", "configs/smoke.yaml", "--kill", "sigterm@2", "--run-root", str(root)])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "nothing was deleted" in err and "checkpoints" in err
    assert (root / "checkpoints" / "step_000010").is_dir() and (root / "metrics.jsonl").exists()


def test_faults_replaces_only_an_earlier_scenarios_output(tmp_path: Path) -> None:
    from speechlm.train.faults import clear_run_root

    root = tmp_path / "faults"
    (root / "straight").mkdir(parents=True)
    (root / "interrupted").mkdir()
    (root / "report.json").write_text("{}")
    clear_run_root(root)
    assert not root.exists()


def test_demo_run_twice_moves_the_first_run_aside(tmp_path: Path, monkeypatch) -> None:
    """The Quick start's `speechlm demo`, run a second time, must not stop on its own earlier run (a used
    run dir is refused for plain `train`): the demo moves it to RUN_DIR.old-<time> and keeps it."""
    monkeypatch.chdir(tmp_path)
    shards = str(Path(__file__).resolve().parents[2] / "data/demo/shards")  # the small bundled corpus
    args = [
        "demo",
        "--shards",
        shards,
        "trainer.max_steps=1",
        "trainer.final_eval_split=none",
        "trainer.run_dir=runs/demo",
    ]
    assert main(args) == 0
    assert (tmp_path / "runs/demo/metrics.jsonl").read_text().strip()
    assert main(args) == 0
    moved = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("demo.old-"))
    assert len(moved) == 1, sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert (tmp_path / "runs" / moved[0] / "metrics.jsonl").read_text().strip()


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """newcomer 2: `speechlm --version` was "unrecognized arguments"."""
    import speechlm

    assert help_text(capsys, "--version").strip() == f"speechlm {speechlm.__version__}"
