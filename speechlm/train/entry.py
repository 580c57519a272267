"""`speechlm train CONFIG [--cp-size C] [--tp-size T] [overrides]` and `python -m speechlm.train ...`.

The command line of training: its arguments, and the exit codes of its outcomes. The run itself is
`speechlm.train.recipe.train`, which reads top to bottom like a recipe: config → validator (before any
weights load) → layout → data → model → trainer → resume → fit → final evaluation; it is imported when
the command runs, so `speechlm --help` starts without torch or Lightning.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from parallel.validator import ValidationError
from speechlm.config import ConfigError, load_config
from speechlm.errors import EXIT_SIGTERM

OVERRIDES_HELP = """\
dotted overrides (KEY=VALUE, any field of the config), for example:
  trainer.max_steps=50 trainer.run_dir=runs/try1 trainer.grad_accum=2 trainer.max_minutes=10
  trainer.val_every=100 trainer.ckpt_every=100 trainer.resume=auto trainer.precision=32
  model.packed_sequences=false model.attention_backend=reference model.dropout=0 model.ctc_weight=0.3
  sampler.max_batch_duration=32 sampler.max_batch_tokens=4096 sampler.temperature=0.3 sampler.seed=1
  optim.lr=1e-3 optim.warmup_steps=50 optim.unfreeze_step=0 parallel.cp_attention=allgather
Unknown keys are errors. `model.dropout=0` turns off every source of randomness in the forward pass.
"""


def add_parser(sub: Any) -> None:  # Any: argparse's subparsers action (a private class)
    p = sub.add_parser(
        "train",
        help="train a speech LLM from a config",
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a speech LLM. Launch several processes with "
        "`torchrun --nproc-per-node N -m speechlm.train CONFIG --cp-size C --tp-size T`.",
    )
    add_train_arguments(p)
    p.set_defaults(func=run_train_command)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML experiment config, e.g. configs/demo.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE (see below)")
    p.add_argument("--cp-size", type=int, default=None, help="context-parallel size (parallel.cp_size)")
    p.add_argument("--tp-size", type=int, default=None, help="tensor-parallel size (parallel.tp_size)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config, layout and plan; exit")


def run_train_command(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.cp_size is not None:
        overrides.append(f"parallel.cp_size={args.cp_size}")
    if args.tp_size is not None:
        overrides.append(f"parallel.tp_size={args.tp_size}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from speechlm.train import recipe  # lazy: torch, lightning (CLI start-up)

    try:
        result = recipe.train(cfg, dry_run=args.dry_run)
    except ValidationError as e:
        print(str(e), file=sys.stderr)
        return 1
    except recipe.DroppedDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result is not None and result.get("preempted"):
        return EXIT_SIGTERM  # saved and stopped: a scheduler reads 143 as "preempted, resume me"
    return 0 if result is not None else 1
