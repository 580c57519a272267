"""`speechlm export RUN_OR_CKPT --out DIR`: the command line of the export (`speechlm.use.export`, imported
when the command runs: `speechlm --help` starts without torch)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from speechlm.use.transcribe import add_checkpoint_argument


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a self-contained model directory (LLM with LoRA merged, tokenizer, encoder) for transcribe",
        description="Export a checkpoint as one directory that `speechlm transcribe` (and transformers, for "
        "the LLM) load with no training code and no network.",
    )
    add_checkpoint_argument(p)
    p.add_argument(
        "--out", required=True, help="the export directory to create (must not exist, or be empty)"
    )
    p.set_defaults(func=run_export_command)


def run_export_command(args: argparse.Namespace) -> int:
    from speechlm.use.export import export_checkpoint  # lazy: torch (CLI start-up)

    out = export_checkpoint(args.checkpoint, Path(args.out))
    print(f"exported {out}")
    return 0
