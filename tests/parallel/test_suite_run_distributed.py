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
