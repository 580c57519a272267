"""Notices that every training run printed and that ask nothing of the user, silenced by their text.

A newcomer's first runs (docs: the 2026-11-25 audit) showed, on every launch, Lightning's advert for its
cloud logger, a "TPU available: False" line, a torch deprecation warning raised inside Lightning's own
code, and torch DCP's note that a one-process checkpoint is saved (or loaded) without a process group,
which is what a one-process run means to do. Each is matched by its exact opening words, only while a run
trains (`quiet_known_notices` restores the filters when it returns), so a new or a different warning still
shows. Lightning's "GPU available" line and everything at warning level and above stay.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# (regular expression matched at the start of the warning's message, why it is noise)
KNOWN_WARNINGS: tuple[tuple[str, str], ...] = (
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "torch 2.13 deprecates what lightning.pytorch.utilities._pytree calls; nothing a user can change",
    ),
    (
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
        r"(save|load) in a single process",
        "a one-process run saves and loads its checkpoint without a process group on purpose",
    ),
)

# (opening words of an info line of Lightning's rank-zero logger, why it is noise)
KNOWN_LOG_LINES: tuple[tuple[str, str], ...] = (
    ("💡 Tip: For seamless cloud logging", "an advert for Lightning's cloud logger, on every run"),
    ("TPU available:", "this trainer has no TPU path"),
)

# the loggers Lightning's rank_zero_info writes to (lightning_utilities' rank_zero module takes one of them)
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropKnownLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(opening) for opening, _ in KNOWN_LOG_LINES)


@contextmanager
def quiet_known_notices() -> Iterator[None]:
    """Inside: the `KNOWN_WARNINGS` are ignored and the `KNOWN_LOG_LINES` dropped; after: as before."""
    drop = _DropKnownLines()
    loggers = [logging.getLogger(name) for name in RANK_ZERO_LOGGERS]
    with warnings.catch_warnings():
        for pattern, _ in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        for logger in loggers:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(drop)
