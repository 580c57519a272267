"""Training's evaluations: the final evaluation after training (`final_evaluation`) and a validation that
scores the training split beside the held-out one (`with_train_split`). Both run the evaluation engine of
`speechlm.use.evaluator` (`Evaluator`: greedy decoding and each task's metrics per language, sharded over
the data-parallel ranks; its module docstring says how), and report with `speechlm.use.eval_report`.

The training split beside the held-out one. A model that memorises scores well on the rows it trained on
and badly on new sentences, so the training split is scored too, on a subset that costs about what the
val split costs: `choose_train_rows` apportions N rows over the (task, language) groups of the training
split in the proportions of the val split's groups (largest remainders; a group with fewer training rows
gives all it has, a val group absent from training gives none) and takes each group's rows evenly spread
over its rows in manifest order (position floor((i + 0.5) * rows / k) of k), not the first N. The choice
depends only on the two manifests and N, so every rank and every validation of a run scores the same rows.
`trainer.final_eval_split=both` scores N = `trainer.final_eval_train_utterances` (default: the val split's
utterances) after the val split; `trainer.val_train_batches=K` scores, at each validation, the largest
such subset that fits in K decoding batches (`periodic_train_rows`), its keys prefixed `train_`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from speechlm.config import ExperimentConfig, final_eval_split
from speechlm.data.run_inputs import RunTokenizer
from speechlm.metrics import DEFAULT_TASK
from speechlm.train import plots
from speechlm.train.eval_rows import train_eval_rows
from speechlm.train.preempt import SIGTERM_FLAG
from speechlm.use.eval_report import (
    count_record,
    format_eval_table,
    format_side_by_side,
    with_prefix,
    write_eval_outputs,
)
from speechlm.use.evaluator import EvalModule, Evaluator


class EvalInputs(Protocol):
    """What the final evaluation reads from the run's inputs (`speechlm.train.recipe.RunInputs`)."""

    @property
    def train_table(self) -> pa.Table | None: ...
    @property
    def val_table(self) -> pa.Table | None: ...
    @property
    def tokenizer(self) -> RunTokenizer: ...
    @property
    def chat_template(self) -> str | None: ...


def with_train_split(
    val_eval: Callable[[EvalModule], dict[str, Any]], train_eval: Evaluator
) -> Callable[[EvalModule], dict[str, Any]]:
    """A validation that scores the val split, then (every rank, in lockstep) `train_eval`'s training rows,
    into one record: the val keys as they are, the training keys prefixed `train_`."""

    def evaluate(module: EvalModule) -> dict[str, Any]:
        return {**val_eval(module), **with_prefix(train_eval(module))}

    return evaluate


def final_evaluation(
    cfg: ExperimentConfig,
    inputs: EvalInputs,
    module: EvalModule,
    run_dir: Path,
    result: dict[str, Any],
    rank: int,
) -> dict[str, Any]:
    """Greedy decoding and the metrics of each task per language on `trainer.final_eval_split` after
    training; rank 0 prints the table and writes eval.json, eval_decodes.jsonl and the learning curve.
    Returns the evaluator's metrics (with `both`: the val split's, and the training subset's prefixed
    `train_`).

    `both` scores the val split, then `train_eval_rows` of the training split, and prints both tables (val
    first) and one line per language with the two side by side; eval.json holds the val record at the top
    level and the training one under `train`, eval_decodes.jsonl gives each decode's `split`.

    The trained weights are already saved when this runs (the end-of-training checkpoint); a SIGTERM
    during it stops it on every rank at the same batch (`EvaluationInterrupted`), with no eval.json (with
    `both`, nothing is written before both splits are scored)."""
    split = final_eval_split(cfg)  # "auto" resolved: val when there is a val manifest, else none
    tables = {"train": inputs.train_table, "val": inputs.val_table}
    table = tables["val" if split == "both" else split] if split != "none" else None
    if table is None:
        if rank == 0:
            why = " and no data.val_manifest" if cfg.trainer.final_eval_split == "auto" else ""
            print(f"no final evaluation (trainer.final_eval_split={cfg.trainer.final_eval_split}{why})")
        return {}
    first = "val" if split == "both" else split
    template = inputs.chat_template
    evaluators = [
        Evaluator(cfg, inputs.tokenizer, table, rank, max_batches=None, split=first, template=template)
    ]
    if split == "both":
        rows = train_eval_rows(cfg, inputs.train_table, table)
        evaluators.append(
            Evaluator(
                cfg,
                inputs.tokenizer,
                inputs.train_table,
                rank,
                max_batches=None,
                split="train",
                rows=rows,
                template=template,
            )
        )
    scores = [ev(module, stop=lambda: SIGTERM_FLAG.requested, progress=True) for ev in evaluators]
    if rank == 0:
        records: list[dict[str, Any]] = []
        decodes: list[tuple[str, str, str]] = []
        tasks: list[str] = []
        splits: list[str] = []
        for ev, sc in zip(evaluators, scores):
            counts = ev.last_counts
            what = "WER" if set(counts["scored_by_task"]) <= {DEFAULT_TASK} else "metrics per task"
            print(
                f"\nfinal greedy {what} on the {ev.split} split after {result['steps']} steps "
                f"({result['train_minutes']:.1f} min):"
            )
            print(format_eval_table(sc, counts))
            records.append({"split": ev.split, **result, **sc, **count_record(counts)})
            decodes += ev.last_decodes
            tasks += ev.last_tasks
            splits += [ev.split] * len(ev.last_decodes)
        if len(scores) == 2:
            print("\nheld-out (val) and training-split scores side by side:")
            print(format_side_by_side(scores[0], scores[1]))
        record = records[0] if len(records) == 1 else {**records[0], "train": records[1]}
        write_eval_outputs(run_dir, record, decodes, tasks, splits=splits)
        png = plots.plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
        print(f"wrote {run_dir / 'eval.json'}, {png}")
    return scores[0] if len(scores) == 1 else {**scores[0], **with_prefix(scores[1])}
