"""Where a run's checkpoints are, and which one a launch resumes: `resolve_resume` (trainer.resume:
none, `auto`, or a path), the data-position file of each dp rank and who writes it, the layout and the
lineage (run id) a checkpoint records. The names of the files inside a checkpoint and their
verification are `speechlm.use.checkpoint_files` (read by training and by evaluate/transcribe/export)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from parallel.mesh import ParallelDims
from speechlm.use.checkpoint_files import (
    COMPLETE_NAME,
    CheckpointError,
    newest_verified,
    previous_complete,
    recover_interrupted_resave,
    verify_checkpoint,
)

Log = Callable[[str], object]  # where a message goes (print on rank 0, nowhere elsewhere)


def latest_checkpoint(ckpt_root: Path, log: Log = print) -> Path | None:
    """The `latest` pointer's checkpoint if it verifies, else the newest one that does (skips are logged).

    None when there is no `step_*` directory; CheckpointError when there are some but none verifies.
    Every rank runs this on the same files and reaches the same answer (nothing here is random)."""
    found, refused = newest_verified(ckpt_root, log)
    if found is None and refused:  # starting over would silently throw the run away (keep_last deletes)
        raise CheckpointError(
            f"resume=auto: none of the {len(refused)} checkpoints in {ckpt_root} can be resumed from (first: "
            f"{refused[0][1]}); checkpoints written before complete.json existed cannot be loaded safely. Start "
            f"over in a new trainer.run_dir, or remove {ckpt_root} to start over in this one"
        )
    return found


def resolve_resume(resume: str | None, run_dir: Path, log: Log = print) -> Path | None:
    """`None` → no resume; `auto` → the latest complete checkpoint of the run if any; else a path."""
    if resume is None or resume == "":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir / "checkpoints", log)
    p = Path(resume)
    if not p.is_dir():
        p = recover_interrupted_resave(p)  # `best` killed between its two renames: the old one is whole
    if not p.is_dir():
        raise CheckpointError(
            f"trainer.resume={resume!r}: no checkpoint directory there; use trainer.resume=auto to pick the "
            f"latest checkpoint of trainer.run_dir, or give a path such as {run_dir}/checkpoints/step_000100"
        )
    try:
        verify_checkpoint(p)
    except CheckpointError as e:
        earlier = previous_complete(p)
        hint = (
            f"resume from the previous complete checkpoint, trainer.resume={earlier}"
            if earlier is not None
            else "no earlier complete checkpoint is next to it; start without trainer.resume"
        )
        raise CheckpointError(f"{e}; {hint}") from None
    return p


def data_position_name(dp_rank: int) -> str:
    return f"data_dp{dp_rank:05d}.json"


def writes_data_position(dims: ParallelDims | None, rank: int) -> bool:
    """Whether `rank` writes its dp rank's data position: the first rank of each dp group (cp rank 0,
    tp rank 0) does, its cp/tp peers hold the same position (they train on the same batches).
    `dims` None: one process."""
    return dims is None or (dims.cp_rank(rank) == 0 and dims.tp_rank(rank) == 0)


def layout_of(dims: ParallelDims | None) -> dict[str, int] | None:
    """The (dp_replicate, dp_shard, cp, tp) sizes of `dims` as complete.json records them (None: unknown)."""
    if dims is None:
        return None
    return {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp}


def run_id_of(ckpt: Path) -> str | None:
    """The run (lineage) that wrote `ckpt`, from its complete.json; None for a checkpoint without one."""
    try:
        rid = json.loads((ckpt / COMPLETE_NAME).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None
