"""The conversation model (speechlm.data.conversation) and its rendering to prompt ids
(speechlm.packing.prompt.ConversationRenderer): which ids are placeholders, which are targets."""

from __future__ import annotations

import pytest

from speechlm.data.conversation import AudioRef, Clip, Conversation, ConversationError, Turn
from speechlm.packing.prompt import ConversationRenderer, PromptFormat, build_prompt_format

BOS, EOS, AUDIO = 1, 2, 3


class WordTokenizer:
    """One id per whitespace word (from 10), no chat template: the plain form."""

    bos_id, eos_id, audio_id, pad_id = BOS, EOS, AUDIO, 0
    chat_template = None

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, 10 + len(self.vocab)) for w in text.split()]


def two_turn_two_clip(task: str = "qa") -> Conversation:
    return Conversation(
        (
            Turn("user", (AudioRef(0), "what animal")),
            Turn("assistant", ("a cat",)),
            Turn("user", (AudioRef(1), "and now")),
            Turn("assistant", ("a big dog",)),
        ),
        (Clip("a.flac", duration=1.5, transcript="<|en|> meow"), Clip("b.flac", offset=2.0, duration=3.0)),
        task=task,
        lang="en",
        id="utt-7",
    )


def test_json_round_trip_keeps_every_part():
    conv = two_turn_two_clip()
    back = Conversation.from_json(conv.to_json())
    assert back == conv
    assert back.clips[1].offset == 2.0 and back.clips[0].transcript == "<|en|> meow"
    assert back.duration == 4.5 and back.answer == "a big dog" and back.audio_order == [0, 1]


@pytest.mark.parametrize(
    "turns, clips, match",
    [
        ((Turn("robot", ("hi",)), Turn("assistant", ("x",))), (), "role 'robot'"),
        ((Turn("user", (AudioRef(1),)), Turn("assistant", ("x",))), (Clip("a"),), "refers to audio clip 1"),
        ((Turn("user", ("hi",)),), (), "no assistant turn"),
        (
            (Turn("user", ("hi",)), Turn("assistant", ("x",))),
            (Clip("a"),),
            r"clip\(s\) \[0\] are never referred",
        ),
        (
            (Turn("user", ("q",)), Turn("assistant", (AudioRef(0),))),
            (Clip("a"),),
            "assistant turn holds audio",
        ),
    ],
)
def test_bad_conversations_are_refused_with_the_part(turns, clips, match):
    with pytest.raises(ConversationError, match=match):
        Conversation(turns, clips, id="row-3")


def test_from_json_names_where_on_garbage():
    with pytest.raises(ConversationError, match="manifest.parquet row 4: not a conversation"):
        Conversation.from_json('{"turns": [{"role": "user"}]}', where="manifest.parquet row 4")


def test_transcription_shape_renders_as_the_prompt_format():
    tok = WordTokenizer()
    conv = Conversation.transcription(Clip("a.flac"), "<|en|> the cat", lang="en", instruction="write it")
    assert conv.clips[0].transcript is None  # the answer is not copied into the clip
    assert conv.ctc_transcripts() == ("<|en|> the cat",)  # the one-clip asr rule makes it the CTC target
    ids, mask = ConversationRenderer(tok).render(conv)
    want_ids, want_mask = PromptFormat.plain(
        bos_id=BOS, eos_id=EOS, audio_id=AUDIO, instruction_ids=tok.encode("write it")
    ).build(tok.encode("<|en|> the cat"))
    assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
    # the general plain path gives the same ids for that shape (the fast path is only a cache)
    r = ConversationRenderer(tok)
    ids2, mask2 = r._render_plain(conv.turns, r.answers_of(conv.turns))
    assert ids2.tolist() == want_ids.tolist() and mask2.tolist() == want_mask.tolist()


@pytest.mark.parametrize("loss_turns", ["all", "last"])
def test_plain_multi_turn_labels_exactly_the_assistant_turns(loss_turns):
    tok = WordTokenizer()
    ids, mask = ConversationRenderer(tok, loss_turns=loss_turns).render(two_turn_two_clip())
    v = tok.vocab
    assert ids.tolist() == [
        BOS, AUDIO, v["what"], v["animal"], v["a"], v["cat"], EOS,
        AUDIO, v["and"], v["now"], v["a"], v["big"], v["dog"], EOS,
    ]  # fmt: skip
    first = [True] * 3 if loss_turns == "all" else [False] * 3
    assert mask.tolist() == [False] * 4 + first + [False] * 3 + [True] * 4


def test_plain_form_refuses_a_system_prompt_it_cannot_place():
    with pytest.raises(ValueError, match="data.system_prompt"):
        ConversationRenderer(WordTokenizer(), system_prompt="be brief").render(two_turn_two_clip())


def test_unknown_loss_turns_is_refused():
    with pytest.raises(ValueError, match="loss_turns='first'"):
        ConversationRenderer(WordTokenizer(), loss_turns="first")


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from pretrained_helpers import make_tiny_pretrained

    from speechlm.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(
        make_tiny_pretrained(tmp_path_factory.mktemp("llm"), langs=["en", "hi"]), langs=["en", "hi"]
    )


def test_chat_transcription_shape_equals_the_prompt_format_both_paths(hf_tok):
    r = ConversationRenderer(hf_tok, system_prompt="You transcribe.")
    conv = Conversation.transcription(Clip("a"), "<|en|> the cat", lang="en", instruction="Transcribe this.")
    want = build_prompt_format(hf_tok, instruction="Transcribe this.", system_prompt="You transcribe.").build(
        hf_tok.encode("<|en|> the cat")
    )
    for ids, mask in (r.render(conv), r._render_chat(conv.turns, r.answers_of(conv.turns))):
        assert ids.tolist() == want[0].tolist() and mask.tolist() == want[1].tolist()


@pytest.mark.parametrize("loss_turns", ["all", "last"])
def test_chat_multi_turn_targets_are_each_answer_and_its_end_of_turn(hf_tok, loss_turns):
    from pretrained_helpers import IM_END

    ids, mask = ConversationRenderer(hf_tok, loss_turns=loss_turns).render(two_turn_two_clip())
    ids_l, mask_l = ids.tolist(), mask.tolist()
    assert ids_l.count(hf_tok.audio_id) == 2
    # the labelled runs, in order
    runs, cur = [], []
    for t, m in zip(ids_l, mask_l):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    end = hf_tok.encode_template(IM_END)
    answers = [hf_tok.encode("a cat") + end, hf_tok.encode("a big dog") + end]
    assert runs == (answers if loss_turns == "all" else answers[1:])
    # the whole prompt is the template's text with the placeholders and answers in place
    text = hf_tok.render_chat(
        [
            {"role": "user", "content": "<|audio|>\nwhat animal"},
            {"role": "assistant", "content": "a cat"},
            {"role": "user", "content": "<|audio|>\nand now"},
            {"role": "assistant", "content": "a big dog"},
        ]
    )
    assert hf_tok.decode(ids_l) == hf_tok.decode(hf_tok.encode_template(text))
