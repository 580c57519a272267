"""Output paths of the data tools (`manifest build|convert|stats --plot`, `shards write`, `tokenizer
train`): a folder or a file's parent that cannot be made, or a file that cannot be written, is one
`OutputError` (exit 4) naming the path and the reason, never a traceback; a file is written under a
temporary name and renamed, so a failed write leaves nothing half-written under the final name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from speechlm.errors import OutputError


def _reason(path: Path, error: OSError) -> str:
    """Why `path` cannot be made: the ancestor that is a file, else the OS's words."""
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, not a folder"
            break
    return error.strerror or str(error)


def output_error(path: str | os.PathLike[str], flag: str, error: OSError) -> OutputError:
    p = Path(path)
    return OutputError(
        f"cannot write {flag} {p}: {_reason(p, error)}; pass a path in a folder you can write to"
    )


def prepare_dir(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """Create folder `path` (and its parents); OutputError naming it when that is impossible."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"cannot write {flag} {p}: it is a file, not a folder; pass a folder path")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise output_error(p, flag, e) from None
    return p


def prepare_parent(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """Create the parent folder of file `path`; OutputError naming `path` when that is impossible."""
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"cannot write {flag} {p}: it is a folder; pass a file path")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise output_error(p, flag, e) from None
    return p


def write_atomic(path: str | os.PathLike[str], write: Callable[[Path], None], flag: str = "--out") -> Path:
    """Call ``write(tmp)`` on a hidden sibling of `path`, then rename it to `path` (parents created).

    An OSError while writing removes the temporary file and becomes an OutputError naming `path`.
    """
    p = prepare_parent(path, flag)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}{p.suffix}")
    try:
        write(tmp)
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise output_error(p, flag, e) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p
