"""A long-form utterance packs as one THD sequence (issue 25, item 1): a 60-minute clip's audio tokens and a
transcript of thousands of tokens become one sequence of the stream, labels shifted within it only."""

from __future__ import annotations

import numpy as np
import torch

from speechlm.data.sampler.cost import TokenCostModel
from speechlm.packing.prompt import build_prompt
from speechlm.packing.thd import IGNORE_INDEX, pack_thd

BOS, EOS, AUDIO = 1, 2, 0


def test_a_sixty_minute_clip_with_a_long_transcript_packs_as_one_thd_sequence():
    audio_tokens = int(TokenCostModel(prompt_tokens=0).count_tokens(np.array([3600.0]))[0])  # 22,500
    transcript = torch.randint(3, 300, (6000,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = build_prompt(transcript, bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    short = build_prompt([7, 8, 9], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    audio = [torch.randn(audio_tokens, 4), torch.randn(5, 4)]
    embed = torch.nn.Embedding(300, 4)
    for cp in (1, 2, 4):
        batch = pack_thd([prompt, short], audio, embed, audio_id=AUDIO, cp=cp)
        real = 1 + audio_tokens + len(transcript) + 1  # bos, audio, transcript, eos
        cu = batch.cu_seqlens.tolist()
        assert batch.seq_lens[0] == real and cu[1] - cu[0] == batch.max_seqlen >= real
        assert (cu[1] - cu[0]) % (2 * cp if cp > 1 else 1) == 0
        first = batch.labels[cu[0] : cu[1]]
        # the last audio slot predicts the first transcript token; the transcript then predicts itself + eos
        assert first[audio_tokens : audio_tokens + len(transcript) + 1].tolist() == [*transcript, EOS]
        assert (first[:audio_tokens] == IGNORE_INDEX).all() and (first[real - 1 :] == IGNORE_INDEX).all()
        assert batch.position_ids[cu[0] : cu[1]].tolist() == list(range(cu[1] - cu[0]))
        torch.testing.assert_close(batch.inputs_embeds[1 : 1 + audio_tokens], audio[0])
        assert batch.num_labelled() == len(transcript) + 1 + 4  # and the short one's 3 tokens + eos
