"""The sweep's shared state: `status.json` changed only under an exclusive `fcntl` lock, by atomic replace.

Every dispatcher (one per machine, or several on one) reads, changes and writes `status.json` inside
`locked()`: a POSIX record lock (`fcntl.lockf`) on `SWEEP_DIR/status.lock`, which NFSv4 and Lustre
(mounted with `flock`) honour across machines. The new state is written to a temporary file in the
same directory, flushed to disk and moved over `status.json` (`speechlm.io.atomic_path`, durable), so a
reader sees the old file or the new one, never half of one; a process killed mid-write leaves only a
stray temporary file behind.

Job states::

    queued ──claim──▶ running ──exit 0──▶ done
                         │    ├─exit 143 or a signal──▶ queued  (preempted: `preempted` counts it;
                         │    │                                  the job resumes from its checkpoint)
                         │    └─other exit≠0──▶ failed  (never retried by itself)
                         └─dispatcher gone──▶ stale   (heartbeat too old, or its pid gone on this host)
    failed | stale ──requeue──▶ queued;   SIGTERM to a dispatcher: its running jobs ──▶ queued
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from speechlm.io import atomic_path

STATES = ("queued", "running", "done", "failed", "stale")


class StatusError(RuntimeError):
    """status.json cannot be read or holds something the dispatcher cannot use."""


def write_json_atomic(path: Path, data: Any) -> None:
    """The sweep's JSON (indent 1, sorted keys, a final newline) written durably (`speechlm.io.atomic_path`
    with ``durable=True``: file and folder fsynced), so a crash never rolls the state back."""
    with atomic_path(path, durable=True) as tmp, open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StatusStore:
    """Read-modify-write access to SWEEP_DIR/status.json under the sweep's lock."""

    def __init__(self, sweep_dir: str | Path):
        self.dir = Path(sweep_dir)
        self.path = self.dir / "status.json"
        self.lock_path = self.dir / "status.lock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """Yield the current state under the exclusive lock; what the block leaves in it is written back."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as lock:
            fcntl.lockf(lock, fcntl.LOCK_EX)
            try:
                state = self._read()
                before = json.dumps(state, sort_keys=True)
                yield state
                if json.dumps(state, sort_keys=True) != before:
                    write_json_atomic(self.path, state)
            finally:
                fcntl.lockf(lock, fcntl.LOCK_UN)

    def read(self) -> dict[str, Any]:
        """A snapshot without the lock (for display: atomic replace means it is always a whole file)."""
        return self._read()

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"version": 1, "jobs": {}, "dispatchers": {}}
        try:
            data = json.loads(self.path.read_text())
        except json.JSONDecodeError as e:
            raise StatusError(
                f"{self.path}: not valid JSON ({e}). The dispatchers only ever replace it whole, so it was "
                f"changed by hand or damaged: fix it, or delete it and run `speechlm sweep init` again "
                f"(every job becomes queued; finished runs keep their checkpoints)"
            ) from None
        except OSError as e:
            raise StatusError(f"{self.path}: cannot read ({e.strerror or e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("jobs"), dict):
            raise StatusError(f"{self.path}: expected an object with a 'jobs' mapping; delete it and re-init")
        for jid, job in data["jobs"].items():
            if not isinstance(job, dict) or job.get("state") not in STATES:
                raise StatusError(f"{self.path}: job '{jid}' has no valid state (one of {', '.join(STATES)})")
        data.setdefault("dispatchers", {})
        return data

    def add_jobs(self, job_ids: Iterable[str]) -> None:
        with self.locked() as state:
            for jid in job_ids:
                state["jobs"].setdefault(jid, {"state": "queued"})


def claim_next(
    state: dict[str, Any],
    order: list[str],
    *,
    dispatcher: str,
    host: str,
    slots: list[str],
    eligible: Any = None,
) -> str | None:
    """Mark the first queued job of `order` (that `eligible(id)` accepts) running for this dispatcher."""
    for jid in order:
        job = state["jobs"].get(jid)
        if job is None or job["state"] != "queued" or (eligible is not None and not eligible(jid)):
            continue
        job.update(
            state="running",
            dispatcher=dispatcher,
            host=host,
            slots=list(slots),
            pid=None,
            started=time.time(),
            ended=None,
            exit_code=None,
            attempts=int(job.get("attempts", 0)) + 1,
        )
        return jid
    return None


def mark_stale(state: dict[str, Any], *, now: float, timeout: float, host: str) -> list[str]:
    """Running jobs whose dispatcher stopped beating (or is a dead pid on this host) become `stale`."""
    dead = set()
    for did, d in state.get("dispatchers", {}).items():
        too_old = now - float(d.get("heartbeat", 0)) > timeout
        gone_here = d.get("host") == host and not pid_alive(int(d.get("pid", 0)))
        if too_old or gone_here:
            dead.add(did)
    marked = []
    for jid, job in state["jobs"].items():
        if job["state"] == "running" and (
            job.get("dispatcher") in dead or job.get("dispatcher") not in state["dispatchers"]
        ):
            job.update(state="stale", ended=now, stale_reason=f"dispatcher {job.get('dispatcher')} stopped")
            marked.append(jid)
    for did in dead:
        if not any(j.get("dispatcher") == did and j["state"] == "running" for j in state["jobs"].values()):
            del state["dispatchers"][did]
    return marked


def requeue(
    state: dict[str, Any], job_ids: Iterable[str] = (), *, failed: bool = False, stale: bool = False
) -> list[str]:
    """Put the named jobs (or every failed / stale one) back in the queue; a running job is refused."""
    chosen = list(job_ids)
    for jid in chosen:
        if jid not in state["jobs"]:
            raise StatusError(f"no job '{jid}' in this sweep; `speechlm sweep status` lists the ids")
        if state["jobs"][jid]["state"] == "running":
            raise StatusError(f"job '{jid}' is running; stop its dispatcher first (SIGTERM requeues it)")
    for jid, job in state["jobs"].items():
        if (failed and job["state"] == "failed") or (stale and job["state"] == "stale"):
            chosen.append(jid)
    for jid in chosen:
        state["jobs"][jid]["state"] = "queued"
    return sorted(set(chosen))
