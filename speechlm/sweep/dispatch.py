"""`speechlm sweep run`: a long-lived dispatcher that keeps its GPU slots busy with queued jobs.

One loop, every `poll` seconds:
1. reap finished children: exit 0 → `done`; exit 143 (the trainer saved a checkpoint after SIGTERM) or
   a death by a signal → `queued` again, counted in `preempted` (the job resumes from its checkpoint);
   anything else → `failed` (no retry: failures are mostly recipe bugs; the log path is in the
   status); and free their slots;
2. under the sweep lock: beat the heartbeat, mark the jobs of dead dispatchers `stale`, and claim
   queued jobs while `gpus_per_job` slots are free; each claimed job starts at once with
   `CUDA_VISIBLE_DEVICES` set to its slots (`speechlm train`, or `torchrun --standalone` for a job
   of several GPUs), its output appended to `jobs/<id>/train.log`;
3. exit when this dispatcher runs nothing and nothing it may take is queued (`--forever`: keep polling).

SIGTERM (or Ctrl-C) to the dispatcher forwards SIGTERM to its jobs, which save a checkpoint and exit
(as `speechlm train` does), marks them `queued` again and exits; the next dispatcher resumes them
(`trainer.resume=auto` is in every job's config). On Linux each job also gets SIGTERM from the kernel
if its dispatcher dies without a handler (`kill -9`), so no orphan keeps training into a run dir that
a requeued copy of the job then shares.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechlm.config import ConfigError, split_override
from speechlm.errors import EXIT_SIGTERM  # 143: the trainer saved a checkpoint after SIGTERM
from speechlm.sweep.spec import read_matrix
from speechlm.sweep.store import STATES, StatusStore, claim_next, mark_stale

DEFAULT_STALE_AFTER = 120.0  # seconds without a heartbeat before another dispatcher gives up on one


MAX_PREEMPTIONS = 20  # a job stopped by a signal more often than this is `failed` (e.g. killed for memory)


def job_outcome(returncode: int) -> str:
    """`done` (exit 0), `preempted` (exit 143, or killed by a signal: resume it) or `failed`."""
    if returncode == 0:
        return "done"
    if returncode == EXIT_SIGTERM or returncode < 0:
        return "preempted"
    return "failed"


def job_command(job: dict[str, Any], config: Path, *, template: str | None = None) -> list[str]:
    """The argv that runs one job: `speechlm train CONFIG`, torchrun for several GPUs, or a template.

    A template is a shell-style command line in which {config}, {run_dir} and {nproc} are replaced (for
    a wrapper such as a container launcher)."""
    nproc = int(job.get("gpus", 1))
    if template:
        return [
            part.format(config=config, run_dir=job["run_dir"], nproc=nproc) for part in shlex.split(template)
        ]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "speechlm.train", str(config)]  # fmt: skip
    return [sys.executable, "-m", "speechlm.train", str(config)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class Child:
    job_id: str
    slots: list[str]
    proc: subprocess.Popen
    log: Any


class Dispatcher:
    def __init__(
        self,
        sweep_dir: str | Path,
        slots: list[str],
        *,
        gpus_per_job: int | None = None,
        poll: float = 10.0,
        only: dict[str, str] | None = None,
        forever: bool = False,
        stale_after: float = DEFAULT_STALE_AFTER,
        command: str | None = None,
        log: Any = print,
    ):
        if not slots:
            raise ValueError("--slots is empty: name at least one GPU slot, e.g. --slots 0,1")
        if len(set(slots)) != len(slots):
            raise ValueError(f"--slots {','.join(slots)} names a slot twice")
        self.dir = Path(sweep_dir).resolve()
        self.store = StatusStore(self.dir)
        self.slots = list(slots)
        self.gpus_per_job = gpus_per_job
        self.poll = poll
        self.only = only or {}
        self.forever = forever
        self.stale_after = stale_after
        self.command = command
        self.log = log
        self.host = socket.gethostname()
        self.id = f"{self.host}:{os.getpid()}:{int(time.time() * 1000)}"
        self.children: dict[str, Child] = {}
        self.stop_requested = False
        matrix = read_matrix(self.dir)
        self.jobs = {j["id"]: j for j in matrix["jobs"]}
        self.order = [j["id"] for j in matrix["jobs"]]
        for key in self.only:
            if not any(_matches(j, {key: ""}, keys_only=True) for j in matrix["jobs"]):
                raise ValueError(f"--only {key}=...: no job of this sweep sets '{key}' (see matrix.json)")

    # --- the loop -------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            with self.store.locked() as state:
                state["dispatchers"][self.id] = self._beat()
            while True:
                self._reap()
                if self.stop_requested:
                    self._shutdown()
                    return 0
                waiting = self._claim_and_start()
                if not self.children and not waiting and not self.forever:
                    self.log(f"[sweep] {self.id}: nothing left to run here; exiting")
                    self.log(f"[sweep] {self.tally()}")
                    return 0
                self._sleep(self.poll)
        finally:
            with self.store.locked() as state:
                state["dispatchers"].pop(self.id, None)
            for s, h in previous.items():
                signal.signal(s, h)

    def tally(self) -> str:
        """How the sweep's jobs stand (every job of the matrix, not only this dispatcher's), and where to
        look at the failed ones: the line `sweep run` ends with."""
        state = self.store.read()
        counts = {s: 0 for s in STATES}
        failed = []
        for jid in self.order:
            st = state["jobs"].get(jid, {}).get("state", "queued")
            counts[st] += 1
            if st == "failed":
                failed.append(f"{jid} (log {self.dir / self.jobs[jid]['log']})")
        parts = ", ".join(f"{counts[s]} {s}" for s in STATES if counts[s] or s in ("done", "failed"))
        line = f"{parts} ({len(self.order)} jobs)"
        if failed:
            line += f"; failed: {', '.join(failed)}; `speechlm sweep requeue --failed` runs them again"
        return line

    def _sleep(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end and not self.stop_requested:
            if any(c.proc.poll() is not None for c in self.children.values()):
                return
            time.sleep(min(0.2, seconds))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _beat(self) -> dict[str, Any]:
        return {"host": self.host, "pid": os.getpid(), "heartbeat": time.time(), "slots": self.slots}

    def _free_slots(self) -> list[str]:
        used = {s for c in self.children.values() for s in c.slots}
        return [s for s in self.slots if s not in used]

    def _eligible(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        if job is None:
            return False
        need = self._gpus(job)
        return need <= len(self.slots) and _matches(job, self.only)

    def _gpus(self, job: dict[str, Any]) -> int:
        return self.gpus_per_job or int(job.get("gpus", 1))

    def _claim_and_start(self) -> bool:
        """Claim and start what fits; True if an eligible job is still queued (waiting for a slot)."""
        self._reload_matrix_if_forever()
        with self.store.locked() as state:
            state["dispatchers"][self.id] = self._beat()
            for stale in mark_stale(state, now=time.time(), timeout=self.stale_after, host=self.host):
                self.log(
                    f"[sweep] job {stale} is stale: its dispatcher stopped (`speechlm sweep requeue --stale`)"
                )
            while True:
                free = self._free_slots()
                fits = [
                    jid
                    for jid in self.order
                    if self._eligible(jid) and self._gpus(self.jobs[jid]) <= len(free)
                ]
                jid = claim_next(state, fits, dispatcher=self.id, host=self.host, slots=[])
                if jid is None:
                    break
                slots = free[: self._gpus(self.jobs[jid])]
                child = self._start(jid, slots)
                state["jobs"][jid].update(
                    slots=slots, pid=child.proc.pid, log=str(self.dir / self.jobs[jid]["log"])
                )
            return any(
                state["jobs"].get(j, {}).get("state") == "queued" for j in self.order if self._eligible(j)
            )

    def _start(self, job_id: str, slots: list[str]) -> Child:
        job = self.jobs[job_id]
        argv = job_command(job, self.dir / job["config"], template=self.command)
        log_path = self.dir / job["log"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a")
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.id} slots={','.join(slots)}: "
                  f"{shlex.join(argv)}\n")  # fmt: skip
        log.flush()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(slots), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=self.dir, preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.log(f"[sweep] started {job_id} on slots {','.join(slots)} (pid {proc.pid}, log {log_path})")
        child = Child(job_id, slots, proc, log)
        self.children[job_id] = child
        return child

    def _reap(self) -> None:
        finished = {jid: c for jid, c in self.children.items() if c.proc.poll() is not None}
        if not finished:
            return
        with self.store.locked() as state:
            for jid, c in finished.items():
                rc = c.proc.returncode
                outcome = job_outcome(rc)
                job = state["jobs"][jid]
                if job.get("state") == "running" and job.get("dispatcher") == self.id:
                    n = int(job.get("preempted", 0)) + 1
                    if outcome == "preempted" and n > MAX_PREEMPTIONS:  # killed again and again: look at it
                        outcome = "failed"
                    if outcome == "preempted":  # checkpointed (or killed): back in the queue, it resumes
                        job.update(state="queued", preempted=n)
                    else:
                        job.update(state=outcome)
                    job.update(exit_code=rc, ended=time.time())
                c.log.close()
                del self.children[jid]
                how = f"exit {rc}" if rc >= 0 else f"killed by signal {-rc}"
                word = {
                    "done": "done",
                    "preempted": f"preempted ({how}); queued again, it resumes from its last checkpoint",
                    "failed": f"FAILED ({how}); log: {self.dir / self.jobs[jid]['log']}",
                }[outcome]
                self.log(f"[sweep] {jid}: {word}")

    def _shutdown(self, grace: float = 600.0) -> None:
        """SIGTERM every job, wait for their checkpoints, put them back in the queue."""
        self.log(
            f"[sweep] {self.id}: stopping; SIGTERM to {len(self.children)} job(s), they checkpoint and exit"
        )
        for c in self.children.values():
            if c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.time() + grace
        for c in self.children.values():
            try:
                c.proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.log(f"[sweep] {c.job_id} did not exit within {grace:.0f} s of SIGTERM; killing it")
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        with self.store.locked() as state:
            for jid, c in self.children.items():
                job = state["jobs"][jid]
                if job.get("dispatcher") == self.id and job["state"] == "running":
                    job.update(state="queued", exit_code=c.proc.returncode, ended=time.time())
                c.log.close()
        self.children.clear()

    def _reload_matrix_if_forever(self) -> None:
        if not self.forever:
            return
        matrix = read_matrix(self.dir)
        for j in matrix["jobs"]:
            if j["id"] not in self.jobs:
                self.jobs[j["id"]] = j
                self.order.append(j["id"])


def _matches(job: dict[str, Any], only: dict[str, str], keys_only: bool = False) -> bool:
    """True if the job sets every KEY=VALUE of `--only` (compared as the override text)."""
    sets = dict(split_override(o) for o in job.get("overrides", []))
    for key, value in only.items():
        if key not in sets and key != "id":
            return False
        if keys_only:
            continue
        if key == "id":
            if job["id"] != value:
                return False
        elif sets[key] != value:
            return False
    return True


def parse_only(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        try:
            k, v = split_override(item, f"--only {item!r}")
        except ConfigError as e:
            raise ValueError(f"{e}, e.g. --only sampler.temperature=0.3") from None
        out[k] = v
    return out
