"""The LLM-alone WER beside the joint one (issue 38, item 2): a run that decodes jointly with its CTC head
(`model.decode_ctc_weight > 0`) also decodes every validation with the LLM alone, and logs it as
`llm_wer`, `asr/llm_wer_<lang>`; that figure is what `speechlm evaluate RUN --manifest VAL --ctc-weight 0`
gives for the same checkpoint. One tiny run on the demo data (a subprocess), validated at its last step.
"""

from __future__ import annotations

import json

import pytest
from helpers import SMOKE, run_train

STEPS = 6


def test_validation_logs_the_llm_alone_wer_that_evaluate_ctc_weight_0_gives(demo_data, tmp_path):
    from speechlm.use.evaluation import evaluate_checkpoint

    run_dir = tmp_path / "run"
    r = run_train(
        [
            SMOKE,
            f"data.train_manifest={demo_data['train']}",
            f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}",
            f"trainer.max_steps={STEPS}",
            "trainer.grad_accum=1",
            f"trainer.val_every={STEPS}",
            f"trainer.ckpt_every={STEPS}",
            "model.decode_ctc_weight=0.5",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = next(rec for rec in records if rec.get("kind") == "val")
    assert val["step"] == STEPS
    langs = sorted(k.removeprefix("asr/wer_") for k in val if k.startswith("asr/wer_"))
    assert len(langs) >= 2
    for key in ("llm_wer", "asr/llm_wer", "audio_reliance", "asr/audio_reliance", "ctc_per_token"):
        assert isinstance(val[key], float), key
    assert all(f"asr/audio_reliance_{lang}" in val for lang in langs)

    alone = evaluate_checkpoint(run_dir, demo_data["val"], ctc_weight=0.0)["record"]
    joint = evaluate_checkpoint(run_dir, demo_data["val"])  # the model's own weight, 0.5
    assert not any(k.startswith("llm_") or "/llm_" in k for k in alone)  # weight 0: one decode only
    for lang in langs:
        assert val[f"asr/llm_wer_{lang}"] == alone[f"asr/wer_{lang}"] == val[f"llm_wer_{lang}"], lang
        assert val[f"asr/wer_{lang}"] == joint["record"][f"asr/wer_{lang}"], lang
        assert joint["record"][f"asr/llm_wer_{lang}"] == alone[f"asr/wer_{lang}"], lang
    assert val["llm_wer"] == alone["wer"]
    assert any(val[f"asr/llm_wer_{lang}"] != val[f"asr/wer_{lang}"] for lang in langs)  # two decodes
    # the same teacher-forced passes (a difference of two CEs: equal to float rounding, in training or not)
    assert val["audio_reliance"] == pytest.approx(joint["record"]["audio_reliance"], abs=1e-5)

    assert f"[val step {STEPS}] wer=" in r.stdout and "llm_wer=" in r.stdout and "audio_reliance=" in r.stdout
    assert "LLM WER" in r.stdout and "joint WER" in r.stdout  # the final evaluation's table
    assert "LLM WER" in joint["table"] and "joint WER" in joint["table"]
    eval_json = json.loads((run_dir / "eval.json").read_text())
    assert eval_json["llm_wer"] == alone["wer"]
