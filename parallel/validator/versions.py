"""Installed-version checks: reading a version string and the table of version ranges a backend refuses.

Versions are read by `packaging.version.Version` (PEP 440). A range compares the release number only:
pre-, post- and dev-release tags and local labels are ignored, so "2.5.0a0+git1234" counts as 2.5.0,
"2.13.0+cpu" as 2.13.0 and "1.7" as 1.7.0. A string that is not a PEP 440 version ("unknown", "latest",
"2.5-custom") is unknown: the version rule does not judge it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class VersionRange:
    """Versions of `package` that `backend` cannot use: low <= version < high (None: unbounded)."""

    backend: str  # a backend name, or "*" for every backend
    package: str  # distribution name as in `installed`: torch, transformer-engine, flash-attn, cudnn
    low: str | None
    high: str | None
    kind: Literal["minimum", "broken"]  # "minimum": below the oldest supported; "broken": known bad
    reason: str
    source: str

    def refuses(self, version: str) -> bool:
        """True when `version` falls in [low, high); ValueError when it is not a readable version."""
        return in_range(version, self.low, self.high)


VERSION_TABLE: tuple[VersionRange, ...] = (
    VersionRange(
        backend="*",
        package="torch",
        low=None,
        high="2.6",
        kind="minimum",
        reason="the oldest torch this project supports (its declared dependency torch>=2.6)",
        source="pyproject.toml dependency",
    ),
    VersionRange(
        backend="torch_varlen",
        package="torch",
        low=None,
        high="2.10",
        kind="minimum",
        reason="torch.nn.attention.varlen (varlen_attn) first ships in torch 2.10",
        source="PyTorch 2.10 docs, torch.nn.attention.varlen; pytorch/pytorch#164502 (Oct 2025)",
    ),
    VersionRange(
        backend="flash",
        package="flash-attn",
        low=None,
        high="2.6",
        kind="minimum",
        reason="oldest flash-attn this project supports for its varlen kernels",
        source="pyproject.toml extra `flash` (flash-attn>=2.6)",
    ),
    VersionRange(
        backend="te",
        package="transformer-engine",
        low=None,
        high="1.11",
        kind="minimum",
        reason="oldest transformer-engine this project supports for THD DotProductAttention",
        source="pyproject.toml extra `te` (transformer-engine[pytorch]>=1.11)",
    ),
)


def parse_version(text: str) -> Version:
    """The release number of a PEP 440 version: '2.13.0+cpu' -> 2.13.0, '2.5.0a0+git1' -> 2.5.0, '1.7' -> 1.7.

    ValueError (naming the expected form) when `text` is not a PEP 440 version.
    """
    try:
        return Version(Version(str(text)).base_version)
    except InvalidVersion:
        raise ValueError(f"cannot read a version number from {text!r}; write it like 2.6.0") from None


def try_parse_version(text: str | None) -> Version | None:
    """`parse_version`, or None for a missing, empty or unreadable version."""
    try:
        return parse_version(text) if text else None
    except ValueError:
        return None


def in_range(version: str, low: str | None, high: str | None) -> bool:
    """low <= version < high on release numbers (None: unbounded)."""
    v = parse_version(version)
    return (low is None or v >= parse_version(low)) and (high is None or v < parse_version(high))
