"""Files, the ground floor: the SHA-256 of a file, and the modes a plain create gives.

`sha256_of` streams the file in 1 MiB chunks (about 1.5 GB/s on one core; memory stays at one chunk):
checkpoints (`speechlm.train.checkpoint`) and exports (`speechlm.model.exported`) record it per file
and verify it on load, `speechlm llm import-gguf` records its source's.

`apply_umask` gives a directory tree written through temporary names the modes of a plain ``mkdir`` /
``open`` under the process's umask: ``tempfile.mkdtemp`` creates 0700 and safetensors' own atomic
write (a temporary file renamed, created 0600 whatever the umask) leaves model weights owner-only, so a
model meant to be shared would be unreadable to the group that shares it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
