"""The progress display (speechlm/progress.py) and where the commands use it (issue 26, item 2).

On a terminal (stderr a TTY, rank 0) a line redraws itself; anywhere else nothing is drawn and logs stay
line-based. Each command's display is checked in this process with the terminal check forced on (what it
draws), and the check itself with a real pseudo-terminal (`pty`) against pipes.
"""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

import speechlm.progress as progress
from speechlm.progress import Progress, eta_seconds, format_duration, progress_enabled

REPO = Path(__file__).resolve().parent.parent


def run_in_pty(args: list[str], timeout: float = 300) -> tuple[int, str]:
    """`python -m speechlm ARGS` with stdout and stderr on a pseudo-terminal; (exit code, what it drew)."""
    master, slave = pty.openpty()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", COLUMNS="200")
    proc = subprocess.Popen(
        [sys.executable, "-m", "speechlm", *args], stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
        cwd=REPO, env=env,
    )  # fmt: skip
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


def run_piped(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "speechlm", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )


@pytest.fixture
def terminal(monkeypatch):
    """Pretend stderr is a terminal (the display draws into what capsys captures), 200 columns wide: the
    line is cut to the terminal's width, which under pytest-xdist is the 80 of no terminal."""
    monkeypatch.setattr(progress, "progress_enabled", lambda rank=0: rank == 0)
    monkeypatch.setenv("COLUMNS", "200")


# ------------------------------------------------------------------------------------------ the display
def test_display_draws_count_eta_and_fields_and_ends_its_line():
    out = io.StringIO()
    bar = Progress(10, "work", "items", enabled=True, stream=out, min_interval=0)
    bar.start -= 4.0  # four seconds in
    bar.update(4, loss="1.2500")
    line = bar.render()
    assert line.startswith("work [########............] 4/10 items 40% 0:04 ETA 0:06")
    assert line.endswith("· loss 1.2500")
    bar.close()
    text = out.getvalue()
    assert text.startswith("\r\x1b[Kwork") and text.endswith("\n")


def test_display_off_writes_nothing_and_write_still_prints():
    out = io.StringIO()
    bar = Progress(3, "work", enabled=False, stream=out, min_interval=0)
    with bar.heartbeat(every=0.01):
        bar.update(3)
        time.sleep(0.05)
    bar.write("a line")
    bar.close()
    assert out.getvalue() == "a line\n"


def test_phases_erase_their_line_and_heartbeat_redraws():
    out = io.StringIO()
    bar = Progress(2, "plan", "phases", enabled=True, stream=out, leave=False)
    with bar, bar.heartbeat(every=0.01):
        bar.phase("reading")
        time.sleep(0.1)
        assert out.getvalue().count("plan: reading") >= 3  # redrawn by the heartbeat thread
        bar.phase("planning")
        assert bar.done == 1
    assert out.getvalue().endswith("\r\x1b[K")  # erased at the end
    assert "plan [####################] 2/2 phases" in out.getvalue()  # the last phase counted done


def test_eta_and_durations():
    assert eta_seconds(5, 10, 0, 10.0) == 10.0
    assert eta_seconds(7, 10, 5, 4.0) == 6.0  # rate since the display started (a resumed run's step 5)
    assert eta_seconds(5, None, 0, 10.0) is None and eta_seconds(0, 10, 0, 1.0) is None
    assert [format_duration(s) for s in (7, 754, 10921)] == ["0:07", "12:34", "3:02:01"]


def test_enabled_only_on_a_terminal_on_rank_0(monkeypatch):
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            monkeypatch.delenv(progress.ENV, raising=False)
            assert progress_enabled(0)
            assert not progress_enabled(1)
            monkeypatch.setenv(progress.ENV, "0")
            assert not progress_enabled(0)
            monkeypatch.setattr(sys, "stderr", io.StringIO())
            monkeypatch.delenv(progress.ENV)
            assert not progress_enabled(0)
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false", "No", " no "])
def test_the_usual_false_words_turn_the_display_off(monkeypatch, capsys, value):
    """PR02: SPEECHLM_PROGRESS=off/false/no was ignored (only "0" worked)."""
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            monkeypatch.setenv(progress.ENV, value)
            assert not progress_enabled(0)
            for on in ("1", "on", "true", "YES", ""):
                monkeypatch.setenv(progress.ENV, on)
                assert progress_enabled(0)
    finally:
        os.close(master)
        os.close(slave)


def test_an_unknown_value_is_warned_about_once_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV, "maybe")
    monkeypatch.setattr(progress, "_warned", set())
    assert progress.progress_setting()
    assert progress.progress_setting()
    err = capsys.readouterr().err
    assert err.count("warning: SPEECHLM_PROGRESS='maybe' is not understood") == 1
    assert "0, off, false, no" in err


# ------------------------------------------------------------------------------------------ commands
def test_plan_draws_on_a_terminal_and_nothing_into_pipes(demo_data):
    args = ["plan", "--config", "configs/demo.yaml", "--manifest", demo_data["train"]]
    rc, drawn = run_in_pty(args)
    assert rc == 0, drawn
    assert "\r\x1b[Kplan: reading the manifest" in drawn and "plan: summarizing" in drawn
    assert "micro-batches per rank" in drawn  # the report follows the erased display
    piped = run_piped(args)
    assert piped.returncode == 0, piped.stderr
    assert "\r" not in piped.stdout + piped.stderr and "micro-batches per rank" in piped.stdout


def test_tokenizer_training_shows_texts_read_then_learning(demo_data, terminal, capsys, tmp_path):
    from speechlm.cli import main

    capsys.readouterr()
    argv = ["tokenizer", "train", "--manifest", demo_data["train"], "--out", str(tmp_path / "tok")]
    assert main([*argv, "--vocab-size", "300"]) == 0
    err = capsys.readouterr().err
    n = len(__import__("pyarrow.parquet").parquet.read_table(demo_data["train"]))
    assert f"{n}/{n} texts read" in err and "now learning the pieces" in err


def test_manifest_build_shows_shards_then_phases(terminal, capsys, tmp_path):
    from speechlm.cli import main

    capsys.readouterr()
    assert main(["manifest", "build", str(REPO / "data/demo/shards"), "--out", str(tmp_path / "m")]) == 0
    out, err = capsys.readouterr()
    n = len([p for p in (REPO / "data/demo/shards").iterdir() if p.is_dir()])
    assert f"reading shards [####################] {n}/{n} shards" in err
    assert "manifest build: cleaning texts" in err and "manifest build: writing" in err
    assert "\r" not in out  # the report on stdout is untouched


def test_shards_write_display_on_a_terminal_lines_otherwise(demo_data, terminal, capsys, tmp_path):
    from speechlm.cli import main

    capsys.readouterr()
    argv = ["shards", "write", demo_data["val"], "--shard-size", "5"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "\r\x1b[Kshards [" in err and "utterances " in err and "shards: " not in err
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(progress, "progress_enabled", lambda rank=0: False)
    try:
        assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    finally:
        monkeypatch.undo()
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1].startswith("shards: ")  # plain lines, the last one
