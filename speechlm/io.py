"""Files, the ground floor: the one atomic write, the SHA-256 of a file, and the modes a plain create gives.

`atomic_path(path)` is the only way speechlm writes a file that a reader may see half-written: the
writer fills a hidden sibling (`.NAME.tmp-HOST-PID`, same folder, so the rename stays on one file
system) and `os.replace` moves it over `path` only once it is complete. A writer stopped midway
(SIGTERM, SIGKILL, a full disk) leaves the previous file, or none, never half of one; the temporary
file is removed on an exception. `durable=True` also fsyncs the file before the rename and the folder
after it, for state a crash must not roll back (checkpoint metadata, the sweep's status, a resume
point); caches and reports skip the two syncs. `atomic_write_text` / `atomic_write_bytes` /
`atomic_write_json` are the common cases.

`sha256_of` streams the file in 1 MiB chunks (about 1.5 GB/s on one core; memory stays at one chunk):
checkpoints (`speechlm.train.checkpoint`) and exports (`speechlm.model.exported`) record it per file
and verify it on load, `speechlm llm import-gguf` records its source's.

`apply_umask` gives a directory tree written through temporary names the modes of a plain ``mkdir`` /
``open`` under the process's umask: ``tempfile.mkdtemp`` creates 0700 and safetensors' own atomic
write (a temporary file renamed, created 0600 whatever the umask) leaves model weights owner-only, so a
model meant to be shared would be unreadable to the group that shares it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HASH_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (about 1.5 GB/s on one core)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give `root` and every directory and file under it the mode a plain create gives (0777 / 0666
    less the process's umask); links are left alone."""
    mask = current_umask()
    root.chmod(0o777 & ~mask)
    for p in root.rglob("*"):
        if p.is_symlink():
            continue
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def temp_sibling(path: Path, tag: str = "tmp") -> Path:
    """The hidden temporary name beside `path` that `atomic_path` writes: unique per host and process,
    so concurrent writers on a shared file system never share one."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{socket.gethostname()}-{os.getpid()}")


def temp_glob(name: str) -> str:
    """The glob of the temporary siblings `atomic_path` writes for a file named `name` (itself may be a
    glob): what a writer killed midway leaves, for a later writer to recognise and remove."""
    return f".{name}.tmp-*"


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path, *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on a clean exit move it over `path` (fsyncing the
    file and the folder first when `durable`), on an exception remove it and re-raise."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = False) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: Path, text: str, *, durable: bool = False) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: Path, data: Any, *, durable: bool = False, **dump_kwargs: Any) -> None:
    """`json.dump(data, **dump_kwargs)` to `path` through `atomic_path`."""
    with atomic_path(path, durable=durable) as tmp, open(tmp, "w") as f:
        json.dump(data, f, **dump_kwargs)
