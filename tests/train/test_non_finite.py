"""Numbers are checked (issue 36, item 4): a NaN or infinite loss or gradient norm stops training at its
first step, before the optimizer applies it, on every rank at the same step; loaded weights that hold a
NaN or an infinity (a pretrained LLM or encoder, a checkpoint) are refused naming the file and the tensor."""

from __future__ import annotations

import math

import pytest
import torch
from parallel_harness import build_model, dp_only_step, global_steps, tiny_config

from speechlm.errors import EXIT_DATA, NonFiniteError
from speechlm.train.schedule import build_optimizer
from speechlm.train.step import StepContext, run_optimizer_step


def _poisoned(micro: list, rank_of_nan: int) -> list:
    """`micro` with NaN audio in micro-batch `rank_of_nan` (a clip the encoder turns into NaN)."""
    b = micro[rank_of_nan]
    b.audio[0, :100] = float("nan")
    return micro


def test_a_nan_loss_stops_at_its_step_before_the_optimizer_changes_the_weights():
    cfg = tiny_config()
    model = build_model(cfg)
    opt, sched = build_optimizer(model, cfg)
    steps = global_steps(2, 1)
    res = run_optimizer_step(model, steps[0], StepContext(), opt, sched, cfg, step=0)
    assert math.isfinite(res["loss"])
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"optimizer step 2: the loss is nan") as e:
        run_optimizer_step(model, _poisoned(steps[1], 0), StepContext(), opt, sched, cfg, step=1)
    assert e.value.exit_code == EXIT_DATA and "nothing of it is saved" in str(e.value)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the NaN step was never applied


def test_an_infinite_gradient_norm_stops_too():
    cfg = tiny_config()
    model = build_model(cfg)
    opt, sched = build_optimizer(model, cfg)
    with pytest.raises(NonFiniteError, match=r"optimizer step 1: .* gradient norm inf"):
        run_optimizer_step(
            model, global_steps(1, 1)[0], StepContext(), opt, sched, cfg, step=0, clip=lambda: math.inf
        )


def _nan_on_one_rank_worker(rank: int, world: int) -> dict:
    model, ctx, opt, sched, micro, cfg = dp_only_step(rank, world)
    if rank == 1:  # only this rank's data turns into NaN
        micro = _poisoned(micro, 0)
    try:
        run_optimizer_step(model, micro, ctx, opt, sched, cfg, step=4)
    except NonFiniteError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.multiproc
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step_without_a_hang():
    from parallel.testing import run_distributed

    per_rank = run_distributed(_nan_on_one_rank_worker, 2, "gloo", timeout_s=240)
    assert [r["error"] is not None for r in per_rank] == [True, True], per_rank
    assert all("optimizer step 5: the loss is nan" in r["error"] for r in per_rank)


def _save_ckpt(root, step: int, value: float):
    """A checkpoint (real DCP shards, meta.pt, complete.json) of the state {"w": value}."""
    from pathlib import Path

    from speechlm.train.checkpoint import save_checkpoint_atomic

    class Strategy:
        is_global_zero, global_rank, world_size = True, 0, 1

        def barrier(self, name: str) -> None:
            pass

    class Trainer:
        strategy, global_step = Strategy(), step

        def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
            from torch.distributed.checkpoint import save

            d = Path(path)
            d.mkdir(parents=True)
            w = torch.full((8, 8), 1.0)
            w[3, 4] = value
            save({"state_dict": {"w": w}}, checkpoint_id=d, no_dist=True)
            torch.save({"global_step": step}, d / "meta.pt")

    return save_checkpoint_atomic(Trainer(), root, f"step_{step:06d}", data_state={"epoch": 0}, run_id="r")


def test_a_checkpoint_holding_nan_weights_is_refused_naming_it_and_the_previous_one(tmp_path):
    import warnings

    from speechlm.train.checkpoint import load_trained_state

    good = _save_ckpt(tmp_path / "checkpoints", 2, 1.0)
    bad = _save_ckpt(tmp_path / "checkpoints", 4, float("nan"))
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_trained_state(module, [], good)
        assert float(module.w.sum()) == 64.0
        with pytest.raises(NonFiniteError) as e:
            load_trained_state(module, [], bad)
    msg = str(e.value)
    assert str(bad) in msg and "tensor w holds 1 NaN" in msg and f"trainer.resume={good}" in msg


@pytest.mark.slow  # a 4-step run through Lightning (~30 s on 2 idle cores)
def test_train_stops_with_exit_1_at_the_nan_step_and_saves_nothing_of_it(
    demo_data, tmp_path, capsys, monkeypatch
):
    """Through Lightning: step 2's loss turns NaN; the run exits 1 naming step 2, metrics.jsonl and the
    checkpoints hold step 1 only (no checkpoint of the NaN step, no final save)."""
    from helpers import SMOKE, read_train_metrics, train_in_process

    from speechlm.train import step as step_module

    real = step_module.compute_micro_losses
    calls = []

    def nan_from_the_second_step(model, batch, **kw):
        out = real(model, batch, **kw)
        calls.append(1)
        if len(calls) >= 2:  # grad_accum=1: the second call is optimizer step 2
            out.ce_sum = out.ce_sum * float("nan")
        return out

    monkeypatch.setattr(step_module, "compute_micro_losses", nan_from_the_second_step)
    run_dir = tmp_path / "run"
    r = train_in_process(
        [SMOKE, f"data.train_manifest={demo_data['train']}", f"data.val_manifest={demo_data['val']}",
         f"data.tokenizer={demo_data['tok']}", "trainer.max_steps=4", "trainer.grad_accum=1",
         "trainer.ckpt_every=1", "trainer.final_eval_split=none", f"trainer.run_dir={run_dir}"],
        capsys,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    assert "optimizer step 2: the loss is nan" in r.stderr and "Traceback" not in r.stderr
    assert [row["step"] for row in read_train_metrics(run_dir)] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000001"]
