"""Output paths of the data tools (`manifest build|convert|stats --plot`, `shards write`, `tokenizer
train`): a folder or a file's parent that cannot be made, or a file that cannot be written, is one
`OutputError` (exit 4) naming the path and the reason, never a traceback; a file is written under a
temporary name and renamed, so a failed write leaves nothing half-written under the final name.

Nothing a user made is replaced (`owned_outputs`): `manifest build`, `tokenizer train` and `speechlm demo`
record what they wrote in the folder's ``speechlm_outputs.json`` (each file's command, size and sha256).
A file there that speechlm did not write, or that changed since, is refused (exit 4) before any work;
a file written by the same command with the same inputs is replaced (a re-run), one written by another
command or with other settings only with ``--overwrite``. A file is recorded after it is written, also
when the command then fails or is interrupted with Ctrl-C; a SIGTERM or SIGKILL between the two leaves
it unrecorded, and the next run refuses it like a file of the user's (move it away).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from speechlm.errors import OutputError
from speechlm.io import atomic_path, sha256_of


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
    """Call ``write(tmp)`` on a hidden sibling of `path` (`speechlm.io.atomic_path`: its name does not end
    in `path`'s suffix), then rename it to `path` (parents created).

    An OSError while writing removes the temporary file and becomes an OutputError naming `path`.
    """
    p = prepare_parent(path, flag)
    try:
        with atomic_path(p) as tmp:
            write(tmp)
    except OSError as e:
        raise output_error(p, flag, e) from None
    return p


# ------------------------------------------------------------------------ what a command may replace
STAMP_NAME = "speechlm_outputs.json"


def command_identity(command: str, source: str | Path, options: dict[str, object]) -> str:
    """`command` with its input resolved and its settings: what `owned_outputs` compares on a re-run."""
    flags = [
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(options.items()) if v is not None and v is not False
    ]
    return " ".join([command, str(Path(source).resolve()), *flags])


def read_stamp(folder: Path) -> dict[str, dict[str, Any]]:
    """``{file name: {"by", "size", "sha256"}}`` of the files speechlm wrote in `folder` ({} if none)."""
    try:
        stamp = json.loads((folder / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = stamp.get("files") if isinstance(stamp, dict) else None
    return files if isinstance(files, dict) else {}


def _recorded(path: Path, stamp: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The stamp's entry of `path` when the file is still exactly what speechlm wrote, else None."""
    entry = stamp.get(path.name)
    if not isinstance(entry, dict) or not path.is_file():
        return None
    if entry.get("size") != path.stat().st_size or entry.get("sha256") != sha256_of(path):
        return None
    return entry


def check_replaceable(
    paths: Sequence[str | os.PathLike[str]], by: str, *, overwrite: bool = False, flag: str = "--out"
) -> None:
    """Refuse (OutputError, every problem at once) to write over an existing file of `paths` unless the
    folder's `STAMP_NAME` records it, unchanged since, as written by the same command with the same inputs
    (`by`: a re-run), or by any speechlm command when `overwrite`. A file speechlm did not write (or
    that was changed since) is never replaced, `overwrite` or not."""
    foreign: list[Path] = []
    others: dict[str, list[str]] = {}  # earlier command -> its files
    for path in map(Path, paths):
        if not path.exists():
            continue
        entry = _recorded(path, read_stamp(path.parent))
        if entry is None:
            foreign.append(path)
        elif entry.get("by") != by and not overwrite:
            others.setdefault(str(entry.get("by")), []).append(str(path))
    if foreign:
        one = len(foreign) == 1
        stamp = foreign[0].parent / STAMP_NAME
        raise OutputError(
            f"{flag}: {', '.join(map(str, foreign))} {'exists' if one else 'exist'} and speechlm did not write "
            f"{'it' if one else 'them'} (or {'it was' if one else 'they were'} changed since: {stamp} records "
            f"what speechlm wrote); your files are never replaced: choose another {flag}, or move "
            f"{'it' if one else 'them'} away"
        )
    if others:
        earlier = "; ".join(f"{', '.join(files)} by `speechlm {b}`" for b, files in others.items())
        raise OutputError(
            f"{flag}: speechlm wrote {earlier}; this is `speechlm {by}` (other inputs or settings): choose "
            f"another {flag}, or add --overwrite to replace what speechlm wrote there"
        )


def record_written(paths: Sequence[str | os.PathLike[str]], by: str) -> None:
    """Record each existing file of `paths` in its folder's `STAMP_NAME` as written by `by`."""
    by_folder: dict[Path, list[Path]] = {}
    for path in map(Path, paths):
        if path.is_file():
            by_folder.setdefault(path.parent, []).append(path)
    for folder, written in by_folder.items():
        files = read_stamp(folder)
        for path in written:
            files[path.name] = {"by": by, "size": path.stat().st_size, "sha256": sha256_of(path)}
        text = json.dumps({"files": files}, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
        write_atomic(folder / STAMP_NAME, _text_writer(text))


def _text_writer(text: str) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text(text, encoding="utf-8")

    return write


def _state(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


@contextlib.contextmanager
def owned_outputs(
    paths: Sequence[str | os.PathLike[str]], by: str, *, overwrite: bool = False, flag: str = "--out"
) -> Iterator[None]:
    """`check_replaceable`, run the body, then record the files of `paths` it wrote (even when it then
    failed: a file it left is its own, and the next run may replace it)."""
    check_replaceable(paths, by, overwrite=overwrite, flag=flag)
    before = {Path(p): _state(Path(p)) for p in paths}
    try:
        yield
    finally:
        record_written([p for p, state in before.items() if _state(p) != state], by)
