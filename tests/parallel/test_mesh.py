"""ParallelDims: pure rank arithmetic (no process group)."""

import itertools
from types import SimpleNamespace

import pytest

from parallel.mesh import LayoutError, ParallelDims, resolve_dp_shard


@pytest.mark.parametrize(
    "world,rep,cp,tp", [(1, 1, 1, 1), (8, 1, 2, 2), (8, 2, 2, 1), (16, 2, 2, 2), (4, 1, 4, 1)]
)
def test_coords_cover_every_rank_once(world, rep, cp, tp):
    d = ParallelDims(world, rep, -1, cp, tp)
    assert d.dp_replicate * d.dp_shard * d.cp * d.tp == world
    seen = {tuple(d.coords(r).values()) for r in range(world)}
    assert len(seen) == world
    # tp is innermost: consecutive ranks are TP peers
    if tp > 1:
        assert d.peers(0, "tp") == list(range(tp))


def test_cp_and_tp_peers_share_dp_rank():
    d = ParallelDims(8, 1, -1, 2, 2)  # dp_shard = 2
    assert d.dp == 2
    for r in range(8):
        for axis in ("cp", "tp"):
            assert {d.dp_rank(p) for p in d.peers(r, axis)} == {d.dp_rank(r)}
    assert sorted({d.dp_rank(r) for r in range(8)}) == [0, 1]


def test_dp_rank_orders_replicate_then_shard():
    d = ParallelDims(8, 2, 2, 2, 1)
    got = [d.dp_rank(r) for r in range(8)]
    assert got == [r // 2 for r in range(8)]
    for r, (a, b) in zip(range(8), itertools.product(range(4), range(2))):
        assert d.coords(r)["cp"] == b and d.dp_rank(r) == a


def test_layout_errors_name_the_numbers():
    with pytest.raises(LayoutError, match="not divisible"):
        ParallelDims(6, 1, -1, 4, 1)
    with pytest.raises(LayoutError, match="1\\*2\\*2\\*1 = 4 != world size 8"):
        ParallelDims(8, 1, 2, 2, 1)
    with pytest.raises(LayoutError, match="cp must be >= 1"):
        ParallelDims(2, 1, -1, 0, 1)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16])
@pytest.mark.parametrize("rep,cp,tp", [(1, 1, 1), (1, 2, 1), (2, 1, 2), (1, 4, 1), (2, 2, 2), (3, 1, 1)])
def test_dp_shard_rest_has_one_owner(world, rep, cp, tp):
    """ParallelDims and the validator (build_context) resolve dp_shard=-1 with the same function."""
    from parallel.validator import build_context
    from speechlm.config import load_config

    resolved = resolve_dp_shard(world, rep, -1, cp, tp)
    assert resolved == (world // (rep * cp * tp) if world % (rep * cp * tp) == 0 else None)
    overrides = [f"parallel.dp_replicate={rep}", f"parallel.cp_size={cp}", f"parallel.tp_size={tp}"]
    assert build_context(load_config(None, overrides), world, {}, None, {}).dp_shard_resolved == resolved
    if resolved is None:
        with pytest.raises(LayoutError, match="not divisible"):
            ParallelDims(world, rep, -1, cp, tp)
    else:
        assert ParallelDims(world, rep, -1, cp, tp).dp_shard == resolved


def test_resolve_dp_shard_keeps_a_configured_value():
    assert resolve_dp_shard(8, 1, 2, 2, 1) == 2  # the product is checked by the caller
    assert resolve_dp_shard(8, 1, 0, 2, 1) is None and resolve_dp_shard(8, 1, -2, 2, 1) is None
    assert resolve_dp_shard(8, 0, -1, 2, 1) is None


def test_from_config_reads_the_parallel_section():
    """`ParallelDims.from_config` is the one place the config's sizes become a layout (train and validate)."""
    section = SimpleNamespace(dp_replicate=2, dp_shard=-1, cp_size=2, tp_size=1)
    assert ParallelDims.from_config(8, section) == ParallelDims(8, 2, 2, 2, 1)
