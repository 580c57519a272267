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


def test_progress_bar_labels_the_optimizer_step():
    bar = compat.step_progress_bar()
    from lightning.pytorch.callbacks import RichProgressBar

    if isinstance(bar, RichProgressBar):
        assert callable(RichProgressBar._get_train_description)
        assert hasattr(bar, "train_progress_bar_id")

        class T:
            global_step, max_steps = 7, 20

        bar._trainer = T()
        assert bar._get_train_description(2) == "step 7/20 · epoch 2"


def test_one_process_checkpoint_is_written_without_dcp_collectives(tmp_path, monkeypatch):
    """The files Lightning's strategy writes (DCP shards + meta.pt), written with no_dist=True: DCP through
    a process group left later CPU steps 1.5-2x slower (scripts/repro_dcp_step_slowdown.py)."""
    import torch.distributed.checkpoint as dcp

    calls = []
    real_save = dcp.save
    monkeypatch.setattr(dcp, "save", lambda *a, **k: (calls.append(k), real_save(*a, **k))[1])
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    compat.save_checkpoint_one_process(
        {
            "state_dict": dict(weights),
            "optimizer_states": [{"state": {}, "param_groups": []}],
            "global_step": 7,
        },
        tmp_path / "ckpt",
    )
    assert calls and calls[0]["no_dist"] is True
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {".metadata", "meta.pt"} <= names and any(n.endswith(".distcp") for n in names)
    back = {"state_dict": {"w": torch.zeros(2, 3)}}
    dcp.load(back, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert torch.equal(back["state_dict"]["w"], weights["w"])
    assert torch.load(tmp_path / "ckpt/meta.pt", weights_only=True) == {"global_step": 7}


def test_progress_bar_shows_the_warmup_lr_with_significant_digits():
    """newcomer: the bar read "lr: 0.000" throughout warmup (Rich prints floats with 3 decimals)."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks.progress.rich_progress import MetricsTextColumn

    bar = compat.step_progress_bar()
    trainer = SimpleNamespace(progress_bar_metrics={"loss": 22.676, "lr": 4e-05, "utt/s": 3.5}, loggers=[])
    shown = bar.get_metrics(trainer, None)
    assert shown == {"loss": 22.676, "lr": "4e-05", "utt/s": 3.5}
    assert compat.format_bar_metrics({"lr": 0.00123456, "lr_encoder": 2e-3})["lr"] == "0.00123"
    column = MetricsTextColumn(trainer, style="", text_delimiter=" ", metrics_format=".3f")
    column._metrics = shown
    assert "lr: 4e-05" in " ".join(column._generate_metrics_texts())
