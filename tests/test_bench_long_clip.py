"""benchmarks/bench_long_clip.py runs (tiny encoder, CPU) and reports both contexts."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_long_clip  # noqa: E402


def test_bench_long_clip_reports_both_contexts(capsys) -> None:
    assert bench_long_clip.main(["0.1", "--tiny", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "context full" in lines[0] and "context limited" in lines[1]
    assert all("75 encoder frames" in line and "fwd+bwd" in line for line in lines)
