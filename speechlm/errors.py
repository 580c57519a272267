"""User errors and the exit codes every `speechlm` command returns.

A user error is something the user can fix (a bad value, a missing or unreadable file, a run dir that
holds another run): the command prints one paragraph `error: ...` that names the input and the fix,
and exits with the code of its class. Anything else is a bug: the traceback is printed and the exit
code is `EXIT_BUG`. `--debug` (or `SPEECHLM_DEBUG=1`) prints the traceback of user errors too.

| code | meaning |
| ---: | --- |
| 0 | success |
| 1 | the data or the layout cannot be used (manifest, audio, tokenizer files, shards, validator errors) |
| 2 | a bad command line or config value (usage) |
| 3 | the run dir or a checkpoint cannot be used (occupied run dir, refused or corrupt resume) |
| 4 | an output cannot be written (not a directory, permission denied, disk full) |
| 70 | a bug in speechlm (traceback printed; please report it) |
| 130 | interrupted by SIGINT (Ctrl-C) |
| 143 | stopped by SIGTERM after saving a checkpoint (preempted: resume with `trainer.resume=auto`) |

`parallel/` imports torch only, so its `ValidationError` and `LayoutError` are mapped here by type.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

EXIT_OK = 0
EXIT_DATA = 1
EXIT_USAGE = 2
EXIT_RUN_DIR = 3
EXIT_OUTPUT = 4
EXIT_BUG = 70
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_DATA: "the data or the layout cannot be used",
    EXIT_USAGE: "a bad command line or config value",
    EXIT_RUN_DIR: "the run dir or a checkpoint cannot be used",
    EXIT_OUTPUT: "an output cannot be written",
    EXIT_BUG: "a bug in speechlm (traceback printed)",
    EXIT_SIGINT: "interrupted (SIGINT)",
    EXIT_SIGTERM: "stopped by SIGTERM after saving a checkpoint (preempted)",
}


class UserError(Exception):
    """An error the user can fix; `exit_code` says which kind. The message names the input and the fix."""

    exit_code = EXIT_DATA


class DataError(UserError):
    """Input data (manifest, audio, tokenizer, shards) that cannot be used."""

    exit_code = EXIT_DATA


class UsageError(UserError, ValueError):
    """A command-line flag, override or config value that cannot be used."""

    exit_code = EXIT_USAGE


class RunDirError(UserError):
    """A run dir or checkpoint that cannot be used as asked (occupied, incomplete, from another run)."""

    exit_code = EXIT_RUN_DIR


class OutputError(UserError):
    """An output path that cannot be written."""

    exit_code = EXIT_OUTPUT


class NonFiniteError(DataError):
    """A NaN or infinity where a number must be finite: a training step's loss or gradient norm, or a
    tensor of loaded weights (a pretrained LLM or encoder, a checkpoint). Exit 1, naming the step, or
    the file and the tensor."""


def debug_enabled() -> bool:
    return os.environ.get("SPEECHLM_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def exit_code_for(exc: BaseException) -> int | None:
    """The exit code of a user error, or None for a bug."""
    if isinstance(exc, UserError):
        return exc.exit_code
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("parallel.") and name == "ValidationError":
        return EXIT_DATA
    if module.startswith("parallel.") and name == "LayoutError":
        return EXIT_USAGE
    return None


def format_user_error(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # a validator report already carries its own header and findings
    if type(exc).__name__ == "ValidationError":
        return text
    return text if text.startswith("error:") else f"error: {text}"


def run_guarded(func: Callable[[], Any], *, debug: bool = False) -> int:
    """Run a command; user errors become one message and their exit code, bugs a traceback and 70."""
    debug = debug or debug_enabled()
    try:
        return int(func() or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except BrokenPipeError:
        # `speechlm plan | head`: the reader went away; not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return EXIT_OK
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the one place that turns exceptions into exit codes
        code = exit_code_for(exc)
        if code is None:
            traceback.print_exc()
            print(
                f"\nerror: internal error ({type(exc).__name__}); this is a bug in speechlm, please report it "
                "with the traceback above",
                file=sys.stderr,
            )
            return EXIT_BUG
        if debug:
            traceback.print_exc()
        print(format_user_error(exc), file=sys.stderr)
        return code
