"""parallel.testing.run_distributed's start methods: gloo ranks are forked (no torch import per rank),
each with its own random state as a spawned rank has; spawn stays available (and is NCCL's default)."""

from __future__ import annotations

import os

import pytest
import torch

from parallel.testing import default_start_method, run_distributed

_SET_BY_THE_PARENT = "import-time value"


def _what_the_rank_sees(rank: int, world_size: int) -> dict:
    return {
        "marker": _SET_BY_THE_PARENT,
        "seed": torch.initial_seed(),
        "rank": torch.distributed.get_rank(),
        "world": world_size,
        "pid": os.getpid(),
    }


@pytest.mark.multiproc
def test_gloo_ranks_are_forked_with_their_own_seed(monkeypatch):
    monkeypatch.setattr(f"{__name__}._SET_BY_THE_PARENT", "set at run time")
    parent_seed = torch.initial_seed()
    got = run_distributed(_what_the_rank_sees, 2, timeout_s=60)
    # a forked child sees the parent's memory (a spawned one would re-import this module)
    assert [g["marker"] for g in got] == ["set at run time"] * 2
    assert [(g["rank"], g["world"]) for g in got] == [(0, 2), (1, 2)]
    seeds = {g["seed"] for g in got}
    assert len(seeds) == 2 and parent_seed not in seeds  # reseeded per rank, not the parent's generator
    assert len({g["pid"] for g in got} | {os.getpid()}) == 3


@pytest.mark.multiproc
def test_spawn_is_still_available(monkeypatch):
    monkeypatch.setattr(f"{__name__}._SET_BY_THE_PARENT", "set at run time")
    got = run_distributed(_what_the_rank_sees, 2, timeout_s=120, start_method="spawn")
    assert [g["marker"] for g in got] == ["import-time value"] * 2
    assert [g["rank"] for g in got] == [0, 1]


def test_default_start_method_per_backend():
    assert default_start_method("gloo") == "fork"
    assert default_start_method("nccl") == "spawn"


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method 'teleport'"):
        run_distributed(_what_the_rank_sees, 2, start_method="teleport")


def _collect_garbage(rank: int, world_size: int) -> int:
    import gc

    return gc.collect() >= 0  # frees whatever the fork copied that is garbage


@pytest.mark.multiproc
def test_a_destroyed_process_group_left_in_a_cycle_does_not_hang_the_forked_ranks(monkeypatch):
    """An in-process run's process group, destroyed by the test teardown but still held in a reference cycle
    (Lightning's strategy and mesh objects), was copied into every forked rank; the rank's garbage collector
    then destroyed it there and joined gloo threads that do not exist in the child: the rank hung (the
    2-rank `speechlm evaluate` test timed out in the full suite). run_distributed collects before forking."""
    import torch.distributed as dist

    from parallel.testing import find_free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cycle: list = [dist.group.WORLD]
    cycle.append(cycle)  # garbage only the cyclic collector frees
    dist.destroy_process_group()
    del cycle
    assert run_distributed(_collect_garbage, 2, timeout_s=60) == [True, True]
