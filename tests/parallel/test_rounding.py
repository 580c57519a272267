"""One owner per fact: the CP/TP rounding rule and the list of attention backends.

Packing, CP sharding, the validator and `speechlm plan` once each computed the rounding unit; the config,
the capability table and the model's registry each listed the backends. These tests fail if any of
them stops asking the single owner (or the owner changes under one of them).
"""

from __future__ import annotations

import numpy as np
import pytest

from parallel.backend_caps import BACKENDS
from parallel.rounding import rounding_unit, sequence_multiple
from parallel.validator import build_context
from speechlm.config import ATTENTION_BACKENDS, load_config
from speechlm.data.plan.figures import cp_padding
from speechlm.packing.thd import round_lengths

LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (2, 8)]


@pytest.mark.parametrize("cp, tp", LAYOUTS)
def test_packing_planner_sharding_and_validator_share_one_rounding_rule(cp, tp):
    unit = rounding_unit(cp, tp)
    rng = np.random.default_rng(cp * 10 + tp)
    lengths = rng.integers(1, 300, size=17)
    rounded = round_lengths(lengths.tolist(), cp, tp)
    assert sum(rounded) % unit == 0 and all(n % sequence_multiple(cp) == 0 for n in rounded)
    # the planner's token count is exactly what packing computes, batch by batch
    offsets = np.array([0, 5, 11, 17])
    expected = sum(
        sum(round_lengths(lengths[a:b].tolist(), cp, tp)) for a, b in zip(offsets[:-1], offsets[1:])
    )
    assert cp_padding(lengths, offsets, cp, tp, 0, 0.0)["computed"] == expected  # threshold 0: split all
    cfg = load_config(None, [f"parallel.cp_size={cp}", f"parallel.tp_size={tp}"])
    ctx = build_context(cfg, cp * tp, {}, None, {})
    assert ctx.rounding_unit == unit


def test_attention_backend_list_has_one_owner():
    from speechlm.model.attention import registered_backends

    assert set(ATTENTION_BACKENDS) == set(BACKENDS) == set(registered_backends())
