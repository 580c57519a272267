"""Dotted overrides on the command line: `trainer.max_steps=50` changes one key of the loaded config.

`split_override` reads one (for every command, sweep specs and filters too); `parse_command_line` is the
one place where a command line's overrides are gathered, also those written after the flags
(`speechlm validate CONFIG --json model.x=1`): argparse fills the `overrides` positional at its first
chance (right after CONFIG) and would call later `KEY=VALUE` words unrecognized.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from speechlm.config.keys import ConfigError


def is_override(word: str) -> bool:
    """A command-line word that is a dotted override (KEY=VALUE) rather than an option or a file."""
    return "=" in word and not word.startswith("-")


def split_override(text: str, where: str = "command line") -> tuple[str, str]:
    """`a.b.c=value` -> ("a.b.c", "value"): the one reader of dotted overrides (train, validate, plan, sweep
    specs and filters). The key is stripped; the value is kept as written (`apply_override` reads it as YAML)."""
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"{where}: override {text!r} must look like key.path=value")
    return key.strip(), raw


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)` (None: the process's arguments), where a command with an `overrides` positional also takes the overrides
    that follow its flags (appended in order); any other word left over is an argument error (exit 2) that
    names only those words."""
    args, extras = parser.parse_known_args(None if argv is None else list(argv))
    moved = [e for e in extras if is_override(e)]
    if moved and hasattr(args, "overrides"):
        args.overrides = [*(args.overrides or []), *moved]
        extras = [e for e in extras if e not in moved]
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args
