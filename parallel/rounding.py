"""The one owner of the CP/TP length rules of a packed (THD) stream. Standard library only.

Load-balanced CP cuts every sequence into ``2 * cp`` equal chunks (rank r keeps chunks r and
2cp-1-r), so under CP each sequence length is a multiple of ``2 * cp``. Each CP rank then holds
``total / cp`` tokens, which tensor/sequence parallelism splits over ``tp`` ranks, so the packed total
is a multiple of ``lcm(2 * cp, cp * tp)``; without CP only ``tp`` must divide it.

Packing (`round_lengths`, here), CP sharding (`parallel.cp_shard`), the validator and
`speechlm plan` all ask these two functions; `tests/parallel/test_rounding.py` checks that they agree.
It has no torch import so that the validator and the planner stay light.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def sequence_multiple(cp: int) -> int:
    """Every packed sequence's length must divide by this: ``2 * cp`` under CP, else 1."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    return 2 * cp if cp > 1 else 1


def rounding_unit(cp: int = 1, tp: int = 1) -> int:
    """Every packed total must divide by this: ``lcm(2 * cp, cp * tp)`` under CP, else ``tp``."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1, got cp={cp}, tp={tp}")
    return math.lcm(2 * cp, cp * tp) if cp > 1 else tp


def round_lengths(
    lengths: Sequence[int], cp: int = 1, tp: int = 1, total_multiple: int | None = None
) -> list[int]:
    """Round sequence lengths so that the packed stream can be sharded over ``cp`` and ``tp``.

    ``cp == 1``: unchanged, except the last length padded so that the total divides by ``tp``.
    ``cp > 1``: each length up to a multiple of ``2 * cp``, then the last one padded further so
    that the total divides by ``lcm(2 * cp, cp * tp)`` (each CP rank's ``total / cp`` divides by
    ``tp``). The extra padding of the last length is a multiple of ``2 * cp``, so it stays legal.
    ``total_multiple`` (``model.pad_to_multiple``) replaces that automatic multiple of the total, for
    example 64 for tensor cores; it must itself be a multiple of `rounding_unit(cp, tp)`.
    """
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1, got cp={cp}, tp={tp}")
    unit = rounding_unit(cp, tp)
    if total_multiple is not None and (total_multiple < 1 or total_multiple % unit):
        raise ValueError(
            f"pad_to_multiple={total_multiple} is not a multiple of lcm(2*cp, cp*tp) = {unit} (cp={cp}, "
            f"tp={tp}); each CP rank's share would not divide by tp. Use a multiple of {unit}"
        )
    out = [int(n) for n in lengths]
    for i, n in enumerate(out):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every packed sequence needs at least one token")
    if not out:
        return out
    chunk = sequence_multiple(cp)
    if chunk > 1:
        out = [-(-n // chunk) * chunk for n in out]
    total = sum(out)
    out[-1] += -total % (total_multiple or unit)
    return out
