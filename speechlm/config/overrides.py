"""Dotted overrides on the command line: `trainer.max_steps=50` changes one key of the loaded config.

`split_override` reads one (for every command, sweep specs and filters too).
"""

from __future__ import annotations

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
