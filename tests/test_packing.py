"""Tests for speechlm.packing.thd: rounding, label shift, THD plan, splicing, THD vs BSHD equivalence."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speechlm.packing.prompt import build_prompt
from speechlm.packing.thd import (
    IGNORE_INDEX,
    PackedBatch,
    pack_bshd,
    pack_thd,
    plan_thd,
    round_lengths,
    shift_labels_within,
    splice_embeddings,
    supervised_pairs_bshd,
    supervised_pairs_thd,
)

BOS, EOS, AUDIO = 1, 2, 3
VOCAB, HIDDEN = 32, 4
CPS, TPS = (1, 2, 4), (1, 2, 3, 8)


def make_embedding() -> torch.nn.Embedding:
    torch.manual_seed(0)
    return torch.nn.Embedding(VOCAB, HIDDEN)


def make_audio(audio_lens, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(a, HIDDEN, generator=gen, dtype=dtype) for a in audio_lens]


def round_lengths_total_tp_only(lengths, cp, tp):
    """The known-bad rule: chunk-align each sequence, but only make the total divisible by tp."""
    out = [-(-n // (2 * cp)) * (2 * cp) for n in lengths]
    total = sum(out)
    out[-1] += -total % math.lcm(2 * cp, tp)
    return out


def expected_pairs(prompts, audio_embeds, embed):
    """Independent oracle: each target token is predicted from the embedding just before it."""
    embeds, targets = [], []
    for (ids_L, mask_L), audio_AH in zip(prompts, audio_embeds):
        ids, mask = ids_L.tolist(), mask_L.tolist()
        for k in range(1, len(ids)):
            if not mask[k]:
                continue
            prev = ids[k - 1]
            embeds.append(audio_AH[-1] if prev == AUDIO else embed.weight[prev])
            targets.append(ids[k])
    if not targets:
        return torch.zeros(0, HIDDEN), torch.zeros(0, dtype=torch.long)
    return torch.stack(embeds), torch.tensor(targets)


def check_thd_invariants(batch: PackedBatch, cp: int, tp: int) -> None:
    cu = batch.cu_seqlens
    assert cu.dtype == torch.int32 and cu.dim() == 1 and int(cu[0]) == 0
    padded = (cu[1:] - cu[:-1]).tolist()
    total = int(cu[-1])
    assert total == batch.inputs_embeds.shape[0] == batch.labels.shape[0] == batch.position_ids.shape[0]
    assert batch.max_seqlen == max(padded)
    assert all(p >= n for p, n in zip(padded, batch.seq_lens))
    if cp > 1:
        assert all(p % (2 * cp) == 0 for p in padded)
        assert total % math.lcm(2 * cp, cp * tp) == 0
        assert (total // cp) % tp == 0
    else:
        assert padded[:-1] == batch.seq_lens[:-1]
        assert total % tp == 0
    for i, (start, p, n) in enumerate(zip(cu[:-1].tolist(), padded, batch.seq_lens)):
        assert batch.position_ids[start : start + p].tolist() == list(range(p)), f"utterance {i}"
        # no label crosses a boundary: last real position and all padding are ignored
        assert (batch.labels[start + n - 1 : start + p] == IGNORE_INDEX).all(), f"utterance {i}"
        assert (batch.inputs_embeds[start + n : start + p] == 0).all(), f"utterance {i}"


# ---------------------------------------------------------------------------------------------
# round_lengths
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "cp", "tp", "expected"),
    [
        ([5, 7, 3], 1, 1, [5, 7, 3]),
        ([5, 7, 3], 1, 2, [5, 7, 4]),
        ([5, 7, 3], 1, 8, [5, 7, 4]),
        ([5, 7, 3], 2, 1, [8, 8, 4]),  # lcm(4, 2) = 4
        ([5, 7, 3], 2, 2, [8, 8, 4]),  # lcm(4, 4) = 4
        ([5, 7, 3], 2, 3, [8, 8, 8]),  # lcm(4, 6) = 12
        ([4, 4], 2, 8, [4, 12]),  # lcm(4, 16) = 16
        ([1], 4, 1, [8]),
        ([], 2, 8, []),
    ],
)
def test_round_lengths_examples(lengths, cp, tp, expected):
    assert round_lengths(lengths, cp=cp, tp=tp) == expected


def test_total_divisible_by_tp_only_breaks_sequence_parallel_at_cp2_tp8():
    lengths, cp, tp = [4, 4], 2, 8
    bad = round_lengths_total_tp_only(lengths, cp, tp)
    assert sum(bad) % tp == 0  # looks fine globally ...
    assert (sum(bad) // cp) % tp != 0  # ... but each CP rank holds 4 tokens, not divisible by tp=8
    good = round_lengths(lengths, cp=cp, tp=tp)
    assert (sum(good) // cp) % tp == 0
    assert all(n % (2 * cp) == 0 for n in good)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    cp=st.sampled_from(CPS),
    tp=st.sampled_from(TPS),
)
def test_round_lengths_invariants(lengths, cp, tp):
    out = round_lengths(lengths, cp=cp, tp=tp)
    assert len(out) == len(lengths)
    assert all(o >= n for o, n in zip(out, lengths))
    total = sum(out)
    if cp == 1:
        assert out[:-1] == lengths[:-1] and total % tp == 0 and out[-1] - lengths[-1] < tp
    else:
        chunk = 2 * cp
        assert all(o % chunk == 0 and o - n < chunk for o, n in zip(out[:-1], lengths[:-1]))
        assert out[-1] % chunk == 0
        assert total % math.lcm(chunk, cp * tp) == 0 and (total // cp) % tp == 0
        assert out[-1] - -(-lengths[-1] // chunk) * chunk < math.lcm(chunk, cp * tp)  # minimal


@pytest.mark.parametrize(("lengths", "cp", "tp"), [([3, 0], 1, 1), ([3], 0, 1), ([3], 1, 0)])
def test_round_lengths_rejects_bad_input(lengths, cp, tp):
    with pytest.raises(ValueError):
        round_lengths(lengths, cp=cp, tp=tp)


# ---------------------------------------------------------------------------------------------
# shift_labels_within
# ---------------------------------------------------------------------------------------------


def test_shift_labels_within_single_sequence():
    ids = torch.tensor([1, 3, 10, 11, 2])
    mask = torch.tensor([False, False, True, True, True])
    assert shift_labels_within(ids, mask).tolist() == [IGNORE_INDEX, 10, 11, 2, IGNORE_INDEX]


def test_shift_labels_within_does_not_cross_boundaries():
    # the second sequence starts with a target: without cu_seqlens it would leak into the first
    ids = torch.tensor([5, 6, 7, 8, 9])
    mask = torch.tensor([False, True, True, True, True])
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert shift_labels_within(ids, mask).tolist() == [6, 7, 8, 9, IGNORE_INDEX]
    assert shift_labels_within(ids, mask, cu).tolist() == [6, IGNORE_INDEX, 8, 9, IGNORE_INDEX]


def test_shift_labels_within_rejects_inconsistent_cu_seqlens():
    ids, mask = torch.tensor([5, 6, 7]), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="end at 3"):
        shift_labels_within(ids, mask, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="same length"):
        shift_labels_within(ids, mask[:2])


# ---------------------------------------------------------------------------------------------
# plan_thd
# ---------------------------------------------------------------------------------------------


def two_utterances():
    p0 = build_prompt([10, 11], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)  # 7 positions with 3 audio
    p1 = build_prompt([12], bos_id=BOS, eos_id=EOS, audio_id=AUDIO, instruction_ids=[20])  # 6 with 2
    return [p0, p1], [3, 2]


def test_plan_thd_worked_example_cp2():
    prompts, audio_lens = two_utterances()
    lay = plan_thd(prompts, audio_lens, audio_id=AUDIO, cp=2, tp=1)
    I = IGNORE_INDEX  # noqa: E741
    assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_seqlens.tolist() == [0, 8, 16]
    assert lay.seq_lens == [7, 6] and lay.max_seqlen == 8
    assert lay.input_ids_T.tolist() == [1, 0, 0, 0, 10, 11, 2, 0, 1, 0, 0, 20, 12, 2, 0, 0]
    assert lay.audio_mask_T.int().tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert lay.pad_mask_T.int().tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    assert lay.labels_T.tolist() == [I, I, I, 10, 11, 2, I, I, I, I, I, 12, 2, I, I, I]
    assert lay.position_ids_T.tolist() == list(range(8)) * 2


def test_plan_thd_cp1_keeps_lengths():
    prompts, audio_lens = two_utterances()
    lay = plan_thd(prompts, audio_lens, audio_id=AUDIO)
    assert lay.cu_seqlens.tolist() == [0, 7, 13] and not lay.pad_mask_T.any()
    lay = plan_thd(prompts, audio_lens, audio_id=AUDIO, tp=8)
    assert lay.cu_seqlens.tolist() == [0, 7, 16]
    assert lay.position_ids_T[7:].tolist() == list(range(9))  # padding continues the count


def test_plan_thd_empty_batch():
    lay = plan_thd([], [], audio_id=AUDIO, cp=2, tp=2)
    assert lay.cu_seqlens.tolist() == [0] and lay.cu_seqlens.dtype == torch.int32
    assert lay.num_tokens == 0 and lay.max_seqlen == 0


@pytest.mark.parametrize("pack", ["thd", "bshd"])
@pytest.mark.parametrize(
    ("bad_ids", "match"),
    [
        ([BOS, 10, EOS], "utterance 1: prompt holds 0 audio placeholders"),
        ([BOS, AUDIO, AUDIO, EOS], "utterance 1: prompt holds 2 audio placeholders"),
    ],
)
def test_placeholder_count_errors_name_the_utterance(pack, bad_ids, match):
    good = build_prompt([10], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    bad = (torch.tensor(bad_ids), torch.zeros(len(bad_ids), dtype=torch.bool))
    prompts = [good, bad, good]
    with pytest.raises(ValueError, match=match):
        if pack == "thd":
            plan_thd(prompts, [2, 2, 2], audio_id=AUDIO)
        else:
            pack_bshd(prompts, make_audio([2, 2, 2]), make_embedding(), audio_id=AUDIO)


def test_placeholder_marked_as_target_is_rejected():
    good = build_prompt([10], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    bad = (torch.tensor([BOS, AUDIO, EOS]), torch.tensor([False, True, True]))
    with pytest.raises(ValueError, match="utterance 1: the audio placeholder is marked as a target"):
        plan_thd([good, bad], [2, 2], audio_id=AUDIO)


def test_audio_count_and_length_mismatch_errors():
    prompts, audio_lens = two_utterances()
    with pytest.raises(ValueError, match="2 prompts but 1 audio"):
        plan_thd(prompts, [3], audio_id=AUDIO)
    lay = plan_thd(prompts, audio_lens, audio_id=AUDIO)
    text_TH = torch.zeros(lay.num_tokens, HIDDEN)
    with pytest.raises(
        ValueError, match=r"utterance 1: audio embeddings have shape \(5, 4\), expected \(2, 4\)"
    ):
        splice_embeddings(lay, text_TH, make_audio([3, 5]))
    with pytest.raises(ValueError, match="2 audio embeddings for 1 utterances|1 audio embeddings for 2"):
        splice_embeddings(lay, text_TH, make_audio([3]))


# ---------------------------------------------------------------------------------------------
# splice / pack: gradients and layout equivalence
# ---------------------------------------------------------------------------------------------


def test_splice_embeddings_gradcheck():
    prompts, audio_lens = two_utterances()
    lay = plan_thd(prompts, audio_lens, audio_id=AUDIO, cp=2, tp=3)
    text_TH = torch.randn(lay.num_tokens, HIDDEN, dtype=torch.float64, requires_grad=True)
    audio = [a.requires_grad_() for a in make_audio(audio_lens, dtype=torch.float64)]

    def splice(text, a0, a1):
        return splice_embeddings(lay, text, [a0, a1])

    assert torch.autograd.gradcheck(splice, (text_TH, *audio))


def test_gradients_reach_audio_and_token_embeddings():
    prompts, audio_lens = two_utterances()
    embed = make_embedding()
    audio = [a.requires_grad_() for a in make_audio(audio_lens)]
    batch = pack_thd(prompts, audio, embed, audio_id=AUDIO, cp=2, tp=2)
    head = torch.nn.Linear(HIDDEN, VOCAB)
    loss = torch.nn.functional.cross_entropy(head(batch.inputs_embeds), batch.labels, reduction="sum")
    loss.backward()
    # utterance 0: last audio frame predicts the first target; utterance 1: audio only feeds position ids
    assert audio[0].grad is not None and audio[0].grad[-1].abs().sum() > 0
    assert audio[0].grad[:-1].abs().sum() == 0
    assert embed.weight.grad is not None
    assert embed.weight.grad[[10, 11, 20, 12]].abs().sum(dim=1).gt(0).all()
    assert embed.weight.grad[0].abs().sum() == 0  # audio/padding slots look up id 0 but are zeroed
    assert batch.num_labelled() == 5


def test_pack_bshd_layout():
    prompts, audio_lens = two_utterances()
    embed = make_embedding()
    audio = make_audio(audio_lens)
    batch = pack_bshd(prompts, audio, embed, audio_id=AUDIO, pad_to_multiple=4)
    I = IGNORE_INDEX  # noqa: E741
    assert batch.inputs_embeds.shape == (2, 8, HIDDEN)
    assert batch.attention_mask.tolist() == [[1] * 7 + [0], [1] * 6 + [0, 0]]
    assert batch.labels.tolist() == [[I, I, I, 10, 11, 2, I, I], [I, I, I, 12, 2, I, I, I]]
    assert batch.position_ids.tolist() == [list(range(8))] * 2
    assert torch.equal(batch.inputs_embeds[0, 1:4], audio[0])
    assert torch.equal(batch.inputs_embeds[1, 1:3], audio[1])
    assert (batch.inputs_embeds[1, 6:] == 0).all()
    assert batch.num_labelled() == 5


@st.composite
def random_batches(draw):
    """Prompts from build_prompt and free-form prompts (arbitrary masks, a target right at the start)."""
    n = draw(st.integers(1, 5))
    token = st.integers(4, VOCAB - 1)
    prompts, audio_lens = [], []
    for _ in range(n):
        if draw(st.booleans()):
            target = draw(st.lists(token, max_size=6))
            instruction = draw(st.lists(token, max_size=3))
            prompts.append(
                build_prompt(target, bos_id=BOS, eos_id=EOS, audio_id=AUDIO, instruction_ids=instruction)
            )
        else:
            length = draw(st.integers(0, 8))
            ids = draw(st.lists(token, min_size=length, max_size=length))
            mask = draw(st.lists(st.booleans(), min_size=length, max_size=length))
            k = draw(st.integers(0, length))
            ids.insert(k, AUDIO)
            mask.insert(k, False)
            prompts.append((torch.tensor(ids), torch.tensor(mask)))
        audio_lens.append(draw(st.integers(1, 7)))
    return prompts, audio_lens, draw(st.integers(0, 2**16))


def assert_same_pairs(prompts, audio_lens, seed, cp, tp, pad_to_multiple=1):
    embed = make_embedding()
    audio = make_audio(audio_lens, seed)
    thd = pack_thd(prompts, audio, embed, audio_id=AUDIO, cp=cp, tp=tp)
    bshd = pack_bshd(prompts, audio, embed, audio_id=AUDIO, pad_to_multiple=pad_to_multiple)
    check_thd_invariants(thd, cp, tp)
    e_thd, t_thd = supervised_pairs_thd(thd)
    e_bshd, t_bshd = supervised_pairs_bshd(bshd)
    e_ref, t_ref = expected_pairs(prompts, audio, embed)
    assert torch.equal(t_thd, t_ref) and torch.equal(t_bshd, t_ref)
    assert torch.equal(e_thd, e_ref) and torch.equal(e_bshd, e_ref)
    assert thd.num_labelled() == bshd.num_labelled() == t_ref.numel()


@settings(max_examples=100, deadline=None)
@given(
    data=random_batches(),
    cp=st.sampled_from(CPS),
    tp=st.sampled_from(TPS),
    pad_to_multiple=st.sampled_from([1, 8]),
)
def test_supervised_pairs_equal_between_thd_and_bshd(data, cp, tp, pad_to_multiple):
    prompts, audio_lens, seed = data
    assert_same_pairs(prompts, audio_lens, seed, cp, tp, pad_to_multiple)


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("tp", TPS)
def test_supervised_pairs_every_rounding_fixed_batch(cp, tp):
    prompts, audio_lens = two_utterances()
    prompts.append(build_prompt([13, 14, 15], bos_id=BOS, eos_id=EOS, audio_id=AUDIO))
    assert_same_pairs(prompts, [*audio_lens, 9], seed=1, cp=cp, tp=tp)


def test_pad_to_multiple_replaces_the_automatic_unit_and_must_be_compatible():
    from speechlm.packing.thd import round_lengths, rounding_unit

    assert rounding_unit(2, 8) == 16 and rounding_unit(1, 3) == 3 and rounding_unit(4, 1) == 8
    out = round_lengths([5, 9, 3], cp=2, tp=2, total_multiple=64)
    assert sum(out) % 64 == 0 and all(n % 4 == 0 for n in out)
    assert out[:2] == [8, 12]  # only the last sequence takes the extra padding
    with pytest.raises(ValueError, match="not a multiple of lcm"):
        round_lengths([5, 9], cp=2, tp=8, total_multiple=24)  # 24 is not a multiple of 16
