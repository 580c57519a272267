"""Answer and transcript are different things (issue 35): every documented format, one clip or several,
with or without per-clip transcripts, read to samples whose clips carry exactly their own CTC target
(or the answer of a one-clip asr sample, the declared rule) and whose labels are the answers; on our
SentencePiece tokenizer and on a pretrained LLM's own tokenizer and chat template."""

from __future__ import annotations

import pytest
import torch
from conv_corpus import ANSWERS, FORMATS, expected_ctc, write_format

from speechlm.data.conversation import AudioRef, Clip, Conversation, ConversationError, Turn
from speechlm.data.dataset import Collator, DroppedSample, SpeechDataset
from speechlm.data.manifest import ManifestError
from speechlm.data.sources.detect import load_source
from speechlm.data.tokenizer import Tokenizer
from speechlm.packing.prompt import ConversationRenderer


@pytest.fixture(scope="module")
def sp_tok(demo_data) -> Tokenizer:
    return Tokenizer(demo_data["tok"])


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from pretrained_helpers import make_tiny_pretrained

    from speechlm.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(make_tiny_pretrained(tmp_path_factory.mktemp("llm"), langs=["en"]), langs=["en"])


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "pretrained"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_clip_gets_its_own_transcript_and_the_answers_are_the_labels(fmt, tokenizer, tmp_path, request):
    tok = request.getfixturevalue("sp_tok" if tokenizer == "sentencepiece" else "hf_tok")
    table = load_source(write_format(fmt, tmp_path))
    ds = SpeechDataset(table, tok, renderer=ConversationRenderer(tok), instruction="")
    items = ds.__getitems__(list(range(len(ds))))
    assert not [x for x in items if isinstance(x, DroppedSample)]  # nothing dropped, nothing refused
    ids = table.column("segment_id").to_pylist()
    seen = set()
    for s in items:
        kind = int(ids[s.index].split("-")[0][1:])
        seen.add(kind)
        want = [None if w is None else tok.encode(f"<|en|> {w}") for w in expected_ctc(fmt, kind)]
        got = [t.tolist() or None for t in s.ctc_tokens]
        assert got == want, (fmt, ids[s.index])
        labelled = s.prompt_ids[s.prompt_mask].tolist()
        assert _contains(labelled, tok.encode(ANSWERS[kind])), (fmt, ids[s.index])
        if kind == 2:  # a QA answer is a label, never a CTC target
            assert all(t.numel() == 0 for t in s.ctc_tokens)
    assert seen == {0, 1, 2, 3, 4}
    batch = Collator(tok.pad_id)(items)
    want_ctc = sum(w is not None for s in items for w in expected_ctc(fmt, int(ids[s.index][1])))
    assert int((batch.ctc_token_lens > 0).sum()) == want_ctc  # the CTC normaliser counts only those


def test_a_qa_answer_is_never_copied_into_the_clip():
    conv = Conversation.transcription(Clip("a.flac"), "cold", lang="en", instruction="First word?", task="qa")
    assert conv.clips[0].transcript is None and conv.ctc_transcripts() == (None,)
    asr = Conversation.transcription(Clip("a.flac"), "Cold, Blue!", lang="en")
    assert asr.ctc_transcripts() == ("<|en|> Cold Blue",)  # cleaned and tagged, the declared rule
    own = Conversation.transcription(
        Clip("a.flac", transcript="cold blue milk"), "cold", lang="en", task="qa"
    )
    assert own.ctc_transcripts() == ("<|en|> cold blue milk",)  # a clip's own text, tagged as readers do
    two = Conversation(
        (Turn("user", (AudioRef(0), AudioRef(1), "Transcribe both.")), Turn("assistant", ("a b",))),
        (Clip("a"), Clip("b")),
        lang="en",
    )
    assert two.ctc_transcripts() == (None, None)  # no rule splits an answer over several clips


@pytest.mark.parametrize(
    "turns, match",
    [
        ([Turn("assistant", ("cold",)), Turn("user", (AudioRef(0),))], "answers before any user turn"),
        ([Turn("system", ("be brief",)), Turn("assistant", ("x",)), Turn("user", (AudioRef(0), "q"))],
         "answers before any user turn"),
        ([Turn("user", ("q",)), Turn("assistant", ("x",)), Turn("user", (AudioRef(0),))],
         r"clip\(s\) \[0\] are heard only after the last assistant turn"),
    ],
)  # fmt: skip
def test_a_turn_order_that_makes_no_sense_is_refused(turns, match):
    with pytest.raises(ConversationError, match=match):
        Conversation(tuple(turns), (Clip("a"),), lang="en", id="x")


def test_only_an_assistant_turn_is_no_user_turn():
    with pytest.raises(ConversationError, match="has no user turn"):
        Conversation((Turn("assistant", ("x",)),), (), lang="en")


def _sharegpt(tmp_path, records):
    import json

    from conv_corpus import write_clip

    write_clip(tmp_path / "a.wav", 1.0, 300.0)
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    return path


def test_sharegpt_answer_before_the_audio_is_refused_at_read_time_naming_the_record(tmp_path):
    good = {
        "id": "ok",
        "lang": "en",
        "sound": ["a.wav"],
        "conversations": [{"from": "human", "value": "<sound> Hi"}, {"from": "gpt", "value": "cold"}],
    }
    bad = {"id": "rev", "lang": "en", "sound": ["a.wav"],
           "conversations": [{"from": "gpt", "value": "cold"}, {"from": "human", "value": "<sound> Hi"}]}  # fmt: skip
    with pytest.raises(ManifestError, match=r"sg\.json\[1\].*answers before any user turn"):
        load_source(_sharegpt(tmp_path, [good, bad]))


def test_a_nemo_row_with_a_negative_offset_is_refused_naming_the_line(tmp_path):
    from conv_corpus import write_clip

    write_clip(tmp_path / "a.wav", 1.0, 300.0)
    rec = {"id": "x", "lang": "en", "conversations": [
        {"from": "User", "type": "audio", "value": "a.wav", "duration": 0.5, "offset": -1.0},
        {"from": "Assistant", "type": "text", "value": "cold"}]}  # fmt: skip
    path = tmp_path / "c.jsonl"
    path.write_text(
        '{"id": "ok", "lang": "en", "conversations": [{"from": "User", "type": "audio", "value": '
        '"a.wav"}, {"from": "Assistant", "type": "text", "value": "x"}]}\n' + __import__("json").dumps(rec)
    )
    with pytest.raises(ManifestError, match=r"c\.jsonl:2.*offset -1\.0"):
        load_source(path)


def test_a_non_utf8_byte_is_reported_on_its_own_line(tmp_path):
    from conv_corpus import write_clip

    write_clip(tmp_path / "a.wav", 1.0, 300.0)
    line = (
        b'{"id": "s", "lang": "en", "conversations": [{"from": "User", "type": "audio", "value": "a.wav"}, '
    )
    path = tmp_path / "c.jsonl"
    path.write_bytes(line + b'{"from": "Assistant", "type": "text", "value": "ok"}]}\n' * 1 + line
                     + b'{"from": "Assistant", "type": "text", "value": "ok"}]}\n' + line
                     + b'{"from": "Assistant", "type": "text", "value": "caf\xff"}]}\n')  # fmt: skip
    with pytest.raises(ManifestError, match=r"c\.jsonl:3: byte 0xff .* not UTF-8"):
        load_source(path)


def test_parquet_prompt_and_target_columns_are_the_instruction_and_answer(tmp_path, sp_tok):
    table = load_source(write_format("parquet", tmp_path))
    ds = SpeechDataset(table, sp_tok, renderer=ConversationRenderer(sp_tok), instruction="")
    row = table.column("segment_id").to_pylist().index("k2-0")
    conv = ds.conversation(row)
    assert conv.answer == ANSWERS[2] and conv.turns[0].text == "What is the first word?"
    assert conv.task == "qa" and conv.ctc_transcripts() == (None,)


def test_a_manifest_with_both_names_of_a_column_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conv_corpus import write_clip

    path = tmp_path / "m.parquet"
    write_clip(tmp_path / "a.wav", 1.0, 300.0)
    pq.write_table(pa.table({"segment_id": ["s"], "shard_id": ["x"], "audio_filepath": [str(tmp_path / "a.wav")],
                             "duration": [1.0], "text": [""], "lang": ["en"], "source": ["user"],
                             "answer": ["x"], "target": ["y"]}), path)  # fmt: skip
    with pytest.raises(
        ManifestError, match=r"m\.parquet has both column 'answer' and its other name 'target'"
    ):
        load_source(path)


def test_counts_of_a_step_are_samples_not_clips_with_transcripts(sp_tok, tmp_path):
    from speechlm.train.step import count_ctc_clips, count_samples

    table = load_source(write_format("sharegpt", tmp_path))  # no per-clip transcripts at all
    ds = SpeechDataset(table, sp_tok, renderer=ConversationRenderer(sp_tok), instruction="")
    rows = [i for i, s in enumerate(table.column("segment_id").to_pylist()) if s[1] in "34"]
    batch = Collator(sp_tok.pad_id)(ds.__getitems__(rows))
    assert count_ctc_clips(batch) == 0  # no clip has a transcript ...
    assert count_samples(batch) == (len(rows), 2 * len(rows))  # ... but every sample was read
    assert torch.equal(batch.ctc_token_lens, torch.zeros(2 * len(rows), dtype=torch.int64))


def test_manifest_stats_and_plan_report_samples_clips_transcribed_clips_and_answer_tokens_per_task(
    tmp_path, capsys
):
    import json

    from speechlm.cli import main

    path = write_format("nemo", tmp_path / "d")  # 2 copies of k0..k4; k2 and k4 are qa
    assert main(["manifest", "stats", str(path), "--json"]) == 0
    tasks = json.loads(capsys.readouterr().out)["tasks"]
    chars = {t: sum(len(ANSWERS[k]) + (5 if k == 4 else 0) for k in ks) * 2 for t, ks in
             {"asr": (0, 1, 3), "qa": (2, 4)}.items()}  # k4 also answers "first" (5 characters)  # fmt: skip
    assert {t: (v["samples"], v["clips"], v["clips_with_transcript"]) for t, v in tasks.items()} == {
        "asr": (6, 8, 4),  # k0, k1 (the asr rule), k3 (2 clips, none)
        "qa": (4, 6, 4),  # k2 (none), k4 (both clips their own)
    }
    assert {t: v["answer_tokens_est"] for t, v in tasks.items()} == {t: -(-c // 3) for t, c in chars.items()}
    assert main(["manifest", "stats", str(path)]) == 0
    assert "with transcript" in capsys.readouterr().out
    out = tmp_path / "plan.json"
    assert main(["plan", "--manifest", str(path), "--json", str(out), "--mode", "exhaustive"]) == 0
    printed = capsys.readouterr().out
    assert "w/ transcript" in printed
    plan = {r["task"]: r for r in json.loads(out.read_text())["tasks"]}
    assert (plan["qa"]["planned_clips"], plan["qa"]["planned_clips_with_transcript"]) == (6, 4)
    assert (plan["asr"]["planned_clips"], plan["asr"]["planned_clips_with_transcript"]) == (8, 4)
