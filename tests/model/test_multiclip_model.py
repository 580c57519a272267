"""SpeechLLM on conversation batches (several clips per sample, per-sample prompts): forward, CTC per
clip, the step's counts and greedy answers, against the one-clip path where the two must agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multiclip_helpers import EOS, make_conv_batch, transcription_pair
from parallel_harness import VOCAB, build_model, make_batch, tiny_config

from parallel.cp_layout import NullCPLayout
from speechlm.model.conversation_inputs import conversation_prompts, last_target_start
from speechlm.model.micro_losses import count_targets
from speechlm.packing.thd import pack_thd
from speechlm.train.step import count_ctc_clips


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config())


def _losses(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch)
    (out.ce_sum + out.ctc_sum).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("packed", [True, False])
def test_transcription_rows_give_the_legacy_losses_and_gradients(model, packed):
    model.cfg = dataclasses.replace(model.cfg, packed_sequences=packed)
    try:
        legacy = make_batch(3, 4)
        conv = transcription_pair(legacy)
        assert conv.prompt_ids is not None and conv.clip_sample.tolist() == [0, 1, 2, 3]
        ref, ref_grads = _losses(model, legacy)
        got, grads = _losses(model, conv)
    finally:
        model.cfg = dataclasses.replace(model.cfg, packed_sequences=True)
    assert got.ce_sum.item() == pytest.approx(ref.ce_sum.item(), rel=1e-6, abs=1e-6)
    assert got.ctc_sum.item() == pytest.approx(ref.ctc_sum.item(), rel=1e-6, abs=1e-6)
    assert (got.n_labelled, got.n_clips) == (ref.n_labelled, ref.n_clips)
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_multiclip_forward_same_in_thd_bshd_and_cp_rounding(model):
    batch = make_conv_batch(7, 4, VOCAB)
    assert batch.audio.shape[0] > len(batch)  # several clips per row
    thd = model(batch)
    model.cfg = dataclasses.replace(model.cfg, packed_sequences=False)
    try:
        bshd = model(batch)
    finally:
        model.cfg = dataclasses.replace(model.cfg, packed_sequences=True)
    model.set_cp_layout(NullCPLayout(round_cp=2, tp=2))  # every sequence padded as for cp2 x tp2
    try:
        rounded = model(batch)
    finally:
        model.set_cp_layout(NullCPLayout(tp=1, pad_to_multiple=model.cfg.pad_to_multiple))
    for other in (bshd, rounded):
        assert other.ce_sum.item() == pytest.approx(thd.ce_sum.item(), rel=1e-5)
        assert other.n_labelled == thd.n_labelled
    assert thd.n_labelled == int(batch.prompt_mask.sum()) == count_targets(batch, model)


def test_ctc_is_per_clip_and_clips_without_transcript_count_nothing(model):
    batch = make_conv_batch(11, 3, VOCAB)
    lens = batch.ctc_token_lens
    assert bool((lens == 0).any()) and bool((lens > 0).any())
    out = model(batch)
    assert out.n_clips == int((lens > 0).sum()) == count_ctc_clips(batch)
    enc = model.encode_audio(batch.audio, batch.audio_lens)
    keep = torch.nonzero(lens > 0).flatten()
    total = torch.zeros(())
    for c in keep.tolist():
        one = model.encode_audio(
            batch.audio[c : c + 1, : int(batch.audio_lens[c])], batch.audio_lens[c : c + 1]
        )
        s, _ = model.ctc_loss_sum(
            one.enc_hidden, one.enc_lens_B, batch.ctc_tokens[c : c + 1], lens[c : c + 1]
        )
        total = total + s
    assert out.ctc_sum.item() == pytest.approx(total.item(), rel=1e-5)
    assert len(enc.embeds) == batch.audio.shape[0]


def test_clips_without_any_transcript_keep_the_ctc_head_in_the_graph(model):
    batch = make_conv_batch(11, 3, VOCAB)
    batch.ctc_token_lens = torch.zeros_like(batch.ctc_token_lens)
    model.zero_grad(set_to_none=True)
    out = model(batch)
    assert out.ctc_sum.item() == 0.0 and out.n_clips == 0 == count_ctc_clips(batch)
    (out.ce_sum + out.ctc_sum).backward()
    assert model.ctc_head.weight.grad is not None and float(model.ctc_head.weight.grad.abs().sum()) == 0.0


def test_inconsistent_conversation_fields_are_clear_errors(model):
    batch = make_conv_batch(7, 2, VOCAB)
    bad = dataclasses.replace(batch, clip_sample=batch.clip_sample.flip(0))
    with pytest.raises(ValueError, match="non-decreasing"):
        model(bad)
    bad = dataclasses.replace(batch, clip_sample=batch.clip_sample[:-1])
    with pytest.raises(ValueError, match="clip_sample has"):
        model(bad)
    bad = dataclasses.replace(batch, clip_sample=torch.zeros_like(batch.clip_sample), indices=[40, 41])
    with pytest.raises(
        ValueError, match=r"row 0 \(manifest row 40\): its prompt holds 2 audio placeholders .* 5 clip"
    ):
        model(bad)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_for_batch_equals_generate_greedy_on_transcription_rows(model, use_cache):
    legacy = make_batch(5, 3)
    want = model.generate_greedy(legacy.audio, legacy.audio_lens, max_new_tokens=6, use_cache=use_cache)
    assert model.generate_for_batch(legacy, max_new_tokens=6, use_cache=use_cache) == want
    conv = transcription_pair(legacy)
    assert model.generate_for_batch(conv, max_new_tokens=6, use_cache=use_cache) == want


def test_generate_for_batch_starts_at_the_last_answer_of_multiclip_rows(model):
    torch.manual_seed(0)
    batch = make_conv_batch(4, 4, VOCAB)
    cached = model.generate_for_batch(batch, max_new_tokens=5)
    assert cached == model.generate_for_batch(batch, max_new_tokens=5, use_cache=False)
    # the first generated token is the argmax of a forward over the prompt cut where the last answer starts
    prompts, clip_sample = conversation_prompts(batch, model.audio_id)
    enc = model.encode_audio(batch.audio, batch.audio_lens)
    c = 0
    model.eval()
    for b, (ids, mask) in enumerate(prompts):
        k = clip_sample.count(b)
        start = last_target_start(mask)
        assert bool(mask[start:].any()) and not bool(mask[start - 1])
        head = (ids[:start], torch.zeros(start, dtype=torch.bool))
        n_head = int((ids[:start] == model.audio_id).sum())
        with torch.no_grad():
            packed = pack_thd(
                [head], enc.embeds_of(range(c, c + n_head)), model.embed_tokens, audio_id=model.audio_id,
                clip_counts=[n_head],
            )  # fmt: skip
            logits = model.forward_packed(packed, return_logits=True)
        first = int(logits[-1].argmax())
        assert cached[b][:1] == ([] if first == model.prompt.stop_id else [first])
        c += k
    model.train()


def test_last_target_start_finds_the_last_run():
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    assert last_target_start(mask) == 5
    with pytest.raises(ValueError, match="row 3: the prompt has no target"):
        last_target_start(torch.zeros(4, dtype=torch.bool), 3)


def test_rows_without_audio_train_and_a_batch_without_any_keeps_the_encoder_in_the_graph(model):
    mixed = make_conv_batch(7, 3, VOCAB, text_rows=1)
    assert 0 not in mixed.clip_sample.tolist()
    out = model(mixed)
    assert out.n_labelled == int(mixed.prompt_mask.sum()) and torch.isfinite(out.ce_sum)
    # the text row's loss is its own: the same as in a batch of its own
    text_only = make_conv_batch(7, 1, VOCAB, text_rows=1)
    assert text_only.audio.shape[0] == 0
    model.zero_grad(set_to_none=True)
    alone = model(text_only)
    rest_rows = dataclasses.replace(
        mixed,
        prompt_ids=mixed.prompt_ids[1:],
        prompt_mask=mixed.prompt_mask[1:],
        prompt_lens=mixed.prompt_lens[1:],
        clip_sample=mixed.clip_sample - 1,
        indices=mixed.indices[1:],
    )
    assert alone.ce_sum.item() + model(rest_rows).ce_sum.item() == pytest.approx(out.ce_sum.item(), rel=1e-5)
    (alone.ce_sum + alone.ctc_sum).backward()  # the dummy clip: encoder and projector in the graph, weight 0
    for part in (model.encoder, model.projector, model.ctc_head):
        grads = [p.grad for p in part.parameters() if p.requires_grad]
        assert grads and all(g is not None and float(g.abs().sum()) == 0.0 for g in grads)
    assert alone.n_clips == 0 and alone.ctc_sum.item() == 0.0
    assert len(model.generate_for_batch(text_only, max_new_tokens=3)) == 1


def test_the_training_step_normalises_by_assistant_tokens_and_clips_with_a_transcript():
    from parallel_harness import reference_run

    from speechlm.train.step import StepContext, agree_step

    cfg = tiny_config()
    batches = [make_conv_batch(21, 3, VOCAB), make_conv_batch(22, 2, VOCAB)]
    counts = agree_step(build_model(cfg), batches, StepContext()).counts
    assert counts.tokens == sum(int(b.prompt_mask.sum()) for b in batches)
    assert counts.clips == sum(int((b.ctc_token_lens > 0).sum()) for b in batches) > 0
    model = build_model(cfg)
    with torch.no_grad():
        outs = [model(b) for b in batches]
    ce = sum(float(o.ce_sum) for o in outs) / counts.tokens
    ctc = sum(float(o.ctc_sum) for o in outs) / counts.clips
    got = reference_run(cfg, [batches])["losses"][0]
    assert got == pytest.approx(ce + cfg.model.ctc_weight * ctc, rel=1e-6)


def test_two_answers_back_to_back_decode_from_the_second():
    """loss_turns=all labels two consecutive assistant turns as one run: the prompt is cut where the
    last answer (`Batch.tokens`) starts, not where the run starts."""
    from multiclip_helpers import collate, random_audio, renderer

    from speechlm.data.conversation import AudioRef, Clip, Conversation, Turn
    from speechlm.model.conversation_inputs import last_answer_start

    conv = Conversation(
        (
            Turn("user", (AudioRef(0), "w20")),
            Turn("assistant", ("w5 w30 w31",)),
            Turn("assistant", ("w40 w41",)),
        ),
        (Clip("a.wav"),),
    )
    audio, lens = random_audio(torch.Generator().manual_seed(3), 1)
    batch = collate([conv], audio, lens, renderer("all"))
    ids, mask = batch.prompt_ids[0], batch.prompt_mask[0]
    run = last_target_start(mask)
    second = last_answer_start(ids, mask, [40, 41])
    assert ids[run : run + 3].tolist() == [5, 30, 31] and ids[second : second + 2].tolist() == [40, 41]
    assert int(ids[second - 1]) == EOS and second > run
    assert last_answer_start(ids, mask, [40, 42]) == run  # not found: the run's start
    m = build_model(tiny_config())
    got = m.generate_for_batch(batch, max_new_tokens=4)
    cut = dataclasses.replace(
        batch,
        prompt_ids=ids[None, : second + 3],
        prompt_mask=torch.cat([torch.zeros(second, dtype=torch.bool), torch.ones(3, dtype=torch.bool)])[None],
        prompt_lens=torch.tensor([second + 3]),
    )  # the same context, the second answer alone labelled
    assert got == m.generate_for_batch(cut, max_new_tokens=4)
    whole_run = dataclasses.replace(batch, tokens=torch.tensor([[5, 30, 31]]), token_lens=torch.tensor([3]))
    assert m.generate_for_batch(whole_run, max_new_tokens=4) != got  # cut at the run: another context


@pytest.mark.parametrize("use_cache", [True, False])
def test_decoding_embeds_as_often_whatever_the_batch_holds(model, use_cache):
    """Under FSDP every `embed_tokens` call all-gathers the embedding: a rank decoding a multi-clip
    conversation batch and a rank decoding evaluation's one-clip dummy must make the same calls, or the
    rank with fewer waits forever (dp=2 final evaluation with a dropped batch hung)."""
    from speechlm.use.evaluator import dummy_batch

    calls: list[int] = []
    orig = model.embed_tokens
    model.embed_tokens = lambda ids: (calls.append(1), orig(ids))[1]
    try:
        counts = []
        for batch in (make_conv_batch(4, 4, VOCAB), dummy_batch(torch.device("cpu")), make_batch(5, 3)):
            calls.clear()
            # max_new_tokens=0: only the prompt is embedded (the decoding steps run in lockstep already)
            model.generate_for_batch(batch, max_new_tokens=0, use_cache=use_cache)
            counts.append(len(calls))
    finally:
        del model.embed_tokens
    assert counts[0] == counts[1] == counts[2] == 1


def test_joint_ctc_decoding_scores_transcription_rows_only(model):
    legacy = make_batch(5, 3)
    plain = model.generate_for_batch(transcription_pair(legacy), max_new_tokens=6)
    model.decode_ctc_weight = 0.8
    try:
        want = model.generate_greedy(legacy.audio, legacy.audio_lens, max_new_tokens=6)
        assert want != plain  # the CTC head's prefix scores change the transcripts
        conv = transcription_pair(legacy)
        assert model.generate_for_batch(conv, max_new_tokens=6) == want  # the conversation path joins alike
        # a translation row's answer is not its clip's transcript: the LLM alone decodes it
        tasks = ["asr", "ast", "asr", "ast", "ast"][: len(conv)]
        mixed = model.generate_for_batch(dataclasses.replace(conv, tasks=tasks), max_new_tokens=6)
        assert mixed == [w if t == "asr" else p for w, p, t in zip(want, plain, tasks)]
    finally:
        model.decode_ctc_weight = 0.0


def test_a_transcription_row_is_a_one_turn_conversation():
    """`as_conversation` (issue 37: one Batch shape): a batch of transcription rows becomes rows of rendered
    prompts, one clip each, the transcript its clip's CTC target; the model's loss is the same either way."""
    from speechlm.model.conversation_inputs import as_conversation
    from speechlm.packing.prompt import build_prompts

    model = build_model(tiny_config())
    batch = make_batch(0, 3)
    conv = as_conversation(batch, model.prompt)
    assert as_conversation(conv, model.prompt) is conv
    assert conv.clip_sample.tolist() == [0, 1, 2] and torch.equal(conv.ctc_token_lens, batch.token_lens)
    prompts, clip_sample = conversation_prompts(conv, model.audio_id)
    want = build_prompts(batch.tokens, batch.token_lens, prompt=model.prompt)
    assert clip_sample == [0, 1, 2]
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(prompts, want))
    torch.manual_seed(0)
    one, two = model(batch), model(conv)
    assert torch.equal(one.ce_sum, two.ce_sum) and torch.equal(one.ctc_sum, two.ctc_sum)
