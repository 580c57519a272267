"""Layout equivalence: losses of 3 optimizer steps and gradients after the first match one process.

Gradients are compared per parameter tensor in norm (see `assert_matches`). Every layout runs the training step of `speechlm.train.module.run_optimizer_step` with the real mesh,
TP plan, FSDP2, distributed audio encoding and CP attention, on gloo/CPU. fp32, relative 1e-5.
All layouts of one world size run in one process group, one after the other. The 8-process layout
(2, 2, 2) is marked `slow`; every other layout, and the all-gather backend, is in the default run. Each
check runs on gloo/CPU and, marked `gpu`, on NCCL/cuda (one GPU per rank).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from helpers import BACKENDS, skip_unless_backend
from parallel_harness import Layout, global_steps, rank_layouts, reference_run, tiny_config

from parallel.testing import run_distributed

N_STEPS = 3
RTOL = 1e-5


@functools.cache
def reference(dp: int) -> dict:
    steps = global_steps(N_STEPS, dp)
    # one process consumes every data-parallel share of a step as micro-batches of one optimizer step
    return reference_run(tiny_config(), steps)


def assert_matches(ref: dict, got: list[dict], trained: tuple[str, ...] = ("encoder.", "projector.")) -> None:
    """`trained`: parts that must receive a nonzero gradient (a frozen encoder receives none)."""
    for r, res in enumerate(got):
        assert res["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {r} losses"
    grads = got[0]["grads"]
    assert set(grads) == set(ref["grads"]), "the same parameters must receive gradients"
    # per parameter tensor, in norm: |g - g_ref| <= 1e-5 |g_ref|; gradients that are zero in exact arithmetic
    # (a key bias under softmax, a conv bias feeding BatchNorm) are rounding noise on both sides, so they
    # are held to 1e-6 of the global gradient norm instead
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in ref["grads"].values()))
    for name, g in ref["grads"].items():
        err = (grads[name].double() - g.double()).norm()
        bound = RTOL * g.double().norm() + 1e-6 * total
        assert err <= bound, f"{name}: |diff| {err:.3e} > {bound:.3e} (|grad| {g.norm():.3e})"
    # the encoder and projector are trained under every layout (a non-differentiable gather would zero them)
    for part in trained:
        assert any(n.startswith(part) and grads[n].abs().sum() > 0 for n in grads), part


# Every layout of one world size runs in one process group (one start, one rendezvous): a test per world
# size and backend. Dynamic CP (parallel.cp_placement): the harness' threshold of 9 tokens mixes whole and
# split utterances (the harness' sequences are 6-12 tokens); the *-split-all / *-all-whole layouts pin the
# two ends and the cases the placement must survive (see test_harness_batches_cover_the_dynamic_cp_cases).
LAYOUTS = [
    Layout("dp2", 2, 1, 1),
    Layout("cp2-ring", 1, 2, 1),
    Layout("tp2", 1, 1, 2),
    Layout("cp2-allgather", 1, 2, 1, "allgather"),
    Layout("cp2-split-all", 1, 2, 1, split_threshold=0),
    Layout("cp2-all-whole", 1, 2, 1, split_threshold=1000),
    Layout("cp2-tp2", 1, 2, 2),
    Layout("cp4", 1, 4, 1),
    Layout("dp2-cp2", 2, 2, 1),
    Layout("cp4-split-all", 1, 4, 1, split_threshold=0),
    Layout("cp4-all-whole", 1, 4, 1, split_threshold=1000),
    Layout("dp2-cp2-tp2", 2, 2, 2),
]


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_layouts_match_single_process(world, backend):
    skip_unless_backend(backend, world)
    layouts = [lay for lay in LAYOUTS if lay.world == world]
    got = run_distributed(rank_layouts, world, backend, layouts, N_STEPS, backend, timeout_s=1100)
    assert_layouts_match(layouts, got)


def assert_layouts_match(
    layouts: list[Layout], got: list, ref: Callable[[Layout], dict] | None = None
) -> None:
    """Every layout's results (``got[rank][i]`` for ``layouts[i]``) match one process (``ref(layout)``;
    default: `reference` of its dp), failures listed."""
    failed = []
    for i, lay in enumerate(layouts):
        try:
            want = ref(lay) if ref is not None else reference(lay.dp)
            assert_matches(want, [per_rank[i] for per_rank in got])
        except AssertionError as e:
            failed.append(f"{lay.id} (dp={lay.dp}, cp={lay.cp}, tp={lay.tp}, {lay.cp_attention}): {e}")
    assert not failed, "\n".join(failed)


def test_reference_losses_fall_and_grads_cover_every_part():
    """Sanity of the harness itself: the reference learns and every trainable piece gets a gradient."""
    ref = reference(2)
    assert ref["losses"][2] < ref["losses"][0]
    names = set(ref["grads"])
    for prefix in ("encoder.", "projector.", "llm.", "ctc_head."):
        assert any(n.startswith(prefix) for n in names), prefix


def test_harness_batches_cover_the_dynamic_cp_cases():
    """What the multi-process cases above and in LAYOUTS exercise, on the harness' own micro-batches."""
    from parallel_harness import build_model

    from parallel.cp_placement import place_sequences

    model = build_model(tiny_config())
    lens = []
    for step in global_steps(N_STEPS, 1):
        for b in step:
            audio = model.audio_embed_lengths(b.audio_lens)
            lens.append([2 + a + int(t) for a, t in zip(audio, b.token_lens.tolist())])
    mixed4 = [place_sequences(s, 4, threshold=9) for s in lens]
    assert any(any(p.split) and not all(p.split) for p in mixed4)  # whole and split in one micro-batch
    assert any(
        any(p.split) and not p.whole_indices(r) for p in mixed4 for r in range(4)
    )  # a rank with none whole
    whole4 = [place_sequences(s, 4, threshold=1000) for s in lens]
    assert any(not any(p.split) for p in whole4) and any(
        any(p.split) for p in whole4
    )  # forced split when < 4
    assert all(all(p.split) for p in (place_sequences(s, 2, threshold=0) for s in lens))
