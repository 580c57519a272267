"""Reading one clip's bytes by (tar, offset, size); `speechlm.data.audio.decode_audio` decodes them.

`MemberReader` keeps one open file descriptor per tar (least recently used closed beyond
`max_open`), owned by the process that opened it: a DataLoader worker forked from a parent with open
tars opens its own, so no two processes share a file offset (and `os.pread` has none anyway).

Each read takes the member's header with its data in one `pread` and checks the header: the member
name must be the one the index names and the size must match. A mismatch means the index is stale
(the tar was rewritten); the clip is refused rather than decoded, since decoding it would pair one
utterance's text with another's audio. A read that ends early means the tar is truncated.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections import OrderedDict


class MemberError(RuntimeError):
    """A member that cannot be read as the index describes it; `reason` is a drop reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class MemberReader:
    """Positional reads of tar members with a small per-process cache of open files."""

    def __init__(self, max_open: int = 64) -> None:
        self.max_open = int(max_open)
        self._pid = os.getpid()
        self._fds: OrderedDict[str, int] = OrderedDict()

    def __getstate__(self) -> dict[str, object]:  # pickled into DataLoader workers: no descriptors travel
        return {"max_open": self.max_open}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(int(state["max_open"]))  # type: ignore[misc,call-overload]

    def _fd(self, tar: str) -> int:
        if os.getpid() != self._pid:  # forked after opening: these descriptors belong to the parent
            self._pid, self._fds = os.getpid(), OrderedDict()
        fd = self._fds.get(tar)
        if fd is not None:
            self._fds.move_to_end(tar)
            return fd
        try:
            fd = os.open(tar, os.O_RDONLY)
        except FileNotFoundError:
            raise MemberError("missing_shard", f"tar shard {tar} does not exist") from None
        except OSError as e:
            raise MemberError("missing_shard", f"tar shard {tar} cannot be opened ({e})") from None
        self._fds[tar] = fd
        while len(self._fds) > self.max_open:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def read(self, tar: str, member: str, offset: int, nbytes: int, header_bytes: int) -> bytes:
        """The data of `member`, checked against its header (MemberError on mismatch or truncation)."""
        where = f"{tar}:{member}"
        start = int(offset) - int(header_bytes)
        if start < 0 or header_bytes < 512:
            raise MemberError(
                "stale_index", f"{where}: index row has offset {offset} and header {header_bytes} bytes"
            )
        buf = os.pread(self._fd(tar), int(header_bytes) + int(nbytes), start)
        if len(buf) < int(header_bytes) + int(nbytes):
            raise MemberError(
                "truncated_shard",
                f"{where}: the tar ends {int(header_bytes) + int(nbytes) - len(buf)} bytes before the member's end; "
                "the shard is truncated: re-copy it",
            )
        try:
            info = tarfile.TarInfo.frombuf(buf[:512], tarfile.ENCODING, "surrogateescape")
            if info.type in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.XGLTYPE):
                with tarfile.open(fileobj=io.BytesIO(buf + b"\0" * 1024), mode="r:") as tf:
                    first = tf.next()
                    if first is None:
                        raise tarfile.HeaderError("no member")
                    info = first
        except (tarfile.HeaderError, tarfile.ReadError, EOFError) as e:
            raise MemberError(
                "stale_index",
                f"{where}: no tar header at the indexed offset ({e}); the offset index is stale",
            ) from None
        if info.name != member or info.size != int(nbytes):
            raise MemberError(
                "stale_index",
                f"{where}: the tar holds {info.name!r} ({info.size} bytes) where the index says {member!r} "
                f"({nbytes} bytes); the offset index is stale: rebuild it (delete the .idx.parquet cache) "
                "or re-create the shards",
            )
        return buf[int(header_bytes) :]

    def close(self) -> None:
        if os.getpid() == self._pid:
            for fd in self._fds.values():
                os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
