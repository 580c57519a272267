"""`speechlm.io.atomic_path`, the one atomic write: a writer stopped midway leaves the previous file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from speechlm.io import atomic_path, atomic_write_json, atomic_write_text, temp_glob, temp_sibling


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(OSError), atomic_path(target) as tmp:
        tmp.write_text('{"v": 2, "half')
        raise OSError(28, "No space left on device")
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_durable_write_replaces_and_the_temporary_is_a_hidden_sibling(tmp_path):
    target = tmp_path / "state.txt"
    atomic_write_text(target, "one", durable=True)
    atomic_write_text(target, "two", durable=True)
    assert target.read_text() == "two"
    tmp = temp_sibling(target)
    assert tmp.parent == tmp_path and tmp.name.startswith(".state.txt.tmp-") and str(os.getpid()) in tmp.name


def test_a_writer_killed_midway_leaves_the_previous_file(tmp_path):
    target = tmp_path / "plan.json"
    atomic_write_json(target, {"v": 1})
    code = (
        "import os, signal, sys; from pathlib import Path; from speechlm.io import atomic_path\n"
        f"with atomic_path(Path({str(target)!r})) as tmp:\n"
        "    tmp.write_text('half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert json.loads(target.read_text()) == {
        "v": 1
    }  # the killed writer's temporary may remain; the file is whole


def test_temp_glob_matches_the_temporary_atomic_path_writes_and_nothing_else(tmp_path):
    """What a killed writer leaves is found by `temp_glob` (shard folders, the index cache clean up by it)."""
    target = tmp_path / "shard-000001.tar"
    left = temp_sibling(target)
    left.write_bytes(b"half a tar")
    (tmp_path / "shard-000001.tar").write_bytes(b"whole")
    (tmp_path / "shard-000001.tar.lock").write_bytes(b"")
    assert list(tmp_path.glob(temp_glob("shard-*.tar"))) == [left]
