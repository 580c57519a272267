"""Resume stays exact with a mixed-task data.input_cfg (issue 23): an ASR dataset and an AST dataset (its own
answers and a per-dataset prompt), weighted; a run stopped at step 3 and resumed gives the same batches and
losses as an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from formats_helpers import full_and_resumed_metrics
from helpers import run_train

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")
ENGLISH = ["water", "house", "big tree", "small river", "the red sun"]


def _ast_manifest(train: str, out: Path) -> Path:
    """The demo train rows as a translation dataset: answers in English, the transcripts kept as `text`."""
    table = pq.read_table(train)
    answers = [ENGLISH[i % len(ENGLISH)] for i in range(len(table))]
    table = table.append_column(pa.field("answer", pa.string()), pa.array(answers, pa.string()))
    pq.write_table(table, out)
    return out


@pytest.mark.slow
def test_resume_is_exact_with_a_mixed_task_input_cfg(demo_data, tmp_path):
    mix = tmp_path / "mix.yaml"
    ast = _ast_manifest(demo_data["train"], tmp_path / "ast.parquet")
    mix.write_text(yaml.safe_dump([
        {"path": demo_data["train"], "name": "asr", "weight": 2},
        {"path": str(ast), "name": "ast", "weight": 1, "task": "ast", "prompt": "Translate to English."},
    ]))  # fmt: skip
    base = [SMOKE, f"data.input_cfg={mix}", f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}", "trainer.final_eval_split=none", "trainer.val_every=0",
            "sampler.max_batch_duration=60", "trainer.grad_accum=2"]  # fmt: skip
    a, b, stdout = full_and_resumed_metrics(run_train, base, tmp_path, steps=6, stop=3)
    assert "train data: data.input_cfg: 442 utterances" in stdout  # 221 ASR + 221 AST rows
    assert len(a) == len(b) == 6
    assert [m["rows_digest"] for m in b] == [m["rows_digest"] for m in a]
    for ma, mb in zip(a, b):
        assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-6), f"step {ma['step']}"
