"""Every documented conversation format trains end to end (issue 35): one clip and several, with and without
per-clip transcripts, alone, and mixed with ASR data by data.input_cfg on SentencePiece and on a pretrained
LLM's own tokenizer; exact resume with such a mix. The corpus is `conv_corpus` (five kinds of sample)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from conv_corpus import FORMATS, NO_PER_CLIP, write_format
from formats_helpers import full_and_resumed_metrics
from helpers import SMOKE, read_train_metrics, run_train

COMMON = ["data.val_manifest=null", "sampler.max_batch_duration=4", "trainer.final_eval_split=none"]


def _check_rows(rows: list[dict], steps: int) -> None:
    assert len(rows) == steps
    for r in rows:
        assert r["utterances"] > 0 and r["clips"] >= r["utterances"] >= 1, r
        assert 0 <= r["ctc_clips"] <= r["clips"], r
        assert math.isfinite(r["loss"]), r
        assert (r["ctc"] is None) == (r["ctc_clips"] == 0), r  # no CTC term without a transcript


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_documented_format_trains(fmt, demo_data, tmp_path):
    data = write_format(fmt, tmp_path / "data")
    run = tmp_path / "run"
    r = run_train([SMOKE, f"data.train_manifest={data}", f"data.tokenizer={demo_data['tok']}", *COMMON,
                   "trainer.max_steps=3", f"trainer.run_dir={run}"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dropping" not in r.stderr  # no sample is dropped: every kind of sample trains
    rows = read_train_metrics(run)
    _check_rows(rows, 3)
    # clips without a transcript of their own (k2, k3, and ShareGPT/ms-swift's k4) were trained on
    assert any(r["ctc_clips"] < r["clips"] for r in rows)
    if fmt in NO_PER_CLIP:  # only one-clip asr samples have a CTC target there: never a 2-clip sample's
        assert all(r["ctc_clips"] <= r["utterances"] for r in rows)


def _mix(tmp_path: Path, demo_data: dict[str, str]) -> Path:
    entries = [{"path": demo_data["train"], "name": "asr", "weight": 1}]
    for fmt in FORMATS:
        entries.append({"path": str(write_format(fmt, tmp_path / fmt)), "name": fmt, "weight": 1})
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


def test_every_format_mixed_with_asr_data_trains_on_a_pretrained_llms_tokenizer(demo_data, tmp_path):
    from pretrained_helpers import make_tiny_pretrained

    llm = make_tiny_pretrained(tmp_path / "llm", langs=["bn", "en", "hi", "ta", "te"])
    run = tmp_path / "run"
    r = run_train([SMOKE, f"data.input_cfg={_mix(tmp_path, demo_data)}", f"model.llm.pretrained={llm}",
                   "data.tokenizer=null", "data.lang_tags=special", "model.llm.train=lora",
                   "model.llm.lora.rank=4", "model.llm.lora.alpha=8", *COMMON, "trainer.max_steps=4",
                   "data.max_tokens=128", f"trainer.run_dir={run}"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _check_rows(read_train_metrics(run), 4)


@pytest.mark.slow
def test_resume_is_exact_with_conversations_mixed_with_asr_data(demo_data, tmp_path):
    """~60 s: 4 steps straight against 2 steps, a checkpoint, and 2 more after a resume."""
    base = [
        SMOKE,
        f"data.input_cfg={_mix(tmp_path, demo_data)}",
        f"data.tokenizer={demo_data['tok']}",
        *COMMON,
    ]
    a, b, _ = full_and_resumed_metrics(run_train, base, tmp_path, steps=4, stop=2)
    assert [m["rows_digest"] for m in b] == [m["rows_digest"] for m in a]
    for ma, mb in zip(a, b):
        assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-6), f"step {ma['step']}"
        assert (mb["utterances"], mb["clips"], mb["ctc_clips"]) == (
            ma["utterances"],
            ma["clips"],
            ma["ctc_clips"],
        )
