"""Conversation formats (issue 23, item 2): every reader turns a 2-turn, 2-clip sample into the same internal
`Conversation`; bad conversations are errors naming the file and line; manifest columns and defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from formats_helpers import (
    A2,
    expected,
    lhotse_cuts,
    manifest_row_jsonl,
    nemo_conversation_jsonl,
    nemo_conversation_tarred,
    nemo_turns,
    sharegpt_json,
    swift_messages_jsonl,
    write_clips,
    write_jsonl,
)

from speechlm.data.conversation import AudioRef
from speechlm.data.dataset import SpeechDataset
from speechlm.data.manifest import ManifestError
from speechlm.data.sources.detect import detect_source_type, load_source
from speechlm.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(demo_data) -> Tokenizer:
    return Tokenizer(demo_data["tok"])


@pytest.fixture()
def clips(tmp_path):
    return write_clips(tmp_path)


def read_back(path: Path, tok: Tokenizer, kind: str | None = None):
    table = load_source(path, kind)
    assert len(table) == 1
    return table, SpeechDataset(table, tok).conversation(0)


@pytest.mark.parametrize(
    "write", [nemo_conversation_jsonl, sharegpt_json, swift_messages_jsonl], ids=["nemo", "sharegpt", "swift"]
)
def test_each_json_format_reads_to_the_same_conversation(write, clips, tmp_path, tok):
    path = write(tmp_path)
    assert detect_source_type(path) == "conversations"
    table, conv = read_back(path, tok)
    assert conv == expected(clips)
    assert table.column("duration").to_pylist() == [pytest.approx(0.75)]  # the sum of the clips
    assert table.column("task").to_pylist() == ["qa"]


def test_manifest_row_with_canonical_conversation_and_parquet_round_trip(clips, tmp_path, tok):
    conv = expected(clips)
    path = manifest_row_jsonl(tmp_path, conv)
    table, got = read_back(path, tok)
    assert got == conv
    pq.write_table(table, tmp_path / "m.parquet")  # a built manifest keeps the columns
    _, again = read_back(tmp_path / "m.parquet", tok)
    assert again == conv


def test_parquet_relative_clip_paths_resolve_against_the_manifest_folder(clips, tmp_path, tok):
    conv = expected(clips)
    table = load_source(manifest_row_jsonl(tmp_path, conv))
    doc = json.loads(table.column("conversation")[0].as_py())
    for c in doc["clips"]:
        c["path"] = Path(c["path"]).name
    table = table.set_column(
        table.schema.get_field_index("conversation"), "conversation", [[json.dumps(doc)]]
    )
    pq.write_table(table, tmp_path / "rel.parquet")
    from speechlm.data.sources.mmap_cache import open_index

    assert SpeechDataset(open_index(tmp_path / "rel.parquet"), tok).conversation(0) == conv


def test_tarred_nemo_conversations_locate_members(clips, tmp_path, tok):
    folder = nemo_conversation_tarred(tmp_path, clips)
    assert detect_source_type(folder) == "conversations"
    _, conv = read_back(folder, tok)
    want = expected(clips)
    assert conv.turns == want.turns and (conv.task, conv.lang, conv.id) == ("qa", "hi", "s1")
    assert [c.path for c in conv.clips] == ["a.wav", "b.wav"]
    assert {c.tar for c in conv.clips} == {str((folder / "audio_0.tar").resolve())}
    assert all(c.member_offset and c.member_nbytes and c.header_bytes for c in conv.clips)
    assert [c.duration for c in conv.clips] == [c.duration for c in want.clips]


def test_lhotse_cut_with_custom_conversation(clips, tmp_path, tok):
    _, conv = read_back(lhotse_cuts(tmp_path, clips), tok)
    assert conv == expected(clips)


def test_transcription_shape_rows_keep_the_plain_columns(clips, tmp_path, tok):
    """A one-clip sample (user: audio + instruction, assistant: answer) is not stored as JSON."""
    rec = {"id": "t1", "lang": "hi", "task": "ast", "audio_filepath": "a.wav", "duration": 0.5,
           "text": "<|hi|> पानी", "instruction": "Translate to English.", "answer": "water",
           "conversations": None}  # fmt: skip
    nemo_style = write_jsonl(tmp_path / "plain.json", [rec])
    table = load_source(nemo_style)
    row = table.slice(0, 1).to_pylist()[0]
    assert (row["task"], row["instruction"], row["answer"], row["text"]) == (
        "ast", "Translate to English.", "water", "<|hi|> पानी",
    )  # fmt: skip
    conv = SpeechDataset(table, tok).conversation(0)
    assert conv.answer == "water" and conv.clips[0].transcript == "<|hi|> पानी" and conv.task == "ast"
    assert conv.turns[0].parts == (AudioRef(0), "Translate to English.")


def test_nemo_manifest_aliases_prompt_and_target(clips, tmp_path, tok):
    rec = {"audio_filepath": "a.wav", "duration": 0.5, "text": "पानी", "lang": "hi", "prompt": "Say it in English.",
           "target": "water", "task": "ast"}  # fmt: skip
    table = load_source(write_jsonl(tmp_path / "m.json", [rec]))
    conv = SpeechDataset(table, tok, instruction="ignored: the row has its own").conversation(0)
    assert (conv.task, conv.answer, conv.turns[0].parts[1]) == ("ast", "water", "Say it in English.")


BAD = [
    ({"from": "robot", "type": "text", "value": "hi"}, "role 'robot'"),
    ({"from": "User", "type": "video", "value": "x"}, "'type' 'video'"),
    ({"from": "User", "type": "audio", "value": "missing.wav", "duration": 1.0}, "does not exist"),
]


@pytest.mark.parametrize("turn,message", BAD, ids=["role", "type", "missing_file"])
def test_bad_nemo_turns_name_the_line(turn, message, clips, tmp_path):
    good = {"id": "s0", "lang": "hi", "conversations": [
        {"from": "User", "type": "audio", "value": "a.wav", "duration": 0.5},
        {"from": "Assistant", "type": "text", "value": "ok"}]}  # fmt: skip
    bad = {
        "id": "s1",
        "lang": "hi",
        "conversations": [turn, {"from": "Assistant", "type": "text", "value": "x"}],
    }
    path = write_jsonl(tmp_path / "bad.jsonl", [good, bad])
    with pytest.raises(ManifestError, match=rf"bad\.jsonl:2.*{message}"):
        load_source(path)


def test_bad_sharegpt_placeholders_and_turns(clips, tmp_path):
    def load(rec):
        return load_source(write_jsonl(tmp_path / "bad.jsonl", [{"lang": "hi", **rec}]))

    human = {"from": "human", "value": "<sound> <sound> what?"}
    gpt = {"from": "gpt", "value": A2}
    with pytest.raises(ManifestError, match=r"bad\.jsonl:1.*placeholder <sound> number 2 has no clip"):
        load({"sound": "a.wav", "conversations": [human, gpt]})
    with pytest.raises(ManifestError, match=r"bad\.jsonl:1.*'b\.wav' is never referred to"):
        load({"sound": ["a.wav", "b.wav"], "conversations": [{"from": "human", "value": "<sound>"}, gpt]})
    with pytest.raises(ManifestError, match=r"bad\.jsonl:1.*no assistant turn"):
        load({"sound": "a.wav", "conversations": [{"from": "human", "value": "<sound> hi"}]})
    with pytest.raises(ManifestError, match=r"bad\.jsonl:1.*no language"):
        one = {"from": "human", "value": "<sound> what?"}
        load_source(write_jsonl(tmp_path / "bad.jsonl", [{"sound": "a.wav", "conversations": [one, gpt]}]))


def test_nemo_reader_refuses_a_conversation_line_after_plain_ones(clips, tmp_path):
    plain = {"audio_filepath": "a.wav", "duration": 0.5, "text": "<|hi|> पानी"}
    conv = {
        "id": "s1",
        "lang": "hi",
        "conversations": [{"from": "human", "value": "<sound>"}],
        "sound": "a.wav",
    }
    with pytest.raises(ManifestError, match=r"m\.json:2.*read the file as type 'conversations'"):
        load_source(write_jsonl(tmp_path / "m.json", [plain, conv]))


def test_conversation_json_in_a_parquet_row_that_is_broken_names_the_row(clips, tmp_path, tok):
    table = load_source(nemo_conversation_jsonl(tmp_path))
    table = table.set_column(table.schema.get_field_index("conversation"), "conversation", [["{not json"]])
    with pytest.raises(ValueError, match=r"manifest .*, segment s1: not a conversation"):
        SpeechDataset(table, tok).conversation(0)


def test_a_parquet_row_with_a_bad_conversation_is_refused_when_indexed(clips, tmp_path):
    from speechlm.data.sources.mmap_cache import open_index

    table = load_source(nemo_conversation_jsonl(tmp_path))
    doc = json.loads(table.column("conversation")[0].as_py())
    doc["turns"] = doc["turns"][:1]  # the user turn only: nothing to train on
    table = table.set_column(
        table.schema.get_field_index("conversation"), "conversation", [[json.dumps(doc)]]
    )
    pq.write_table(table, tmp_path / "bad.parquet")
    for read in (load_source, open_index):
        with pytest.raises(ManifestError, match=r"bad\.parquet, row 0: .*no assistant turn"):
            read(tmp_path / "bad.parquet")


def test_a_cut_short_conversation_file_or_tar_is_an_error_naming_it(clips, tmp_path):
    """What a killed writer leaves: half a JSON line, a tar cut in the middle of its last member."""
    path = nemo_conversation_jsonl(tmp_path)
    whole = path.read_text()
    path.write_text(whole + whole[: len(whole) // 2])
    with pytest.raises(ManifestError, match=r"nemo_conv\.jsonl:2: not valid JSON"):
        load_source(path)
    folder = nemo_conversation_tarred(tmp_path, clips)
    tar = folder / "audio_0.tar"
    tar.write_bytes(tar.read_bytes()[: 512 * 3 + 1000])  # a.wav whole-ish, b.wav's header and part of it
    with pytest.raises(ManifestError, match=r"audio_0\.tar"):
        load_source(folder)


def test_manifest_convert_writes_conversations_to_parquet(clips, tmp_path, tok):
    from speechlm.cli import main

    src = sharegpt_json(tmp_path)
    assert (
        main(
            [
                "manifest",
                "convert",
                str(src),
                "--format",
                "conversations",
                "--out",
                str(tmp_path / "c.parquet"),
            ]
        )
        == 0
    )
    _, conv = read_back(tmp_path / "c.parquet", tok)
    assert conv == expected(clips)


def test_lhotse_cut_with_prompt_and_target_in_its_supervision_custom(clips, tmp_path, tok):
    from lhotse import CutSet, Recording, SupervisionSegment

    cut = Recording.from_file(clips["a.wav"], recording_id="rec-a").to_cut()
    cut.id = "t1"
    sup = SupervisionSegment("t1-sup", "rec-a", 0.0, cut.duration, text="पानी", language="hi")
    sup.custom = {"prompt": "Translate to English.", "target": "water", "task": "ast"}
    cut.supervisions = [sup]
    other = Recording.from_file(clips["b.wav"], recording_id="rec-b").to_cut()
    other.supervisions = [SupervisionSegment("o", "rec-b", 0.0, other.duration, text="घर", language="hi")]
    CutSet.from_cuts([cut, other]).to_file(tmp_path / "cuts.jsonl.gz")
    table = load_source(tmp_path / "cuts.jsonl.gz")
    ds = SpeechDataset(table, tok)
    conv = ds.conversation(0)
    assert (conv.task, conv.answer, conv.clips[0].transcript) == ("ast", "water", "<|hi|> पानी")
    assert conv.turns[0].parts == (AudioRef(0), "Translate to English.")
    plain = ds.conversation(1)  # a cut without custom fields: today's transcript row
    assert (plain.task, plain.answer) == ("asr", "<|hi|> घर") and table.column("answer")[1].as_py() is None


def test_parquet_manifest_with_a_conversations_column(clips, tmp_path, tok):
    """A manifest's `conversations` column (NeMo form, JSON text) next to plain transcript rows."""
    import pyarrow as pa

    turns = json.dumps(nemo_turns("a.wav", "b.wav"))
    table = pa.table({
        "segment_id": ["s1", "p1"], "audio_filepath": ["a.wav", "b.wav"], "duration": [0.75, 0.25],
        "text": ["", "<|hi|> घर"], "lang": ["hi", "hi"], "task": ["qa", None], "conversations": [turns, None],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "m.parquet")
    assert detect_source_type(tmp_path / "m.parquet") == "conversations"
    got = load_source(tmp_path / "m.parquet")
    ds = SpeechDataset(got, tok)
    assert ds.conversation(0) == expected(clips)
    assert (ds.conversation(1).answer, ds.conversation(1).task) == ("<|hi|> घर", "asr")
