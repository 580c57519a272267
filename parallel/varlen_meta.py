"""The boundaries of one varlen call, on the device and on the host: `VarlenMeta`.

Letters: N sequences, T packed tokens.

Built once per micro-batch (`build_varlen_meta`, one device sync) and handed to every layer and
every kernel, so no layer syncs the device to read lengths. Its own module so that the varlen
interface (`parallel.varlen`) and the kernels behind it (`parallel.varlen_flash`) both import it
without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["VarlenMeta", "build_varlen_meta"]


@dataclass(frozen=True)
class VarlenMeta:
    """cu_seqlens of one pack on the device and on the host, with the max lengths: built once."""

    cu_seqlens_q: Tensor  # int32 (N+1,) on the attention's device
    cu_seqlens_k: Tensor
    cu_q: tuple[int, ...]  # the same boundaries as host integers
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int


def _check_boundaries(name: str, cu: Sequence[int]) -> tuple[int, ...]:
    cu = tuple(int(x) for x in cu)
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(
            f"{name}={list(cu)[:8]}{'...' if len(cu) > 8 else ''} is not a cumulative length list "
            "(it must start at 0 and never decrease): build it with torch.cumsum over sequence lengths"
        )
    return cu


def build_varlen_meta(
    cu_seqlens_q: Sequence[int] | Tensor,
    cu_seqlens_k: Sequence[int] | Tensor | None = None,
    device: torch.device | str = "cpu",
) -> VarlenMeta:
    """Read the boundaries to the host once (one sync per micro-batch) and keep both copies."""
    host_q = cu_seqlens_q.tolist() if isinstance(cu_seqlens_q, Tensor) else cu_seqlens_q
    cu_q = _check_boundaries("cu_seqlens_q", host_q)
    if cu_seqlens_k is None:
        cu_k = cu_q
    else:
        host_k = cu_seqlens_k.tolist() if isinstance(cu_seqlens_k, Tensor) else cu_seqlens_k
        cu_k = _check_boundaries("cu_seqlens_k", host_k)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q has {len(cu_q) - 1} sequences and cu_seqlens_k {len(cu_k) - 1}: "
            "pass one boundary list per side for the same sequences"
        )

    def span(cu: tuple[int, ...]) -> int:
        return max((b - a for a, b in zip(cu, cu[1:], strict=False)), default=0)

    return VarlenMeta(
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        cu_q=cu_q,
        cu_k=cu_k,
        max_q=span(cu_q),
        max_k=span(cu_k),
    )
