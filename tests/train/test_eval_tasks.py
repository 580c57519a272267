"""Issue 23 item 4, evaluation per (task, language): decoding rows carry their task and its statistics, the
table and eval.json give each task's metrics per language, sharding over ranks gives the one-rank BLEU exactly,
trainer.best_metric may name any metric (checked at fit start, kept in its direction)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pytest
import sacrebleu
import torch
from test_eval_counts import build_evaluator, smoke_cfg
from test_evaluate import VOCAB, WordTokenizer, build_model, make_batches

from parallel.collectives import Collectives
from parallel.mesh import ParallelDims
from parallel.testing import run_distributed
from speechlm.errors import UsageError
from speechlm.metrics import aggregate
from speechlm.use.eval_report import format_eval_table
from speechlm.use.evaluator import decode_shard, shard_eval_batches

TASKS = ("asr", "ast", "qa")


def mixed_batches() -> list:
    """The tiny legacy batches of test_evaluate, each row given a task (asr, ast, qa in turn)."""
    batches = make_batches(4)
    k = 0
    for b in batches:
        b.tasks = [TASKS[(k + j) % 3] for j in range(len(b))]
        k += len(b)
    return batches


def decode(batches, comm=None) -> list[dict]:
    return decode_shard(
        build_model(VOCAB), batches, WordTokenizer(), device=torch.device("cpu"), comm=comm or Collectives(),
        max_new_tokens=6,
    )  # fmt: skip


def test_decoded_rows_carry_their_task_and_each_tasks_metrics():
    rows = decode(mixed_batches())
    assert {r["task"] for r in rows} == set(TASKS) and all(r["stats"] for r in rows)
    for r in rows:
        assert set(r["stats"]) == {"asr": {"wer"}, "ast": {"bleu", "chrf"}, "qa": {"accuracy"}}[r["task"]]
        assert ("errors" in r) == (r["task"] == "asr")
    out = aggregate((r["task"], r["lang"], r["stats"]) for r in rows)
    ast = [r for r in rows if r["task"] == "ast"]
    assert out["ast/bleu"] == sacrebleu.corpus_bleu([r["hyp"] for r in ast], [[r["ref"] for r in ast]]).score
    for lang in {r["lang"] for r in ast}:
        mine = [r for r in ast if r["lang"] == lang]
        want = sacrebleu.corpus_chrf([r["hyp"] for r in mine], [[r["ref"] for r in mine]]).score
        assert out[f"ast/chrf_{lang}"] == want
    qa = [r for r in rows if r["task"] == "qa"]
    assert out["qa/accuracy"] == sum(r["hyp"].lower() == r["ref"].lower() for r in qa) / len(qa)
    assert out["wer"] == out["asr/wer"]

    table = format_eval_table(out)
    blocks = table.split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == ["task asr:", "task ast:", "task qa:"]
    assert blocks[1].splitlines()[1].split() == ["language", "utterances", "BLEU", "chrF"]
    all_ast = next(ln for ln in blocks[1].splitlines() if ln.startswith("all"))
    assert all_ast.split()[-2:] == [f"{out['ast/bleu']:.1f}", f"{out['ast/chrf']:.1f}"]
    assert blocks[2].splitlines()[-1].split()[-1] == f"{100 * out['qa/accuracy']:.1f}%"


def test_batches_without_tasks_are_asr_and_keep_todays_table():
    rows = decode(make_batches(2))
    assert {r["task"] for r in rows} == {"asr"}
    out = aggregate((r["task"], r["lang"], r["stats"]) for r in rows)
    table = format_eval_table(out, {"hi": 2, "en": 2})
    assert table.splitlines()[0] == "language  utterances  WER"  # no task heading: today's WER table
    assert table.splitlines()[-1].startswith("all") and f"{100 * out['wer']:5.1f}%" in table.splitlines()[-1]


def _bleu_worker(rank: int, world: int) -> list[dict]:
    comm = ParallelDims(world).collectives(rank)
    batches = mixed_batches()
    share = shard_eval_batches([[i] for i in range(len(batches))], comm.dp_rank, comm.dp_size)
    from speechlm.data.dataset import Batch

    rows = decode([batches[s[0]] if s else Batch.empty() for s in share], comm)
    return [r for part in comm.gather_objects(rows) for r in part]


@pytest.mark.multiproc
def test_bleu_over_two_ranks_equals_one_rank_exactly():
    want = aggregate((r["task"], r["lang"], r["stats"]) for r in decode(mixed_batches()))
    for got in run_distributed(_bleu_worker, 2, "gloo", timeout_s=240):
        assert aggregate((r["task"], r["lang"], r["stats"]) for r in got) == want  # every key, exactly


# --------------------------------------------------------------------------- Evaluator and eval.json


def with_tasks(table, tasks):
    """`table` with a `task` column (the manifest column of interface A), `tasks(i)` for row i."""
    return table.append_column("task", pa.array([tasks(i) for i in range(len(table))]))


def test_evaluation_of_a_mixed_split_gives_each_task_per_language(demo_data, tmp_path, monkeypatch, capsys):
    """The val split, half of it ASR and half AST (the batches' `tasks` filled from the manifest as the
    conversation Collator does): per-task keys, counts, table, eval.json and decodes."""
    from speechlm.train import evaluate
    from speechlm.use import evaluator

    ev, module, table = build_evaluator(demo_data, demo_data["val"])
    ev.table = table = with_tasks(table, lambda i: "ast" if i % 2 else "asr")
    task_of = table.column("task").to_pylist()
    load = evaluator.Evaluator.load_slots

    def load_with_tasks(ds, share):
        for batch in load(ds, share):
            batch.tasks = [task_of[i] for i in batch.indices]
            yield batch

    monkeypatch.setattr(evaluator.Evaluator, "load_slots", staticmethod(load_with_tasks))
    result = ev(module)
    assert {"asr/wer", "ast/bleu", "ast/chrf", "wer", "loss"} <= set(result)
    langs = {
        lang for lang, task in zip(table.column("lang").to_pylist(), task_of, strict=True) if task == "ast"
    }
    assert {k for k in result if k.startswith("ast/bleu_")} == {f"ast/bleu_{lang}" for lang in langs}
    counts = ev.last_counts
    assert set(counts["scored_by_task"]) == {"asr", "ast"}
    assert sum(counts["scored_by_task"]["ast"].values()) == sum(t == "ast" for t in ev.last_tasks) == 6
    inputs = SimpleNamespace(train_table=None, val_table=table, tokenizer=ev.tokenizer, chat_template=None)
    ev.cfg.trainer.final_eval_split = "val"
    monkeypatch.setattr(
        "speechlm.train.plots.plot_learning_curve", lambda metrics, png: png
    )  # no metrics.jsonl in this run dir
    evaluate.final_evaluation(ev.cfg, inputs, module, tmp_path, {"steps": 0, "train_minutes": 0.0}, 0)
    out = capsys.readouterr().out
    assert "final greedy metrics per task" in out and "task asr:" in out and "task ast:" in out
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["ast/bleu"] == result["ast/bleu"] and record["wer"] == record["asr/wer"]
    assert record["tasks"]["ast"]["utterances"]["all"] == 6 and record["utterances"]["all"] == 12
    decodes = [json.loads(ln) for ln in (tmp_path / "eval_decodes.jsonl").read_text().splitlines()]
    assert [d["task"] for d in decodes] == ev.last_tasks


def test_a_split_with_a_task_that_has_no_metric_is_refused_before_decoding(demo_data, tmp_path):
    ev, module, table = build_evaluator(demo_data, demo_data["val"])
    ev.table = with_tasks(table, lambda i: "caption" if i == 3 else "asr")
    module.model.generate_for_batch = None  # never reached
    with pytest.raises(UsageError, match=r"val\.parquet.*task 'caption'.*trainer\.eval_metrics"):
        ev(module)
    ev, module, table = build_evaluator(demo_data, demo_data["val"], "trainer.eval_metrics={caption: [bleu]}")
    ev.table = with_tasks(table, lambda i: "caption" if i == 3 else "asr")
    assert ev.plan()


# --------------------------------------------------------------------------- trainer.best_metric


def test_fit_start_refuses_a_best_metric_the_validation_does_not_produce(demo_data, tmp_path, capsys):
    from helpers import train_in_process

    base = ["configs/smoke.yaml", f"data.train_manifest={demo_data['train']}", f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}", "trainer.val_every=1", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    r = train_in_process([*base, "trainer.best_metric=ast/bleu"], capsys)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "trainer.best_metric='ast/bleu'" in r.stderr and "asr/wer" in r.stderr and "wer_hi" in r.stderr
    assert not (tmp_path / "run/checkpoints").exists() or not any((tmp_path / "run/checkpoints").iterdir())
    # the same name is fine once the split has AST rows
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.preflight import checks as preflight

    mixed = with_tasks(open_index(demo_data["val"]), lambda i: "ast" if i % 2 else "asr")
    cfg = smoke_cfg(demo_data, "trainer.val_every=1", "trainer.best_metric=ast/bleu")
    preflight.check_eval_metrics(cfg, None, mixed)


def _callback(best_metric: str, values, tmp_path, monkeypatch, patience: int = 2):
    from speechlm.train import callbacks

    saved: list[int] = []
    trainer = SimpleNamespace(global_step=0, lightning_module=None, is_global_zero=True, should_stop=False)
    monkeypatch.setattr(
        callbacks, "save_checkpoint_atomic", lambda *a, **k: saved.append(trainer.global_step)
    )
    it = iter(values)
    cb = callbacks.ValidationCallback(
        lambda module: {"loss": 1.0, best_metric: next(it)}, callbacks.MetricsWriter(tmp_path), tmp_path,
        every=1, best_metric=best_metric, patience=patience,
    )  # fmt: skip
    for step in range(1, len(values) + 1):
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, None, step)
        if trainer.should_stop:
            break
    return cb, saved, trainer.global_step


@pytest.mark.parametrize("name", ["ast/bleu", "qa/accuracy_hi", "ast/chrf"])
def test_higher_is_better_for_bleu_chrf_accuracy(name, tmp_path, monkeypatch):
    cb, saved, stopped = _callback(name, [10.0, 20.0, 15.0, 18.0, 30.0], tmp_path, monkeypatch)
    assert saved == [1, 2] and cb.best == 20.0 and stopped == 4  # 15 and 18 are worse than 20


@pytest.mark.parametrize("name", ["asr/wer", "asr/cer_zh", "loss", "wer_hi"])
def test_lower_is_better_for_wer_cer_loss(name, tmp_path, monkeypatch):
    cb, saved, stopped = _callback(name, [0.5, 0.4, 0.45, 0.3], tmp_path, monkeypatch)
    assert saved == [1, 2, 4] and cb.best == 0.3 and stopped == 4


def test_resume_with_another_best_metric_starts_the_best_afresh(tmp_path, monkeypatch, capsys):
    """The best value is saved with its metric's name: a BLEU of 20 must not be compared with a WER."""
    cb, _, _ = _callback("asr/wer", [0.5, 0.6], tmp_path, monkeypatch)
    state = cb.state_dict()
    assert state == {"best": 0.5, "bad_evals": 1, "metric": "asr/wer"}
    same, _, _ = _callback("asr/wer", [], tmp_path, monkeypatch)
    same.load_state_dict(state)
    assert (same.best, same.bad_evals) == (0.5, 1)
    other, _, _ = _callback("ast/bleu", [], tmp_path, monkeypatch)
    other.load_state_dict(state)
    assert (other.best, other.bad_evals) == (
        None,
        0,
    ) and "trainer.best_metric changed" in capsys.readouterr().out
    old, _, _ = _callback("wer", [], tmp_path, monkeypatch)
    old.load_state_dict({"best": 0.7, "bad_evals": 0})  # a checkpoint from before the name was saved
    assert old.best == 0.7


def test_learning_curve_plots_each_tasks_scores_and_tolerates_missing_keys(tmp_path):
    from speechlm.train.plots import plot_learning_curve, validation_series

    val = [
        {"kind": "val", "step": 2, "loss": 2.0, "wer": 0.9, "wer_hi": 0.8, "asr/wer": 0.9, "asr/wer_hi": 0.8,
         "ast/bleu": 3.5, "ast/bleu_hi": 3.5, "qa/accuracy": 0.25, "utterances": 4},
        {"kind": "val", "step": 4, "loss": 1.5, "wer": 0.7, "asr/wer": 0.7, "ast/bleu": 9.0, "qa/accuracy": 0.5},
    ]  # fmt: skip
    series = validation_series(val)
    assert series["greedy WER"] == {"wer": [(2, 90.0), (4, 70.0)], "wer_hi": [(2, 80.0)]}
    assert series["other tasks"] == {"ast/bleu": [(2, 3.5), (4, 9.0)], "qa/accuracy": [(2, 25.0), (4, 50.0)]}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"step": 1, "loss": 3.0}, *val]))
    assert plot_learning_curve(path, tmp_path / "curve.png").stat().st_size > 0
