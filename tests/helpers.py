"""Helpers shared by test files (import with `from helpers import ...`; tests/ is on sys.path through
conftest.py's folder, as pytest's default import mode puts it there).

BACKENDS parametrises a distributed test over gloo (CPU, always) and NCCL (marked `gpu`: deselected by
the default run, skipped where CUDA or enough GPUs are missing), as OLMo-core's test suite does:

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_x(backend):
        skip_unless_backend(backend, world_size=2)
        run_distributed(_worker, 2, backend, ...)       # the worker puts its tensors on device_for(backend)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOKE = str(REPO / "configs/smoke.yaml")

BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("nccl", id="nccl", marks=pytest.mark.gpu),
]


def skip_unless_backend(backend: str, world_size: int) -> None:
    """Skip the calling test where `backend` cannot run `world_size` ranks here (NCCL: one GPU per rank)."""
    if backend != "nccl":
        return
    import torch

    if not torch.cuda.is_available():
        pytest.skip("nccl needs a CUDA GPU")
    if torch.cuda.device_count() < world_size:
        pytest.skip(
            f"nccl with {world_size} ranks needs {world_size} GPUs, found {torch.cuda.device_count()}"
        )


def device_for(backend: str, rank: int) -> Any:
    """The device a rank of `backend` computes on: cuda:rank under NCCL (exact fp32: no TF32), else CPU."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", rank)


def to_cpu(x: Any) -> Any:
    """Tensors (in dicts/lists) detached and on the CPU, to compare a device rank with a CPU reference."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def build_corpus(shards: Path, out: Path) -> dict[str, str]:
    """Manifest (train/val) and a 300-piece tokenizer for the shards under `shards` (in this process)."""
    from speechlm.cli import main

    assert main(["manifest", "build", str(shards), "--out", str(out)]) == 0
    tok = ["tokenizer", "train", "--manifest", str(out / "train.parquet"), "--out", str(out / "tok")]
    assert main([*tok, "--vocab-size", "300"]) == 0
    return {
        "train": str(out / "train.parquet"),
        "val": str(out / "val.parquet"),
        "tok": str(out / "tok.model"),
    }


def run_train(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m speechlm.train ARGS` in a subprocess from the repository root (a fresh process group)."""
    return _run_module("speechlm.train", args, timeout)


def run_cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m speechlm ARGS` (any subcommand) in a subprocess from the repository root, offline."""
    return _run_module("speechlm", args, timeout, HF_HUB_OFFLINE="1")


def _run_module(
    module: str, args: list[str], timeout: float, **env_extra: str
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def read_train_metrics(run_dir: Path) -> list[dict]:
    """The `kind: train` rows of a run's metrics.jsonl, in order."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in rows if r.get("kind") == "train"]


def train_in_process(args: list[str], capsys) -> subprocess.CompletedProcess:
    """`python -m speechlm.train ARGS` in this process (its `main`, exit code and output as a subprocess
    would give them): for launches that stop before any training (refusals, --dry-run), where a
    subprocess would only add its ~5 s of imports. Keep subprocesses where the process is the point
    (signals, torchrun, a fresh process group for a run that trains)."""
    from speechlm.train.__main__ import main

    capsys.readouterr()
    try:
        rc = main(args)
    except SystemExit as e:  # argparse errors
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def record_demo_commands(monkeypatch: Any, argv: list[str]) -> tuple[int, list[list[str]]]:
    """`speechlm demo ARGV` with its `speechlm` steps recorded: build/tokenizer/plan run, train and the
    closing evaluate do not."""
    import speechlm.demo.run as demo
    from speechlm.cli import main

    seen: list[list[str]] = []
    real_run = demo._run

    def record(args: list[str]) -> int:
        seen.append(args)
        return 0 if args[0] in ("train", "evaluate") else real_run(args)

    monkeypatch.setattr(demo, "_run", record)
    return main(["demo", *argv]), seen
