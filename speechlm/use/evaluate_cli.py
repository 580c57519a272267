"""`speechlm evaluate RUN_OR_CKPT --manifest M [--json]`: the metrics table of a checkpoint on a manifest.

The checkpoint (a run dir's latest complete one, or a checkpoint dir) is rebuilt in this process with
the config and tokenizer it was trained with (`speechlm.use.checkpoint`); the manifest is any format
the trainer reads (`open_index`). Decoding and scoring are the training run's own (`Evaluator`:
greedy decoding with the KV cache, each task's metrics from per-utterance statistics per language, under
the checkpoint's `trainer.eval_*` settings: `speechlm.metrics`), so a checkpoint
evaluated here gives the figures its run's final evaluation gives on the same manifest.

Under ``torchrun`` every process holds the whole model and decodes a share of the evaluation batches
(`shard_eval_batches`: round-robin by its rank, explicit rank and world); the per-utterance counts are
gathered and summed, which makes the table equal to the one-process table, and rank 0 prints it. Each
process uses ``cuda:LOCAL_RANK`` where there are GPUs (NCCL), else the CPU (gloo).

``--json`` prints one object instead of the table: ``checkpoint``, ``step``, ``manifest``, ``loss``
(teacher-forced), ``<task>/<metric>`` and ``<task>/<metric>_<lang>`` (``asr/wer``, ``ast/bleu``, ...),
``wer`` and ``wer_<lang>`` (ASR), ``utterances`` and ``dropped`` per language (and ``all``), the same per
task under ``tasks``, ``dropped_reasons``. ``--decodes FILE`` writes one JSON line per decoded utterance
(``row``, ``task``, ``lang``, ``ref``, ``hyp``). ``--metric TASK=METRIC[,METRIC]`` scores a task with these
metrics (replacing the checkpoint's ``trainer.eval_metrics`` entry); a task with no metric is refused
before decoding, naming that option.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from speechlm.errors import DataError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "evaluate",
        help="metrics per task and language of a checkpoint on a manifest (sharded over ranks under torchrun)",
        description="Greedy-decode a manifest with a checkpoint and print each task's metrics (WER, BLEU, "
        "accuracy, ...) per language. Under "
        "`torchrun --nproc-per-node N -m speechlm evaluate ...` each process decodes 1/N of the batches.",
    )
    from speechlm.use.transcribe import add_checkpoint_argument, add_decoding_arguments

    add_checkpoint_argument(p)
    p.add_argument(
        "--manifest", required=True, help="the manifest to evaluate on (any format the trainer reads)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="TASK=METRIC[,METRIC]",
        help="score TASK with these metrics, replacing the checkpoint's trainer.eval_metrics entry (repeatable; "
        "e.g. --metric caption=accuracy)",
    )
    p.add_argument(
        "--decodes", default=None, help="also write one JSON line per utterance (row, task, lang, ref, hyp)"
    )
    add_decoding_arguments(p, device_help="cpu or cuda (default: cuda:LOCAL_RANK when available)")
    p.set_defaults(func=run_evaluate_command)


def run_evaluate_command(args: argparse.Namespace) -> int:
    from speechlm.use.transcribe import check_decoding_arguments

    check_decoding_arguments(args)
    metrics = parse_metric_arguments(args.metric)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = args.device or default_device()
    if world_size > 1:
        init_process_group(device)
    try:
        result = evaluate_checkpoint(
            args.checkpoint,
            args.manifest,
            rank=rank,
            world_size=world_size,
            device=device,
            max_new_tokens=args.max_new_tokens,
            max_utterances=args.batch_size,
            batch_seconds=args.batch_seconds,
            ctc_weight=args.ctc_weight,
            metrics=metrics,
        )
    finally:
        if world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank == 0:
        if args.decodes:
            from speechlm.use.transcribe import write_records

            write_records(result["decodes"], args.decodes)
        if args.json:
            print(json.dumps(result["record"], ensure_ascii=False))
        else:
            print(result["table"])
    return 0


def parse_metric_arguments(values: list[str]) -> dict[str, list[str]]:
    """``--metric TASK=METRIC[,METRIC]`` (repeatable) as {task: [metric, ...]}; UsageError naming a bad one."""
    from speechlm.errors import UsageError
    from speechlm.metrics import METRICS

    out: dict[str, list[str]] = {}
    for value in values:
        task, sep, names = value.partition("=")
        metrics = [m.strip() for m in names.split(",") if m.strip()]
        unknown = [m for m in metrics if m not in METRICS]
        if not sep or not task.strip() or not metrics or unknown:
            raise UsageError(
                f"--metric {value}: give TASK=METRIC[,METRIC], e.g. --metric caption=accuracy (metrics: "
                f"{', '.join(METRICS)})"
            )
        out[task.strip()] = metrics
    return out


def check_tasks_have_metrics(cfg: Any, table: Any, manifest: str | Path) -> None:
    """Every task of `table` has a metric under `cfg` (with --metric applied); the advice is evaluate's."""
    from speechlm.metrics import MetricSpec, table_pairs

    spec = MetricSpec.from_config(cfg)
    for task in sorted({task for task, _ in table_pairs(table)}):
        spec.check_task(
            task,
            f"--manifest {manifest}",
            how=f"give it one with --metric, e.g. `speechlm evaluate ... --metric {task}=accuracy`",
        )


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def init_process_group(device: str) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


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
) -> dict[str, Any]:
    """Evaluate on this rank's share, gather; returns {record, table, decodes} (the same on every rank).
    `metrics` ({task: [metric, ...]}, ``--metric``) replace those tasks' entries of trainer.eval_metrics.

    With `world_size` > 1 the default process group must be initialised (torchrun, or a test harness)."""
    from parallel.collectives import Collectives
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.preflight import checks as preflight
    from speechlm.train.evaluate import Evaluator, count_record, format_eval_table
    from speechlm.train.step import StepContext
    from speechlm.use.checkpoint import load_checkpoint

    quiet = rank != 0
    loaded = load_checkpoint(checkpoint, device=device, log=(lambda m: None) if quiet else _stderr)
    cfg = loaded.cfg
    cfg.data.val_manifest = str(manifest)  # names the split in messages
    if batch_seconds is not None:
        cfg.trainer.eval_batch_duration = float(batch_seconds)
    cfg.trainer.eval_metrics = {**cfg.trainer.eval_metrics, **(metrics or {})}
    table = open_index(manifest)
    check_tasks_have_metrics(cfg, table, manifest)
    problems = preflight.check_table(table, f"--manifest {manifest}", loaded.tokenizer)
    if problems:
        raise DataError("\n".join(problems))
    if not quiet:
        warn_uncovered(table, f"--manifest {manifest}", loaded.tokenizer, cfg.data.text_normalize)
    module = loaded.module
    from speechlm.use.transcribe import apply_ctc_weight

    apply_ctc_weight(module.model, ctc_weight)
    module.step_ctx = StepContext(
        rank=rank,
        collectives=Collectives(
            rank=rank, world_size=world_size, dp_rank=rank, dp_size=world_size, device=device
        ),
    )
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
                f"{world_size} process(es)")  # fmt: skip
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


def warn_uncovered(table: Any, name: str, tokenizer: Any, rule: str) -> None:
    """A warning when references hold characters the checkpoint's tokenizer cannot encode under its
    data.text_normalize rule: the model cannot write them, so they are scored as errors (never as the
    tokenizer's round trip of the text)."""
    from speechlm.preflight.checks import uncovered_targets

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
