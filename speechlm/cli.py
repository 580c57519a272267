"""`speechlm` command line: one subcommand per module, each registered by that module's `add_parser`.

Every subcommand module exposes `add_parser(subparsers)`, which adds its parser and sets
`func=callable(args) -> int`. Heavy imports (torch, transformers) stay inside the callables so
that `speechlm --help` and `speechlm validate` are quick.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from speechlm.config import parse_command_line
from speechlm.errors import EXIT_CODES, run_guarded

EXIT_CODES_HELP = "exit codes:\n" + "\n".join(f"  {code:>3}  {what}" for code, what in EXIT_CODES.items())


def _version() -> str:
    try:
        return version("speechlm")
    except PackageNotFoundError:
        return "unknown"


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count that must be at least 1 (an argument error, exit 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give one of at least 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a number of at least 1")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=`` for a finite quantity that must be above 0 (an argument error, exit 2, otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give one above 0") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: give a finite number above 0")
    return value


# subcommand modules, in the order `--help` lists them
SUBCOMMAND_MODULES = (
    "speechlm.data.manifest_cli",  # manifest build | stats
    "speechlm.data.shards_cli",  # shards write
    "speechlm.data.tokenizer",  # tokenizer train
    "speechlm.model.gguf_cli",  # llm import-gguf
    "speechlm.model.encoder_cli",  # encoder import (CTranslate2 Whisper)
    "speechlm.data.plan",  # plan
    "speechlm.train.entry",  # train
    "speechlm.train.faults",  # faults (interrupt + resume vs straight, step by step)
    "speechlm.preflight.validate",  # validate
    "speechlm.preflight.estimate",  # estimate (per-rank memory and step time of a layout)
    "speechlm.use.evaluate_cli",  # evaluate (a checkpoint on a manifest)
    "speechlm.use.transcribe",  # transcribe (audio files or a manifest)
    "speechlm.use.export_cli",  # export (a self-contained model directory)
    "speechlm.demo.run",  # demo (the Quick start's main job)
    "speechlm.preflight.bench",  # bench sampler | packing | ...
    "speechlm.sweep.cli",  # sweep init | run | status | requeue | report | slurm
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speechlm",
        description="Train speech LLMs on packed (THD) sequences with context, tensor and data parallelism.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"speechlm {_version()}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of user errors too (also SPEECHLM_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that subcommand is not part of this build
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, also after the subcommand
    argv = [a for a in argv if a != "--debug"]
    # dotted overrides may come after options (`train CONFIG --cp-size 2 trainer.max_steps=3`)
    args = parse_command_line(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_guarded(lambda: args.func(args), debug=debug)


if __name__ == "__main__":
    raise SystemExit(main())
