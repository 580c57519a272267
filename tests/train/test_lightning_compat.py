"""The Lightning shim: each private API it wraps still behaves on the installed Lightning, and nothing
else under speechlm/ touches a private name of Lightning (or torch's scheduler)."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import torch

from speechlm.train import lightning_compat as compat

REPO = Path(__file__).resolve().parents[2]
PRIVATE = re.compile(
    r"\b(_setup_distributed|_device_mesh|_has_dtensor_modules|_last_lr|_get_train_description|"
    r"train_progress_bar_id)\b|\.fit_loop\b|lightning\.\w+(\.\w+)*\s+import\s+_"
)


def test_private_names_are_used_only_in_the_shim():
    offenders = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in sorted((REPO / "speechlm").rglob("*.py"))
        if p.name != "lightning_compat.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert offenders == []


def test_strategy_hooks_exist_on_installed_lightning():
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert callable(ModelParallelStrategy._setup_distributed)

    class Holder:
        pass

    strategy, module = Holder(), Holder()
    compat.set_device_mesh(strategy, module, "mesh")
    assert strategy._device_mesh == module._device_mesh == "mesh"


def test_set_fit_max_steps_reaches_the_training_loop(tmp_path):
    trainer = L.Trainer(max_steps=10, logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    compat.set_fit_max_steps(trainer, 3)
    assert trainer.max_steps == 3


def test_set_scheduler_lrs_is_what_get_last_lr_and_the_next_step_see():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    compat.set_scheduler_lrs(sched, 4, [0.2])
    assert sched.get_last_lr() == [0.2] and opt.param_groups[0]["lr"] == 0.2
    opt.step()
    sched.step()
    assert sched.last_epoch == 5 and abs(sched.get_last_lr()[0] - 1.0 / 6) < 1e-12
