"""CTC-compressed audio rows (`model.audio_compression: ctc`), aligned audio positions
(`model.audio_positions: aligned`) and the oracle prefix (`model.audio_prefix: oracle`), issue 38."""

from __future__ import annotations

import pytest
import torch

from speechlm.config import ModelConfig
from speechlm.model.compression import compress_frames, compressed_output, ctc_runs, heard_tokens
from speechlm.model.conversation_inputs import as_conversation, conversation_prompts
from speechlm.model.generation import decode, prompt_positions, splice_prompts
from speechlm.packing.positions import align_audio_positions
from speechlm.packing.thd import pack_bshd, pack_thd, plan_thd
from tests.model.test_model import AUDIO, EOS, LANG, build_tiny_model, make_batch, micro_losses

COMPRESSED = dict(audio_compression="ctc", projector_stack=1)
ALIGNED = dict(COMPRESSED, audio_positions="aligned")


def test_runs_drop_blanks_merge_repeats_and_cut_at_clip_boundaries():
    blank = 0
    # clip 0: _ 3 3 _ 4 4 4 _ | clip 1: all blank | clip 2: 5 5 _ 5 | clip 3: empty | clip 4: 5 (same label
    # as clip 2's last frame: a new clip starts a new run)
    labels = torch.tensor([0, 3, 3, 0, 4, 4, 4, 0, 0, 0, 0, 5, 5, 0, 5, 5])
    lens = torch.tensor([8, 3, 4, 0, 1])
    row_of_frame, rows_B, frames_of_row = ctc_runs(labels, lens, blank)
    assert rows_B.tolist() == [2, 1, 2, 0, 1]
    assert row_of_frame.tolist() == [-1, 0, 0, -1, 1, 1, 1, -1, 2, 2, 2, 3, 3, -1, 4, 5]
    assert frames_of_row.tolist() == [2, 3, 3, 2, 1, 1]
    frames = torch.arange(16.0)[:, None].repeat(1, 3).requires_grad_(True)
    rows, rows_B2 = compress_frames(frames, labels, lens, blank)
    assert rows_B2.tolist() == rows_B.tolist()
    # each row is the mean of its run; the silent clip's one row is the mean of all its frames
    assert rows[:, 0].tolist() == [1.5, 5.0, 9.0, 11.5, 14.0, 15.0]
    rows.sum().backward()
    grad = frames.grad[:, 0].tolist()
    assert grad[0] == 0.0 and grad[3] == 0.0 and grad[13] == 0.0  # dropped blanks get no gradient
    assert grad[1] == 0.5 and grad[4] == pytest.approx(1 / 3) and grad[15] == 1.0


def test_aligned_positions_put_row_k_at_the_answer_token_it_stands_for():
    # seq 0: bos a a a tag y y y eos | seq 1: bos a a tag y y (one row of rounding padding)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6])
    audio = torch.tensor([0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]).bool()
    target = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]).bool()
    seq = torch.tensor([0] * 9 + [1] * 7)
    out = align_audio_positions(pos, audio, target, seq, [3, 2], [9, 6], skip=1)
    # row k sits at the position of the k-th token after the tag (the tag at 4 and 3)
    assert out.tolist() == [0, 5, 6, 7, 4, 5, 6, 7, 8, 0, 4, 5, 3, 4, 5, 6]
    # no answer after a clip in its own sequence (a generation prompt): from the sequence's next position
    none = align_audio_positions(pos, audio, torch.zeros(16, dtype=torch.bool), seq, [3, 2], [9, 6], skip=1)
    assert none.tolist() == [0, 10, 11, 12, 4, 5, 6, 7, 8, 0, 7, 8, 3, 4, 5, 6]


def test_thd_and_bshd_lay_out_the_same_aligned_positions():
    prompts = [
        (torch.tensor([2, AUDIO, LANG, 9, 10, EOS]), torch.tensor([0, 0, 1, 1, 1, 1]).bool()),
        (torch.tensor([2, AUDIO, LANG, 11, EOS]), torch.tensor([0, 0, 1, 1, 1]).bool()),
    ]
    lens = [3, 0]  # the second clip compressed to nothing (no frame heard, and no frame at all)
    thd = plan_thd(prompts, lens, audio_id=AUDIO, align_skip=1)
    assert thd.position_ids_T.tolist() == [0, 5, 6, 7, 4, 5, 6, 7, 0, 1, 2, 3]
    bshd = pack_bshd(
        prompts,
        [torch.zeros(n, 8) for n in lens],
        lambda i: torch.zeros(*i.shape, 8),
        audio_id=AUDIO,
        align_skip=1,
    )
    assert bshd.position_ids[0].tolist() == [0, 5, 6, 7, 4, 5, 6, 7]
    assert bshd.position_ids[1, :4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("settings", [COMPRESSED, ALIGNED], ids=["compressed", "aligned"])
def test_compressed_thd_and_bshd_agree_and_train_every_part(settings):
    model = build_tiny_model(**settings)
    model.train()
    batch = make_batch()
    enc = model.encode_audio(batch.audio, batch.audio_lens)
    rows = [int(e.shape[0]) for e in enc.embeds]
    frames = enc.enc_lens_B.tolist()
    assert all(1 <= r <= f for r, f in zip(rows, frames)) and rows != frames  # compressed, never empty
    thd = micro_losses(model, batch, packed=True)
    bshd = micro_losses(model, batch, packed=False)
    torch.testing.assert_close(thd.ce_sum, bshd.ce_sum, atol=1e-4, rtol=1e-5)
    # the plan and the FLOP count see the compressed lengths: what the LLM computed
    prompts, _ = conversation_prompts(as_conversation(batch, model.prompt), model.audio_id)
    assert thd.placed is not None
    assert thd.placed.seq_lens == [len(ids) - 1 + r for (ids, _), r in zip(prompts, rows)]
    assert thd.placed.computed_tokens == sum(thd.placed.seq_lens)
    (thd.ce_sum + thd.ctc_sum).backward()
    for name, module in (("encoder", model.encoder), ("projector", model.projector), ("ctc", model.ctc_head)):
        grads = [p.grad for p in module.parameters() if p.requires_grad]
        assert grads and all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0, (
            name
        )


def test_compression_needs_its_settings():
    assert any("projector_stack=1" in p for p in ModelConfig(audio_compression="ctc").problems())
    assert any(
        "ctc_weight > 0" in p
        for p in ModelConfig(audio_compression="ctc", projector_stack=1, ctc_weight=0).problems()
    )
    assert any("audio_compression=ctc" in p for p in ModelConfig(audio_positions="aligned").problems())
    assert ModelConfig(**ALIGNED).problems() == []


def _teacher_forced_logits(model, batch) -> list[torch.Tensor]:
    """The training forward's logits at every answer position, per row."""
    conv = as_conversation(batch, model.prompt)
    prompts, _ = conversation_prompts(conv, model.audio_id)
    enc = model.encode_audio(batch.audio, batch.audio_lens)
    packed = pack_thd(prompts, enc.embeds, model.embed_tokens, audio_id=AUDIO, align_skip=model.align_skip)
    logits = model.forward_packed(packed, return_logits=True)
    out = []
    for b, (_ids, mask) in enumerate(prompts):
        start = int(packed.cu_seqlens[b])
        rows = int(enc.embeds[b].shape[0])
        first = int(torch.nonzero(mask).flatten()[0])  # the answer's first token (the tag) in the prompt
        at = start + first - 1 + rows - 1  # the row before it, audio expanded
        out.append(logits[at : at + int(mask.sum())])
    return out


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "recompute"])
def test_decoding_sees_the_positions_training_laid_out(use_cache):
    """Greedy decoding, fed the reference tokens, computes the training forward's logits at every answer
    position: its prompt positions (`prompt_positions`) are training's aligned ones."""
    model = build_tiny_model(**ALIGNED)
    model.eval()
    batch = make_batch()
    with torch.no_grad():
        want = _teacher_forced_logits(model, batch)
        enc = model.encode_audio(batch.audio, batch.audio_lens)
        head_ids, tail_ids = model.prompt.generation_prompt
        head = torch.tensor([*head_ids, model.audio_id, *tail_ids])
        clips = [[e] for e in enc.embeds]
        rows = splice_prompts(model, [head] * 3, clips, torch.device("cpu"))
        positions = prompt_positions(model, [head] * 3, None, clips)
        assert positions is not None
        refs = [[LANG, *batch.tokens[b, 1 : int(batch.token_lens[b])].tolist(), EOS] for b in range(3)]
        seen: dict[int, list[torch.Tensor]] = {b: [] for b in range(3)}

        def pick(rows_: list[int], logits: torch.Tensor) -> torch.Tensor:
            ids = []
            for j, b in enumerate(rows_):
                seen[b].append(logits[j].clone())
                ids.append(refs[b][len(seen[b]) - 1])
            return torch.tensor(ids)

        decode(model, rows, 16, use_cache=use_cache, keep_going=None, pick=pick, positions=positions)
    for b in range(3):
        got = torch.stack(seen[b])
        torch.testing.assert_close(got, want[b][: got.shape[0]], atol=1e-4, rtol=1e-4)


def test_token_embedding_adds_the_heard_token_to_each_row():
    labels = torch.tensor([0, 3, 3, 0, 4, 4, 4, 0, 0, 0, 0, 5, 5, 0, 5, 5])
    assert heard_tokens(labels, torch.tensor([8, 3, 4, 0, 1]), 0).tolist() == [3, 4, -1, 5, 5, 5]
    model = build_tiny_model(**ALIGNED)
    batch = make_batch()
    plain = model.encode_audio(batch.audio, batch.audio_lens)
    with_tokens = build_tiny_model(**ALIGNED, audio_token_embedding=True).encode_audio(
        batch.audio, batch.audio_lens
    )
    frames = plain.enc_hidden.data_UE
    heard = heard_tokens(model.ctc_head(frames).argmax(-1), plain.enc_lens_B, model.ctc_blank_id)
    tokens = model.embed_tokens(heard.clamp(min=0)) * (heard >= 0)[:, None]
    # the projected frames come in through a gate that starts at 0 (the model's `audio_gate`)
    torch.testing.assert_close(torch.cat(with_tokens.embeds), tokens + 0.0 * torch.cat(plain.embeds))
    gate = torch.full((1,), 0.5)
    gated = compressed_output(
        model.ctc_head,
        model.projector,
        model.ctc_blank_id,
        frames,
        plain.enc_lens_B,
        True,
        model.embed_tokens,
        gate,
    )
    torch.testing.assert_close(torch.cat(gated.embeds), tokens + 0.5 * torch.cat(plain.embeds))
    assert build_tiny_model(**ALIGNED, audio_token_embedding=True).audio_gate is not None
    assert build_tiny_model(**ALIGNED).audio_gate is None  # no new parameter otherwise
    assert any("audio_compression=ctc" in p for p in ModelConfig(audio_token_embedding=True).problems())
