"""The weight-0 dummy micro-batch (`speechlm.model.micro_losses`): what an all-dropped micro-batch runs so
every rank issues the same collectives. The model layer builds it without importing the data layer."""

from __future__ import annotations

import torch

from parallel.frames import DUMMY_CLIP_SAMPLES, SAMPLE_RATE
from speechlm.data.batch import Batch
from speechlm.model.micro_losses import make_dummy_batch


def test_the_dummy_of_an_empty_batch_is_one_clip_of_silence_and_one_eos_token():
    dummy = make_dummy_batch(Batch.empty(dropped={"undecodable": 2}), eos_id=7)
    assert isinstance(dummy, Batch) and len(dummy) == 1 and dummy.indices == [-1]
    assert dummy.audio.shape == (1, DUMMY_CLIP_SAMPLES) and not dummy.audio.any()
    assert dummy.audio_lens.tolist() == [DUMMY_CLIP_SAMPLES]
    assert dummy.tokens.tolist() == [[7]] and dummy.token_lens.tolist() == [1]
    assert dummy.dropped == {}  # the empty batch's drops stay counted on it, not on its dummy
    assert torch.allclose(dummy.durations, torch.tensor([DUMMY_CLIP_SAMPLES / SAMPLE_RATE]))
