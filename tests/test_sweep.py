"""`speechlm sweep`: matrix init, dispatchers sharing one sweep directory, stale claims, requeue, views.

Most jobs run `tests/sweep_fake_trainer.py` (through `sweep run --command`), which behaves like a tiny
`speechlm train`; the kill -9 test runs the real trainer on the smoke config so that a requeued job is
seen to resume from its own checkpoint.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from speechlm.config import load_config
from speechlm.sweep.spec import SpecError, load_spec, write_sweep
from speechlm.sweep.store import StatusError, StatusStore, claim_next
from tests.train.test_training import SMOKE, data_overrides

REPO = Path(__file__).resolve().parent.parent
FAKE = f"{sys.executable} {REPO / 'tests/sweep_fake_trainer.py'} {{config}}"


def make_sweep(tmp_path: Path, spec: dict, name: str = "sweep") -> Path:
    spec_path = tmp_path / f"{name}.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = tmp_path / name
    write_sweep(load_spec(spec_path), out)
    return out


def sweep_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speechlm", "sweep", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})  # fmt: skip


def start_dispatcher(sweep: Path, slots: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "speechlm", "sweep", "run", str(sweep), "--slots", slots, "--poll", "0.2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


def states(sweep: Path) -> dict[str, str]:
    return {jid: j["state"] for jid, j in StatusStore(sweep).read()["jobs"].items()}


def wait_for(cond, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


SMALL = {"base": SMOKE, "overrides": {"trainer.max_steps": 3}}


def test_init_writes_resolved_configs_with_stable_ids(tmp_path):
    spec = {**SMALL, "grid": {"sampler.temperature": [0.3, 0.5], "trainer.seed": [0, 1, 2]},
            "jobs": [{"name": "no ctc", "overrides": {"model.ctc_weight": 0}}], "gpus_per_job": 2}  # fmt: skip
    sweep = make_sweep(tmp_path, spec)
    matrix = json.loads((sweep / "matrix.json").read_text())
    ids = [j["id"] for j in matrix["jobs"]]
    assert ids[:2] == ["temperature-0.3_seed-0", "temperature-0.3_seed-1"] and ids[-1] == "no-ctc"
    assert len(ids) == 7 and all(j["gpus"] == 2 for j in matrix["jobs"])
    assert set(states(sweep).values()) == {"queued"}
    # the resolved config is the whole config, and `speechlm train` reads it unchanged
    cfg = load_config(sweep / "jobs/temperature-0.5_seed-2/config.yaml")
    assert (cfg.sampler.temperature, cfg.trainer.seed, cfg.trainer.max_steps) == (0.5, 2, 3)
    assert (
        cfg.trainer.resume == "auto"
        and Path(cfg.trainer.run_dir) == (sweep / "jobs/temperature-0.5_seed-2/run").resolve()
    )
    assert load_config(sweep / "jobs/no-ctc/config.yaml").model.ctc_weight == 0

    # re-init with one more seed: old jobs keep their state, the new ones are queued
    with StatusStore(sweep).locked() as state:
        state["jobs"]["no-ctc"]["state"] = "done"
    spec["grid"]["trainer.seed"].append(3)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    write_sweep(load_spec(tmp_path / "sweep.yaml"), sweep)
    st = states(sweep)
    assert len(st) == 9 and st["no-ctc"] == "done" and st["temperature-0.3_seed-3"] == "queued"


@pytest.mark.parametrize(
    "spec, message",
    [
        ({**SMALL, "grids": {}}, "unknown key 'grids'"),
        ({**SMALL, "grid": {"sampler.temprature": [0.3]}}, "unknown key 'sampler.temprature'"),
        ({**SMALL, "grid": {"trainer.seed": 3}}, "grid key 'trainer.seed' must have a non-empty list"),
        ({**SMALL, "jobs": [{"name": "a", "overide": {}}]}, "jobs[0]: unknown key 'overide'"),
        ({**SMALL, "jobs": [{"name": "a"}, {"name": "a"}]}, "two jobs have the id 'a'"),
        ({**SMALL, "gpus_per_job": 0}, "'gpus_per_job' must be a whole number >= 1"),
    ],
)
def test_bad_spec_is_an_error_naming_the_key(tmp_path, spec, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_sweep(tmp_path, spec)


def test_three_dispatchers_run_every_job_exactly_once(tmp_path):
    # 24 jobs: 12 seeds x 2 temperatures; seed 13 fails (exit 3) and must not stop the others
    seeds = [*range(11), 13]
    sweep = make_sweep(
        tmp_path, {**SMALL, "grid": {"trainer.seed": seeds, "sampler.temperature": [0.3, 0.5]}}
    )
    procs = [start_dispatcher(sweep, f"d{i}a,d{i}b", "--command", FAKE) for i in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ran = Counter(line.split()[0] for line in (sweep / "ran.log").read_text().splitlines())
    assert len(ran) == 24 and set(ran.values()) == {1}, ran  # every job once, none twice
    st = states(sweep)
    assert sorted(j for j, s in st.items() if s == "failed") == [
        "seed-13_temperature-0.3",
        "seed-13_temperature-0.5",
    ]
    assert Counter(st.values()) == {"done": 22, "failed": 2}
    status = StatusStore(sweep).read()
    assert status["dispatchers"] == {}  # each dispatcher removed itself
    failed = status["jobs"]["seed-13_temperature-0.3"]
    assert failed["exit_code"] == 3 and Path(failed["log"]).is_file()
    # each job saw only its own claimed slot, one of its dispatcher's
    for line in (sweep / "ran.log").read_text().splitlines():
        jid, slots = line.split()[:2]
        assert slots == ",".join(status["jobs"][jid]["slots"]) and slots[:2] in ("d0", "d1", "d2")
    assert sum(o.count("[sweep] started ") for o in outs) == 24


def _claim_all(sweep: str, order: list[str], name: str, q) -> None:
    store = StatusStore(sweep)
    mine = []
    while True:
        with store.locked() as state:
            jid = claim_next(state, order, dispatcher=name, host="h", slots=["0"])
        if jid is None:
            break
        mine.append(jid)
    q.put(mine)


def test_concurrent_claims_never_take_a_job_twice(tmp_path):
    sweep = tmp_path / "race"
    order = [f"job{i:03d}" for i in range(80)]
    StatusStore(sweep).add_jobs(order)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(str(sweep), order, f"p{i}", q)) for i in range(8)]
    for p in procs:
        p.start()
    claimed = [jid for _ in procs for jid in q.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
    assert sorted(claimed) == order  # all claimed, none twice
    assert set(states(sweep).values()) == {"running"}


def test_sigterm_to_dispatcher_requeues_its_jobs_which_then_resume(tmp_path):
    sweep = make_sweep(
        tmp_path, {**SMALL, "overrides": {"trainer.max_steps": 20}, "grid": {"trainer.seed": [0, 1]}}
    )
    slow = {"FAKE_STEP_SECONDS": "0.3"}
    d = start_dispatcher(sweep, "0,1", "--command", FAKE, env=slow)
    wait_for(
        lambda: all((sweep / f"jobs/seed-{s}/run/ckpt").exists() for s in (0, 1)), what="both jobs stepping"
    )
    d.send_signal(signal.SIGTERM)
    out = d.communicate(timeout=60)[0]
    assert d.returncode == 0, out
    assert states(sweep) == {"seed-0": "queued", "seed-1": "queued"}
    steps = {s: int((sweep / f"jobs/seed-{s}/run/ckpt").read_text()) for s in (0, 1)}
    assert all(0 < n < 20 for n in steps.values())
    d = start_dispatcher(sweep, "0,1", "--command", FAKE)
    assert d.wait(timeout=120) == 0
    assert states(sweep) == {"seed-0": "done", "seed-1": "done"}
    starts = [ln for ln in (sweep / "ran.log").read_text().splitlines() if ln.startswith("seed-0")]
    assert starts[-1].endswith(f"start={steps[0]}")  # the second run continued from the saved step


def test_status_file_is_replaced_atomically_and_a_corrupt_one_is_named(tmp_path, monkeypatch):
    sweep = make_sweep(tmp_path, {**SMALL, "grid": {"trainer.seed": [0, 1]}})
    before = (sweep / "status.json").read_text()

    def broken_dump(*args, **kwargs):
        args[1].write('{"jobs": {"seed-0": ')  # half a file, then the "disk" fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("speechlm.sweep.store.json.dump", broken_dump)
    with pytest.raises(OSError, match="No space left"):
        with StatusStore(sweep).locked() as state:
            state["jobs"]["seed-0"]["state"] = "running"
    monkeypatch.undo()
    assert (sweep / "status.json").read_text() == before  # the old state, whole
    assert not list(sweep.glob(".status.json.tmp-*"))  # no half-written file left behind

    (sweep / "status.json").write_text('{"jobs": {"seed-0": {"state": "runn')
    res = sweep_cli("status", str(sweep))
    assert res.returncode == 2
    assert str(sweep / "status.json") in res.stderr and "not valid JSON" in res.stderr
    with pytest.raises(StatusError, match="status.json"):
        StatusStore(sweep).read()


def test_status_json_report_plot_and_slurm_script(tmp_path):
    sweep = make_sweep(
        tmp_path, {**SMALL, "grid": {"sampler.temperature": [0.3, 0.5], "trainer.seed": [0, 13]}}
    )
    d = start_dispatcher(sweep, "0,1", "--command", FAKE)
    assert d.wait(timeout=120) == 0
    res = sweep_cli("status", str(sweep), "--json")
    assert res.returncode == 0, res.stderr
    jobs = {j["id"]: j for j in json.loads(res.stdout)["jobs"]}
    ok = jobs["temperature-0.3_seed-0"]
    assert ok["state"] == "done" and ok["step"] == 3 and ok["best_wer"] == pytest.approx(1 / (1 + 0.3 + 3))
    assert ok["elapsed_s"] is not None and ok["host"] and ok["slots"] in (["0"], ["1"])
    assert (
        jobs["temperature-0.5_seed-13"]["state"] == "failed"
        and jobs["temperature-0.5_seed-13"]["exit_code"] == 3
    )
    table = sweep_cli("status", str(sweep)).stdout
    assert "2 done, 2 failed (4 jobs)" in table and "failed: temperature-0.3_seed-13 (exit 3)" in table

    res = sweep_cli("report", str(sweep), "--plot", str(tmp_path / "r.png"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert res.stdout.splitlines()[0].startswith(
        "temperature-0.5_seed-0: best validation WER"
    )  # lowest first

    res = sweep_cli("requeue", str(sweep), "--failed")
    assert res.returncode == 0 and "requeued 2 job(s)" in res.stdout
    assert Counter(states(sweep).values()) == {"done": 2, "queued": 2}

    res = sweep_cli("slurm", str(sweep), "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu")
    assert res.returncode == 0, res.stderr
    script = (sweep / "sweep.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script and "--ntasks-per-node=1" in script
    assert f"speechlm sweep run {sweep.resolve()}" in script and "0,1,2,3,4,5,6,7" in script


def test_run_ends_with_counts_and_report_prints_final_wer_without_plot(tmp_path):
    """newcomer: `sweep run` ended with no done/failed count; `sweep report` needed --plot and ignored the
    final eval.json WER of runs that had no validation during training."""
    sweep = make_sweep(
        tmp_path, {**SMALL, "grid": {"sampler.temperature": [0.3, 0.5], "trainer.seed": [0, 13]}}
    )
    d = start_dispatcher(sweep, "0,1", "--command", FAKE, env={"FAKE_FINAL_EVAL": "1"})
    out = d.communicate(timeout=120)[0]
    assert d.returncode == 0, out
    last = out.strip().splitlines()[-1]
    assert "2 done, 2 failed (4 jobs); failed: temperature-0.3_seed-13 (log " in last, out
    assert "speechlm sweep requeue --failed" in last

    table = sweep_cli("status", str(sweep)).stdout
    assert "final WER" in table.splitlines()[0]
    res = sweep_cli("report", str(sweep))  # no --plot: text only
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    want = 100 / (2 + 0.5 + 3)
    assert lines[0] == f"temperature-0.5_seed-0: final WER {want:.1f}% at step 3", res.stdout
    assert lines[1].startswith("temperature-0.3_seed-0: final WER")
    assert lines[2] == "no WER yet: temperature-0.3_seed-13 (failed), temperature-0.5_seed-13 (failed)"
    assert not list(tmp_path.glob("*.png"))


def test_kill9_dispatcher_makes_stale_and_requeued_real_job_resumes(demo_data, tmp_path):
    """A real `speechlm train` job: its dispatcher dies with kill -9 after the step-2 checkpoint."""
    spec = {"base": SMOKE, "overrides": [*data_overrides(demo_data), "trainer.max_steps=6", "trainer.ckpt_every=2",
                                         "trainer.final_eval_split=val"]}  # fmt: skip
    sweep = make_sweep(tmp_path, spec)
    run_dir = sweep / "jobs/base/run"
    d = start_dispatcher(sweep, "0", "--stale-after", "3")
    wait_for(
        lambda: (run_dir / "checkpoints/step_000002").is_dir(), timeout=300, what="the step-2 checkpoint"
    )
    job_pid = StatusStore(sweep).read()["jobs"]["base"]["pid"]
    d.kill()  # SIGKILL: no handler runs in the dispatcher
    d.wait()
    # the kernel sends the orphaned trainer SIGTERM (PR_SET_PDEATHSIG): it checkpoints and exits
    wait_for(lambda: not Path(f"/proc/{job_pid}").exists() or "zombie" in Path(f"/proc/{job_pid}/status").read_text().lower(),
             timeout=300, what="the orphaned trainer to exit")  # fmt: skip
    assert StatusStore(sweep).read()["jobs"]["base"]["state"] == "running"  # nobody has looked yet
    res = sweep_cli("status", str(sweep), "--stale-after", "3")
    assert "stale" in res.stdout, res.stdout
    res = sweep_cli("requeue", str(sweep), "--stale")
    assert res.returncode == 0 and "base" in res.stdout
    d = start_dispatcher(sweep, "0")
    out = d.communicate(timeout=600)[0]
    assert d.returncode == 0, out
    st = StatusStore(sweep).read()["jobs"]["base"]
    assert st["state"] == "done" and st["attempts"] == 2
    log = (sweep / "jobs/base/train.log").read_text()
    assert "resuming from" in log  # the second attempt continued from its own checkpoint
    steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(ln).get("kind") == "train"]  # fmt: skip
    assert steps == [1, 2, 3, 4, 5, 6]


def test_progress_reads_eval_json_and_counts_a_damaged_one_as_absent(tmp_path):
    from speechlm.sweep.view import format_report, read_progress

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 4}) + "\n")
    (tmp_path / "eval.json").write_text(json.dumps({"split": "val", "steps": 4, "wer": 0.25}))
    got = read_progress(tmp_path / "metrics.jsonl")
    assert (got["step"], got["final_wer"], got["final_step"], got["best_wer"]) == (4, 0.25, 4, None)
    (tmp_path / "eval.json").write_text('{"split": "val", "wer": 0.2')  # cut off mid-write or damaged
    got = read_progress(tmp_path / "metrics.jsonl")
    assert got["final_wer"] is None and got["step"] == 4
    report = format_report([{"id": "a", "state": "done", **got}])
    assert report.startswith("no job has a WER yet")
