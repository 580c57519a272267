"""Resume loses nothing: the data position, the losses and the counters continue exactly.

Small runs (smoke-sized model, 4 optimizer steps per epoch) so that several epoch boundaries are cheap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")
# 8 micro-batches per epoch, grad_accum 2: 4 optimizer steps per epoch
SMALL_EPOCHS = ["sampler.max_batch_duration=60", "trainer.grad_accum=2", "trainer.val_every=0"]


def build_corpus(shards: Path, out: Path) -> dict[str, str]:
    """Manifest (train/val) and a 300-piece tokenizer for the shards under `shards`."""
    from speechlm.cli import main

    assert main(["manifest", "build", str(shards), "--out", str(out)]) == 0
    tok = ["tokenizer", "train", "--manifest", str(out / "train.parquet"), "--out", str(out / "tok")]
    assert main([*tok, "--vocab-size", "300"]) == 0
    return {
        "train": str(out / "train.parquet"),
        "val": str(out / "val.parquet"),
        "tok": str(out / "tok.model"),
    }


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> dict[str, str]:
    return build_corpus(REPO / "data/demo/shards", tmp_path_factory.mktemp("demo_manifest"))


def base_args(d: dict[str, str]) -> list[str]:
    return [
        SMOKE,
        f"data.train_manifest={d['train']}",
        f"data.val_manifest={d['val']}",
        f"data.tokenizer={d['tok']}",
        "trainer.final_eval_split=val",
        *SMALL_EPOCHS,
    ]


def run_train(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "speechlm.train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def read_train_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in rows if r.get("kind") == "train"]


def test_resume_mid_epoch_keeps_full_epochs_after_the_boundary(demo_data, tmp_path):
    """Resumed at step 3 of a 4-step epoch: epochs 1 and 2 must still have all their 4 steps each."""
    base = base_args(demo_data)
    full = run_train([*base, "trainer.max_steps=10", f"trainer.run_dir={tmp_path / 'full'}"])
    assert full.returncode == 0, full.stderr[-3000:]
    part = run_train(
        [*base, "trainer.max_steps=3", "trainer.ckpt_every=3", f"trainer.run_dir={tmp_path / 'p'}"]
    )
    assert part.returncode == 0, part.stderr[-3000:]
    resumed = run_train(
        [*base, "trainer.max_steps=10", f"trainer.run_dir={tmp_path / 'p'}", "trainer.resume=auto"]
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_train_metrics(tmp_path / "full"), read_train_metrics(tmp_path / "p")
    assert [m["epoch"] for m in a] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert [m["epoch"] for m in b] == [m["epoch"] for m in a], "epochs after the resume are cut short"
    assert [m["rows_digest"] for m in b] == [m["rows_digest"] for m in a]
    assert [m["loss"] for m in b] == [m["loss"] for m in a]
