"""Layout equivalence: losses of 3 optimizer steps and gradients after the first match one process.

Gradients are compared per parameter tensor in norm (see `assert_matches`). Every layout runs the training step of `speechlm.train.module.run_optimizer_step` with the real mesh,
TP plan, FSDP2, distributed audio encoding and CP attention, on gloo/CPU. fp32, relative 1e-5.
The 8-process layout (2, 2, 2) is marked `slow`; every other layout, and the all-gather backend,
is in the default run.
"""

from __future__ import annotations

import functools

import pytest
import torch
from parallel_harness import global_steps, rank_run, reference_run, tiny_config

from parallel.testing import run_distributed

N_STEPS = 3
RTOL = 1e-5


@functools.cache
def reference(dp: int) -> dict:
    steps = global_steps(N_STEPS, dp)
    # one process consumes every data-parallel share of a step as micro-batches of one optimizer step
    return reference_run(tiny_config(), steps)


def assert_matches(ref: dict, got: list[dict]) -> None:
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
    assert any(n.startswith("encoder.") and grads[n].abs().sum() > 0 for n in grads)
    assert any(n.startswith("projector.") and grads[n].abs().sum() > 0 for n in grads)


LAYOUTS = [
    pytest.param(2, 1, 1, "ring", id="dp2"),
    pytest.param(1, 2, 1, "ring", id="cp2-ring"),
    pytest.param(1, 1, 2, "ring", id="tp2"),
    pytest.param(1, 2, 1, "allgather", id="cp2-allgather"),
    pytest.param(1, 2, 2, "ring", id="cp2-tp2"),
    pytest.param(1, 4, 1, "ring", id="cp4"),
    pytest.param(2, 2, 1, "ring", id="dp2-cp2"),
    pytest.param(2, 2, 2, "ring", id="dp2-cp2-tp2", marks=pytest.mark.slow),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("dp,cp,tp,kind", LAYOUTS)
def test_layout_matches_single_process(dp, cp, tp, kind):
    world = dp * cp * tp
    got = run_distributed(rank_run, world, "gloo", cp, tp, kind, N_STEPS, timeout_s=600)
    assert_matches(reference(dp), got)


def test_reference_losses_fall_and_grads_cover_every_part():
    """Sanity of the harness itself: the reference learns and every trainable piece gets a gradient."""
    ref = reference(2)
    assert ref["losses"][2] < ref["losses"][0]
    names = set(ref["grads"])
    for prefix in ("encoder.", "projector.", "llm.", "ctc_head."):
        assert any(n.startswith(prefix) for n in names), prefix


# Dynamic CP (parallel.cp_placement): the layouts above use the harness' threshold of 9 tokens, which mixes
# whole and split utterances (the harness' sequences are 6-12 tokens). These pin the two ends and the cases
# the placement must survive (see test_harness_batches_cover_the_dynamic_cp_cases).
DYNAMIC = [
    pytest.param(1, 2, 1, 0, id="cp2-split-all"),
    pytest.param(1, 2, 1, 1000, id="cp2-all-whole"),
    pytest.param(1, 4, 1, 0, id="cp4-split-all"),
    pytest.param(1, 4, 1, 1000, id="cp4-all-whole"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("dp,cp,tp,threshold", DYNAMIC)
def test_dynamic_cp_extremes_match_single_process(dp, cp, tp, threshold):
    got = run_distributed(
        rank_run, dp * cp * tp, "gloo", cp, tp, "ring", N_STEPS, split_threshold=threshold, timeout_s=600
    )
    assert_matches(reference(dp), got)


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
    assert any(any(p.split) and not p.whole_indices(r) for p in mixed4 for r in range(4))  # a rank with none whole
    whole4 = [place_sequences(s, 4, threshold=1000) for s in lens]
    assert any(not any(p.split) for p in whole4) and any(any(p.split) for p in whole4)  # forced split when < 4
    assert all(all(p.split) for p in (place_sequences(s, 2, threshold=0) for s in lens))
