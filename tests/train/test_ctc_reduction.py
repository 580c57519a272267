"""`model.ctc_reduction` (issue 25, long-form audio): the step divides the auxiliary CTC sum by its clips
(`clip`, the default) or by their CTC target tokens (`token`), agreed over the data-parallel ranks like the
other normalisers; per token, a 35 s clip no longer outweighs the short clips beside it by its length."""

from __future__ import annotations

import pytest
import torch
from parallel_harness import build_model, global_steps, tiny_config

from speechlm.train.schedule import build_optimizer
from speechlm.train.step import StepContext, agree_step, count_ctc_tokens, run_optimizer_step


@pytest.mark.parametrize("reduction", ["clip", "token"])
def test_the_step_divides_the_ctc_sum_by_the_chosen_normaliser(reduction):
    cfg = tiny_config(overrides=(f"model.ctc_reduction={reduction}",))
    batch = global_steps(1, 1, batches="long")[0][0]
    model = build_model(cfg)
    ctc_sum = float(model(batch).ctc_sum.detach())
    counts = agree_step(model, [batch], StepContext()).counts
    targets = int((batch.token_lens - 1).clamp(min=0).sum())  # the language tag is not a CTC target
    assert counts.clips == len(batch) and counts.ctc_tokens == targets == count_ctc_tokens(batch, 1)
    model = build_model(cfg)
    opt, sched = build_optimizer(model, cfg)
    res = run_optimizer_step(model, [batch], StepContext(), opt, sched, cfg, step=0)
    expected = ctc_sum / (targets if reduction == "token" else len(batch))
    assert res["ctc"] == pytest.approx(expected, rel=1e-5)
    assert res["loss"] == pytest.approx(res["ce"] + 0.3 * expected, rel=1e-5)
    assert res["utterances"] == len(batch)


def test_conversation_batches_count_the_targets_of_clips_with_a_transcript():
    batch = global_steps(1, 1, batches="conversations")[0][0]
    lens = batch.ctc_token_lens
    assert count_ctc_tokens(batch, 1) == int((lens[lens > 0] - 1).clamp(min=0).sum())
    assert count_ctc_tokens(batch, 0) == int(lens.sum())
    no_ctc = type(batch)(**{**batch.__dict__, "ctc_token_lens": None})
    assert count_ctc_tokens(no_ctc, 1) == 0
    assert torch.is_tensor(lens)
