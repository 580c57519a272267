"""A run trained with the issue-38 audio rows (CTC compression, the heard token's embedding behind its gate,
aligned positions, an oracle warm-up) evaluates, exports and transcribes: the export decodes what
`speechlm evaluate` decodes from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_train

from tests.use.test_usecli import SMOKE, read_jsonl, transcribe_subprocess

COMPRESSED = [
    "model.audio_compression=ctc",
    "model.projector_stack=1",
    "model.audio_token_embedding=true",
    "model.audio_positions=aligned",
    "model.oracle_warmup_steps=2",
]


@pytest.fixture(scope="module")
def compressed_run(demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("compressed") / "run"
    r = run_train(
        [
            SMOKE,
            f"data.train_manifest={demo_data['train']}",
            f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}",
            "trainer.max_steps=6",
            "trainer.grad_accum=1",
            "trainer.ckpt_every=6",
            "trainer.final_eval_split=none",
            f"trainer.run_dir={run_dir}",
            *COMPRESSED,
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_a_compressed_run_exports_and_transcribes_as_it_evaluates(compressed_run, demo_data, tmp_path):
    from speechlm.model.exported import EXPORT_CONFIG
    from speechlm.use.evaluation import evaluate_checkpoint
    from speechlm.use.export import export_checkpoint

    evaluated = evaluate_checkpoint(compressed_run, demo_data["val"], ctc_weight=0.0)
    exported = export_checkpoint(compressed_run, tmp_path / "model")
    model_cfg = json.loads((exported / EXPORT_CONFIG).read_text())["model"]
    assert model_cfg["audio_compression"] == "ctc" and model_cfg["audio_positions"] == "aligned"
    out = tmp_path / "hyps.jsonl"
    r = transcribe_subprocess(
        [str(exported), "--manifest", demo_data["val"], "--out", str(out), "--ctc-weight", "0"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    by_row = {line["row"]: line["text"] for line in read_jsonl(out)}
    assert {d["row"]: d["hyp"] for d in evaluated["decodes"]} == by_row and len(by_row) == 12
