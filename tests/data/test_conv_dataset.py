"""SpeechDataset/Collator with a ConversationRenderer (issue 23, interface B): an old manifest gives today's
tokens and audio; a 2-clip sample fills the conversation Batch fields; a bad clip drops its whole sample;
data.input_cfg's task/prompt defaults reach the rows."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from formats_helpers import A1, A2, expected, nemo_conversation_jsonl, write_clips

from speechlm.data.conversation import AudioRef
from speechlm.data.dataset import Collator, DroppedSample, Sample, SpeechDataset
from speechlm.data.sources.detect import load_source
from speechlm.data.sources.input_cfg import load_input_cfg
from speechlm.data.tokenizer import Tokenizer
from speechlm.packing.prompt import ConversationRenderer, build_prompt_format


@pytest.fixture(scope="module")
def tok(demo_data) -> Tokenizer:
    return Tokenizer(demo_data["tok"])


@pytest.mark.parametrize("instruction", ["", "Transcribe the audio."])
def test_old_manifest_gives_todays_tokens_audio_and_prompt(demo_data, tok, instruction):
    table = load_source(demo_data["val"])
    old = SpeechDataset(table, tok)
    new = SpeechDataset(table, tok, renderer=ConversationRenderer(tok), instruction=instruction)
    fmt = build_prompt_format(tok, instruction=instruction)
    rows = list(range(len(old)))
    a, b = old.__getitems__(rows), new.__getitems__(rows)
    assert [type(x) for x in a] == [type(x) for x in b]
    assert [x.reason for x in a if isinstance(x, DroppedSample)] == [
        x.reason for x in b if isinstance(x, DroppedSample)
    ]
    for x, y in zip(a, b):
        if isinstance(x, Sample):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.audio, y.audio)
            assert (x.duration, x.lang, y.task) == (y.duration, y.lang, "asr")
            ids, mask = fmt.build(x.tokens.tolist())
            assert torch.equal(y.prompt_ids, ids) and torch.equal(y.prompt_mask, mask)
            assert len(y.ctc_tokens) == 1 and torch.equal(y.ctc_tokens[0], x.tokens)
    collate = Collator(tok.pad_id)
    legacy, conv = collate(a), collate(b)
    for name in ("audio", "audio_lens", "tokens", "token_lens", "durations"):
        assert torch.equal(getattr(legacy, name), getattr(conv, name)), name
    assert legacy.prompt_ids is None and legacy.tasks == []
    assert conv.clip_sample.tolist() == list(range(len(conv)))
    assert torch.equal(conv.ctc_tokens, conv.tokens) and torch.equal(conv.ctc_token_lens, conv.token_lens)


def _two_clip_table(tmp_path, tok):
    clips = write_clips(tmp_path)
    table = load_source(nemo_conversation_jsonl(tmp_path))
    one = {"audio_filepath": str(clips["a.wav"]), "duration": 0.5, "text": "<|hi|> नमस्ते", "lang": "hi"}
    from formats_helpers import write_jsonl

    plain = load_source(write_jsonl(tmp_path / "plain.json", [one]))
    columns = {f.name: pa.concat_arrays([
        table.column(f.name).combine_chunks().cast(f.type),
        (plain.column(f.name).combine_chunks() if f.name in plain.column_names else pa.nulls(1)).cast(f.type),
    ]) for f in table.schema}  # fmt: skip
    return clips, pa.table(columns)


def test_two_clip_sample_fills_the_conversation_fields(tmp_path, tok):
    clips, table = _two_clip_table(tmp_path, tok)
    renderer = ConversationRenderer(tok)
    ds = SpeechDataset(table, tok, renderer=renderer)
    assert ds.conversation(0) == expected(clips)
    items = ds.__getitems__([1, 0])
    batch = Collator(tok.pad_id)(items)
    assert batch.indices == [1, 0] and batch.tasks == ["asr", "qa"]
    assert batch.clip_sample.tolist() == [0, 1, 1]
    assert batch.audio.shape == (3, 8000) and batch.audio_lens.tolist() == [8000, 8000, 4000]
    assert torch.equal(batch.audio[1, :8000], batch.audio[0])  # row 0's one clip is a.wav too
    ids, mask = renderer.render(ds.conversation(0))
    p = int(batch.prompt_lens[1])
    assert torch.equal(batch.prompt_ids[1, :p], ids) and torch.equal(batch.prompt_mask[1, :p], mask)
    assert int((ids == tok.audio_id).sum()) == 2
    assert not batch.prompt_mask[1, p:].any() and (batch.prompt_ids[1, p:] == tok.pad_id).all()
    supervised = tok.decode(ids[mask].tolist())
    assert A1 in supervised and A2 in supervised
    n = int(batch.token_lens[1])
    assert batch.tokens[1, :n].tolist() == tok.encode(A2)  # the last answer
    assert batch.ctc_token_lens.tolist() == [len(tok.encode("<|hi|> नमस्ते")), 0, 0]
    assert batch.durations.tolist() == pytest.approx([0.5, 0.75])
    last = SpeechDataset(table, tok, renderer=ConversationRenderer(tok, loss_turns="last"))[0]
    assert int(last.prompt_mask.sum()) < int(mask.sum())  # only the last answer (and its eos)


def test_a_bad_clip_drops_the_whole_sample_naming_it(tmp_path, tok):
    clips, table = _two_clip_table(tmp_path, tok)
    clips["b.wav"].unlink()
    ds = SpeechDataset(table, tok, renderer=ConversationRenderer(tok))
    got = ds[0]
    assert isinstance(got, DroppedSample) and got.reason == "missing_file"
    assert "clip 1 of 2" in got.detail and "b.wav" in got.detail
    clips["b.wav"].write_bytes(b"not audio at all" * 100)
    got = ds[0]
    assert isinstance(got, DroppedSample) and got.reason == "undecodable" and "clip 1 of 2" in got.detail
    batch = Collator(tok.pad_id)(ds.__getitems__([0, 1]))
    assert batch.indices == [1] and batch.dropped == {"undecodable": 1}
    assert batch.clip_sample.tolist() == [0]


def test_max_tokens_bounds_a_conversation_and_an_empty_answer_is_dropped(tmp_path, tok):
    _, table = _two_clip_table(tmp_path, tok)
    small = SpeechDataset(table, tok, renderer=ConversationRenderer(tok), max_tokens=5)
    got = small[0]
    assert isinstance(got, DroppedSample) and got.reason == "too_many_tokens"
    conv = table.column("conversation")[0].as_py().replace('"house"', '"  "')
    table = table.set_column(table.schema.get_field_index("conversation"), "conversation", [[conv, None]])
    got = SpeechDataset(table, tok, renderer=ConversationRenderer(tok))[0]
    assert isinstance(got, DroppedSample) and got.reason == "empty_text"


def test_input_cfg_task_and_prompt_default_the_rows_that_carry_none(demo_data, tmp_path, tok):
    write_clips(tmp_path)
    cfg = [
        {"path": demo_data["val"], "name": "asr", "weight": 1},
        {"path": demo_data["val"], "name": "ast", "weight": 1, "task": "ast", "prompt": "Translate to English."},
        {"path": str(nemo_conversation_jsonl(tmp_path)), "name": "qa", "weight": 1, "task": "ignored",
         "prompt": "not for conversations"},
    ]  # fmt: skip
    table = load_input_cfg(cfg, cache_dir=tmp_path / "cache")
    ds = SpeechDataset(table, tok, renderer=ConversationRenderer(tok), instruction="Transcribe.")
    n = (len(table) - 1) // 2
    first, second, last = ds.conversation(0), ds.conversation(n), ds.conversation(len(table) - 1)
    assert (first.task, first.turns[0].parts) == ("asr", (AudioRef(0), "Transcribe."))
    assert (second.task, second.turns[0].parts) == ("ast", (AudioRef(0), "Translate to English."))
    assert last.task == "qa" and last.turns == expected(write_clips(tmp_path)).turns  # its own task and turns
    assert first.answer == second.answer  # no answer column: the transcript
    chars = table.column("text_chars").to_pylist()
    assert chars[n] == chars[0] + len("Translate to English.")


def test_invalid_utf8_text_is_dropped_with_a_renderer_as_without(demo_data, tok):
    table = load_source(demo_data["val"])
    raw = [s.encode() for s in table.column("text").to_pylist()]
    raw[1] = b"<|en|> \xff\xfe bad"
    table = table.set_column(
        table.schema.get_field_index("text"), "text", pa.array(raw, pa.binary()).view(pa.string())
    )
    for renderer in (None, ConversationRenderer(tok)):
        item = SpeechDataset(table, tok, renderer=renderer)[1]
        assert isinstance(item, DroppedSample) and item.reason == "invalid_text" and "UTF-8" in item.detail


def test_preflight_names_an_unknown_tag_in_an_answer_column(demo_data, tok):
    from speechlm.data.tokenizer_checks import check_table

    table = load_source(demo_data["val"])
    answers = [None] * len(table)
    answers[2] = "<|fr|> de l'eau"
    table = table.append_column(pa.field("answer", pa.string()), pa.array(answers, pa.string()))
    problems = check_table(table, "manifest m", tok)
    assert len(problems) == 1 and "column answer, row 2" in problems[0] and "<|fr|>" in problems[0]


def test_a_turn_with_a_tag_the_tokenizer_lacks_drops_the_sample(tmp_path, tok):
    _, table = _two_clip_table(tmp_path, tok)
    conv = table.column("conversation")[0].as_py().replace("And then?", "<|fr|> And then?")
    table = table.set_column(table.schema.get_field_index("conversation"), "conversation", [[conv, None]])
    got = SpeechDataset(table, tok, renderer=ConversationRenderer(tok))[0]
    assert isinstance(got, DroppedSample) and got.reason == "tag_mismatch" and "<|fr|>" in got.detail
