"""How a config key is declared, once: a section field with its type, default, meaning and valid values.

    max_tokens: int = key(512, "text tokens per utterance after tokenization", POS_INT)

`key(default, doc, rule)` puts the one line of meaning and the `Rule` on the field's metadata; the
annotation is the type. A choice key's annotation is a `Literal` (speechlm/config/choices.py) and its
rule is read from it (`OneOf` with the Literal's values, or a `OneOf(advice=...)` whose choices are left
out); a `bool` key's rule is `Flag()`. From these fields come the checks (`Section.validate`), the error
messages (`KeySpec.advice`) and docs/config.md (`speechlm.config.docs`): nothing else lists the keys.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from speechlm.config.rules import Flag, OneOf, Rule, show
from speechlm.errors import EXIT_DATA, UsageError

T = TypeVar("T")
_META = "speechlm.config.key"  # the field-metadata entry `key()` writes


class ConfigError(UsageError):
    """A config file or override that cannot be applied; the message names the file and key."""


class MissingInputError(ConfigError):
    """A config key names an input file that does not exist: a data problem (exit 1), named by its key."""

    exit_code = EXIT_DATA


@dataclass(frozen=True)
class KeySpec:
    """What a config declares about one key besides its type and default: its meaning and valid values."""

    doc: str  # one line of meaning (docs/config.md, error messages)
    rule: Rule

    def advice(self) -> str:
        """The end of every message that refuses a value of this key: the valid values and the meaning."""
        return f"use {self.rule.describe()} ({self.doc})"


def key(default: T, doc: str, rule: Rule | None = None) -> T:
    """A config key: a dataclass field with `default` (a list or dict is copied for each instance), one line
    of meaning `doc` and its valid values `rule` (None: from the annotation, see the module docstring)."""
    meta = {_META: (doc, rule)}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _resolved(rule: Rule | None, tp: Any, where: str) -> Rule:
    """`rule` completed from the annotation `tp`: a choice key's values, a bool key's Flag."""
    choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
    if isinstance(rule, OneOf) and not rule.choices and choices:
        return dataclasses.replace(rule, choices=choices)
    if rule is None and choices:
        return OneOf(choices)
    if rule is None and tp is bool:
        return Flag()
    if rule is None or (isinstance(rule, OneOf) and not rule.choices):
        raise TypeError(f"{where}: give key(...) a rule; only Literal and bool fields imply theirs")
    return rule


def field_specs(cls: type) -> Mapping[str, KeySpec]:
    """The keys of one section class by field name (sub-sections left out), in declaration order."""
    if cls not in _SPECS:
        _SPECS[cls] = _read_specs(cls)
    return _SPECS[cls]


_SPECS: dict[type, Mapping[str, KeySpec]] = {}  # field_specs, per section class


def _read_specs(cls: type) -> Mapping[str, KeySpec]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        where = f"{cls.__qualname__}.{f.name}"
        if _META not in f.metadata:  # pragma: no cover - a developer error, caught on import
            raise TypeError(f"{where}: declare the field with key(default, doc, rule)")
        doc, rule = f.metadata[_META]
        out[f.name] = KeySpec(doc, _resolved(rule, hints[f.name], where))
    return out


def key_specs(cls: type, prefix: str = "") -> dict[str, KeySpec]:
    """Every key under `cls` by dotted name, sub-sections walked where they are declared."""
    hints = typing.get_type_hints(cls)
    specs = field_specs(cls)
    out: dict[str, KeySpec] = {}
    for f in dataclasses.fields(cls):
        if f.name in specs:
            out[prefix + f.name] = specs[f.name]
        else:
            out.update(key_specs(hints[f.name], f"{prefix}{f.name}."))
    return out


def check_key(key: str, spec: KeySpec, value: Any, origin: Mapping[str, str] | None) -> None:
    """`value` against the rule of `key`; the message says where the value was set."""
    reason = spec.rule.check(value)
    if reason is not None:
        where = "" if origin is None else f" (set {origin[key]})" if key in origin else " (the default)"
        raise ConfigError(f"{key}={show(value)}{where}: {reason}; {spec.advice()}")


class Section:
    """A config section: `validate()` checks each key against its rule in declaration order (a sub-section
    through its own `validate()`), then the section's own rules across its keys (`problems`)."""

    KEY: ClassVar[str] = ""  # dotted prefix of the section's keys ("model.encoder")

    def validate(self, origin: Mapping[str, str] | None = None) -> None:
        """Raise `ConfigError` on the first bad value; `origin` maps dotted keys to where they were set
        (None: not known, e.g. a config built in code; a key missing from it: the default)."""
        specs = field_specs(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value.validate(origin)
            else:
                check_key(f"{self.KEY}.{f.name}", specs[f.name], value, origin)
        for problem in self.problems():
            raise ConfigError(problem)

    def problems(self) -> list[str]:
        """Rules that tie keys of this section together (each message names every key involved)."""
        return []
