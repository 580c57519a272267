"""The validator on long-form audio (issue 25): Whisper cannot take (nor shard) a clip over its 30 s window,
full context over a long clip warns with a memory estimate, and both read the longest row the plan keeps
(data.max_duration applied)."""

from __future__ import annotations

import pyarrow as pa

from speechlm.config import load_config
from speechlm.preflight import checks as preflight
from speechlm.preflight.rules import validate

INSTALLED = {"torch": "2.13.0"}


def findings(cfg, manifest):
    return {f.rule_id: f for f in validate(cfg, 1, {}, None, INSTALLED, manifest_summary=manifest)}


def test_full_context_over_a_long_clip_warns_with_the_memory_estimate():
    cfg = load_config(None, ["model.encoder.num_heads=4", "model.encoder.num_layers=3"])
    f = findings(cfg, {"max_duration": 600.0, "max_encoder_frames": 7500})["encoder-full-context-long-clip"]
    assert f.level == "warning"
    # 7500^2 frames x 4 heads x 4 bytes x 2 = 1.68 GiB per layer, 5.03 GiB over 3 layers
    assert (
        "600 s (7,500 encoder frames)" in f.reason and "1.7 GiB per encoder layer, 5.0 GiB over 3" in f.reason
    )
    assert "att_context_size" in f.fix
    short = findings(cfg, {"max_duration": 300.0, "max_encoder_frames": 3750})
    assert "encoder-full-context-long-clip" not in short


def test_whisper_over_its_window_is_an_error_that_says_why():
    cfg = load_config(None, ["model.encoder.kind=whisper"])
    f = findings(cfg, {"max_duration": 1800.0, "max_encoder_frames": 90_000})["whisper-clip-over-window"]
    assert f.level == "error" and "1800 s" in f.reason and "fixed 30 s window" in f.reason
    assert "data.max_duration=30" in f.fix


def test_the_summary_reads_the_longest_row_the_plan_keeps():
    table = pa.table({"duration": pa.array([10.0, 45.0, 3600.0], pa.float32())})
    s = preflight.summarize(table, load_config(None))
    assert s["max_duration"] == 3600.0 and s["max_encoder_frames"] == 45_000
    s = preflight.summarize(table, load_config(None, ["data.max_duration=100"]))
    assert s["max_duration"] == 45.0 and s["max_encoder_frames"] == 563  # ceil(4500 / 8)
    cfg = load_config(None, ["model.encoder.kind=whisper", "data.max_duration=30"])
    assert "whisper-clip-over-window" not in findings(cfg, preflight.summarize(table, cfg))


def test_per_clip_ctc_beside_long_form_audio_warns_with_the_ratio():
    man = {"max_duration": 600.0, "median_duration": 5.0, "max_encoder_frames": 7500}
    f = findings(load_config(None, []), man)["ctc-per-clip-long-form"]
    assert f.level == "warning" and "120 times the median clip (5 s)" in f.reason
    assert "model.ctc_reduction=token" in f.fix
    for overrides, summary in [
        (["model.ctc_reduction=token"], man),
        (["model.ctc_weight=0"], man),
        ([], dict(man, max_duration=60.0)),  # 12 times the median: no warning
    ]:
        assert "ctc-per-clip-long-form" not in findings(load_config(None, overrides), summary)


def test_the_summary_has_the_median_duration():
    cfg = load_config(None, [])
    table = pa.table({"duration": pa.array([1.0, 2.0, 3.0, 100.0], pa.float32())})
    assert preflight.summarize(table, cfg)["median_duration"] == 2.5
