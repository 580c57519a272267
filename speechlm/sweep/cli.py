"""`speechlm sweep init|run|status|requeue|report|slurm` (see docs/sweep.md)."""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from speechlm.sweep.dispatch import Dispatcher, parse_only
from speechlm.sweep.spec import SpecError, load_spec, read_matrix, write_sweep
from speechlm.sweep.store import StatusError, StatusStore, mark_stale, requeue
from speechlm.sweep.view import collect_status, format_report, format_status, plot_report


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sweep", help="run an experiment matrix over GPU slots (init, run, status, ...)")
    ss = p.add_subparsers(dest="sweep_command", metavar="SWEEP_COMMAND", required=True)

    q = ss.add_parser("init", help="spec → matrix.json, one resolved config and run dir per job")
    q.add_argument("spec", help="sweep spec YAML (base, overrides, grid, jobs, gpus_per_job)")
    q.add_argument("--out", required=True, help="the sweep directory (on a filesystem every machine mounts)")
    q.set_defaults(func=cmd_init)

    q = ss.add_parser("run", help="dispatch queued jobs onto free slots until none is left")
    q.add_argument("sweep_dir")
    q.add_argument("--slots", required=True, help="GPU slots of this machine, e.g. 0,1,2,3")
    q.add_argument("--gpus-per-job", type=int, default=None, help="slots per job (default: the spec's)")
    q.add_argument("--poll", type=float, default=10.0, help="seconds between polls (default 10)")
    q.add_argument(
        "--only", action="append", metavar="KEY=VALUE", help="only jobs that set KEY=VALUE (repeatable)"
    )
    q.add_argument("--forever", action="store_true", help="keep polling for jobs added later")
    q.add_argument(
        "--stale-after", type=float, default=120.0, help="heartbeat age (s) that makes a dispatcher dead"
    )
    q.add_argument("--command", default=None,
                   help="command a job runs instead of `speechlm train`; {config} {run_dir} {nproc} are filled in")  # fmt: skip
    q.set_defaults(func=cmd_run)

    q = ss.add_parser("status", help="one row per job: state, host/slots, step, WER, elapsed")
    q.add_argument("sweep_dir")
    q.add_argument("--json", action="store_true", help='print {"jobs": [{"id", "state", ...}]}')
    q.add_argument(
        "--stale-after", type=float, default=120.0, help="heartbeat age (s) that makes a dispatcher dead"
    )
    q.set_defaults(func=cmd_status)

    q = ss.add_parser("requeue", help="put failed or stale jobs (or the named ones) back in the queue")
    q.add_argument("sweep_dir")
    q.add_argument("job_ids", nargs="*")
    q.add_argument("--failed", action="store_true", help="every failed job")
    q.add_argument("--stale", action="store_true", help="every stale job")
    q.add_argument(
        "--stale-after", type=float, default=120.0, help="heartbeat age (s) that makes a dispatcher dead"
    )
    q.set_defaults(func=cmd_requeue)

    q = ss.add_parser(
        "report",
        help="each job's final WER (eval.json) and best validation WER, best first; --plot draws them",
    )
    q.add_argument("sweep_dir")
    q.add_argument(
        "--plot", metavar="FILE.png", help="also draw the WER per job and per value of each grid axis"
    )
    q.set_defaults(func=cmd_report)

    q = ss.add_parser("slurm", help="write an sbatch script: one dispatcher per node on this sweep")
    q.add_argument("sweep_dir")
    q.add_argument("--nodes", type=int, required=True)
    q.add_argument("--gpus-per-node", type=int, required=True)
    q.add_argument("--partition", default=None)
    q.add_argument("--time", default=None, help="Slurm time limit, e.g. 24:00:00")
    q.add_argument("--account", default=None)
    q.add_argument("--out", default=None, help="script path (default SWEEP_DIR/sweep.sbatch)")
    q.set_defaults(func=cmd_slurm)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_init(args: argparse.Namespace) -> int:
    try:
        matrix = write_sweep(load_spec(args.spec), Path(args.out))
    except SpecError as e:
        return _fail(str(e))
    print(f"{args.out}: {len(matrix['jobs'])} jobs (matrix.json, jobs/<id>/config.yaml)")
    for j in matrix["jobs"]:
        print(f"  {j['id']}: {' '.join(j['overrides']) or '(base config)'}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        d = Dispatcher(
            args.sweep_dir, [s.strip() for s in args.slots.split(",") if s.strip()],
            gpus_per_job=args.gpus_per_job, poll=args.poll, only=parse_only(args.only), forever=args.forever,
            stale_after=args.stale_after, command=args.command, log=lambda m: print(m, flush=True),
        )  # fmt: skip
        return d.run()
    except (SpecError, StatusError, ValueError) as e:
        return _fail(str(e))


def cmd_status(args: argparse.Namespace) -> int:
    try:
        rows = collect_status(Path(args.sweep_dir), stale_after=args.stale_after)
    except (SpecError, StatusError) as e:
        return _fail(str(e))
    print(json.dumps({"jobs": rows}, indent=1) if args.json else format_status(rows))
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    if not (args.job_ids or args.failed or args.stale):
        return _fail("name job ids, or --failed, or --stale")
    try:
        with StatusStore(args.sweep_dir).locked() as state:
            mark_stale(state, now=time.time(), timeout=args.stale_after, host=socket.gethostname())
            done = requeue(state, args.job_ids, failed=args.failed, stale=args.stale)
    except StatusError as e:
        return _fail(str(e))
    print(f"requeued {len(done)} job(s): {', '.join(done) or '-'} (they resume from their latest checkpoint)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    try:
        rows = collect_status(Path(args.sweep_dir))
    except (SpecError, StatusError) as e:
        return _fail(str(e))
    print(format_report(rows))
    if args.plot:
        try:
            out = plot_report(rows, Path(args.plot))
        except ValueError as e:
            return _fail(str(e))
        print(f"wrote {out}")
    return 0


def slurm_script(sweep_dir: Path, *, nodes: int, gpus_per_node: int, partition: str | None = None,
                 time_limit: str | None = None, account: str | None = None) -> str:  # fmt: skip
    """An sbatch script that starts one `speechlm sweep run` per node on the same sweep directory."""
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=speechlm-sweep",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --output={sweep_dir}/slurm-%j-%N.out",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    default_slots = ",".join(str(i) for i in range(gpus_per_node))
    lines += [
        "",
        "# one dispatcher per node; the fcntl lock in the sweep directory keeps them from claiming a job twice.",
        "# Slots are the GPUs Slurm gave this node (CUDA_VISIBLE_DEVICES), or 0..G-1 when it sets none.",
        "# Jobs still running when the allocation ends get SIGTERM, checkpoint and go back to the queue.",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c "
        f"'exec speechlm sweep run {shlex.quote(str(sweep_dir))} "
        f'--slots "${{CUDA_VISIBLE_DEVICES:-{default_slots}}}"\'',
        "",
    ]
    return "\n".join(lines)


def cmd_slurm(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    try:
        read_matrix(sweep_dir)
    except SpecError as e:
        return _fail(str(e))
    if args.nodes < 1 or args.gpus_per_node < 1:
        return _fail("--nodes and --gpus-per-node must be >= 1")
    out = Path(args.out) if args.out else sweep_dir / "sweep.sbatch"
    out.write_text(slurm_script(sweep_dir, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                partition=args.partition, time_limit=args.time, account=args.account))  # fmt: skip
    print(f"wrote {out}; submit it with: sbatch {out}")
    return 0
