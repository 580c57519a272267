"""Every use of a private API of Lightning (and of torch's LR scheduler) in one place.

Lightning has no public hook for what these do; an upgrade that renames one of them breaks here, and
`tests/train/test_lightning_compat.py` fails on the installed version before any training run does. Nothing
else under `speechlm/` touches a private name of Lightning (the same test checks that).

Checked against: lightning 2.4 to 2.6 (the versions pyproject.toml allows).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh

from speechlm.io import atomic_path


def setup_process_group(strategy: ModelParallelStrategy) -> None:
    """`ModelParallelStrategy._setup_distributed`: init the process group (torchrun or Lightning's launcher)."""
    strategy._setup_distributed()


def set_device_mesh(strategy: ModelParallelStrategy, module: L.LightningModule, mesh: DeviceMesh) -> None:
    """Install our mesh where `ModelParallelStrategy` and `LightningModule.device_mesh` look for it."""
    strategy._device_mesh = mesh
    module._device_mesh = mesh


def set_fit_max_steps(trainer: L.Trainer, max_steps: int) -> None:
    """Change `max_steps` of a Trainer already built (evaluation-only runs restore, then train 0 steps)."""
    trainer.fit_loop.epoch_loop.max_steps = max_steps


def set_scheduler_lrs(sched: torch.optim.lr_scheduler.LRScheduler, step: int, lrs: list[float]) -> None:
    """Put a scheduler at `step` with these rates, as if it had stepped there (`get_last_lr` reads them)."""
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched.last_epoch = step
    sched._last_lr = list(lrs)  # type: ignore[assignment]


def save_checkpoint_one_process(checkpoint: dict[str, Any], path: str | Path) -> None:
    """Write what `ModelParallelStrategy.save_checkpoint` writes (DCP shards of the model and optimizer
    states, the rest in `meta.pt`) for a one-process run, with DCP's ``no_dist=True``.

    A DCP save of the model's tensors through a process group left every later CPU step of the demo
    model 1.5-2x slower for the rest of the process (scripts/repro_dcp_step_slowdown.py; a fresh
    tensor or ``no_dist`` does not); one process needs no collective to write its checkpoint.
    The files are the same, so loading does not change."""
    from torch.distributed.checkpoint import (
        save,  # lazy: DCP (seconds to import; only a save or a load needs it)
    )

    path = Path(path)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    converted = {"state_dict": checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    save(converted, checkpoint_id=path, no_dist=True)
    torch.save(checkpoint, path / _METADATA_FILENAME)


def keeping_csv_logger(save_dir: str, name: str = "csv") -> Any:
    """Lightning's CSVLogger, except that an existing `metrics.csv` is kept and appended to.

    Lightning's writer deletes `metrics.csv` when its folder is not empty (`_check_log_dir_exists`), so a
    resumed run lost the CSV history; here the old header's keys are taken over instead, and
    `truncate_after(step)` (called on resume) drops the rows of the steps that will be trained again."""

    class KeepingWriter(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            if os.path.isfile(self.metrics_file_path):
                with open(self.metrics_file_path, newline="") as f:
                    self.metrics_keys = sorted(next(csv.reader(f), []))

    class KeepingCSVLogger(CSVLogger):
        @property
        @rank_zero_experiment
        def experiment(self) -> Any:
            if self._experiment is None:
                os.makedirs(self.root_dir, exist_ok=True)
                self._experiment = KeepingWriter(log_dir=self.log_dir)
            return self._experiment

        def truncate_after(self, step: int) -> None:
            """Keep the rows of optimizer steps <= `step` (Lightning's `step` column is the step - 1)."""
            path = os.path.join(self.log_dir, ExperimentWriter.NAME_METRICS_FILE)
            if not os.path.isfile(path):
                return
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                fields = list(reader.fieldnames or [])
                rows = [r for r in reader if not (r.get("step") or "").strip() or float(r["step"]) < step]
            with atomic_path(Path(path)) as tmp, open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)

    return KeepingCSVLogger(save_dir, name=name, version="")
