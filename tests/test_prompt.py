"""Tests for speechlm.packing.prompt: prompt layout, target mask, batch helper."""

from __future__ import annotations

import pytest
import torch

from speechlm.packing import prompt
from speechlm.packing import thd as packing
from speechlm.packing.prompt import IGNORE_INDEX, build_prompt, build_prompts

BOS, EOS, AUDIO = 1, 2, 3


def test_ignore_index_has_one_definition():
    assert IGNORE_INDEX == -100
    assert prompt.IGNORE_INDEX is packing.IGNORE_INDEX


def test_build_prompt_layout_without_instruction():
    ids_L, mask_L = build_prompt([10, 11, 12], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    assert ids_L.dtype == torch.long and mask_L.dtype == torch.bool
    assert ids_L.tolist() == [BOS, AUDIO, 10, 11, 12, EOS]
    assert mask_L.tolist() == [False, False, True, True, True, True]


def test_build_prompt_layout_with_instruction():
    ids_L, mask_L = build_prompt([10, 11], bos_id=BOS, eos_id=EOS, audio_id=AUDIO, instruction_ids=[20, 21])
    assert ids_L.tolist() == [BOS, AUDIO, 20, 21, 10, 11, EOS]
    assert mask_L.tolist() == [False, False, False, False, True, True, True]


def test_build_prompt_empty_target_supervises_eos_only():
    ids_L, mask_L = build_prompt([], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    assert ids_L.tolist() == [BOS, AUDIO, EOS]
    assert mask_L.tolist() == [False, False, True]


@pytest.mark.parametrize("where", ["target_ids", "instruction_ids"])
def test_build_prompt_rejects_placeholder_in_text(where):
    kwargs = {"target_ids": [10], "instruction_ids": [20]}
    kwargs[where] = [AUDIO]
    with pytest.raises(ValueError, match=where):
        build_prompt(
            kwargs["target_ids"],
            bos_id=BOS,
            eos_id=EOS,
            audio_id=AUDIO,
            instruction_ids=kwargs["instruction_ids"],
        )


def test_build_prompts_uses_row_lengths():
    tokens_BL = torch.tensor([[10, 11, 12], [13, 0, 0], [0, 0, 0]])
    out = build_prompts(tokens_BL, torch.tensor([3, 1, 0]), bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    assert [ids.tolist() for ids, _ in out] == [
        [BOS, AUDIO, 10, 11, 12, EOS],
        [BOS, AUDIO, 13, EOS],
        [BOS, AUDIO, EOS],
    ]
    assert [m.sum().item() for _, m in out] == [4, 2, 1]


def test_build_prompts_rejects_bad_lengths():
    tokens_BL = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="one length per row"):
        build_prompts(tokens_BL, [1], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    with pytest.raises(ValueError, match="row 1"):
        build_prompts(tokens_BL, [1, 4], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
