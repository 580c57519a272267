"""`speechlm evaluate`'s work (its command line is `speechlm.use.evaluate_cli`): a checkpoint rebuilt in
this process (`speechlm.use.checkpoint`) decodes its share of a manifest with the `Evaluator` that
training's validation runs (`speechlm.use.evaluator`); the counts are gathered and summed over the ranks
(the module docstring of `speechlm.use.evaluate_cli` says what is printed and written)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from parallel.collectives import Collectives
from parallel.cp_layout import DynamicCPLayout
from parallel.mesh import ParallelDims
from speechlm.config import ExperimentConfig
from speechlm.data.run_inputs import RunTokenizer
from speechlm.data.sources.mmap_cache import open_index
from speechlm.data.tokenizer_checks import check_table, uncovered_targets
from speechlm.errors import DataError, UsageError
from speechlm.metrics import MetricSpec, table_pairs
from speechlm.use.checkpoint import load_checkpoint
from speechlm.use.eval_report import count_record, format_eval_table
from speechlm.use.evaluator import EvalContext, Evaluator
from speechlm.use.transcribe import apply_ctc_weight


def check_tasks_have_metrics(cfg: ExperimentConfig, table: pa.Table, manifest: str | Path) -> None:
    """Every task of `table` has a metric under `cfg` (with --metric applied); the advice is evaluate's."""
    spec = MetricSpec.from_config(cfg)
    for task in sorted({task for task, _ in table_pairs(table)}):
        spec.check_task(
            task,
            f"--manifest {manifest}",
            how=f"give it one with --metric, e.g. `speechlm evaluate ... --metric {task}=accuracy`",
        )


def evaluate_checkpoint(
    checkpoint: str | Path,
    manifest: str | Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    max_new_tokens: int = 96,
    max_utterances: int | None = None,
    batch_seconds: float | None = None,
    ctc_weight: float | None = None,
    metrics: dict[str, list[str]] | None = None,
    cp_size: int = 1,
) -> dict[str, Any]:
    """Evaluate on this rank's share, gather; returns {record, table, decodes} (the same on every rank).
    `metrics` ({task: [metric, ...]}, ``--metric``) replace those tasks' entries of trainer.eval_metrics.
    `cp_size` > 1: groups of `cp_size` ranks decode one share together under dynamic CP (`cp_collectives`).

    With `world_size` > 1 the default process group must be initialised (torchrun, or a test harness)."""
    check_cp_size(cp_size, world_size)
    quiet = rank != 0
    loaded = load_checkpoint(checkpoint, device=device, log=(lambda m: None) if quiet else _stderr)
    cfg = loaded.cfg
    cfg.data.val_manifest = str(manifest)  # names the split in messages
    if batch_seconds is not None:
        cfg.trainer.eval_batch_duration = float(batch_seconds)
    cfg.trainer.eval_metrics = {**cfg.trainer.eval_metrics, **(metrics or {})}
    table = open_index(manifest)
    check_tasks_have_metrics(cfg, table, manifest)
    problems = check_table(table, f"--manifest {manifest}", loaded.tokenizer)
    if problems:
        raise DataError("\n".join(problems))
    if not quiet:
        warn_uncovered(table, f"--manifest {manifest}", loaded.tokenizer, cfg.data.text_normalize)
    module = loaded.module

    apply_ctc_weight(module.model, ctc_weight)
    if cp_size > 1:
        collectives = cp_collectives(module.model, cfg, rank, world_size, cp_size, device)
    else:
        collectives = Collectives(
            rank=rank, world_size=world_size, dp_rank=rank, dp_size=world_size, device=device
        )
    module.step_ctx = EvalContext(collectives=collectives)
    evaluator = Evaluator(
        cfg,
        loaded.tokenizer,
        table,
        rank,
        max_batches=None,
        max_new_tokens=max_new_tokens,
        max_utterances=max_utterances,
    )
    if not quiet:
        _stderr(f"evaluating {loaded.ckpt} (step {loaded.step}) on {manifest}: {len(table)} utterances, "
                f"{world_size} process(es)" + (f", CP groups of {cp_size}" if cp_size > 1 else ""))  # fmt: skip
    metrics = evaluator(module, display=True)  # a progress display on a terminal (rank 0)
    counts = evaluator.last_counts
    scores = {k: v for k, v in metrics.items() if k not in ("utterances", "dropped")}
    record = {"checkpoint": str(loaded.ckpt), "step": loaded.step, "manifest": str(manifest), **scores}
    record.update(count_record(counts))
    decodes = [
        {"row": row, "task": task, "lang": lang, "ref": ref, "hyp": hyp}
        for row, task, (lang, ref, hyp) in zip(
            evaluator.last_rows, evaluator.last_tasks, evaluator.last_decodes
        )
    ]
    return {"record": record, "table": format_eval_table(metrics, counts), "decodes": decodes}


def check_cp_size(cp_size: int, world_size: int) -> None:
    if cp_size < 1 or world_size % cp_size:
        raise UsageError(
            f"--cp-size {cp_size} with {world_size} process(es): the number of processes must be a multiple of "
            "the CP size (e.g. torchrun --nproc-per-node 4 ... --cp-size 2)"
        )


def cp_collectives(
    model: Any, cfg: ExperimentConfig, rank: int, world_size: int, cp_size: int, device: str
) -> Collectives:
    """Put `model` under dynamic CP over this rank's CP group (`ParallelDims(world_size, cp=cp_size)`: the
    ranks of one data-parallel share, as training groups them) with the checkpoint's `parallel.cp_attention`
    and `parallel.cp_split_threshold`, and return this rank's collectives: the group decodes its share
    together, a clip the layout shards encoded over it (`speechlm.model.cp_audio.encode_for_decoding`), the
    teacher-forced loss computed under CP, and only the group's first rank reports its rows."""
    dims = ParallelDims(world_size, cp=cp_size)
    dims.build_mesh(torch.device(device).type)
    model.set_cp_layout(
        DynamicCPLayout(
            group=dims.mesh["cp"].get_group(),
            cp_size=cp_size,
            cp_rank=dims.cp_rank(rank),
            kind=cfg.parallel.cp_attention,
            threshold=cfg.parallel.cp_split_threshold,
            pair_cost=1.0 / (6 * model.llm.config.hidden_size),
            pad_to_multiple=cfg.model.pad_to_multiple,
        )
    )
    return dims.collectives(rank, device)


def warn_uncovered(table: pa.Table, name: str, tokenizer: RunTokenizer, rule: str) -> None:
    """A warning when references hold characters the checkpoint's tokenizer cannot encode under its
    data.text_normalize rule: the model cannot write them, so they are scored as errors (never as the
    tokenizer's round trip of the text)."""
    found = uncovered_targets(table, tokenizer, rule)
    if found is not None:
        _stderr(
            f"warning: {found.describe(name, tokenizer, rule)}: the model cannot write them, so the metrics "
            f"count them as errors (the references are the manifest's text under data.text_normalize={rule}, "
            f"the rule the checkpoint was trained with): {found.quoted}; to score without them, normalise "
            "the manifest's text the way the training data was (e.g. lower-case it)"
        )


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def close_process_group() -> None:
    dist.destroy_process_group()
