"""Fault injection: prove that an interrupted and resumed run trains exactly like a straight one.

`speechlm faults CONFIG --kill sigterm@5 --kill sigkill_in_save@8 [--nproc 2] [--cp-size 2] [overrides]`
runs the same training twice under `RUN_ROOT`:

  straight/      start to finish, no interruption;
  interrupted/   one launch per fault, each killed by it, each relaunched with `trainer.resume=auto`,
                 then a last launch that runs to `trainer.max_steps`.

and compares `metrics.jsonl` step by step: `rows_digest` (the manifest rows each step trained on),
loss and learning rate must be identical (bit-for-bit: the floats are compared as written). It prints
one line per launch and a verdict, and exits 1 on the first differing step.

Faults (environment `SPEECHLM_FAULTS`, read by the training process; `KIND@STEP`):

  sigterm@N          every rank sends itself SIGTERM after optimizer step N: the documented
                     preemption path (checkpoint at step N, clean exit);
  sigkill@N          rank 0 is SIGKILLed after step N, before any checkpoint of step N (no handler
                     runs; under torchrun the other ranks are torn down with it);
  sigkill_in_save@N  rank 0 is SIGKILLed inside the checkpoint save of step N, after every rank
                     wrote its shards and before the checkpoint is marked complete and renamed;
  sigterm_in_val@N   every rank sends itself SIGTERM once the validation of step N has started
                     (needs `trainer.val_every` to divide N): validation finishes, step N is saved.

After a SIGKILL the next launch resumes from the last complete checkpoint and repeats the steps
after it; `metrics.jsonl` is truncated to that step first, so the comparison covers every step once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechlm.errors import RunDirError

ENV = "SPEECHLM_FAULTS"
KINDS = ("sigterm", "sigkill", "sigkill_in_save", "sigterm_in_val")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}"


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, step = item.partition("@")
        if kind not in KINDS or not step.isdigit() or int(step) < 1:
            raise ValueError(
                f"fault {item!r}: write KIND@STEP with KIND one of {', '.join(KINDS)} and STEP >= 1"
            )
        faults.append(Fault(kind, int(step)))
    return faults


def active_faults() -> list[Fault]:
    return parse_faults(os.environ.get(ENV, ""))


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def fault_point(where: str, step: int) -> None:
    """Called by the checkpoint writer between the shards and the completion marker (`save`) and by
    the validation callback as validation starts (`val`)."""
    if where == "save" and global_rank() == 0 and Fault("sigkill_in_save", step) in active_faults():
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "val" and Fault("sigterm_in_val", step) in active_faults():
        os.kill(os.getpid(), signal.SIGTERM)


# --- the harness -------------------------------------------------------------------------------------
def build_command(config: str, overrides: list[str], nproc: int, cp_size: int) -> list[str]:
    if nproc > 1:
        exe = shutil.which("torchrun")
        cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
        cmd += ["--standalone", f"--nproc-per-node={nproc}", "-m", "speechlm.train"]
    else:
        cmd = [sys.executable, "-m", "speechlm.train"]
    return [*cmd, config, *overrides, *([f"parallel.cp_size={cp_size}"] if cp_size > 1 else [])]


def launch(cmd: list[str], run_dir: Path, faults: list[Fault], log_path: Path, timeout: float) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{ENV: ",".join(map(str, faults))})
    env.setdefault("OMP_NUM_THREADS", "1")
    with log_path.open("a") as log:
        log.write(f"\n$ {ENV}={env[ENV]} {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.run(
            [*cmd, f"trainer.run_dir={run_dir}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout,
        )
    return proc.returncode


def read_train_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    return [r for r in rows if r.get("kind") == "train"]


def compare_metrics(
    straight: list[dict], resumed: list[dict], keys=("rows_digest", "loss", "lr")
) -> list[str]:
    """Differences, one line each: missing/extra steps and any differing key (exact comparison)."""
    a = {m["step"]: m for m in straight}
    b = {m["step"]: m for m in resumed}
    diffs = []
    if sorted(a) != sorted(b):
        diffs.append(f"steps differ: straight {sorted(a)}, interrupted {sorted(b)}")
    for step in sorted(set(a) & set(b)):
        for k in keys:
            if a[step].get(k) != b[step].get(k):
                diffs.append(f"step {step}: {k} straight={a[step].get(k)!r} interrupted={b[step].get(k)!r}")
    return diffs


def run_scenario(
    config: str,
    overrides: list[str],
    faults: list[Fault],
    run_root: Path,
    *,
    nproc: int = 1,
    cp_size: int = 1,
    timeout: float = 900,
    log: Callable[[str], object] = print,
    inspect: Callable[[Fault, int, Path], object] | None = None,
) -> dict[str, Any]:
    """Straight run vs a run interrupted by each fault in turn; returns the launches and differences."""
    run_root.mkdir(parents=True, exist_ok=True)
    cmd = build_command(config, overrides, nproc, cp_size)
    log_path = run_root / "harness.log"
    rc = launch(cmd, run_root / "straight", [], log_path, timeout)
    log(f"straight run: exit {rc}")
    if rc != 0:
        raise RuntimeError(f"the straight run failed (exit {rc}); see {log_path}")
    launches = []
    interrupted = run_root / "interrupted"
    for i, fault in enumerate(faults):
        extra = ["trainer.resume=auto"] if i else []
        rc = launch([*cmd, *extra], interrupted, [fault], log_path, timeout)
        last = read_train_metrics(interrupted)
        launches.append({"fault": str(fault), "exit": rc, "last_step": last[-1]["step"] if last else 0})
        log(f"launch {i + 1} with {fault}: exit {rc}, metrics end at step {launches[-1]['last_step']}")
        if inspect is not None:  # tests look at the run directory between launches
            inspect(fault, rc, interrupted)
    rc = launch([*cmd, "trainer.resume=auto"], interrupted, [], log_path, timeout)
    launches.append({"fault": None, "exit": rc})
    log(f"final launch (resume=auto): exit {rc}")
    if rc != 0:
        raise RuntimeError(f"the last resumed run failed (exit {rc}); see {log_path}")
    straight, resumed = read_train_metrics(run_root / "straight"), read_train_metrics(interrupted)
    diffs = compare_metrics(straight, resumed)
    return {"launches": launches, "steps": len(straight), "differences": diffs, "log": str(log_path)}


def add_parser(sub: Any) -> None:  # Any: argparse's subparsers action (a private class)
    p = sub.add_parser(
        "faults",
        help="fault-injection harness: interrupted + resumed vs straight training, step by step",
        # the whole module docstring: what runs, where, and the fault kinds (KIND@STEP)
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML experiment config, e.g. configs/smoke.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides for both runs (KEY=VALUE)")
    p.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="KIND@STEP",
        help="a fault (kinds above), repeatable, in launch order",
    )
    p.add_argument(
        "--run-root",
        default="runs/faults",
        help="directory for straight/ and interrupted/; an earlier scenario's output there is replaced, anything else is refused (default: %(default)s)",
    )
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun, gloo on CPU; default: 1)")
    p.add_argument("--cp-size", type=int, default=1, help="context-parallel size of both runs (default: 1)")
    p.set_defaults(func=run_faults_command)


FAULTS_OWN = frozenset({"straight", "interrupted", "harness.log", "report.json"})


def clear_run_root(root: Path) -> None:
    """Empty `root` for a new scenario, but only when it holds nothing but an earlier scenario's output.

    Anything else there (another run's checkpoints, a mistyped --run-root) is refused, never deleted."""
    if not root.exists():
        return
    if not root.is_dir():
        raise RunDirError(f"--run-root {root} is a file; give a directory for straight/ and interrupted/")
    foreign = sorted(p.name for p in root.iterdir() if p.name not in FAULTS_OWN)
    if foreign:
        raise RunDirError(
            f"--run-root {root} holds files that `speechlm faults` did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); nothing was deleted: give an empty or new directory"
        )
    shutil.rmtree(root)


def run_faults_command(args: argparse.Namespace) -> int:
    try:
        faults = parse_faults(",".join(args.kill))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not faults:
        print("error: give at least one --kill KIND@STEP", file=sys.stderr)
        return 2
    root = Path(args.run_root)
    clear_run_root(root)
    report = run_scenario(
        args.config, list(args.overrides), faults, root, nproc=args.nproc, cp_size=args.cp_size
    )
    (root / "report.json").write_text(json.dumps(report, indent=1))
    if report["differences"]:
        print(f"DIFFERENT after resume ({len(report['differences'])} differences):")
        print("\n".join(report["differences"][:20]))
        return 1
    print(f"identical: rows_digest, loss and lr of all {report['steps']} steps match the straight run")
    return 0
