"""SIGTERM and stop decisions agreed by every rank; exit codes a scheduler can read (issue 20).

- a SIGTERM that reaches one rank only stops both ranks at the same step, both save it, both exit 143;
- a data error (unreadable micro-batch) on one rank only: both ranks exit 1 with its message;
- SIGTERM during the final evaluation keeps the trained weights (saved before it) and exits 143;
- epochs leave no DataLoader workers behind;
- `speechlm sweep` requeues a job that exits 143 (or dies by a signal) instead of marking it done.

The two-rank tests start the ranks themselves (the environment torchrun sets, one process per rank) so
that each rank's exit code and output are seen, and no launcher tears a waiting rank down: a rank
left waiting in a collective would show as a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_training import SMOKE, data_overrides

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(args: list[str], logs: Path, n: int = 2) -> list[subprocess.Popen]:
    """`n` ranks of `python -m speechlm.train ARGS` with the environment torchrun gives its workers."""
    port = free_port()
    procs = []
    for rank in range(n):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="test-signals")  # fmt: skip
        out = open(logs / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, "-m", "speechlm.train", *args], stdout=out,
                                      stderr=subprocess.STDOUT, env=env, cwd=REPO))  # fmt: skip
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    codes = [p.poll() for p in procs]
    for p in procs:  # a rank still running after the timeout is a hang: end it (ours, by pid)
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln)["step"] for ln in path.read_text().splitlines()
            if ln.strip() and json.loads(ln).get("kind") == "train"]  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.parametrize("order", ["rank1_only", "rank0_then_rank1"])
def test_sigterm_to_one_rank_stops_both_at_the_same_step(demo_data, tmp_path, order):
    run_dir = tmp_path / "run"
    procs = start_ranks([SMOKE, *data_overrides(demo_data), "trainer.max_steps=300", "trainer.max_minutes=3",
                         "sampler.max_batch_duration=6", f"trainer.run_dir={run_dir}"], tmp_path)  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline and len(train_steps(run_dir)) < 2:
        assert all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()[-3000:]
        time.sleep(0.2)
    if order == "rank0_then_rank1":  # the signal reaches the ranks at different moments
        procs[0].send_signal(signal.SIGTERM)
        time.sleep(0.3)
    procs[1].send_signal(signal.SIGTERM)
    codes = wait_all(procs, timeout=120)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    assert codes == [143, 143], "\n----\n".join(x[-2500:] for x in logs)
    assert "SIGTERM: saved checkpoint" in logs[0]
    latest = (run_dir / "checkpoints/latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert step < 300 and train_steps(run_dir)[-1] == step  # the saved step is the last one trained
    ckpt = run_dir / "checkpoints" / latest
    complete = json.loads((ckpt / "complete.json").read_text())
    assert complete["step"] == step and complete["world_size"] == 2
    for r in (0, 1):  # both ranks (dp ranks 0 and 1) saved their data position of that same step
        assert (ckpt / f"speechlm/data_dp{r:05d}.json").is_file()
    assert not (run_dir / "eval.json").exists()


def rows_of_rank(demo_data, dp_rank: int, micro_batches: int, overrides: list[str]) -> set[int]:
    """Manifest rows of the first `micro_batches` micro-batches of one dp rank (of 2)."""
    from speechlm.config import load_config
    from speechlm.data.sampler.build import build_sampler
    from speechlm.data.sources.mmap_cache import open_index

    cfg = load_config(SMOKE, [*data_overrides(demo_data), *overrides])
    sampler = build_sampler(cfg, open_index(demo_data["train"]), dp_rank=dp_rank, dp_size=2)
    it = iter(sampler)
    return {i for _ in range(micro_batches) for i in next(it)}


@pytest.mark.multiproc
def test_dropped_data_on_one_rank_stops_both_ranks(demo_data, tmp_path):
    overrides = ["sampler.max_batch_duration=6", "trainer.max_steps=3"]
    # rank 1's first two steps (2 micro-batches each), minus every row rank 0 reads in the run
    missing = rows_of_rank(demo_data, 1, 4, overrides) - rows_of_rank(demo_data, 0, 10, overrides)
    assert missing
    t = pq.read_table(demo_data["train"])
    paths = [str(Path(p).parent / "gone" / Path(p).name) if i in missing else p
             for i, p in enumerate(t["audio_filepath"].to_pylist())]  # fmt: skip
    manifest = tmp_path / "rank1_missing.parquet"
    pq.write_table(t.set_column(t.schema.get_field_index("audio_filepath"), "audio_filepath", pa.array(paths)),
                   manifest)  # fmt: skip
    run_dir = tmp_path / "run"
    procs = start_ranks([SMOKE, *data_overrides(demo_data), f"data.train_manifest={manifest}", *overrides,
                         f"trainer.run_dir={run_dir}"], tmp_path)  # fmt: skip
    codes = wait_all(procs, timeout=240)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    assert codes == [1, 1], "\n----\n".join(x[-2500:] for x in logs)
    for log in logs:  # the same error on both ranks, naming rank 1's files
        assert "error: rank 1:" in log and "/gone/" in log and "data.max_dropped_fraction" in log
        assert "Traceback" not in log


def test_sigterm_during_final_evaluation_keeps_the_weights(demo_data, tmp_path):
    """S3: ckpt_every=0 and a SIGTERM while the final evaluation decodes: the weights are saved before it."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "speechlm.train", SMOKE, *data_overrides(demo_data), "trainer.max_steps=2",
             "trainer.ckpt_every=0", "trainer.final_eval_split=train", f"trainer.run_dir={run_dir}"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        deadline = time.time() + 240
        while time.time() < deadline and "final evaluation on the train split" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    text = log.read_text()
    assert rc == 143, text[-3000:]
    ckpt = run_dir / "checkpoints/step_000002"
    assert (ckpt / "complete.json").is_file()
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_000002"
    assert "SIGTERM during the final evaluation" in text and str(ckpt) in text
    assert "eval.json was not written" in text and not (run_dir / "eval.json").exists()


_BEFORE: set[int] = set()


def worker_count() -> int:
    """Children of this process started since `_BEFORE` was taken (earlier tests may leave some behind)."""
    return sum(
        1 for c in psutil.Process().children(recursive=True) if c.is_running() and c.pid not in _BEFORE
    )


def test_epochs_leave_no_dataloader_workers_behind(demo_data, tmp_path):
    """Each epoch's loader is shut down when the next epoch starts (also an epoch left mid-way) or on close()."""
    from speechlm.config import load_config
    from speechlm.data.dataset import SpeechDataset
    from speechlm.data.sampler.build import build_sampler
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.train.data import StepLoader

    small = tmp_path / "small.parquet"
    pq.write_table(pq.read_table(demo_data["train"]).slice(0, 30), small)
    cfg = load_config(
        SMOKE, [*data_overrides(demo_data), f"data.train_manifest={small}", "trainer.grad_accum=1"]
    )
    table = open_index(str(small))
    ds = SpeechDataset(table, Tokenizer(cfg.data.tokenizer), max_tokens=64)
    loader = StepLoader(build_sampler(cfg, table, dp_rank=0, dp_size=1), ds, grad_accum=1, num_workers=1)
    _BEFORE.clear()
    _BEFORE.update(c.pid for c in psutil.Process().children(recursive=True))
    assert worker_count() == 0
    held = []
    for _epoch in range(3):  # a stop mid-epoch leaves its iterator suspended (Lightning holds it)
        it = iter(loader)
        next(it), next(it)
        held.append(it)
        assert worker_count() <= 1
    for _epoch in range(3):  # whole epochs
        assert sum(1 for _ in loader) > 0
        assert worker_count() <= 1
    it = iter(loader)
    next(it)
    loader.close()
    deadline = time.time() + 10
    while worker_count() and time.time() < deadline:
        time.sleep(0.1)
    assert worker_count() == 0


FAKE = f"{sys.executable} {REPO / 'tests/sweep_fake_trainer.py'} {{config}}"


def test_sweep_requeues_a_preempted_job(tmp_path):
    """SW1: a job that exits 143 (SIGTERM, checkpoint saved) is requeued and resumed, never marked done."""
    import yaml

    from speechlm.sweep.spec import load_spec, write_sweep
    from speechlm.sweep.store import StatusStore

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"base": SMOKE, "overrides": {"trainer.max_steps": 6},
                                    "grid": {"trainer.seed": [0]}}))  # fmt: skip
    sweep = tmp_path / "sw"
    write_sweep(load_spec(spec), sweep)
    env = dict(os.environ, FAKE_SIGTERM_SELF_AT="3")  # the fake trainer SIGTERMs itself at step 3, once
    r = subprocess.run([sys.executable, "-m", "speechlm", "sweep", "run", str(sweep), "--slots", "0", "--poll",
                        "0.2", "--command", FAKE], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "preempted (exit 143)" in r.stdout
    job = StatusStore(sweep).read()["jobs"]["seed-0"]
    assert job["state"] == "done" and job["attempts"] == 2 and job["preempted"] == 1
    starts = (sweep / "ran.log").read_text().split()
    assert "start=0" in starts and "start=3" in starts  # the second attempt resumed from its checkpoint


def test_sweep_job_killed_by_a_signal_is_requeued_not_done(tmp_path):
    from speechlm.sweep.dispatch import job_outcome

    assert job_outcome(0) == "done"
    assert job_outcome(143) == "preempted" and job_outcome(-signal.SIGTERM) == "preempted"
    assert job_outcome(-signal.SIGKILL) == "preempted"
    assert job_outcome(1) == "failed" and job_outcome(70) == "failed"


def test_lightning_cannot_move_the_step_loaders_epoch(demo_data):
    """Lightning calls `loader.sampler.set_epoch(its own epoch count)` at each epoch start; after a
    SIGTERM stop with the epoch's last batch fetched, its count is one ahead of ours on resume, which
    skipped an epoch (step 5 trained on epoch 2's rows). The StepLoader owns the epoch."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    from speechlm.config import load_config
    from speechlm.data.sampler.build import build_sampler
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.train.data import StepLoader

    cfg = load_config(SMOKE, data_overrides(demo_data))
    sampler = build_sampler(cfg, open_index(demo_data["train"]), dp_rank=0, dp_size=1)
    loader = StepLoader(sampler, None, grad_accum=2)
    loader.sampler.seek(0, 6)
    _set_sampler_epoch(loader, 1)
    assert (loader.sampler.epoch, loader.sampler.position) == (0, 6)
    assert loader.state_dict()["epoch"] == 0
