"""Load-balanced context-parallel (CP) sharding of packed THD batches.

Letters: T tokens (global), t tokens (local to one CP rank), N sequences, H hidden or heads, R CP
ranks.

There is no BSHD sharding: padded batches under CP are refused (the validator's BSHD + cp > 1 rule;
padding cannot be masked in the CP attention path).

Chunk pairing. A sequence of padded length L (a multiple of 2*cp) is cut into 2*cp chunks of
c = L / (2*cp) tokens. CP rank r keeps chunk r and chunk 2*cp-1-r, in that order:

    global position  g = start + k*c + p      (chunk k in [0, 2cp), offset p in [0, c))
    local offset     o in [0, 2c):  k = r if o < c else 2cp-1-r,   p = o mod c

Under a causal mask the work of chunk k grows with k, so pairing the k-th cheapest chunk with
the k-th most expensive one gives every rank the same amount of attention work. For a packed
THD batch the pairing is applied per sequence and the kept pieces are concatenated in sequence
order, so every rank holds 2c tokens of every sequence and the local ``cu_seqlens`` is simply
the global one divided by cp (as is the local max_seqlen).

Published example, cu_seqlens [0, 8, 16] and cp=2 (c=2):

    sequence 0: chunks [0,1] [2,3] [4,5] [6,7]       rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    rank 0 -> [0, 1, 6, 7, 8, 9, 14, 15]             rank 1 -> [2, 3, 4, 5, 10, 11, 12, 13]

Labels must be shifted by the packer on the *global* sequence before sharding: a shift after
sharding would pair a token with its neighbour in the local stream, which is a different
position (or a different document) at every chunk boundary.

Everything here is a pure function of (cu_seqlens, cp_size, cp_rank): no process group. The
inverse (every rank's piece back to global order) is a gather by the inverse of
``cp_all_rank_indices_thd(..).flatten()`` (`inverse_permutation`), which the all-gather attention does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import overload

import torch
from torch import Tensor

from parallel.rounding import sequence_multiple

__all__ = [
    "check_cp_args",
    "cp_shard_indices_thd",
    "cp_all_rank_indices_thd",
    "inverse_permutation",
    "shard_thd",
    "shard_placed_thd",
]


def check_cp_args(cp_size: int, cp_rank: int | None = None) -> None:
    """Raise ValueError unless cp_size >= 1 and 0 <= cp_rank < cp_size."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")


def _check_cu_seqlens(cu_seqlens: Tensor, multiple: int, what: str = "sequence") -> Tensor:
    """Validate cu_seqlens ([0, ..., T], non-decreasing) and return the lengths [N].

    Every length must be a multiple of ``multiple``; the error names the first offending sequence.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.long()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu.tolist()[:8]}")
    lengths_N = cu[1:] - cu[:-1]
    if bool((lengths_N < 0).any()):
        i = int(torch.nonzero(lengths_N < 0)[0])
        raise ValueError(f"cu_seqlens must be non-decreasing; {what} {i} has length {int(lengths_N[i])}")
    bad_N = lengths_N % multiple != 0
    if bool(bad_N.any()):
        i = int(torch.nonzero(bad_N)[0])
        raise ValueError(
            f"{what} {i} has length {int(lengths_N[i])}, which is not a multiple of {multiple} "
            f"(2*cp); pad every packed sequence to a multiple of 2*cp before CP sharding"
        )
    return lengths_N


def cp_shard_indices_thd(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Global token indices [t] kept by ``cp_rank``: per sequence chunks r and 2cp-1-r, in order.

    Vectorised over tokens: with local starts ls_n = cu_n / cp and local offset o = i - ls_n of
    local token i in sequence n, the global index is cu_n + k*c_n + (o mod c_n) where
    k = r if o < c_n else 2cp-1-r. Returned on the device of ``cu_seqlens``.
    """
    check_cp_args(cp_size, cp_rank)
    lengths_N = _check_cu_seqlens(cu_seqlens, 2 * cp_size)
    cu_N1 = cu_seqlens.long()
    device = cu_N1.device
    chunk_N = lengths_N // (2 * cp_size)
    local_len_N = 2 * chunk_N
    n_local = int(local_len_N.sum())
    seq_t = torch.repeat_interleave(torch.arange(lengths_N.numel(), device=device), local_len_N)
    local_start_N = cu_N1[:-1] // cp_size
    offset_t = torch.arange(n_local, device=device) - local_start_N[seq_t]
    c_t = chunk_N[seq_t]
    second_t = offset_t >= c_t
    chunk_id_t = torch.where(second_t, 2 * cp_size - 1 - cp_rank, cp_rank)
    pos_t = offset_t - second_t.long() * c_t
    return cu_N1[:-1][seq_t] + chunk_id_t * c_t + pos_t


def cp_all_rank_indices_thd(cu_seqlens: Tensor, cp_size: int) -> Tensor:
    """[R, t] global indices kept by every rank (row r = ``cp_shard_indices_thd(.., r)``).

    Flattened, this is the global index of each row of a rank-major gather (all_gather output).
    """
    return torch.stack([cp_shard_indices_thd(cu_seqlens, cp_size, r) for r in range(cp_size)])


def inverse_permutation(perm: Tensor) -> Tensor:
    """inv with inv[perm[i]] = i, so ``x[perm][inv] == x`` for a permutation ``perm`` of 0..n-1."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


@overload
def shard_thd(
    tensors: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int
) -> tuple[Tensor, Tensor, int]: ...


@overload
def shard_thd(
    tensors: Mapping[str, Tensor], cu_seqlens: Tensor, cp_size: int, cp_rank: int
) -> tuple[dict[str, Tensor], Tensor, int]: ...


def shard_thd(
    tensors: Tensor | Mapping[str, Tensor], cu_seqlens: Tensor, cp_size: int, cp_rank: int
) -> tuple[Tensor | dict[str, Tensor], Tensor, int]:
    """Keep this rank's tokens of packed THD tensors along dim 0.

    ``tensors`` is one tensor or a mapping (e.g. inputs_embeds [T, H], labels [T], position_ids
    [T]); each must have T = cu_seqlens[-1] rows. Labels must already be shifted globally (see the
    module docstring); position_ids keep their global values, which is what RoPE needs.

    Returns (sharded tensor(s) of the same kind, local cu_seqlens = cu_seqlens // cp,
    local max_seqlen = global max length // cp).
    """
    idx_t = cp_shard_indices_thd(cu_seqlens, cp_size, cp_rank)
    total = int(cu_seqlens[-1])
    items = {"tensor": tensors} if isinstance(tensors, Tensor) else dict(tensors)
    out: dict[str, Tensor] = {}
    for name, x in items.items():
        if x.shape[0] != total:
            raise ValueError(
                f"{name} has {x.shape[0]} rows along dim 0 but cu_seqlens[-1] = {total}; "
                "THD tensors must have exactly one row per packed token"
            )
        out[name] = x.index_select(0, idx_t.to(x.device))
    cu_local = cu_seqlens // cp_size
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    max_seqlen_local = int(lengths.max()) // cp_size if lengths.numel() else 0
    if isinstance(tensors, Tensor):
        return out["tensor"], cu_local, max_seqlen_local
    return out, cu_local, max_seqlen_local


def shard_placed_thd(
    tensors: Mapping[str, Tensor], cu_seqlens: Tensor, n_split: int, cp_size: int, cp_rank: int
) -> tuple[dict[str, Tensor], Tensor, int]:
    """Dynamic CP (`parallel.cp_placement`): the first ``n_split`` sequences of this rank's stream are
    cut into load-balanced chunk pairs like `shard_thd`; the rest (this rank's whole sequences) are
    kept as they are. Returns (local tensors, local cu_seqlens, local max_seqlen). With
    ``n_split = N`` (every sequence split) this is `shard_thd`."""
    total = int(cu_seqlens[-1])
    t_split = int(cu_seqlens[n_split])
    out: dict[str, Tensor] = {}
    cu_split = cu_seqlens[: n_split + 1]
    if n_split:
        split_part, cu_split_local, max_split = shard_thd(
            {k: v[:t_split] for k, v in tensors.items()}, cu_split, cp_size, cp_rank
        )
    else:
        split_part = {k: v[:0] for k, v in tensors.items()}
        cu_split_local, max_split = cu_split[:1] * 0, 0
    for k, v in tensors.items():
        if v.shape[0] != total:
            raise ValueError(f"{k} has {v.shape[0]} rows along dim 0 but cu_seqlens[-1] = {total}")
        out[k] = torch.cat([split_part[k], v[t_split:]])
    whole_cu = cu_seqlens[n_split + 1 :] - t_split + cu_split_local[-1]
    cu_local = torch.cat([cu_split_local, whole_cu])
    lengths = cu_seqlens[n_split + 1 :] - cu_seqlens[n_split:-1]
    max_local = max(max_split, int(lengths.max()) if lengths.numel() else 0)
    return out, cu_local, max_local


def shard_by_degree(
    tensors: Mapping[str, Tensor], lengths_by_segment: list[tuple[int, list[int]]], cp_rank: int
) -> tuple[dict[str, Tensor], list[tuple[int, list[int]]]]:
    """Hybrid CP degrees (`parallel.cp_placement.HybridPlacement.segments`): this rank's stream before
    sharding is one segment per degree, ``lengths_by_segment[j] = (d, padded lengths of its sequences)``;
    a degree-d segment is cut like `shard_thd` over its aligned sub-group of d ranks (this rank is rank
    ``cp_rank % d`` of it), the degree-1 segment (whole sequences) is kept. Returns the local tensors and
    the segments' local host boundaries, ``(d, cu_local)`` each (empty for an empty segment), which is
    what `parallel.cp_attention.attention_by_degree` takes."""
    parts: dict[str, list[Tensor]] = {k: [] for k in tensors}
    segments: list[tuple[int, list[int]]] = []
    start = 0
    for d, lengths in lengths_by_segment:
        rows = sum(lengths)
        if any(n % sequence_multiple(d) for n in lengths):
            raise ValueError(f"degree-{d} sequence lengths {lengths} must divide by {sequence_multiple(d)}")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n // d)
        for k, v in tensors.items():
            piece = v[start : start + rows]
            if d > 1 and rows:
                piece = shard_thd(
                    piece, torch.tensor([c * d for c in cu], dtype=torch.int32), d, cp_rank % d
                )[0]
            parts[k].append(piece)
        segments.append((d, cu if lengths else []))
        start += rows
    for k, v in tensors.items():
        if v.shape[0] != start:
            raise ValueError(f"{k} has {v.shape[0]} rows along dim 0 but the segments hold {start}")
    return {k: torch.cat(p) for k, p in parts.items()}, segments
