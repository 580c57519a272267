"""Atomic, verifiable checkpoints, and resuming from them.

Layout of `RUN_DIR/checkpoints/step_000100/`:

    .metadata, __*_*.distcp   model and optimizer shards (PyTorch Distributed Checkpoint, one per rank)
    meta.pt                   Lightning's loop/scheduler/callback state and our counters: plain
                              containers and tensors only, loaded with `torch.load(weights_only=True)`
    speechlm/data_rank00000.json  the data pipeline's `state_dict()` of every rank (JSON)
    speechlm/rng_rank00000.pt     every rank's own RNG states (tensors only)
    complete.json             written last: the step and the size of every file above

Saving: every rank writes into `checkpoints/.tmp-step_000100`; after a barrier rank 0 writes
`complete.json` and renames the directory to `step_000100` (`os.replace`, atomic), then rewrites the
`latest` pointer atomically and only then deletes checkpoints beyond `keep_last`. A process killed at
any moment leaves either a `.tmp-*` directory (never resumed from, removed by the next save) or a
complete checkpoint; the previous good checkpoint is deleted only after a newer one is complete.

Loading: `verify_checkpoint` checks `complete.json` against the files (a missing or truncated file is
an error naming it) and reads `meta.pt` with `weights_only=True`, so a checkpoint directory from
someone else cannot run code. `resume=auto` takes the newest checkpoint that verifies and says which
incomplete ones it skipped; an explicit path that does not verify is an error suggesting the previous
checkpoint. `restore_training_state` then gives every rank its own data position and RNG states.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speechlm.errors import RunDirError

STEP_RE = re.compile(r"^step_(\d{6,})$")
COMPLETE_NAME = "complete.json"
META_NAME = "meta.pt"
RANK_DIR = "speechlm"


class CheckpointError(RunDirError, RuntimeError):
    """A checkpoint that is incomplete, truncated, altered or from another setup."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_root: Path, log: Any = print) -> Path | None:
    """The `latest` pointer's checkpoint if it verifies, else the newest one that does (skips are logged).

    None when there is no `step_*` directory; CheckpointError when there are some but none verifies."""
    pointer = ckpt_root / "latest"
    candidates = [p for _, p in reversed(list_checkpoints(ckpt_root))]
    if pointer.is_file():
        target = ckpt_root / pointer.read_text().strip()
        if target in candidates:
            candidates.remove(target)
            candidates.insert(0, target)
    reasons = []
    for p in candidates:
        try:
            verify_checkpoint(p)
        except CheckpointError as e:
            log(f"resume=auto: skipping {p}: {e}")
            reasons.append(str(e))
            continue
        return p
    if reasons:  # starting over would silently throw the run away (and keep_last would delete them)
        raise CheckpointError(
            f"resume=auto: none of the {len(reasons)} checkpoints in {ckpt_root} can be resumed from (first: "
            f"{reasons[0]}); checkpoints written before complete.json existed cannot be loaded safely. Start "
            f"over in a new trainer.run_dir, or remove {ckpt_root} to start over in this one"
        )
    return None


def resolve_resume(resume: str | None, run_dir: Path, log: Any = print) -> Path | None:
    """`None` → no resume; `auto` → the latest complete checkpoint of the run if any; else a path."""
    if resume is None or resume == "":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir / "checkpoints", log)
    p = Path(resume)
    if not p.is_dir():
        raise FileNotFoundError(
            f"trainer.resume={resume!r}: no checkpoint directory there; use trainer.resume=auto to pick the "
            f"latest checkpoint of trainer.run_dir, or give a path such as {run_dir}/checkpoints/step_000100"
        )
    try:
        verify_checkpoint(p)
    except CheckpointError as e:
        earlier = [q for step, q in list_checkpoints(p.parent) if q != p and q.name < p.name]
        hint = (
            f"resume from the previous checkpoint, trainer.resume={earlier[-1]}"
            if earlier
            else ("no earlier checkpoint is next to it; start without trainer.resume")
        )
        raise CheckpointError(f"{e}; {hint}") from None
    return p


# --- writing ----------------------------------------------------------------------------------------
def list_files(root: Path) -> dict[str, int]:
    return {
        str(f.relative_to(root)): f.stat().st_size
        for f in sorted(root.rglob("*"))
        if f.is_file() and f.name != COMPLETE_NAME
    }


def write_rank_state(ckpt_dir: Path, rank: int, data_state: dict[str, Any] | None) -> None:
    """This rank's data position (JSON) and RNG states (tensors), next to the model shards."""
    d = ckpt_dir / RANK_DIR
    d.mkdir(parents=True, exist_ok=True)
    if data_state is not None:
        (d / f"data_rank{rank:05d}.json").write_text(json.dumps(data_state, indent=1))
    torch.save(capture_rng_state(), d / f"rng_rank{rank:05d}.pt")


def save_checkpoint_atomic(
    trainer: Any,
    ckpt_root: Path,
    name: str,
    *,
    keep_last: int | None = None,
    update_latest: bool = True,
    data_state: dict[str, Any] | None = None,
) -> Path:
    """Save through `trainer.save_checkpoint` into a temp dir, then rename on rank 0 (all ranks call)."""
    from speechlm.train.faults import fault_point

    strategy = trainer.strategy
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp-{name}"
    final = ckpt_root / name
    if strategy.is_global_zero and tmp.exists():
        shutil.rmtree(tmp)
    strategy.barrier("speechlm_ckpt_pre")
    trainer.save_checkpoint(str(tmp), weights_only=False)  # full state: optimizer, loops, callbacks
    write_rank_state(tmp, strategy.global_rank, data_state)
    fault_point("save", trainer.global_step)  # the fault-injection harness kills here
    strategy.barrier("speechlm_ckpt_saved")
    if strategy.is_global_zero:
        manifest = {"step": trainer.global_step, "world_size": strategy.world_size, "files": list_files(tmp)}
        (tmp / COMPLETE_NAME).write_text(json.dumps(manifest, indent=1))
        if final.exists():
            old = ckpt_root / f".old-{name}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        if update_latest:
            write_text_atomic(ckpt_root / "latest", name)
        if keep_last:
            for _, p in list_checkpoints(ckpt_root)[:-keep_last]:
                shutil.rmtree(p, ignore_errors=True)
        for p in ckpt_root.glob(".tmp-*"):
            if p != tmp:
                shutil.rmtree(p, ignore_errors=True)
    strategy.barrier("speechlm_ckpt_done")
    return final


# --- reading ----------------------------------------------------------------------------------------
def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check completeness and sizes against `complete.json`; return it (CheckpointError names the file)."""
    marker = path / COMPLETE_NAME
    if not marker.is_file():
        raise CheckpointError(f"{path} is incomplete: no {COMPLETE_NAME} (the save was interrupted)")
    try:
        manifest = json.loads(marker.read_text())
        files = dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{marker} is unreadable ({e}): the checkpoint was altered or truncated"
        ) from None
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint is incomplete")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{f} is {f.stat().st_size} bytes, {size} when saved: the file was truncated or altered"
            )
    load_metadata(path)
    return manifest


def load_metadata(path: Path) -> dict[str, Any]:
    """`meta.pt` read with `weights_only=True` (plain containers and tensors only: no code runs)."""
    f = path / META_NAME
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is not what we wrote
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{f} cannot be loaded safely (weights_only=True): {first}; the file was truncated, altered or "
            f"written by another program"
        ) from None


def read_data_state(path: Path, rank: int) -> dict[str, Any] | None:
    f = path / RANK_DIR / f"data_rank{rank:05d}.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}): the checkpoint was altered") from None


def read_rng_state(path: Path, rank: int) -> dict[str, Any] | None:
    f = path / RANK_DIR / f"rng_rank{rank:05d}.pt"
    if not f.is_file():
        return None
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f} cannot be loaded safely (weights_only=True): {e}") from None


def restore_training_state(
    ckpt: Path, loader: Any, module: Any, *, resume_data: str, rank: int, world_size: int
) -> tuple[int, dict[str, int]]:
    """Give this rank its data position and RNG states from `ckpt`; return (global step, position).

    `resume_data="exact"` continues the data after the last trained micro-batch and needs the saved
    layout; `"next_epoch"` starts the epoch after the saved one in this run's layout."""
    meta = load_metadata(ckpt)
    saved_world = json.loads((ckpt / COMPLETE_NAME).read_text()).get("world_size", world_size)
    state = read_data_state(ckpt, rank if resume_data == "exact" else 0)
    if state is None:
        raise CheckpointError(
            f"{ckpt / RANK_DIR} has no data state for rank {rank} (saved by {saved_world} processes, this run "
            f"has {world_size}); add trainer.resume_data=next_epoch to resume the model and optimizer into "
            f"this layout (the data restarts at the next epoch)"
        )
    try:
        loader.restore(state, next_epoch=resume_data == "next_epoch")
    except ValueError as e:
        raise CheckpointError(
            f"cannot continue the data order of {ckpt}: {e}\nTo resume the model and optimizer into this layout "
            f"anyway, add trainer.resume_data=next_epoch (the data restarts at the next epoch)"
        ) from None
    module.pending_rng = read_rng_state(ckpt, rank) if saved_world == world_size else None
    return int(meta.get("global_step", 0)), dict(loader.consumed)


# --- RNG states as tensors and plain values (weights_only-safe) ---------------------------------------
def capture_rng_state() -> dict[str, Any]:
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any] | None) -> None:
    if not state:
        return
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_run(
    cfg: Any,
    run_dir: Path,
    loader: Any,
    module: Any,
    trainer: Any,
    metrics: Any,
    *,
    rank: int,
    world_size: int,
) -> Path | None:
    """Resolve `trainer.resume`, restore this rank's data position and RNG state (the weights,
    optimizer and loops are restored by `trainer.fit(ckpt_path=...)`), and trim `metrics.jsonl` to the
    restored step. Returns the checkpoint to hand to fit, or None for a fresh start."""
    from speechlm.train.lightning_compat import set_fit_max_steps

    t = cfg.trainer
    step, pos = 0, None  # type: tuple[int, dict[str, int] | None]
    try:
        ckpt = resolve_resume(t.resume, run_dir, log=print if rank == 0 else (lambda _m: None))
        if ckpt is not None:
            step, pos = restore_training_state(
                ckpt, loader, module, resume_data=t.resume_data, rank=rank, world_size=world_size
            )
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    if pos is not None and rank == 0:
        metrics.truncate_after(step)
        print(f"resuming from {ckpt} (optimizer step {step}, epoch {pos['epoch']}, "
              f"micro-batch {pos['position']} of it; data: {t.resume_data})")  # fmt: skip
    if t.validate_only:
        # evaluation only: restore the checkpoint (if any) through fit, with no optimizer step to take
        set_fit_max_steps(trainer, step if ckpt is not None else 0)
    if ckpt is None and rank == 0:
        metrics.truncate_after(0)  # a fresh run starts a fresh history
        old = run_dir / "checkpoints"
        if any(old.glob("step_*")):
            print(
                f"note: {old} holds checkpoints of an earlier run; this run starts from scratch (add "
                f"trainer.resume=auto to continue that run instead); they are replaced as new ones are saved"
            )
    return ckpt
