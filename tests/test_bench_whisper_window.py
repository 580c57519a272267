"""benchmarks/bench_whisper_window.py runs (2-layer 64-wide encoder, CPU): both windows timed, and the
difference measured from a saved encoder directory (random weights here; docs/pretrained.md has tiny.en's)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_whisper_window  # noqa: E402


def test_bench_whisper_window_times_both_windows_and_measures_the_difference(tmp_path, capsys) -> None:
    assert bench_whisper_window.main(["--tiny", "--seconds", "1", "--repeats", "1"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert (
        line.startswith("test (2x64), 1 s clip, CPU ms per clip: forward full")
        and "forward+backward full" in line
    )
    enc = bench_whisper_window.build("test", "full")
    torch.manual_seed(0)
    for p in enc.model.embed_positions.parameters():  # saved with positions (random ones here)
        p.data.normal_()
    enc.model.save_pretrained(tmp_path / "enc")
    assert (
        bench_whisper_window.main(["--no-timing", "--pretrained", str(tmp_path / "enc"), "--clips", "2"]) == 0
    )
    (line,) = capsys.readouterr().out.splitlines()
    assert (
        line.startswith("enc: clip vs full window on 2 English demo clips")
        and "relative error median" in line
    )
