"""Issue 24, the training-split scores beside the held-out ones: `trainer.final_eval_split=both` (val, then
a per-language proportional, capped, spread subset of the training split), `trainer.val_train_batches`
(train_wer at each validation), the dashed training curves of learning_curve.png, a SIGTERM during `both`."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from test_eval_counts import build_evaluator, smoke_cfg

from speechlm.train.eval_rows import (
    apportion,
    choose_train_rows,
    periodic_train_rows,
    row_groups,
    train_eval_rows,
)


def groups(*spec: tuple[str, int]) -> np.ndarray:
    """Rows of groups in blocks: groups(("asr/hi", 3), ("asr/ta", 2)) -> [asr/hi x3, asr/ta x2]."""
    return np.array([g for g, n in spec for _ in range(n)], dtype=object)


# --------------------------------------------------------------------------- the training subset


def test_apportion_gives_largest_remainders_summing_to_n():
    assert apportion(np.array([1, 1, 1]), 4).tolist() == [2, 1, 1]  # a tie: the earlier group
    assert apportion(np.array([6, 3, 1]), 5).tolist() == [3, 2, 0]
    assert apportion(np.array([2, 2]), 0).tolist() == [0, 0]


def test_train_rows_follow_the_val_proportions_spread_over_each_language():
    train = groups(("asr/hi", 100), ("asr/ta", 100), ("asr/bn", 40))
    val = groups(("asr/hi", 6), ("asr/ta", 2), ("asr/bn", 2))
    rows = choose_train_rows(train, val, 20)
    assert rows == choose_train_rows(train, val.copy(), 20) == sorted(rows)  # deterministic, sorted
    assert Counter(train[rows]) == {"asr/hi": 12, "asr/ta": 4, "asr/bn": 4}  # 6:2:2 of 20
    hi = [r for r in rows if train[r] == "asr/hi"]
    assert hi == [4, 12, 20, 29, 37, 45, 54, 62, 70, 79, 87, 95]  # spread over its 100 rows, not the first 12
    ta = [r for r in rows if train[r] == "asr/ta"]
    assert ta == [112, 137, 162, 187]


def test_train_rows_are_capped_by_what_each_group_has():
    train = groups(("asr/hi", 50), ("asr/ta", 3), ("ast/hi", 10))
    val = groups(("asr/hi", 2), ("asr/ta", 2), ("asr/bn", 2), ("ast/hi", 2))
    rows = choose_train_rows(train, val, 40)  # 10 per group asked
    assert Counter(train[rows]) == {"asr/hi": 10, "asr/ta": 3, "ast/hi": 10}  # ta has 3; bn none in train
    assert len(rows) == len(set(rows)) <= 40
    assert choose_train_rows(train, val, 10_000) == list(range(len(train)))  # asked more than there is: all


def test_a_val_split_of_languages_training_lacks_is_refused_by_name(demo_data):
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.errors import DataError

    train, val = open_index(demo_data["train"]), open_index(demo_data["val"])
    other = val.set_column(val.schema.get_field_index("lang"), "lang", [["xx"] * len(val)])
    for k, choose in ((0, train_eval_rows), (1, periodic_train_rows)):
        cfg = smoke_cfg(demo_data, "trainer.val_every=1", f"trainer.val_train_batches={k}")
        with pytest.raises(
            DataError, match=r"no row of the training split .*\(asr/xx\).*val_train_batches=0"
        ):
            choose(cfg, train, other)


def test_final_train_subset_defaults_to_the_val_size_and_the_key_caps_it(demo_data):
    from speechlm.data.sources.mmap_cache import open_index

    train, val = open_index(demo_data["train"]), open_index(demo_data["val"])
    cfg = smoke_cfg(demo_data, "trainer.final_eval_split=both")
    rows = train_eval_rows(cfg, train, val)
    assert len(rows) == len(val) and rows != list(range(len(val)))
    val_langs = Counter(str(x) for x in val.column("lang").to_pylist())
    assert Counter(row_groups(train)[rows]) == {f"asr/{k}": v for k, v in val_langs.items()}
    cfg = smoke_cfg(demo_data, "trainer.final_eval_split=both", "trainer.final_eval_train_utterances=5")
    assert len(train_eval_rows(cfg, train, val)) == 5


def test_periodic_train_rows_fit_the_batches_and_stay_the_same(demo_data):
    from speechlm.data.manifest import manifest_arrays
    from speechlm.data.sampler.batching import batch_by_duration
    from speechlm.data.sources.mmap_cache import open_index

    train, val = open_index(demo_data["train"]), open_index(demo_data["val"])
    durations = manifest_arrays(train).durations
    sizes = []
    for k in (1, 2):
        cfg = smoke_cfg(demo_data, "trainer.val_every=1", f"trainer.val_train_batches={k}")
        rows = periodic_train_rows(cfg, train, val)
        assert rows == periodic_train_rows(cfg, train, val)  # the same rows at every validation
        assert len(batch_by_duration(durations[rows], 4 * 12.0)) <= k  # smoke: 4x sampler.max_batch_duration
        assert set(row_groups(train)[rows]) <= set(row_groups(val))
        sizes.append(len(rows))
    assert 1 < sizes[0] < sizes[1]


def test_every_dp_rank_plans_the_same_training_rows_and_decodes_its_share(demo_data):
    """Ranks simulated in one process (no process group): each builds its evaluator from the manifests
    alone, gets the same plan of training rows, and the round-robin shares cover it once, in lockstep."""
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.use.evaluator import Evaluator, shard_eval_batches

    cfg = smoke_cfg(demo_data, "trainer.val_every=1", "trainer.val_train_batches=2",
                    "trainer.eval_batch_duration=6")  # fmt: skip
    plans = []
    for rank in range(2):  # what each rank does at startup (entry.build_trainer)
        train, val = open_index(demo_data["train"]), open_index(demo_data["val"])
        rows = periodic_train_rows(cfg, train, val)
        plans.append(Evaluator(cfg, None, train, rank, split="train", rows=rows).plan())
    assert plans[0] == plans[1] and len(plans[0]) == 2
    assert sorted(r for b in plans[0] for r in b) == rows
    shares = [shard_eval_batches(plans[0], dp_rank, 2) for dp_rank in range(2)]
    assert len(shares[0]) == len(shares[1])  # the same number of slots: lockstep
    assert sorted(r for share in shares for b in share for r in b) == rows


# --------------------------------------------------------------------------- final_eval_split=both


def both_inputs(demo_data):
    from speechlm.data.sources.mmap_cache import open_index

    ev, module, val = build_evaluator(demo_data, demo_data["val"], "trainer.final_eval_split=both")
    inputs = SimpleNamespace(
        train_table=open_index(demo_data["train"]), val_table=val, tokenizer=ev.tokenizer, chat_template=None
    )
    return ev.cfg, inputs, module


def test_both_prints_and_writes_the_val_and_the_train_record(demo_data, tmp_path, monkeypatch, capsys):
    from speechlm.train import evaluate

    monkeypatch.setattr("speechlm.train.plots.plot_learning_curve", lambda metrics, png: png)
    cfg, inputs, module = both_inputs(demo_data)
    result = {"steps": 0, "train_minutes": 0.0}
    scores = evaluate.final_evaluation(cfg, inputs, module, tmp_path, result, 0)
    out = capsys.readouterr().out
    val_at, train_at = (
        out.index("on the val split after 0 steps"),
        out.index("on the train split after 0 steps"),
    )
    side = out.index("held-out (val) and training-split scores side by side")
    assert val_at < train_at < side
    langs = sorted(set(str(x) for x in inputs.val_table.column("lang").to_pylist()))
    for lang in langs:  # `hi        val 100.0%  train 100.0%`
        line = next(ln for ln in out[side:].splitlines() if ln.startswith(f"{lang} "))
        want = f"val {100 * scores[f'wer_{lang}']:.1f}%  train {100 * scores[f'train_wer_{lang}']:.1f}%"
        assert line.split(None, 1)[1] == want
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["split"] == "val" and record["wer"] == scores["wer"]  # today's readers: the val record
    assert record["utterances"]["all"] == len(inputs.val_table)
    train = record["train"]
    assert train["split"] == "train" and train["wer"] == scores["train_wer"]
    assert set(train) == set(record) - {"train"}  # the same shape
    assert train["utterances"]["all"] == len(inputs.val_table)  # capped at the val split's size
    decodes = [json.loads(ln) for ln in (tmp_path / "eval_decodes.jsonl").read_text().splitlines()]
    assert [d["split"] for d in decodes] == ["val"] * len(inputs.val_table) + ["train"] * len(
        inputs.val_table
    )


def test_val_alone_writes_no_train_record(demo_data, tmp_path, monkeypatch, capsys):
    from speechlm.train import evaluate

    monkeypatch.setattr("speechlm.train.plots.plot_learning_curve", lambda metrics, png: png)
    cfg, inputs, module = both_inputs(demo_data)
    cfg.trainer.final_eval_split = "val"
    scores = evaluate.final_evaluation(cfg, inputs, module, tmp_path, {"steps": 0, "train_minutes": 0.0}, 0)
    assert "train" not in json.loads((tmp_path / "eval.json").read_text())
    assert not any(k.startswith("train_") for k in scores) and "side by side" not in capsys.readouterr().out
    decodes = [json.loads(ln) for ln in (tmp_path / "eval_decodes.jsonl").read_text().splitlines()]
    assert {d["split"] for d in decodes} == {"val"}


def test_sigterm_during_the_train_part_of_both_writes_no_eval_json(demo_data, tmp_path, monkeypatch):
    """The val split scored, then a SIGTERM as the training subset starts: EvaluationInterrupted at a batch, and
    no eval.json (nothing is written before both splits are scored)."""
    from speechlm.train import evaluate
    from speechlm.train.preempt import SIGTERM_FLAG
    from speechlm.use.evaluator import EvaluationInterrupted, Evaluator

    run_share = Evaluator.run_share
    seen = []

    def sigterm_in_train(self, *args, **kwargs):
        seen.append(self.split)
        if self.split == "train":
            SIGTERM_FLAG.requested = True  # what the SIGTERM handler does
        return run_share(self, *args, **kwargs)

    monkeypatch.setattr(Evaluator, "run_share", sigterm_in_train)
    cfg, inputs, module = both_inputs(demo_data)
    try:
        with pytest.raises(EvaluationInterrupted, match="stopped at batch 1 of"):
            evaluate.final_evaluation(cfg, inputs, module, tmp_path, {"steps": 0, "train_minutes": 0.0}, 0)
    finally:
        SIGTERM_FLAG.reset()
    assert seen == ["val", "train"]
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "eval_decodes.jsonl").exists()


def test_both_needs_a_val_manifest_and_an_evaluated_run_is_recognised(demo_data, tmp_path):
    from speechlm.config import ConfigError, load_config
    from speechlm.train.recipe import already_evaluated

    with pytest.raises(ConfigError, match=r"trainer.final_eval_split='both'.*data.val_manifest"):
        load_config("configs/smoke.yaml", ["trainer.final_eval_split=both"])
    cfg = smoke_cfg(demo_data, "trainer.final_eval_split=both")
    ckpt = tmp_path / "checkpoints/step_000003"
    ckpt.mkdir(parents=True)
    (ckpt / "complete.json").write_text(json.dumps({"step": 3}))
    (tmp_path / "eval.json").write_text(json.dumps({"split": "val", "steps": 3}))
    assert not already_evaluated(cfg, tmp_path, ckpt, 3)  # a val-only eval.json: `both` evaluates again
    (tmp_path / "eval.json").write_text(json.dumps({"split": "val", "steps": 3, "train": {"split": "train"}}))
    assert already_evaluated(cfg, tmp_path, ckpt, 3)


# --------------------------------------------------------------------------- trainer.val_train_batches


def validations(cfg, inputs, module, run_dir) -> list[dict]:
    """The records the run's ValidationCallback (as build_trainer wires it) writes at steps 2 and 4."""
    from speechlm.train.callbacks import ValidationCallback
    from speechlm.train.recipe import build_trainer

    _, trainer = build_trainer(cfg, inputs, run_dir)
    cb = next(cb for cb in trainer.callbacks if isinstance(cb, ValidationCallback))
    cb.best = 0.0  # a best nothing beats: no checkpoint is written
    for step in (2, 4):
        state = SimpleNamespace(global_step=step, is_global_zero=True, should_stop=False)
        cb.on_train_batch_end(state, module, None, None, 0)
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_val_train_batches_adds_train_keys_to_each_validation(demo_data, tmp_path, capsys):
    from parallel.mesh import ParallelDims

    cfg, inputs, module = both_inputs(demo_data)
    inputs.rank, inputs.dims = 0, ParallelDims(1, 1, 1, 1, 1)
    cfg.trainer.val_every = 1
    plain = validations(cfg, inputs, module, tmp_path / "off")
    assert [r["step"] for r in plain] == [2, 4] and "wer" in plain[0]
    assert not any(k.startswith("train_") for r in plain for k in r)  # off by default: today's record
    assert " train_wer=" not in capsys.readouterr().out
    cfg.trainer.val_train_batches = 1
    records = validations(cfg, inputs, module, tmp_path / "on")
    langs = {str(x) for x in inputs.val_table.column("lang").to_pylist()}
    assert [r["step"] for r in records] == [2, 4]
    for r, p in zip(records, plain):
        assert {k for k in r if not k.startswith("train_")} == set(p)  # the val keys as they were
        assert {"train_wer", "train_loss", "train_asr/wer"} | {f"train_wer_{lang}" for lang in langs} <= set(
            r
        )
        assert r["train_utterances"] == records[0]["train_utterances"] > 0  # the same rows each time
    out = capsys.readouterr().out
    assert (
        out.count("[val step") == 2 and " train_wer=" in out and out.index(" wer=") < out.index("train_wer=")
    )


def test_val_max_batches_cuts_the_val_split_not_the_training_subset(demo_data, tmp_path):
    from parallel.mesh import ParallelDims

    cfg, inputs, module = both_inputs(demo_data)
    inputs.rank, inputs.dims = 0, ParallelDims(1, 1, 1, 1, 1)
    t = cfg.trainer
    t.val_every, t.val_max_batches, t.val_train_batches, t.eval_batch_duration = 1, 1, 2, 6.0
    rows = periodic_train_rows(cfg, inputs.train_table, inputs.val_table)
    record = validations(cfg, inputs, module, tmp_path)[0]
    assert record["utterances"] + record["dropped"] < len(inputs.val_table)  # one batch of val
    assert record["train_utterances"] + record["train_dropped"] == len(rows)  # both training batches


def test_best_metric_may_name_a_train_key_kept_in_its_direction(demo_data):
    from speechlm.config import ConfigError, load_config
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.errors import UsageError
    from speechlm.preflight import checks as preflight
    from speechlm.train.callbacks import ValidationCallback

    assert ValidationCallback(None, None, ".", every=1, best_metric="train_wer").lower_is_better
    assert not ValidationCallback(None, None, ".", every=1, best_metric="train_ast/bleu").lower_is_better
    with pytest.raises(ConfigError, match="trainer.best_metric"):
        load_config("configs/smoke.yaml", ["trainer.best_metric=train_bogus"])
    train, val = open_index(demo_data["train"]), open_index(demo_data["val"])
    cfg = smoke_cfg(demo_data, "trainer.val_every=1", "trainer.best_metric=train_wer")
    with pytest.raises(UsageError, match="trainer.val_train_batches=0"):
        preflight.check_eval_metrics(cfg, train, val)
    cfg.trainer.val_train_batches = 1
    preflight.check_eval_metrics(cfg, train, val)
    # validation off turns the training subset off with it (configs/demo.yaml trainer.val_every=0 must load)
    assert load_config("configs/demo.yaml", ["trainer.val_every=0"]).trainer.val_train_batches == 1


# --------------------------------------------------------------------------- learning_curve.png


def test_learning_curve_groups_the_train_curves_with_their_val_curves(tmp_path):
    from speechlm.train.plots import is_train_curve, plot_learning_curve, validation_series

    val = [
        {"kind": "val", "step": 2, "loss": 2.0, "wer": 0.9, "wer_hi": 0.8, "train_wer": 0.5, "train_wer_hi": 0.4,
         "train_loss": 1.0, "train_utterances": 4, "ast/bleu": 3.0, "train_ast/bleu": 7.0, "train_asr/wer": 0.5},
        {"kind": "val", "step": 4, "loss": 1.5, "wer": 0.7, "train_wer": 0.25},
    ]  # fmt: skip
    series = validation_series(val)
    assert series["greedy WER"] == {
        "train_wer": [(2, 50.0), (4, 25.0)], "train_wer_hi": [(2, 40.0)], "wer": [(2, 90.0), (4, 70.0)],
        "wer_hi": [(2, 80.0)],
    }  # fmt: skip
    assert series["other tasks"] == {"ast/bleu": [(2, 3.0)], "train_ast/bleu": [(2, 7.0)]}
    dashed = {k for curves in series.values() for k in curves if is_train_curve(k)}
    assert dashed == {"train_wer", "train_wer_hi", "train_ast/bleu"}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"step": 1, "loss": 3.0}, *val]))
    assert plot_learning_curve(path, tmp_path / "curve.png").stat().st_size > 0


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_run_with_both_splits_logs_and_reports_them_side_by_side(demo_data, tmp_path):
    """`speechlm train` with val_train_batches and final_eval_split=both: the wiring of entry.py, in a real fit."""
    from helpers import run_train

    run_dir = tmp_path / "run"
    r = run_train(["configs/smoke.yaml", f"data.train_manifest={demo_data['train']}",
                   f"data.val_manifest={demo_data['val']}", f"data.tokenizer={demo_data['tok']}",
                   "trainer.max_steps=4", "trainer.val_every=2", "trainer.val_train_batches=1",
                   "trainer.final_eval_split=both", f"trainer.run_dir={run_dir}"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    val = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if '"val"' in ln]
    assert [v["step"] for v in val] == [2, 4] and all("wer" in v and "train_wer" in v for v in val)
    assert r.stdout.count(" train_wer=") == 2
    assert "held-out (val) and training-split scores side by side" in r.stdout
    record = json.loads((run_dir / "eval.json").read_text())
    assert record["split"] == "val" and record["train"]["split"] == "train" and record["steps"] == 4
    assert (run_dir / "learning_curve.png").stat().st_size > 0
