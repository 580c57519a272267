"""benchmarks/bench_compression.py on a tiny model whose CTC head hears tokens: compressed rows are fewer
than the frames, both settings train and are timed, and the table carries both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.model.test_audio_compression import ALIGNED
from tests.model.test_model import LANG, build_tiny_model, make_batch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_compression  # noqa: E402


def hearing_model():
    """A tiny compressed, aligned model whose CTC head hears a token on most frames: the blank's bias
    pushed down so the argmax is a (varying) token, not the blank an untrained head emits."""
    model = build_tiny_model(**ALIGNED)
    with torch.no_grad():
        model.ctc_head.bias[model.ctc_blank_id] = -10.0
    return model


def test_rates_steps_and_table_on_a_tiny_hearing_model():
    model = hearing_model()
    batch = make_batch()
    batch.langs = ["en", "hi", "en"]
    rates = bench_compression.measure_rates(model, [batch])
    assert set(rates) == {"all", "en", "hi"} and rates["all"].clips == 3
    assert rates["en"].clips == 2 and rates["all"].seconds == pytest.approx(24000 / 16000)
    assert 0 < rates["all"].rows_ctc < rates["all"].frames  # repeats merged: fewer rows than frames
    assert rates["all"].rows_stack2 == sum(
        -(-f // 2) for f in bench_compression.compressed_rows(model, batch)[1]
    )
    assert rates["all"].tokens == (5 - 1) + (3 - 1) + (7 - 1)  # the language tag left out
    cfg_before = (model.cfg.audio_compression, model.cfg.audio_positions)
    steps = bench_compression.measure_steps(model, [batch], reps=2)
    assert (model.cfg.audio_compression, model.cfg.audio_positions) == cfg_before  # restored
    assert all(len(steps[m].cpu_seconds) == 2 and steps[m].cpu_median > 0 for m in ("ctc", "none"))
    assert steps["ctc"].llm_tokens < steps["none"].llm_tokens  # the LLM computes fewer rows
    lines = bench_compression.format_table(rates, steps, None, batches=1, reps=2)
    assert any(line.split()[:1] == ["ctc"] for line in lines)
    assert any(line.split()[:1] == ["none"] for line in lines)
    assert any(line.split()[:1] == ["hi"] for line in lines)


def test_long_clip_concatenates_transcripts_and_steps_both_settings():
    model = hearing_model()
    g = torch.Generator().manual_seed(0)
    samples = [
        type(
            "S",
            (),
            dict(
                audio=0.1 * torch.randn(8000, generator=g),
                ctc_tokens=(),
                lang="en",
                tokens=torch.tensor([LANG, 11 + i, 12 + i]),
            ),
        )()  # fmt: skip
        for i in range(3)
    ]
    batch, n = bench_compression.long_batch(samples, 1.5 / 60, skip=1)  # 1.5 s: three 0.5 s clips
    assert n == 3 and batch.audio.shape == (1, 24000)
    assert batch.tokens[0].tolist() == [LANG, 11, 12, 12, 13, 13, 14]  # one tag, then each transcript
    warmup, _ = bench_compression.long_batch(samples, 0.5 / 60, skip=1)
    long = bench_compression.measure_long(model, batch, warmup)
    assert long["ctc"]["rows"] < long["none"]["rows"]
    assert long["ctc"]["llm_tokens"] < long["none"]["llm_tokens"]
    assert all(long[m]["step_s"] > 0 and long[m]["cpu_s"] > 0 for m in ("ctc", "none"))
    steps = {m: bench_compression.StepTimes([1.0], [1.0], 10.0) for m in ("ctc", "none")}
    lines = bench_compression.format_table(
        {}, steps, long, long_seconds=1.5, long_clips=n, context=[128, 128]
    )
    assert "one 0.0-minute clip (3 held-out clips concatenated)" in "\n".join(lines)
    rows = [w for w in (line.split() for line in lines) if w[:1] in (["ctc"], ["none"]) and w[1] != "/"]
    assert len(rows) == 4  # ctc and none, in the step table and the long clip's


def test_without_a_run_it_says_why_one_is_needed(capsys):
    with pytest.raises(SystemExit):
        bench_compression.main([])
    assert "untrained CTC head hears only blanks" in capsys.readouterr().err


def test_a_model_without_stack_1_is_refused():
    with pytest.raises(SystemExit, match="projector_stack=1"):
        bench_compression.check_model(build_tiny_model(projector_stack=2), "RUN")
