"""Run a function on several local processes with an initialised process group (for tests).

Usage (``fn`` is best a module-level function: spawned children must import it):

    def _worker(rank: int, world_size: int, n: int) -> torch.Tensor:
        x = torch.full((n,), float(rank))
        torch.distributed.all_reduce(x)
        return x                                     # anything torch.save can store

    def test_all_reduce():
        results = run_distributed(_worker, 2, "gloo", 3)   # -> [tensor, tensor], one per rank
        assert all(torch.equal(r, torch.ones(3)) for r in results)

Each child gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and
OMP_NUM_THREADS=1 (and ``torch.set_num_threads(1)``), so code that reads the torch environment
variables (``init_process_group("gloo")`` with env://, DeviceMesh) works unchanged; the default
group is initialised before ``fn`` runs and destroyed after. With backend "nccl" rank i uses
``cuda:i``. Return values travel through ``torch.save`` files (detach tensors you return).

Failures never hang the caller: an exception in a rank is re-raised in the parent as a
RuntimeError carrying that rank's traceback (the other ranks are killed), a rank that dies
without a result is reported with its exit code, and the whole run is killed after
``timeout_s`` with a TimeoutError that says which ranks had not finished.

Start method: gloo ranks are forked by default (``start_method="fork"``): a forked child has torch and
the test's modules already imported, so a rank starts in milliseconds instead of the ~3 s a spawned
child spends importing torch. Each forked child reseeds torch's default generator non-deterministically,
as a spawned child's torch import does, instead of inheriting the parent's state. NCCL ranks are spawned
(CUDA cannot be used in a child forked from a parent that initialised it); pass
``start_method="spawn"`` to get spawn for gloo too (``fn`` must then be a module-level function).
Starting ranks costs little either way, but a group per check still costs a rendezvous and a
teardown: pack several checks (layouts, cases) into one call where they share a world size.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "find_free_port", "default_start_method"]


def default_start_method(backend: str) -> str:
    """The start method for ``backend``: fork for gloo (no torch import per rank), spawn for NCCL."""
    return "spawn" if backend == "nccl" else "fork"


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    out_dir: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    torch.seed()  # a fresh, non-deterministic seed, as a spawned rank's torch import draws (not the parent's state)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    backend: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout_s: float,
    out_dir: str,
    start_method: str,
) -> tuple[list[Any] | None, dict[int, str]]:
    """One attempt: (results or None, {rank: error text}); raises TimeoutError on a hang."""
    ctx: Any = mp.get_context(start_method)
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, backend, port, out_dir, timeout_s, fn, args, kwargs),
            daemon=False,  # fn may start its own workers (a daemonic process may not)
        )
        for rank in range(world_size)
    ]
    sys.stdout.flush()  # a forked child would write the parent's buffered output a second time
    sys.stderr.flush()
    # Garbage the children would inherit is freed here, where it was made: a destroyed process group still
    # held in a reference cycle, collected in a forked child, joins gloo threads the child does not have
    # and never returns.
    gc.collect()
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait for it forever
            if time.monotonic() > deadline:
                running = [r for r, p in enumerate(procs) if p.is_alive()]
                raise TimeoutError(
                    f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) did not finish "
                    f"within {timeout_s} s; ranks still running: {running} (a collective that not every rank "
                    "reaches hangs like this); they were killed"
                )
            time.sleep(0.02)
    finally:
        _stop(procs)
    errors: dict[int, str] = {}
    for rank in range(world_size):
        err_path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(err_path):
            with open(err_path) as f:
                errors[rank] = f.read()
    for rank, p in enumerate(procs):
        if rank not in errors and not os.path.exists(os.path.join(out_dir, f"rank{rank}.pt")):
            why = "killed after another rank failed" if errors else f"exited with code {p.exitcode}"
            errors[rank] = f"no result ({why})"
    if errors:
        return None, errors
    results = [
        torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)
    ]
    return results, {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "gloo",
    *args: Any,
    timeout_s: float = 120,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local processes.

    Returns the per-rank return values in rank order. Raises RuntimeError with the failing
    ranks' tracebacks if any rank fails, TimeoutError after ``timeout_s`` seconds. If the free
    port was taken by someone else before rank 0 bound it, the run is retried on a new port.
    ``start_method`` None means `default_start_method(backend)` (fork for gloo, spawn for NCCL).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    method = start_method or default_start_method(backend)
    if method not in mp.get_all_start_methods():
        raise ValueError(
            f"start_method {method!r} is not available here (available: {mp.get_all_start_methods()}); "
            'pass start_method="spawn"'
        )
    for attempt in range(3):
        with tempfile.TemporaryDirectory(prefix="run_distributed_") as out_dir:
            results, errors = _run_once(fn, world_size, backend, args, kwargs, timeout_s, out_dir, method)
        if results is not None:
            return results
        port_race = any(
            "address already in use" in e.lower() or "eaddrinuse" in e.lower() for e in errors.values()
        )
        if not (port_race and attempt < 2):
            break
    text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
    raise RuntimeError(
        f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) failed:\n{text}"
    )
