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
process uses ``cuda:LOCAL_RANK`` where there are GPUs (NCCL), else the CPU (gloo). ``--cp-size N``: groups
of N processes decode one share together under dynamic CP (`speechlm.use.evaluation.cp_collectives`): a
clip the layout shards (longer than 30 s, with limited-context attention) is encoded slice by slice over
the group instead of whole on one process, and the group's first process reports its hypotheses.

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
from typing import Any

from speechlm.errors import UsageError
from speechlm.metrics import METRICS
from speechlm.use.transcribe import (
    add_checkpoint_argument,
    add_decoding_arguments,
    check_decoding_arguments,
    init_process_group,
    rank_device,
    write_records,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "evaluate",
        help="metrics per task and language of a checkpoint on a manifest (sharded over ranks under torchrun)",
        description="Greedy-decode a manifest with a checkpoint and print each task's metrics (WER, BLEU, "
        "accuracy, ...) per language. Under "
        "`torchrun --nproc-per-node N -m speechlm evaluate ...` each process decodes 1/N of the batches.",
    )
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
    p.add_argument(
        "--cp-size",
        type=int,
        default=1,
        help="under torchrun: groups of this many processes decode one share together under context "
        "parallelism, a clip longer than 30 s encoded sharded over the group (default 1)",
    )
    p.set_defaults(func=run_evaluate_command)


def run_evaluate_command(args: argparse.Namespace) -> int:
    from speechlm.use import evaluation  # lazy: torch (CLI start-up)

    check_decoding_arguments(args)
    metrics = parse_metric_arguments(args.metric)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = args.device or rank_device()
    if world_size > 1:
        init_process_group(device)
    try:
        result = evaluation.evaluate_checkpoint(
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
            cp_size=args.cp_size,
        )
    finally:
        if world_size > 1:
            evaluation.close_process_group()
    if rank == 0:
        if args.decodes:
            write_records(result["decodes"], args.decodes)
        if args.json:
            print(json.dumps(result["record"], ensure_ascii=False))
        else:
            print(result["table"])
    return 0


def parse_metric_arguments(values: list[str]) -> dict[str, list[str]]:
    """``--metric TASK=METRIC[,METRIC]`` (repeatable) as {task: [metric, ...]}; UsageError naming a bad one."""
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
