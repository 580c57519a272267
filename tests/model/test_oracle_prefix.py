"""The oracle prefix (`model.audio_prefix: oracle`, issue 38): the transcript's own embeddings in the audio
rows, through the training forward and greedy decoding. Random transcripts cannot be guessed from the
language, so a decoder that copies them reads its prefix: a defect anywhere on the path (splice, packing,
positions, masks, the decoder's prompt) keeps it from copying."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from speechlm.model.oracle import apply_oracle
from tests.model.test_audio_compression import ALIGNED
from tests.model.test_model import LANG, VOCAB, build_tiny_model, make_audio, micro_losses

ORACLE_ALIGNED = dict(ALIGNED, audio_prefix="oracle")


def random_transcripts(n: int, g: torch.Generator, *, longest: int = 9) -> SimpleNamespace:
    """A batch of ``n`` short clips whose transcripts are random tokens (language tag first)."""
    lens = torch.randint(4, longest + 1, (n,), generator=g)
    tokens = torch.zeros(n, longest, dtype=torch.long)
    for i, k in enumerate(lens.tolist()):
        tokens[i, 0] = LANG
        tokens[i, 1:k] = torch.randint(10, VOCAB, (k - 1,), generator=g)
    audio, audio_lens = make_audio([1600] * n, seed=int(torch.randint(0, 1000, (1,), generator=g)))
    return SimpleNamespace(
        audio=audio,
        audio_lens=audio_lens,
        tokens=tokens,
        token_lens=lens,
        ctc_tokens=tokens,
        ctc_token_lens=lens,
    )


def test_the_oracle_replaces_each_clip_by_its_transcript():
    model = build_tiny_model(**ORACLE_ALIGNED)
    batch = random_transcripts(3, torch.Generator().manual_seed(0))
    enc = model.encode_audio(batch.audio, batch.audio_lens)
    apply_oracle(enc, model.embed_tokens, batch.tokens, batch.token_lens, skip=1, one_row_per_token=True)
    for c in range(3):
        ids = batch.tokens[c, 1 : int(batch.token_lens[c])]
        torch.testing.assert_close(enc.embeds[c], model.embed_tokens(ids))
    assert len(enc.unused) == 3  # the projected audio stays in the graph with weight 0
    # without compression the clip keeps its rows: tokens first, zeros after
    model = build_tiny_model(audio_prefix="oracle")
    enc = model.encode_audio(batch.audio, batch.audio_lens)
    rows = [int(e.shape[0]) for e in enc.embeds]
    apply_oracle(enc, model.embed_tokens, batch.tokens, batch.token_lens, skip=1, one_row_per_token=False)
    assert [int(e.shape[0]) for e in enc.embeds] == rows
    n = int(batch.token_lens[0]) - 1
    assert float(enc.embeds[0][n:].abs().sum()) == 0.0


@pytest.mark.parametrize("packed", [True, False], ids=["thd", "bshd"])
def test_oracle_losses_agree_across_layouts(packed):
    model = build_tiny_model(**ORACLE_ALIGNED)
    batch = random_transcripts(4, torch.Generator().manual_seed(1))
    ref = micro_losses(model, batch, packed=True)
    got = micro_losses(model, batch, packed=packed, cp=2, tp=2)  # rounding as cp 2 x tp 2 would
    torch.testing.assert_close(got.ce_sum, ref.ce_sum, atol=1e-4, rtol=1e-5)
    assert got.n_labelled == ref.n_labelled == int(batch.token_lens.sum()) + 4  # + the stop token


def test_a_decoder_learns_to_copy_its_oracle_prefix():
    """A 2-layer decoder from scratch, aligned positions: trained on random transcripts, it copies unseen
    ones through greedy decoding (the same oracle rows and positions as training)."""
    torch.manual_seed(0)
    model = build_tiny_model(**ORACLE_ALIGNED)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    model.train()
    for _ in range(180):  # 16 of 16 copied at step 180 (sequential positions: 0 at step 400)
        out = model(random_transcripts(8, g))
        opt.zero_grad()
        (out.ce_sum / out.n_labelled).backward()
        opt.step()
    model.eval()
    held_out = random_transcripts(16, torch.Generator().manual_seed(99))
    hyps = model.generate_for_batch(held_out, max_new_tokens=12)
    refs = [held_out.tokens[i, : int(held_out.token_lens[i])].tolist() for i in range(16)]
    exact = sum(h == r for h, r in zip(hyps, refs))
    assert exact >= 12, (exact, hyps[:3], refs[:3])
    with pytest.raises(ValueError, match="oracle decodes from the transcript"):
        model.generate_greedy(held_out.audio, held_out.audio_lens, max_new_tokens=4)


def test_oracle_warmup_fills_the_first_steps_with_the_transcripts():
    from speechlm.config import ExperimentConfig
    from speechlm.train.schedule import oracle_prefix_runs

    cfg = ExperimentConfig()
    cfg.model.oracle_warmup_steps = 3
    assert [oracle_prefix_runs(s, cfg) for s in range(5)] == [True, True, True, False, False]
    batch = random_transcripts(3, torch.Generator().manual_seed(4))
    warm = build_tiny_model(**ALIGNED)
    always = build_tiny_model(**ORACLE_ALIGNED)  # same seed: same weights
    torch.testing.assert_close(warm(batch, oracle=True).ce_sum, always(batch).ce_sum)
    assert float((warm(batch).ce_sum - always(batch).ce_sum).abs()) > 1e-3  # after the warm-up: the audio
