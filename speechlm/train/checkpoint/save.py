"""Saving a checkpoint atomically (`save_checkpoint_atomic`).

Every rank writes into `checkpoints/.tmp-step_000100` (its DCP shards, its RNG states, the data
position of its dp rank once per dp group, and the SHA-256 of what it wrote); after a barrier rank 0
writes `complete.json` and renames the directory to `step_000100` (`os.replace`, atomic), then rewrites
the `latest` pointer atomically and durably and only then deletes checkpoints beyond `keep_last`
(`rotate_checkpoints`, this run's lineage only). A process killed at any moment leaves either a `.tmp-*`
directory (never resumed from, removed by the next save) or a complete checkpoint; a full disk removes
the temp dir and names the previous checkpoint, which is kept (`save_failed`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from speechlm.errors import OutputError
from speechlm.io import atomic_write_text, sha256_of
from speechlm.train.checkpoint.paths import data_position_name, run_id_of
from speechlm.train.checkpoint.rng import capture_rng_state
from speechlm.train.faults import fault_point
from speechlm.use.checkpoint_files import (
    COMPLETE_NAME,
    CONFIG_NAME,
    RANK_DIR,
    list_checkpoints,
    recover_interrupted_resave,
    trash_name,
)


def list_files(root: Path) -> dict[str, int]:
    return {
        str(f.relative_to(root)): f.stat().st_size
        for f in sorted(root.rglob("*"))
        if f.is_file() and f.name != COMPLETE_NAME
    }


def own_files(ckpt_dir: Path, rank: int) -> list[Path]:
    """The files this rank wrote: its DCP shards `__<rank>_*.distcp` and its `speechlm/*_rank<rank>.*`."""
    return sorted([*ckpt_dir.glob(f"__{rank}_*.distcp"), *(ckpt_dir / RANK_DIR).glob(f"*_rank{rank:05d}.*")])


def hash_own_files(ckpt_dir: Path, rank: int, also: list[Path] | None = None) -> None:
    """Each rank hashes what it wrote (`own_files` and `also`: its dp rank's data position) into
    `speechlm/sha256_rank<r>.json`, so the cost is spread over the ranks."""
    files = sorted({*own_files(ckpt_dir, rank), *(also or [])})
    hashes = {str(f.relative_to(ckpt_dir)): sha256_of(f) for f in files}
    (ckpt_dir / RANK_DIR).mkdir(parents=True, exist_ok=True)
    (ckpt_dir / RANK_DIR / f"sha256_rank{rank:05d}.json").write_text(json.dumps(hashes, indent=1))


def collect_hashes(ckpt_dir: Path, files: dict[str, int]) -> dict[str, str]:
    """Every file's SHA-256: the ranks' own (hash_own_files), the rest (.metadata, meta.pt, ...) here."""
    known: dict[str, str] = {}
    for f in sorted((ckpt_dir / RANK_DIR).glob("sha256_rank*.json")):
        known.update(json.loads(f.read_text()))
    return {rel: known.get(rel) or sha256_of(ckpt_dir / rel) for rel in files}


def write_rank_state(ckpt_dir: Path, rank: int, data_state: dict[str, Any] | None) -> list[Path]:
    """This rank's RNG states (tensors) and, when given (once per dp rank), the data position of its dp
    rank (JSON, keyed by the state's `dp_rank`), next to the model shards; returns the files written."""
    d = ckpt_dir / RANK_DIR
    d.mkdir(parents=True, exist_ok=True)
    written = [d / f"rng_rank{rank:05d}.pt"]
    torch.save(capture_rng_state(), written[0])
    if data_state is not None:
        written.append(d / data_position_name(int(data_state.get("dp_rank", 0))))
        written[-1].write_text(json.dumps(data_state, indent=1))
    return written


def rotate_checkpoints(ckpt_root: Path, keep_last: int | None, run_id: str | None) -> list[Path]:
    """Delete this run's `step_*` checkpoints beyond the `keep_last` highest steps; return what was deleted.

    Only checkpoints of this run's lineage are candidates (complete.json `run_id` equal to ours: saved
    by this run, or by the run it resumed from); the one `latest` names is never deleted; `keep_last`
    None or < 1 keeps everything (validation refuses < 1; this is the belt to its braces)."""
    if not keep_last or keep_last < 1 or run_id is None:
        return []
    pointer = ckpt_root / "latest"
    protected = ckpt_root / pointer.read_text().strip() if pointer.is_file() else None
    ours = [p for _, p in list_checkpoints(ckpt_root) if run_id_of(p) == run_id]
    doomed = [p for p in ours[:-keep_last] if p != protected]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def save_checkpoint_atomic(
    trainer: Any,  # Any: a Trainer whose strategy is a ParallelStrategy (tests: a stand-in)
    ckpt_root: Path,
    name: str,
    *,
    keep_last: int | None = None,
    update_latest: bool = True,
    data_state: dict[str, Any] | None = None,
    run_id: str | None = None,
    layout: dict[str, int] | None = None,
) -> Path:
    """Save through `trainer.save_checkpoint` into a temp dir, then rename on rank 0 (all ranks call).

    `data_state`: the data position of this rank's dp rank, given by the first rank of each dp group
    only (`writes_data_position`; None on its cp/tp peers); `layout`: the run's `layout_of(dims)`,
    recorded in complete.json (the RNG states are restored only into the same layout). A full disk (or any OS error while
    writing) removes the temp dir and raises OutputError naming the checkpoint and the previous one,
    which is kept."""
    from torch.distributed.checkpoint.api import (
        CheckpointException,  # lazy: DCP (seconds to import; only a save or a load needs it)
    )

    strategy = trainer.strategy
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp-{name}"
    final = ckpt_root / name
    if strategy.is_global_zero:
        recover_interrupted_resave(final)
        if tmp.exists():
            shutil.rmtree(tmp)
    strategy.barrier("speechlm_ckpt_pre")
    try:
        trainer.save_checkpoint(str(tmp), weights_only=False)  # full state: optimizer, loops, callbacks
        written = write_rank_state(tmp, strategy.global_rank, data_state)
        hash_own_files(tmp, strategy.global_rank, written)
    except (Exception, CheckpointException) as e:
        err = save_failed(e, ckpt_root, tmp, final, strategy.is_global_zero)
        if err is None:
            raise
        raise err from e
    fault_point("save", trainer.global_step)  # the fault-injection harness kills here
    strategy.barrier("speechlm_ckpt_saved")
    if strategy.is_global_zero:
        try:
            config = ckpt_root.parent / CONFIG_NAME
            if config.is_file():
                shutil.copyfile(config, tmp / RANK_DIR / CONFIG_NAME)
            files = list_files(tmp)
            manifest = {
                "step": trainer.global_step,
                "world_size": strategy.world_size,
                "layout": layout,
                "run_id": run_id,
                "files": files,
                "sha256": collect_hashes(tmp, files),
            }
            # written last, inside the temporary directory whose rename (`publish`) is the atomic step: a
            # reader never sees the directory under its final name without it
            (tmp / COMPLETE_NAME).write_text(json.dumps(manifest, indent=1))
        except OSError as e:
            raise save_failed(e, ckpt_root, tmp, final, True) from e  # type: ignore[misc]
        publish(tmp, final)
        if update_latest:
            atomic_write_text(ckpt_root / "latest", name, durable=True)  # the resume point
        rotate_checkpoints(ckpt_root, keep_last, run_id)
        for p in ckpt_root.glob(".tmp-*"):
            if p != tmp:
                shutil.rmtree(p, ignore_errors=True)
    strategy.barrier("speechlm_ckpt_done")
    return final


def publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. Re-saving a name (`best`): the old one goes to `.old-<name>` first, so a
    kill between the two renames leaves a complete `.old-<name>`, which every reader takes for `<name>`
    (recover_interrupted_resave); it is deleted only once the new one is in place."""
    if not final.exists():
        os.replace(tmp, final)
        return
    trash = final.with_name(trash_name(final.name))
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(final, trash)
    os.replace(tmp, final)
    shutil.rmtree(trash, ignore_errors=True)


def save_failed(
    e: BaseException, ckpt_root: Path, tmp: Path, final: Path, remove: bool
) -> OutputError | None:
    """An OS error while writing a checkpoint (disk full, permission): remove the temp dir, keep the rest."""
    os_error = e if isinstance(e, OSError) else _find_os_error(e)
    if os_error is None:
        return None  # not an I/O failure: a bug, let it through
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    pointer = ckpt_root / "latest"
    kept = pointer.read_text().strip() if pointer.is_file() else None
    previous = (
        f"the previous checkpoint {ckpt_root / kept} is kept and trainer.resume=auto continues from it"
        if kept
        else "no earlier checkpoint exists"
    )
    return OutputError(
        f"cannot write checkpoint {final}: {os_error.strerror or os_error} ({tmp} removed); {previous}. "
        f"Free space under {ckpt_root} (or fix its permissions) and resume with trainer.resume=auto"
    )


def _find_os_error(e: BaseException) -> OSError | None:
    """The OSError inside an exception that wraps it (DCP's CheckpointException keeps per-rank failures)."""
    seen: set[int] = set()
    stack: list[Any] = [e]
    while stack:
        x = stack.pop()
        if id(x) in seen or x is None:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        if isinstance(x, BaseException):
            stack += [x.__cause__, x.__context__, *x.args]
            failures = getattr(x, "failures", None)
            if isinstance(failures, dict):
                stack += list(failures.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return None
