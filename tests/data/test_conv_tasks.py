"""Shares per task (issue 23): `speechlm manifest stats` and `speechlm plan` report utterances and hours of
each task next to the languages, for a manifest with a task column and for a mixed ASR + AST input_cfg."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from speechlm.cli import main
from speechlm.data.sources.detect import load_source


def test_manifest_stats_report_each_task(demo_data, tmp_path, capsys):
    table = load_source(demo_data["val"])
    n = len(table)
    tasks = ["ast" if i % 4 == 0 else None for i in range(n)]  # null: asr
    table = table.append_column(pa.field("task", pa.string()), pa.array(tasks, pa.string()))
    pq.write_table(table, tmp_path / "m.parquet")
    assert main(["manifest", "stats", str(tmp_path / "m.parquet"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    durations = table.column("duration").to_numpy()
    ast = durations[[t == "ast" for t in tasks]]
    assert stats["tasks"]["ast"]["utterances"] == len(ast) == (n + 3) // 4
    assert stats["tasks"]["asr"]["utterances"] == n - len(ast)
    assert stats["tasks"]["ast"]["hours"] == pytest.approx(ast.sum() / 3600, abs=1e-4)
    assert stats["tasks"]["ast"]["hours_share"] == pytest.approx(ast.sum() / durations.sum(), abs=1e-4)
    assert main(["manifest", "stats", str(tmp_path / "m.parquet")]) == 0
    text = capsys.readouterr().out
    assert "task" in text and "ast" in text and "hours share" in text
    assert main(["manifest", "stats", demo_data["val"], "--json"]) == 0  # no task column: as before
    assert "tasks" not in json.loads(capsys.readouterr().out)


def test_plan_of_a_mixed_asr_ast_input_cfg_reports_task_shares(demo_data, tmp_path, capsys):
    cfg = [
        {"path": demo_data["val"], "name": "asr", "weight": 3},
        {
            "path": demo_data["val"],
            "name": "ast",
            "weight": 1,
            "task": "ast",
            "prompt": "Translate to English.",
        },
    ]
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "plan.json"
    argv = ["plan", "--input-cfg", str(tmp_path / "mix.yaml"), "--epoch-size", "400", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "task" in text and "ast" in text
    summary = json.loads(out.read_text())
    tasks = {r["task"]: r for r in summary["tasks"]}
    assert set(tasks) == {"asr", "ast"}
    assert tasks["asr"]["natural_share"] == pytest.approx(0.5)  # the same dataset twice
    assert tasks["ast"]["planned_share"] == pytest.approx(0.25, abs=0.06)  # the weights: 3 to 1
    assert (
        tasks["asr"]["planned_utterances"] + tasks["ast"]["planned_utterances"]
        == summary["planned_utterances"]
    )
    hours = sum(r["planned_hours"] for r in summary["tasks"])
    assert hours == pytest.approx(summary["planned_hours"], rel=1e-4)
