"""`speechlm estimate`: the memory arithmetic, the refusal of a layout that does not fit, and the estimate
against the peak RSS measured by a CPU run of two configs (docs/benchmarks.md, "estimate vs measured")."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_train_metrics, run_train

from speechlm.cli import main
from speechlm.config import load_config
from speechlm.preflight.estimate import (
    GIB,
    Layout,
    ParamCounts,
    Workload,
    activation_bytes,
    config_workloads,
    count_parameters,
    estimate_layout,
    weights_bytes,
)

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs/smoke.yaml")
DEMO = str(REPO / "configs/demo.yaml")
# the estimate is within this share of the measured peak RSS (docs/benchmarks.md)
RSS_TOLERANCE = 0.25


def test_weights_split_by_tp_and_sharded_by_fsdp():
    cfg = load_config(SMOKE, ["trainer.precision=32"])
    p = ParamCounts(encoder=100, projector=10, llm=1000, largest_unit=300)
    w = weights_bytes(cfg, p, Layout(world=8, tp=2))  # FSDP over 4 ranks, the LLM halved by TP
    assert w["parameters"] == 4 * (110 + 500) / 4
    assert w["gradients"] == 4 * (110 + 500) / 4 and w["optimizer"] == 8 * (110 + 500) / 4
    assert w["fsdp_gathered"] == 2 * 300 * 4  # the current and the prefetched unit, fp32
    frozen = weights_bytes(load_config(SMOKE, ["model.llm.train=frozen"]), p, Layout(world=8, tp=2))
    assert frozen["parameters"] == w["parameters"] and frozen["gradients"] == 4 * 110 / 4
    one = weights_bytes(cfg, p, Layout(world=1))
    assert one["parameters"] == 4 * 1110 and one["optimizer"] == 8 * 1110 and one["fsdp_gathered"] == 0


def test_activations_shrink_with_checkpointing_cp_and_a_smaller_budget():
    cfg = load_config(DEMO, ["data.train_manifest=null"])
    _, dims = count_parameters(cfg, 300)
    heavy, _ = config_workloads(cfg)
    assert heavy.audio_seconds == pytest.approx(32.0, abs=0.1) and heavy.text_tokens[0] == cfg.data.max_tokens
    plain = activation_bytes(cfg, dims, heavy, Layout(1), checkpointing=False)
    ckpt = activation_bytes(cfg, dims, heavy, Layout(1), checkpointing=True)
    cp2 = activation_bytes(cfg, dims, heavy, Layout(2, cp=2), checkpointing=False)
    assert ckpt["total"] < plain["total"] and ckpt["encoder"] == plain["encoder"]
    assert cp2["total"] == pytest.approx(plain["total"] / 2)  # the stream and the clips split over 2
    half = Workload(
        heavy.clip_frames[: len(heavy.clip_frames) // 2], heavy.text_tokens[: len(heavy.text_tokens) // 2]
    )
    assert activation_bytes(cfg, dims, half, Layout(1), checkpointing=False)["total"] < plain["total"]
    assert 0 < plain["encoder"] < plain["total"]


def test_a_layout_that_does_not_fit_is_refused_and_sharding_makes_it_fit(capsys):
    big = [
        "model.llm.hidden_size=8192",
        "model.llm.num_layers=40",
        "model.llm.num_heads=64",
        "model.llm.num_kv_heads=8",
        "model.llm.intermediate_size=28672",
        "data.train_manifest=null",
    ]
    rc = main(["estimate", SMOKE, "--world-size", "1", "--device", "h100", *big])
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert "DOES NOT FIT" in out and "the layout does not fit" in err and "--world-size" in err
    rc = main(["estimate", SMOKE, "--world-size", "64", "--device", "h100", *big])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "fits" in out and "FSDP shards over 64" in out and "KiB per LLM token" in out


def test_estimate_refuses_a_world_size_the_layout_does_not_divide(capsys):
    assert main(["estimate", SMOKE, "--world-size", "6", "--cp-size", "4"]) == 2
    assert "not a multiple of cp x tp" in capsys.readouterr().err
    assert main(["estimate", SMOKE, "--world-size", "1", "--mfu", "1.5"]) == 2
    assert "--mfu 1.5" in capsys.readouterr().err
    assert main(["estimate", SMOKE, "--world-size", "1", "--cp-size", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,overrides",
    [
        (SMOKE, []),
        (DEMO, ["sampler.max_batch_duration=90"]),  # the demo's model with a larger micro-batch
    ],
    ids=["smoke", "demo-size"],
)
def test_estimate_is_within_tolerance_of_measured_peak_rss(demo_data, tmp_path, config, overrides):
    data = [
        f"data.train_manifest={demo_data['train']}",
        f"data.tokenizer={demo_data['tok']}",
        "data.val_manifest=null",
    ]
    run_dir = tmp_path / "run"
    overrides = [*data, *overrides, "trainer.final_eval_split=none", "trainer.val_every=0"]
    args = [config, *overrides, "trainer.max_steps=3"]
    r = run_train([*args, "trainer.ckpt_every=0", f"trainer.run_dir={run_dir}"])
    assert r.returncode == 0, r.stderr[-3000:]
    measured = max(row["rss_gib"] for row in read_train_metrics(run_dir))
    est = estimate_layout(load_config(config, overrides), Layout(1), "cpu", None)[0]
    print(
        f"estimate {est.total / GIB:.3f} GiB, measured {measured:.3f} GiB:",
        {k: round(v / GIB, 3) for k, v in est.memory.items()},
    )
    assert est.total / GIB == pytest.approx(measured, rel=RSS_TOLERANCE), (est.memory, measured)


def test_a_damaged_manifest_is_named(tmp_path, capsys):
    bad = tmp_path / "train.parquet"
    bad.write_bytes(b"PAR1 not really")
    assert main(["estimate", SMOKE, "--world-size", "1", "--manifest", str(bad)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "speechlm manifest build" in err
