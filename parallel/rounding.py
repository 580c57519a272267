"""The one owner of the CP/TP length rules of a packed (THD) stream. Standard library only.

Load-balanced CP cuts every sequence into ``2 * cp`` equal chunks (rank r keeps chunks r and
2cp-1-r), so under CP each sequence length is a multiple of ``2 * cp``. Each CP rank then holds
``total / cp`` tokens, which tensor/sequence parallelism splits over ``tp`` ranks, so the packed total
is a multiple of ``lcm(2 * cp, cp * tp)``; without CP only ``tp`` must divide it.

Packing (`speechlm.packing.round_lengths`), CP sharding (`parallel.cp_shard`), the validator and
`speechlm plan` all ask these two functions; `tests/parallel/test_rounding.py` checks that they agree.
It has no torch import so that the validator and the planner stay light.
"""

from __future__ import annotations

import math


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
