"""`speechlm plan`: show one epoch's plan before training on it.

The subcommand of `speechlm.data.plan`. The arguments resolve to a `PlanRequest` (defaults, then the config file, then the flags); then the inputs
are read, the sampler training builds plans the epoch, `figures` summarizes it and `report` prints it.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from speechlm.config import ConfigError, load_config
from speechlm.data.plan.figures import PlanRequest, summarize_plan
from speechlm.data.plan.report import format_summary, trim_warning
from speechlm.io import atomic_write_json
from speechlm.progress import Progress


def resolve_request(args: argparse.Namespace) -> PlanRequest:
    """Defaults, then the config file (if any), then the flags."""
    from speechlm.data.sampler.build import sampler_settings  # lazy: pyarrow (CLI start-up)

    cfg = load_config(args.config)
    dp = cfg.parallel.dp_replicate * (cfg.parallel.dp_shard if cfg.parallel.dp_shard > 0 else 1)
    settings = sampler_settings(cfg, dp_size=dp)
    flags = {
        key: getattr(args, key)
        for key in ("dp_size", "grad_accum", "mode", "temperature", "seed", "epoch_size")
        if getattr(args, key) is not None
    }
    if args.max_duration is not None:
        flags["max_duration"] = args.max_duration
    if args.max_batch_tokens is not None:
        flags["max_batch_tokens"] = args.max_batch_tokens
    elif args.max_batch_duration is not None:
        flags["max_batch_duration"], flags["max_batch_tokens"] = args.max_batch_duration, None
    settings = replace(settings, **flags)
    cp = args.cp_size if args.cp_size is not None else cfg.parallel.cp_size
    threshold = (
        args.cp_split_threshold if args.cp_split_threshold is not None else cfg.parallel.cp_split_threshold
    )
    manifest = args.manifest if args.manifest is not None else cfg.data.train_manifest
    input_cfg = (
        args.input_cfg if args.input_cfg is not None else (None if args.manifest else cfg.data.input_cfg)
    )
    if manifest is None and input_cfg is None:  # no default data (the config's paths are optional)
        raise ConfigError(
            "no training data to plan: pass --manifest PATH (or --input-cfg), or set data.train_manifest in "
            f"{args.config or 'the --config file'}"
        )
    return PlanRequest(
        settings=settings,
        manifest=manifest,
        epoch=args.epoch if args.epoch is not None else 0,
        cp_size=cp,
        tp_size=args.tp_size if args.tp_size is not None else cfg.parallel.tp_size,
        cp_split_threshold=threshold,
        pair_cost=1.0 / (6 * cfg.model.llm.hidden_size),
        input_cfg=input_cfg,
        cfg=cfg,
    )


def run_plan(args: argparse.Namespace) -> int:
    try:
        req = resolve_request(args)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"speechlm plan: {e}", file=sys.stderr)
        return 1
    # the phases, on a terminal only (speechlm.progress): reading 10M rows and planning take seconds
    bar = Progress(4 if args.json else 3, "plan", "phases", leave=False)
    with bar, bar.heartbeat():
        return plan_and_report(args, req, bar)


def plan_and_report(args: argparse.Namespace, req: PlanRequest, bar: Progress) -> int:
    """`speechlm plan` after its arguments are resolved: read, plan, summarize, print (and --json)."""
    from speechlm.data.plan.inputs import plan_inputs  # lazy: pyarrow (CLI start-up)
    from speechlm.data.sampler.build import make_sampler  # lazy: pyarrow (CLI start-up)

    bar.phase("reading the manifest")
    settings = req.settings
    try:
        inputs, read_text = plan_inputs(req)
        if read_text is not None and settings.max_batch_tokens is not None:  # the plan needs them
            inputs, read_text = replace(inputs, text_chars=read_text()), None
    except (OSError, ValueError) as e:
        bar.close()
        print(f"speechlm plan: {e}", file=sys.stderr)
        return 1
    bar.phase(f"planning {len(inputs.durations):,} utterances")
    # a budget of seconds plans without the text lengths: a second thread reads them meanwhile (decoding
    # the texts and building the plan both run mostly outside the GIL, in Arrow and numpy)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-texts") as pool:
        text_chars = pool.submit(read_text) if read_text is not None else None
        try:  # the sampler training builds (rank 0's; the plan covers every dp rank)
            sampler = make_sampler(
                settings, inputs, dp_rank=0, epoch=req.epoch, max_text_tokens=req.cfg.data.max_tokens
            )
            plan = sampler.plan
            if text_chars is not None:
                inputs = replace(inputs, text_chars=text_chars.result())
        except (OSError, ValueError) as e:
            bar.close()
            print(f"speechlm plan: {e}", file=sys.stderr)
            return 1
    estimated = settings.bucket_boundaries is None  # sampler.bucket_boundaries=null: the sampler's estimate
    settings = replace(settings, bucket_boundaries=sampler.settings.bucket_boundaries)
    req = replace(req, settings=settings)
    bar.phase("summarizing")
    summary = summarize_plan(
        plan,
        inputs,
        settings,
        cp_size=req.cp_size,
        tp_size=req.tp_size,
        cp_split_threshold=req.cp_split_threshold,
        pair_cost=req.pair_cost,
        max_text_tokens=req.cfg.data.max_tokens,
        shard_min_slice=req.cfg.model.encoder.shard_min_slice(req.cfg.model.projector_stack),
    )
    summary["bucket_source"] = (
        f"estimated from the data (sampler.num_buckets={settings.num_buckets}, equal total duration each)"
        if estimated
        else "sampler.bucket_boundaries"
    )
    budget = (
        f"{settings.max_batch_tokens} tokens (length penalty {settings.length_penalty:g})"
        if settings.max_batch_tokens is not None
        else f"{settings.max_batch_duration:g} s"
    )
    source = "data.input_cfg" if req.input_cfg is not None else str(req.manifest)
    if args.json:
        bar.phase(f"writing {args.json}")
        summary["manifest"] = source
        summary["settings"] = req.as_json()
        summary["ranks"] = [
            [b.tolist() for b in _split_batches(*plan.rank_rows(r))] for r in range(plan.dp_size)
        ]
    bar.close()  # the display's line is erased before the report
    print(format_summary(summary, source, budget))
    warning = trim_warning(plan, settings.grad_accum)
    summary["warnings"] = [warning] if warning else []
    if warning:
        print(f"\n{warning}", file=sys.stderr)
    if args.json:
        try:
            atomic_write_json(Path(args.json), summary)
        except OSError as e:
            print(f"speechlm plan: cannot write {args.json}: {e}", file=sys.stderr)
            return 1
        print(f"\nwrote {args.json}")
    return 0


def _threshold(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: use auto, 0 or a number of tokens")
    return value


def _split_batches(rows: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return np.split(rows, offsets[1:-1])


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print an epoch plan: batches, steps, language mix, padding",
        description=__doc__.split("\n")[0],
    )
    p.add_argument(
        "--config", help="experiment YAML; its data/sampler/trainer/parallel fields are the defaults"
    )
    p.add_argument(
        "--manifest",
        help="training data of any kind: manifest, shard folder, ... (default: data.train_manifest)",
    )
    p.add_argument(
        "--input-cfg", metavar="FILE.yaml", help="a data.input_cfg list of weighted datasets instead"
    )
    p.add_argument(
        "--dp-size", type=int, help="data-parallel ranks (default: parallel.dp_replicate * dp_shard)"
    )
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--max-batch-duration", type=float, metavar="S", help="seconds of audio per micro-batch"
    )
    budget.add_argument("--max-batch-tokens", type=int, metavar="N", help="tokens per micro-batch instead")
    p.add_argument(
        "--max-duration",
        type=float,
        metavar="S",
        help="leave rows longer than S seconds out of the plan (default data.max_duration: no limit)",
    )
    p.add_argument("--mode", choices=("temperature", "exhaustive"))
    p.add_argument("--temperature", type=float, help="language temperature T (<= 0: uniform)")
    p.add_argument("--epoch-size", type=int, help="utterances per epoch in temperature mode")
    p.add_argument("--seed", type=int)
    p.add_argument("--epoch", type=int)
    p.add_argument("--cp-size", type=int, help="context-parallel degree for the THD rounding")
    p.add_argument("--tp-size", type=int, help="tensor-parallel degree for the THD rounding")
    p.add_argument(
        "--cp-split-threshold",
        type=_threshold,
        metavar="auto|N",
        help="dynamic CP: split utterances longer than N tokens (0: all; default parallel.cp_split_threshold)",
    )
    p.add_argument("--json", metavar="FILE", help="write the summary and every rank's micro-batches")
    p.set_defaults(func=run_plan)
