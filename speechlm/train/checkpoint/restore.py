"""Resuming from a checkpoint: every rank gets the data position of its dp rank and, in the saved
layout, its own RNG states (`restore_training_state`); `resume_run` also adopts the checkpoint's
lineage and trims the logs to the restored step. The weights, optimizer and loops are restored by
Lightning through `trainer.fit(ckpt_path=...)` (`speechlm.train.strategy`, `load_trained_state`).

The position depends on the dp rank only (cp/tp peers train on the same batches), so a checkpoint
resumes exactly under another cp/tp with the same dp size; another dp size cannot continue the saved
data order and is refused, naming `trainer.resume_data=next_epoch`.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch

from parallel.mesh import ParallelDims
from speechlm.config import ExperimentConfig
from speechlm.train.checkpoint.paths import data_position_name, layout_of, run_id_of
from speechlm.train.data import StepLoader
from speechlm.train.lightning_compat import set_fit_max_steps
from speechlm.use.checkpoint_files import COMPLETE_NAME, RANK_DIR, CheckpointError, load_metadata


class ResumableModule(Protocol):
    """What a resume sets on the training module (`speechlm.train.module.SpeechLLMModule`)."""

    dims: ParallelDims | None
    pending_rng: dict[str, Any] | None


class TruncatableLog(Protocol):
    """The metrics log a resume trims to the restored step (`speechlm.train.callbacks.MetricsWriter`)."""

    path: Path

    def truncate_after(self, step: int) -> None: ...


def _read_json(f: Path) -> dict[str, Any]:
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}): the checkpoint was altered") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{f} holds no data position (a JSON object): the checkpoint was altered")
    return data


def read_data_position(path: Path, dp_rank: int) -> dict[str, Any] | None:
    """The data position of `dp_rank` in checkpoint `path` (None if it has none).

    Checkpoints saved before positions were keyed by dp rank hold one `data_rankRRRRR.json` per
    process, each naming its `dp_rank`: the first one of `dp_rank` is taken (its peers hold the same)."""
    f = path / RANK_DIR / data_position_name(dp_rank)
    if f.is_file():
        return _read_json(f)
    for legacy in sorted((path / RANK_DIR).glob("data_rank*.json")):
        state = _read_json(legacy)
        if state.get("dp_rank", 0) == dp_rank:
            return state
    return None


def saved_dp_size(path: Path) -> int | None:
    """The number of data-parallel ranks `path` was saved with, from its data positions (None: none)."""
    files = sorted((path / RANK_DIR).glob("data_dp*.json")) or sorted(
        (path / RANK_DIR).glob("data_rank*.json")
    )
    for f in files:
        size = _read_json(f).get("dp_size")
        if isinstance(size, int):
            return size
    return None


def read_rng_state(path: Path, rank: int) -> dict[str, Any] | None:
    f = path / RANK_DIR / f"rng_rank{rank:05d}.pt"
    if not f.is_file():
        return None
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f} cannot be loaded safely (weights_only=True): {e}") from None


def restore_training_state(
    ckpt: Path,
    loader: StepLoader,
    module: ResumableModule,
    *,
    resume_data: str,
    rank: int,
    world_size: int,
    dims: ParallelDims | None = None,
) -> tuple[int, dict[str, int]]:
    """Give this rank the data position of its dp rank and its RNG states from `ckpt`; return
    (global step, position).

    `resume_data="exact"` continues the data after the last trained micro-batch and needs the saved
    dp size (any cp/tp); `"next_epoch"` starts the epoch after the saved one in this run's layout.
    The RNG states are per process and belong to its place in the layout: they come back only into
    the saved layout (`dims`; the same number of processes for a checkpoint that has no layout),
    elsewhere every rank keeps the run's seeding."""
    meta = load_metadata(ckpt)
    complete = json.loads((ckpt / COMPLETE_NAME).read_text())
    saved_world = complete.get("world_size", world_size)
    saved_layout, layout = complete.get("layout"), layout_of(dims)
    same_layout = saved_layout == layout if saved_layout and layout else saved_world == world_size
    dp_rank = loader.dp_rank if resume_data == "exact" else 0  # next_epoch takes the saved epoch only
    state = read_data_position(ckpt, dp_rank)
    if state is None:
        raise missing_position(ckpt, dp_rank, loader.sampler.dp_size)
    try:
        loader.restore(state, next_epoch=resume_data == "next_epoch")
    except ValueError as e:
        raise CheckpointError(
            f"cannot continue the data order of {ckpt}: {e}\nTo resume the model and optimizer into this layout "
            f"anyway, add trainer.resume_data=next_epoch (the data restarts at the next epoch)"
        ) from None
    module.pending_rng = read_rng_state(ckpt, rank) if same_layout else None
    return int(meta.get("global_step", 0)), dict(loader.consumed)


def missing_position(ckpt: Path, dp_rank: int, dp_size: int) -> CheckpointError:
    """The error for a checkpoint without a data position for `dp_rank`: saved with this dp size, the
    entry was lost (an altered checkpoint); saved with another, the data order cannot continue."""
    saved = saved_dp_size(ckpt)
    f = ckpt / RANK_DIR / data_position_name(dp_rank)
    if saved == dp_size:
        return CheckpointError(
            f"{ckpt} has no data position for dp rank {dp_rank} ({f} is missing) although it was saved with "
            f"{saved} data-parallel ranks: the checkpoint was altered. Resume from an earlier checkpoint, or "
            f"add trainer.resume_data=next_epoch to resume the model and optimizer (the data restarts at the "
            f"next epoch)"
        )
    was = f"saved with {saved} data-parallel ranks" if saved is not None else "it holds no data position"
    return CheckpointError(
        f"{ckpt} has no data position for dp rank {dp_rank} ({was}, this run has {dp_size}); add "
        f"trainer.resume_data=next_epoch to resume the model and optimizer into this layout (the data "
        f"restarts at the next epoch)"
    )


def resume_run(
    cfg: ExperimentConfig,
    ckpt: Path | None,
    loader: StepLoader,
    module: ResumableModule,
    trainer: L.Trainer,
    metrics: TruncatableLog,
    *,
    rank: int,
    world_size: int,
) -> Path | None:
    """Restore this rank's data position and RNG state from `ckpt` (resolved and checked by
    run_dir.prepare_run_dir; the weights, optimizer and loops are restored by `trainer.fit(ckpt_path=...)`),
    adopt its lineage for rotation, and trim `metrics.jsonl` and the CSV log to the restored step.
    Returns `ckpt` (None: a fresh start)."""
    t = cfg.trainer
    step, pos = 0, None  # type: tuple[int, dict[str, int] | None]
    if ckpt is not None:
        step, pos = restore_training_state(
            ckpt,
            loader,
            module,
            resume_data=t.resume_data,
            rank=rank,
            world_size=world_size,
            dims=module.dims,
        )
    adopt_lineage(trainer, run_id_of(ckpt) if ckpt is not None else None)
    if pos is not None and rank == 0:
        metrics.truncate_after(step)
        for logger in getattr(trainer, "loggers", []):
            if hasattr(logger, "truncate_after"):
                logger.truncate_after(step)
        print(f"resuming from {ckpt} (optimizer step {step}, epoch {pos['epoch']}, "
              f"micro-batch {pos['position']} of it; data: {t.resume_data})")  # fmt: skip
    if t.validate_only:
        # evaluation only: restore the checkpoint (if any) through fit, with no optimizer step to take
        set_fit_max_steps(trainer, step if ckpt is not None else 0)
    if ckpt is None and rank == 0:
        if metrics.path.is_file() and metrics.path.read_text(errors="replace").strip():
            print(
                f"note: no checkpoint to resume from; {metrics.path} starts over (its steps were not saved)"
            )
        metrics.truncate_after(0)  # a fresh run starts a fresh history (prepare_run_dir checked it is ours)
    return ckpt


def adopt_lineage(trainer: L.Trainer, run_id: str | None) -> str:
    """Give the checkpoint-saving callbacks this run's id: the resumed checkpoint's, or a new one."""
    rid = run_id or uuid.uuid4().hex
    for cb in getattr(trainer, "callbacks", []):
        if hasattr(cb, "run_id"):
            cb.run_id = rid
    return rid
