"""A progress display for long commands: one line on stderr that redraws itself, on a terminal only.

The display is drawn on stderr, only when this process is rank 0 and stderr is a terminal. Anything
else (stderr piped or redirected to a log, CI, a scheduler's log file, a rank other than 0) gets no
display at all: no carriage returns, no redraws, so logs stay line-based and the commands print the
same lines as before. stdout is never drawn on: `speechlm transcribe ... > out.jsonl` on a terminal
shows the display and writes clean lines. `SPEECHLM_PROGRESS=0` (or off, false, no) turns the display
off on a terminal too; a value it does not understand is warned about once.

A `Progress` counts `done` of `total` (None: an open count, e.g. a phase whose length is unknown) and
draws ``DESC [#####.....] 12/40 UNIT 30% 0:12 ETA 0:28 · key value ...``; the ETA is the mean rate
since the display started applied to what is left. Redraws are at most every 0.2 s; `heartbeat()`
redraws from a thread while a call that reports nothing runs (SentencePiece training), so the elapsed
time keeps moving. `write()` prints a line above the display.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

ENV = "SPEECHLM_PROGRESS"
BAR_WIDTH = 20


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


OFF_WORDS = ("0", "off", "false", "no")
ON_WORDS = ("1", "on", "true", "yes")
_warned: set[str] = set()


def progress_setting() -> bool:
    """SPEECHLM_PROGRESS read as a switch: off for 0/off/false/no, on for 1/on/true/yes or unset (any
    case); another value is warned about once per process, naming the variable, and leaves the display on."""
    value = os.environ.get(ENV, "").strip()
    word = value.lower()
    if word in OFF_WORDS:
        return False
    if word and word not in ON_WORDS and value not in _warned:
        _warned.add(value)
        print(
            f"warning: {ENV}={value!r} is not understood; set it to one of {', '.join(OFF_WORDS)} to turn the "
            f"progress display off ({', '.join(ON_WORDS)} or unset: on)",
            file=sys.stderr,
        )
    return True


def progress_enabled(rank: int = 0) -> bool:
    """True when a progress display may be drawn: rank 0, stderr a terminal, SPEECHLM_PROGRESS not off."""
    if rank != 0 or not progress_setting():
        return False
    return is_terminal(sys.stderr)


def format_duration(seconds: float) -> str:
    """``0:07``, ``12:34``, ``3:02:01`` (hours unbounded)."""
    s = int(max(0.0, seconds) + 0.5)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta_seconds(done: int, total: int | None, initial: int, elapsed: float) -> float | None:
    """Seconds left at the mean rate since the display started (None: unknown total or no progress yet)."""
    if total is None or done <= initial or elapsed <= 0:
        return None
    return (total - done) * elapsed / (done - initial)


class Progress:
    """One display line; a no-op unless `active` (see the module doc). `enabled` overrides the check."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "",
        *,
        initial: int = 0,
        rank: int = 0,
        enabled: bool | None = None,
        leave: bool = True,
        stream: TextIO | None = None,
        min_interval: float = 0.2,
    ):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.done = initial
        self.initial = initial
        self.active = progress_enabled(rank) if enabled is None else enabled
        self.leave = leave
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self.fields: dict[str, str] = {}
        self.phase_name: str | None = None
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> Progress:
        self.draw()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1, **fields: Any) -> None:
        """Count `n` more done and set the trailing `key value` fields (None removes one)."""
        self.done += n
        self.set_fields(**fields)
        if time.monotonic() - self._last_draw >= self.min_interval or self.done == self.total:
            self.draw()

    def phase(self, name: str) -> None:
        """Start phase `name` of a display that counts phases (the previous phase is done)."""
        if self.phase_name is not None:
            self.done += 1
        self.phase_name = name
        self.draw()

    def set_fields(self, **fields: Any) -> None:
        for key, value in fields.items():
            if value is None:
                self.fields.pop(key, None)
            else:
                self.fields[key] = str(value)

    def eta(self) -> float | None:
        return eta_seconds(self.done, self.total, self.initial, time.monotonic() - self.start)

    def render(self) -> str:
        """The display line (without the carriage return), cut to the terminal's width."""
        elapsed = time.monotonic() - self.start
        parts = [self.desc + (f": {self.phase_name}" if self.phase_name else "")]
        if self.total:
            filled = min(BAR_WIDTH, int(BAR_WIDTH * self.done / self.total))
            parts.append(f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}]")
            parts.append(f"{self.done}/{self.total}{' ' + self.unit if self.unit else ''}")
            parts.append(f"{100 * self.done / self.total:.0f}%")
        elif self.total is None and self.done:
            parts.append(f"{self.done}{' ' + self.unit if self.unit else ''}")
        parts.append(format_duration(elapsed))
        eta = self.eta()
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        line = " ".join(parts)
        if self.fields:
            line += " · " + " · ".join(f"{k} {v}" for k, v in self.fields.items())
        width = shutil.get_terminal_size((100, 20)).columns - 1
        return line[:width]

    def draw(self) -> None:
        if not self.active or self._closed:
            return
        with self._lock:
            self.stream.write("\r\x1b[K" + self.render())
            self.stream.flush()
            self._last_draw = time.monotonic()

    def write(self, message: str) -> None:
        """Print `message` on a line of its own (above the display when it is drawn)."""
        if self.active and not self._closed:
            with self._lock:
                self.stream.write("\r\x1b[K")
            print(message, file=self.stream, flush=True)
            self.draw()
        else:
            print(message, file=self.stream, flush=True)

    @contextmanager
    def heartbeat(self, every: float = 0.5) -> Iterator[None]:
        """Redraw every `every` seconds from a thread while the body runs (the elapsed time moves)."""
        if not self.active:
            yield
            return
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every):
                self.draw()

        thread = threading.Thread(target=beat, name="speechlm-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def close(self) -> None:
        """Draw the last state and end the line (`leave`), or erase it."""
        if not self.active or self._closed:
            self._closed = True
            return
        if self.phase_name is not None and self.total is not None:
            self.done, self.phase_name = self.total, None  # the last phase is done too
        self.draw()
        with self._lock:
            self.stream.write("\n" if self.leave else "\r\x1b[K")
            self.stream.flush()
        self._closed = True
