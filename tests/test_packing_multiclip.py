"""Packing samples with several audio clips: each placeholder spliced in place, cu_seqlens per sample,
labels exactly on the assistant turns, the same supervised pairs in THD and BSHD."""

from __future__ import annotations

import pytest
import torch
from multiclip_helpers import AUDIO, BOS, EOS, random_conversation, renderer

from speechlm.data.conversation import AudioRef, Clip, Conversation, Turn
from speechlm.packing.prompt import build_prompt
from speechlm.packing.thd import (
    IGNORE_INDEX,
    pack_bshd,
    pack_thd,
    plan_thd,
    supervised_pairs_bshd,
    supervised_pairs_thd,
)

H = 6


def embedding() -> torch.nn.Embedding:
    torch.manual_seed(0)
    return torch.nn.Embedding(64, H)


def clips(lens: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, generator=g) for n in lens]


def two_clip_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([BOS, AUDIO, 10, AUDIO, 11, 12, EOS])
    mask = torch.tensor([False, False, False, False, False, True, True])
    return ids, mask


def test_each_placeholder_is_replaced_by_its_clip_in_place():
    one = build_prompt([20, 21], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    lay = plan_thd([two_clip_prompt(), one], [3, 2, 4], audio_id=AUDIO, clip_counts=[2, 1])
    # sample 0: 7 - 2 + 3 + 2 = 10; sample 1: 5 - 1 + 4 = 8
    assert lay.seq_lens == [10, 8] and lay.cu_seqlens.tolist() == [0, 10, 18]
    assert lay.audio_mask_T[:10].tolist() == [False, True, True, True, False, True, True, False, False, False]
    assert lay.input_ids_T[:10].tolist() == [BOS, 0, 0, 0, 10, 0, 0, 11, 12, EOS]
    assert lay.position_ids_T.tolist() == list(range(10)) + list(range(8))
    emb = embedding()
    packed = pack_thd([two_clip_prompt(), one], clips([3, 2, 4]), emb, audio_id=AUDIO, clip_counts=[2, 1])
    c = clips([3, 2, 4])
    x = packed.inputs_embeds.detach()
    assert torch.equal(x[1:4], c[0]) and torch.equal(x[5:7], c[1]) and torch.equal(x[11:15], c[2])
    assert torch.equal(x[4], emb(torch.tensor(10)).detach())


def test_one_clip_per_prompt_is_todays_layout():
    prompts = [build_prompt([20 + i] * (i + 1), bos_id=BOS, eos_id=EOS, audio_id=AUDIO) for i in range(3)]
    for kw in (dict(cp=2, tp=2), dict(cp=1, tp=4), dict(padded_lengths=[9, 12, 10])):
        old = plan_thd(prompts, [3, 5, 4], audio_id=AUDIO, **kw)
        new = plan_thd(prompts, [3, 5, 4], audio_id=AUDIO, clip_counts=[1, 1, 1], **kw)
        for name in ("input_ids_T", "audio_mask_T", "pad_mask_T", "labels_T", "position_ids_T", "cu_seqlens"):
            assert torch.equal(getattr(old, name), getattr(new, name)), name
        assert (old.seq_lens, old.max_seqlen) == (new.seq_lens, new.max_seqlen)


def _two_turn_two_clip() -> Conversation:
    turns = (
        Turn("user", (AudioRef(0), "w20 w21")),
        Turn("assistant", ("w5 w30 w31",)),
        Turn("user", ("w22", AudioRef(1))),
        Turn("assistant", ("w40 w41",)),
    )
    return Conversation(turns, (Clip("a.wav"), Clip("b.wav")), task="qa")


@pytest.mark.parametrize("loss_turns", ["all", "last"])
@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_label_mask_covers_exactly_the_assistant_turns(loss_turns, layout):
    conv = _two_turn_two_clip()
    prompt = renderer(loss_turns).render(conv)
    emb = embedding()
    ids = None
    if layout == "thd":
        labels = pack_thd([prompt], clips([4, 3]), emb, audio_id=AUDIO, clip_counts=[2], cp=2, tp=2).labels
        ids = plan_thd([prompt], [4, 3], audio_id=AUDIO, clip_counts=[2], cp=2, tp=2).input_ids_T
    else:
        padded = pack_bshd([prompt], clips([4, 3]), emb, audio_id=AUDIO, clip_counts=[2], pad_to_multiple=8)
        labels = padded.labels[0]
    # expanded sample: bos, 4 audio, w20 w21, [w5 w30 w31 eos], w22, 3 audio, [w40 w41 eos]
    first = [5, 30, 31, EOS]
    second = [40, 41, EOS]
    expected_targets = (first if loss_turns == "all" else []) + second
    keep = torch.nonzero(labels != IGNORE_INDEX).flatten()
    assert labels[keep].tolist() == expected_targets
    # the position predicting a target is the one before it: the target's own slot is t + 1
    starts_first, starts_second = 1 + 4 + 2, 1 + 4 + 2 + 4 + 1 + 3
    want = list(range(starts_second - 1, starts_second + 2))
    if loss_turns == "all":
        want = list(range(starts_first - 1, starts_first + 3)) + want
    assert keep.tolist() == want
    if ids is not None:
        assert ids[keep + 1].tolist() == expected_targets


@pytest.mark.parametrize(("cp", "tp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_supervised_pairs_match_thd_and_bshd_with_multiclip_samples(cp, tp):
    g = torch.Generator().manual_seed(cp * 10 + tp)
    convs = [random_conversation(g, 1 + i % 3, 64, two_turns=i % 2 == 1) for i in range(5)]
    r = renderer()
    prompts = [r.render(c) for c in convs]
    counts = [len(c.audio_order) for c in convs]
    audio = clips([int(n) for n in torch.randint(1, 7, (sum(counts),), generator=g)], seed=cp + tp)
    emb = embedding()
    thd = pack_thd(prompts, audio, emb, audio_id=AUDIO, cp=cp, tp=tp, clip_counts=counts)
    bshd = pack_bshd(prompts, audio, emb, audio_id=AUDIO, pad_to_multiple=tp, clip_counts=counts)
    x_thd, y_thd = supervised_pairs_thd(thd)
    x_bshd, y_bshd = supervised_pairs_bshd(bshd)
    assert torch.equal(y_thd, y_bshd) and torch.equal(x_thd, x_bshd)
    assert int(y_thd.numel()) == sum(int(m.sum()) for _, m in prompts)
    assert thd.cu_seqlens.numel() == len(convs) + 1  # one sequence per sample, whatever its clips
    assert all(int(n) % (2 * cp) == 0 for n in torch.diff(thd.cu_seqlens)) or cp == 1


@pytest.mark.parametrize("pack", ["thd", "bshd"])
def test_placeholder_count_not_matching_the_clips_names_the_sample(pack):
    one = build_prompt([20], bos_id=BOS, eos_id=EOS, audio_id=AUDIO)
    prompts = [one, two_clip_prompt()]
    with pytest.raises(ValueError, match=r"utterance 1: prompt holds 2 audio placeholders .* has 3 clip"):
        if pack == "thd":
            plan_thd(prompts, [2, 2, 2, 2], audio_id=AUDIO, clip_counts=[1, 3])
        else:
            pack_bshd(prompts, clips([2, 2, 2, 2]), embedding(), audio_id=AUDIO, clip_counts=[1, 3])
    with pytest.raises(ValueError, match=r"clip_counts \[1, 2\] .* but 4 audio lengths"):
        plan_thd(prompts, [2, 2, 2, 2], audio_id=AUDIO, clip_counts=[1, 2])
    with pytest.raises(ValueError, match="utterance 1: prompt holds 2 audio placeholders"):
        plan_thd(prompts, [2, 2], audio_id=AUDIO)  # no clip_counts: one clip per prompt, as today
