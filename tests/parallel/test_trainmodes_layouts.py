"""Layout equivalence with LoRA and a frozen LLM: dp2 (FSDP2) and cp2 against one process.

The same harness as tests/parallel/test_parallel_equivalence.py (fp32, relative 1e-5, losses of 3
optimizer steps, gradients after the first), with `model.llm.train=lora` (adapters on every attention
and MLP projection, dropout 0), `model.llm.train=frozen` (dp2, tp2: the TP plan keeps requires_grad) and `model.encoder.train=frozen` (dp2, and cp2,
where the clips are encoded on one CP rank each and gathered without autograd). LoRA's B matrices start at zero, so the
first step's gradients reach B only; the losses of steps 2 and 3 depend on A's updates too. Frozen
parameters get no gradient under FSDP2 (none is reduce-scattered), so the sets of parameters with a
gradient must match the one-process run's, which has none on the frozen base. LoRA with TP is refused
by the validator (rule lora-with-tp, tests/parallel/test_validator.py).
"""

from __future__ import annotations

import pytest
from helpers import BACKENDS, skip_unless_backend
from parallel_harness import Layout, global_steps, rank_layouts, reference_run, tiny_config
from test_parallel_equivalence import N_STEPS, assert_matches

from parallel.testing import run_distributed

LORA = ("model.llm.train=lora", "model.llm.lora.rank=4", "model.llm.lora.dropout=0")
FROZEN = ("model.llm.train=frozen",)
FROZEN_ENCODER = ("model.encoder.train=frozen",)

LAYOUTS = [
    Layout("lora-dp2", 2, 1, 1, overrides=LORA),
    Layout("lora-cp2-ring", 1, 2, 1, overrides=LORA),
    Layout("lora-cp2-allgather", 1, 2, 1, "allgather", overrides=LORA),
    Layout("frozen-dp2", 2, 1, 1, overrides=FROZEN),
    Layout("frozen-tp2", 1, 1, 2, overrides=FROZEN),
    Layout("frozen-encoder-dp2", 2, 1, 1, overrides=FROZEN_ENCODER),
    Layout("frozen-encoder-cp2", 1, 2, 1, overrides=FROZEN_ENCODER),
]


def reference(lay: Layout) -> dict:
    return reference_run(tiny_config(overrides=lay.overrides), global_steps(N_STEPS, lay.dp))


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_and_frozen_layouts_match_single_process(backend):
    skip_unless_backend(backend, 2)
    got = run_distributed(rank_layouts, 2, backend, LAYOUTS, N_STEPS, backend, timeout_s=800)
    failed = []
    for i, lay in enumerate(LAYOUTS):
        ref = reference(lay)
        grads = got[0][i]["grads"]
        try:
            frozen_encoder = lay.overrides == FROZEN_ENCODER
            assert_matches(
                ref,
                [per_rank[i] for per_rank in got],
                ("projector.",) if frozen_encoder else ("encoder.", "projector."),
            )
            llm = {n for n in grads if n.startswith("llm.")}
            if lay.overrides in (LORA, FROZEN):  # the rows of the added tokens (AddedTokenRows) train
                assert {"added_rows.emb", "added_rows.head"} <= set(grads), sorted(grads)[:5]
            if lay.overrides == LORA:
                assert llm and all(".lora_A." in n or ".lora_B." in n for n in llm), sorted(llm)
            elif lay.overrides == FROZEN:
                assert not llm, f"frozen LLM parameters got gradients: {sorted(llm)[:3]}"
            else:
                assert not any(n.startswith("encoder.") for n in grads), "a frozen encoder got gradients"
        except AssertionError as e:
            failed.append(f"{lay.id}: {e}")
    assert not failed, "\n".join(failed)
