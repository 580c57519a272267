"""The valid values of a config key, as small rule objects: `Num`, `OneOf`, `Text`, `Flag`, `Seq`, ...

Each rule answers two questions: `check(value)` (None, or why the value is refused) and `describe()`
(the valid values in words, for docs/config.md and the error messages). A key's rule sits on its
dataclass field (`speechlm.config.keys.key`), beside its default and its one line of meaning.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from speechlm.metrics import METRICS, check_metric_name

TRAIN_PREFIX = "train_"  # validation keys of the training split (trainer.val_train_batches): train_wer, ...
SEED_MAX = 2**32 - 1  # numpy's seed range


def show(value: Any) -> str:
    """A value as the messages and docs write it: strings quoted, lists in brackets."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Rule(abc.ABC):
    """The valid values of one key (abstract: Num, OneOf, Flag, ... implement both methods)."""

    @abc.abstractmethod
    def check(self, value: Any) -> str | None:
        """None, or why `value` is refused."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The valid values in words (docs/config.md and error messages)."""


@dataclass(frozen=True)
class Num(Rule):
    """A finite number within bounds (NaN and infinities are refused); `null` admits None."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False
    null: str = ""  # non-empty: None is valid and means this
    integer: bool = False

    def check(self, value: Any) -> str | None:
        if value is None:
            return None if self.null else "a value is required (null is not allowed)"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a {'whole number' if self.integer else 'number'}"
        if not math.isfinite(value):
            return "must be a finite number"
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return "out of range" if low or high else None

    def describe(self) -> str:
        kind = "integer" if self.integer else "number"
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        text = f"{kind} {' and '.join(b for b in (lo, hi) if b)}" if lo or hi else f"finite {kind}"
        return text + (f", or null ({self.null})" if self.null else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class OneOf(Rule):
    """One of a fixed set; `advice` maps common wrong spellings to the right one. On a field typed with a
    `Literal`, the choices are left out and read from the type (`speechlm.config.keys`)."""

    choices: tuple[Any, ...] = ()
    advice: tuple[tuple[str, str], ...] = ()

    def check(self, value: Any) -> str | None:
        if value in self.choices:
            return None
        tip = dict(self.advice).get(str(value).lower())
        return f"not a valid choice ({tip})" if tip else "not a valid choice"

    def describe(self) -> str:
        return "one of " + ", ".join(show(c) for c in self.choices)


@dataclass(frozen=True)
class Text(Rule):
    """Free text or a path; `path`: an input path (resolved, see `resolve_config_paths`)."""

    null: str = ""  # non-empty: None is valid and means this
    path: bool = False
    keywords: tuple[str, ...] = ()  # values that are not paths (e.g. resume=auto)

    def check(self, value: Any) -> str | None:
        if value is None:
            return None if self.null else "a value is required (null is not allowed)"
        if not isinstance(value, str):
            return "must be a string"
        if self.path and not value.strip():
            return "an empty path; give a path or null"
        return None

    def describe(self) -> str:
        what = "a path" if self.path else "any text"
        if self.keywords:
            what = " or ".join(repr(k) for k in self.keywords) + f" or {what}"
        return what + (f", or null ({self.null})" if self.null else "")


@dataclass(frozen=True)
class Flag(Rule):
    """true or false (or null, when `null` says what that means)."""

    null: str = ""

    def check(self, value: Any) -> str | None:
        if value is None and self.null:
            return None
        return None if isinstance(value, bool) else "must be true or false"

    def describe(self) -> str:
        return "true or false" + (f", or null ({self.null})" if self.null else "")


@dataclass(frozen=True)
class Seq(Rule):
    """A list of numbers, each valid under `item`; optionally of a fixed length, strictly increasing."""

    item: Num = field(default_factory=Num)
    length: int | None = None
    increasing: bool = False
    nonempty: bool = False
    null: str = ""  # non-empty: None is valid and means this

    def check(self, value: Any) -> str | None:
        if value is None and self.null:
            return None
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        if self.length is not None and len(value) != self.length:
            return f"must have {self.length} items, got {len(value)}"
        if self.nonempty and not value:
            return "must not be empty"
        for i, v in enumerate(value):
            if self.item.check(v) is not None:
                return f"item {i} ({show(v)}) is {self.item.check(v)}"
        if self.increasing and any(b <= a for a, b in zip(value, value[1:], strict=False)):
            return "must be strictly increasing"
        return None

    def describe(self) -> str:
        n = f"{self.length} " if self.length is not None else ""
        inc = ", strictly increasing" if self.increasing else ""
        null = f", or null ({self.null})" if self.null else ""
        return f"a list of {n}numbers, each a {self.item.describe()}{inc}{null}"


@dataclass(frozen=True)
class Names(Rule):
    """A list of non-empty names (strings); non-empty unless `nonempty` is False."""

    nonempty: bool = True

    def check(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)) or (self.nonempty and not value):
            return f"must be a {'non-empty ' if self.nonempty else ''}list of names"
        bad = [v for v in value if not isinstance(v, str) or not v.strip()]
        return f"item {show(bad[0])} is not a name" if bad else None

    def describe(self) -> str:
        if not self.nonempty:
            return "a list of names such as [zh, ja], or []"
        return "a non-empty list of names such as [q_proj, v_proj]"


@dataclass(frozen=True)
class TaskLists(Rule):
    """A mapping {task: [names]}, each name one of `choices` (each list non-empty if `nonempty`)."""

    choices: tuple[str, ...] = ()
    nonempty: bool = False

    def check(self, value: Any) -> str | None:
        if not isinstance(value, Mapping):
            return "must be a mapping {task: [names]}"
        for task, names in value.items():
            if not isinstance(task, str) or not task.strip() or "/" in task:
                return f"task {show(task)} is not a task name (non-empty, without '/')"
            if not isinstance(names, (list, tuple)) or (self.nonempty and not names):
                return f"{task}: must be a {'non-empty ' if self.nonempty else ''}list"
            bad = [n for n in names if n not in self.choices]
            if bad:
                return f"{task}: {show(bad[0])} is not one of {', '.join(self.choices)}"
        return None

    def describe(self) -> str:
        lst = "a non-empty list" if self.nonempty else "a list"
        return f"a mapping {{task: [names]}} ({lst} of {', '.join(self.choices)} per task), or {{}} (the defaults)"


@dataclass(frozen=True)
class MetricName(Rule):
    """A validation metric name: 'loss', 'wer[_<lang>]' or '<task>/<metric>[_<lang>]' (speechlm.metrics), or
    one of them prefixed 'train_' (the training-split metrics of trainer.val_train_batches)."""

    def check(self, value: Any) -> str | None:
        if not isinstance(value, str):
            return "must be a metric name"
        return check_metric_name(value.removeprefix(TRAIN_PREFIX))

    def describe(self) -> str:
        return (
            "'wer', 'loss', 'wer_<lang>' or '<task>/<metric>[_<lang>]' with metric one of "
            + ", ".join(METRICS)
            + " (e.g. 'asr/wer', 'asr/wer_hi', 'ast/bleu', 'qa/accuracy'); any of them prefixed 'train_' "
            "(e.g. 'train_wer') names the training-split metric of trainer.val_train_batches"
        )


@dataclass(frozen=True)
class Either(Rule):
    """Valid under any of `rules` (e.g. 'auto' or a number)."""

    rules: tuple[Rule, ...] = ()

    def check(self, value: Any) -> str | None:
        reasons = [r.check(value) for r in self.rules]
        return None if any(r is None for r in reasons) else next(r for r in reasons if r)

    def describe(self) -> str:
        return "; or ".join(r.describe() for r in self.rules)


@dataclass(frozen=True)
class InputList(Rule):
    """data.input_cfg: a list of dataset entries, a YAML file of one, or null."""

    null: str = ""

    def check(self, value: Any) -> str | None:
        if value is None or isinstance(value, list):
            return None
        if isinstance(value, str):
            return None if value.strip() else "an empty path; give a path or null"
        return "must be a list of entries or the path of a YAML file"

    def describe(self) -> str:
        return (
            "a list of {path, type?, weight?, lang?, name?, tags?} or {group, weight?, inputs} entries, "
            + (f"or a path of a YAML file of one, or null ({self.null})")
        )


POS_INT = Num(lo=1, integer=True)  # a count of at least 1 (sizes, buffers, steps between things)
