"""Atomic checkpoints in PyTorch Distributed Checkpoint format.

Lightning's model-parallel strategy writes a DCP directory (one shard file per rank plus a metadata
file). We write it under `checkpoints/.tmp-step_000100`, wait for every rank, and only then rank 0
renames it to `checkpoints/step_000100` and rewrites the `latest` pointer with an atomic
`os.replace`. A crash mid-save leaves a `.tmp-*` directory that is ignored and cleaned up later; the
previous checkpoint and the `latest` pointer stay valid.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d{6,})$")


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


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        target = ckpt_root / pointer.read_text().strip()
        if target.is_dir():
            return target
    ckpts = list_checkpoints(ckpt_root)
    return ckpts[-1][1] if ckpts else None


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """`None` → no resume; `auto` → the latest complete checkpoint of the run if any; else a path."""
    if resume is None or resume == "":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir / "checkpoints")
    p = Path(resume)
    if not p.is_dir():
        raise FileNotFoundError(
            f"trainer.resume={resume!r}: no checkpoint directory there; use trainer.resume=auto to pick the "
            f"latest checkpoint of trainer.run_dir, or give a path such as {run_dir}/checkpoints/step_000100"
        )
    return p


def save_checkpoint_atomic(
    trainer, ckpt_root: Path, name: str, *, keep_last: int | None = None, update_latest: bool = True
) -> Path:
    """Save through `trainer.save_checkpoint` into a temp dir, then rename on rank 0 (all ranks call)."""
    strategy = trainer.strategy
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp-{name}"
    final = ckpt_root / name
    if strategy.is_global_zero and tmp.exists():
        shutil.rmtree(tmp)
    strategy.barrier("speechlm_ckpt_pre")
    trainer.save_checkpoint(str(tmp), weights_only=False)  # full state: optimizer, loops, callbacks
    strategy.barrier("speechlm_ckpt_saved")
    if strategy.is_global_zero:
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
