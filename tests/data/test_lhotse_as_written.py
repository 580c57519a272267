"""Issue 36, item 2: Lhotse cuts as Lhotse writes them.

Every input here is written with Lhotse's own API (`Recording`, `SupervisionSegment`, `MonoCut`,
`CutSet.to_file` to ``.json``, ``.json.gz``, ``.jsonl``, ``.jsonl.gz``; `SharWriter`) over small audio files
written with soundfile. Three rules (docs/data.md, "Lhotse"): every one of these files is detected as
Lhotse cuts; a language name (``English``) becomes its code through a declared table, any other value
that is not a code is refused naming the cut, the file and the value; a cut trains on its supervised
span (the extent of its supervisions, their texts joined in time order), and the seconds no
supervision covers are reported by the reader and by `speechlm manifest stats`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speechlm.data.manifest import ManifestError
from speechlm.data.sources.detect import detect_source_type, load_source

pytest.importorskip("lhotse")  # installed with the dev extras; the project declares it in [lhotse]

SR = 16000
FORMATS = ("json", "json.gz", "jsonl", "jsonl.gz")


def _wav(path: Path, seconds: float) -> Path:
    t = np.arange(round(seconds * SR)) / SR
    sf.write(path, (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), SR)
    return path


def _cut(
    audio: Path, cut_id: str, sups: list[tuple[float, float, str]], *, language="en", start=0.0, duration=None
):
    """A MonoCut over `audio` from `start` (seconds) with supervisions (start, duration, text) in the cut."""
    from lhotse import MonoCut, Recording, SupervisionSegment

    rec = Recording.from_file(audio, recording_id=f"rec-{cut_id}")
    segments = [
        SupervisionSegment(
            id=f"{cut_id}-s{k}", recording_id=rec.id, start=s, duration=d, text=text, language=language
        )
        for k, (s, d, text) in enumerate(sups)
    ]
    length = rec.duration - start if duration is None else duration
    return MonoCut(id=cut_id, start=start, duration=length, channel=0, recording=rec, supervisions=segments)


def _write(cuts: list, path: Path) -> Path:
    from lhotse import CutSet

    CutSet.from_cuts(cuts).to_file(path)
    return path


# ------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize("ext", FORMATS)
def test_cutset_to_file_is_read_as_lhotse_cuts(ext, tmp_path):
    """The audit's case whole: 'English', one supervision over 4.65 s of a 10.51 s cut, in every
    file form `CutSet.to_file` writes. Old code: `.json` was read as conversations, `.json.gz` was an
    unknown format, and every form trained on `<|english|>` over the whole 10.51 s."""
    audio = _wav(tmp_path / "long.wav", 10.51)
    cut = _cut(audio, "c0", [(2.0, 4.65, "hello there")], language="English")
    path = _write([cut], tmp_path / f"cuts.{ext}")
    assert detect_source_type(path) == "lhotse_cuts"
    row = load_source(path).to_pylist()[0]
    assert (row["segment_id"], row["lang"], row["text"]) == ("c0", "en", "<|en|> hello there")
    assert row["audio_filepath"] == str(audio)
    assert row["start"] == pytest.approx(2.0) and row["duration"] == pytest.approx(4.65)


@pytest.mark.filterwarnings("ignore:Your manifest was created with Lhotse version earlier than v0.8")
def test_json_cutset_written_as_lhotse_fixtures_are(tmp_path):
    """Lhotse's own fixtures (test/fixtures/ami/cuts.json) are a pretty-printed JSON array whose cuts
    begin with another key than `id` and whose type is the old name `Cut`: still Lhotse cuts."""
    audio = _wav(tmp_path / "a.wav", 2.0)
    d = _cut(audio, "c0", [(0.0, 2.0, "hi")]).to_dict()
    d["type"] = "Cut"
    (tmp_path / "cuts.json").write_text(json.dumps([dict(sorted(d.items()))], indent=2))
    assert detect_source_type(tmp_path / "cuts.json") == "lhotse_cuts"
    assert load_source(tmp_path / "cuts.json").column("text").to_pylist() == ["<|en|> hi"]


def test_a_one_line_json_cutset_with_a_large_first_cut(tmp_path):
    """The first cut is parsed from the front of the file in chunks: a first cut longer than one chunk,
    in an array written on one line, is still found."""
    from lhotse import CutSet

    audio = _wav(tmp_path / "a.wav", 1.0)
    cut = _cut(audio, "c0", [(0.0, 1.0, "hello")])
    cut.custom = {"note": "x" * 200_000}
    path = tmp_path / "cuts.json"
    path.write_text(
        json.dumps([c.to_dict() for c in CutSet.from_cuts([cut, _cut(audio, "c1", [(0, 1, "hi")])])])
    )
    assert path.read_text().count("\n") == 0
    assert detect_source_type(path) == "lhotse_cuts"
    assert load_source(path).column("segment_id").to_pylist() == ["c0", "c1"]


def test_sharegpt_json_arrays_are_still_conversations(tmp_path):
    """The other JSON array the project reads keeps its reader, also when it is not UTF-8 past the
    first chunk (its reader names the line)."""
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": "s", "sound": "a.wav", "conversations": []}]))
    assert detect_source_type(path) == "conversations"
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'[\n{"id": "s", "note": "' + b"y" * 70_000 + b'\xff", "conversations": []}]')
    assert detect_source_type(bad) == "conversations"


@pytest.mark.parametrize(
    ("what", "ext"), [("RecordingSet", "json"), ("RecordingSet", "jsonl.gz"), ("SupervisionSet", "json")]
)
def test_a_recording_or_supervision_manifest_is_named_as_not_cuts(what, ext, tmp_path, capsys):
    """Lhotse's other manifests written by their own to_file: one error saying to make cuts of them
    (old code: a RecordingSet .jsonl.gz ended in exit 70, a .json was read as a conversation file)."""
    from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

    from speechlm.cli import main

    rec = Recording.from_file(_wav(tmp_path / "a.wav", 1.0), recording_id="r0")
    manifest = (
        RecordingSet.from_recordings([rec])
        if what == "RecordingSet"
        else SupervisionSet.from_segments(
            [SupervisionSegment("s0", "r0", 0.0, 1.0, text="hi", language="en")]
        )
    )
    path = tmp_path / f"m.{ext}"
    manifest.to_file(path)
    assert main(["manifest", "stats", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and "Traceback" not in err
    assert "not a CutSet" in err and "CutSet.from_manifests" in err


# ------------------------------------------------------------------------------------- languages
@pytest.mark.parametrize(
    ("written", "code"),
    [("English", "en"), ("ENGLISH", "en"), ("english", "en"), ("Hindi", "hi"), ("Mandarin", "zh"),
     ("Chinese", "zh"), ("Cantonese", "yue"), ("Tibetan", "bo"), ("German", "de"), ("hi", "hi"), ("EN", "en")],
)  # fmt: skip
def test_language_names_become_codes(written, code, tmp_path):
    audio = _wav(tmp_path / "a.wav", 1.0)
    path = _write([_cut(audio, "c0", [(0.0, 1.0, "hello")], language=written)], tmp_path / "cuts.jsonl.gz")
    row = load_source(path).to_pylist()[0]
    assert (row["lang"], row["text"]) == (code, f"<|{code}|> hello")


@pytest.mark.parametrize("written", ["Klingon", "Singaporean English", "English-US"])
def test_a_language_that_is_neither_a_code_nor_a_known_name_is_refused(written, tmp_path):
    audio = _wav(tmp_path / "a.wav", 1.0)
    good = _cut(audio, "ok", [(0.0, 1.0, "hello")])
    bad = _cut(audio, "c7", [(0.0, 1.0, "hello")], language=written)
    path = _write([good, bad], tmp_path / "cuts.json")
    with pytest.raises(ManifestError) as e:
        load_source(path)
    msg = str(e.value)
    assert "cut 'c7'" in msg and "cuts.json" in msg and repr(written) in msg
    assert "docs/data.md" in msg and "ISO 639" in msg


def test_a_language_name_in_the_custom_lang_field_becomes_its_code(tmp_path):
    """The issue-23 custom `lang` goes through the same table."""
    audio = _wav(tmp_path / "a.wav", 1.0)
    cut = _cut(audio, "c0", [(0.0, 1.0, "pani")], language="Hindi")
    cut.custom = {"lang": "Hindi", "task": "ast", "prompt": "Translate.", "target": "water"}
    row = load_source(_write([cut], tmp_path / "cuts.jsonl")).to_pylist()[0]
    assert row["lang"] == "hi"


def test_the_default_language_takes_a_name_too(tmp_path):
    """`--lang English` (default_lang) for cuts whose supervisions name no language: `en`, not `<|english|>`;
    without it the error names the cut and the three places a language can come from."""
    audio = _wav(tmp_path / "a.wav", 1.0)
    path = _write([_cut(audio, "c0", [(0.0, 1.0, "hello")], language=None)], tmp_path / "cuts.jsonl.gz")
    row = load_source(path, default_lang="English").to_pylist()[0]
    assert (row["lang"], row["text"]) == ("en", "<|en|> hello")
    with pytest.raises(
        ManifestError, match=r"cut 'c0' \(cuts.jsonl.gz\) names no language.*custom 'lang'.*--lang"
    ):
        load_source(path)
    with pytest.raises(ManifestError, match="default_lang 'Klingon', which is neither"):
        load_source(path, default_lang="Klingon")


def test_an_unknown_custom_lang_is_refused(tmp_path):
    """Old code fell back to the supervision's language without a word."""
    audio = _wav(tmp_path / "a.wav", 1.0)
    cut = _cut(audio, "c0", [(0.0, 1.0, "pani")], language="hi")
    cut.custom = {"lang": "Hindustani", "task": "ast", "prompt": "Translate.", "target": "water"}
    with pytest.raises(
        ManifestError, match=r"cut 'c0' \(cuts.jsonl\): custom 'lang' 'Hindustani', which is neither"
    ):
        load_source(_write([cut], tmp_path / "cuts.jsonl"))


def test_supervisions_in_two_languages_are_refused(tmp_path):
    audio = _wav(tmp_path / "a.wav", 2.0)
    cut = _cut(audio, "c0", [(0.0, 1.0, "hello")], language="English")
    from lhotse import SupervisionSegment

    cut.supervisions.append(
        SupervisionSegment("c0-hi", cut.recording_id, 1.0, 1.0, text="नमस्ते", language="hi")
    )
    with pytest.raises(ManifestError, match=r"cut 'c0' \(cuts.jsonl.gz\).*'en'.*'hi'"):
        load_source(_write([cut], tmp_path / "cuts.jsonl.gz"))


# ---------------------------------------------------------------------------------- supervised span
def test_a_cut_of_a_recording_trains_on_its_supervision_inside_the_recording(tmp_path):
    """Cut 1.0-4.0 s of a 5 s file, supervision 0.5-2.0 s into the cut: the row reads 1.5-3.0 s of the file."""
    audio = _wav(tmp_path / "a.wav", 5.0)
    cut = _cut(audio, "c0", [(0.5, 1.5, "hello")], start=1.0, duration=3.0)
    row = load_source(_write([cut], tmp_path / "cuts.jsonl.gz")).to_pylist()[0]
    assert row["start"] == pytest.approx(1.5) and row["duration"] == pytest.approx(1.5)


def test_a_fully_supervised_cut_is_unchanged(tmp_path):
    audio = _wav(tmp_path / "a.wav", 2.0)
    table = load_source(_write([_cut(audio, "c0", [(0.0, 2.0, "hello")])], tmp_path / "cuts.jsonl.gz"))
    assert "start" not in table.column_names and table.column("duration").to_pylist() == [pytest.approx(2.0)]


def test_several_supervisions_join_in_time_order_over_their_extent(tmp_path):
    """Written out of order, with a gap: the texts in time order, the clip from the first start to the
    last end (the gap inside is kept and counted). Old code refused any cut with two supervisions."""
    audio = _wav(tmp_path / "a.wav", 6.0)
    cut = _cut(audio, "c0", [(3.36, 1.0, "you can call me abbie"), (1.46, 1.36, "i'm abigail claflin")])
    table = load_source(_write([cut], tmp_path / "cuts.json"))
    row = table.to_pylist()[0]
    assert row["text"] == "<|en|> i'm abigail claflin you can call me abbie"
    assert row["start"] == pytest.approx(1.46) and row["duration"] == pytest.approx(4.36 - 1.46)
    coverage = json.loads(table.schema.metadata[b"speechlm.lhotse_coverage"])
    assert coverage["cuts"] == 1 and coverage["trimmed_cuts"] == 1
    assert coverage["left_out_s"] == pytest.approx(6.0 - (4.36 - 1.46), abs=1e-3)
    assert coverage["between_supervisions_s"] == pytest.approx(3.36 - 2.82, abs=1e-3)


def test_overlapping_supervisions_are_refused(tmp_path):
    audio = _wav(tmp_path / "a.wav", 3.0)
    cut = _cut(audio, "c0", [(0.0, 2.0, "one speaker"), (1.5, 1.5, "another speaker")])
    with pytest.raises(ManifestError) as e:
        load_source(_write([cut], tmp_path / "cuts.jsonl.gz"))
    msg = str(e.value)
    assert "cut 'c0'" in msg and "'c0-s0'" in msg and "'c0-s1'" in msg and "overlap" in msg
    assert "trim_to_supervisions" in msg


def test_a_supervision_beyond_its_cut_is_refused(tmp_path):
    """Its text holds words the cut's audio lacks (a cut truncated with its supervisions kept whole)."""
    audio = _wav(tmp_path / "a.wav", 4.0)
    cut = _cut(audio, "c0", [(1.0, 2.5, "more words than audio")], duration=2.0)
    with pytest.raises(ManifestError) as e:
        load_source(_write([cut], tmp_path / "cuts.jsonl.gz"))
    msg = str(e.value)
    assert "cut 'c0'" in msg and "'c0-s0'" in msg and "1.000-3.500" in msg and "2.000" in msg


def test_a_prompted_cut_trains_on_its_supervised_span_too(tmp_path):
    """A cut with a prompt and a target (issue 23) and a supervision over part of it: the clip is the span."""
    audio = _wav(tmp_path / "a.wav", 4.0)
    cut = _cut(audio, "c0", [(1.0, 2.0, "pani")], language="hi")
    cut.custom = {"task": "ast", "prompt": "Translate.", "target": "water"}
    row = load_source(_write([cut], tmp_path / "cuts.jsonl.gz")).to_pylist()[0]
    assert row["duration"] == pytest.approx(2.0) and row["start"] == pytest.approx(1.0)


def test_loading_warns_of_uncovered_audio(tmp_path, caplog):
    audio = _wav(tmp_path / "a.wav", 10.51)
    full = _cut(_wav(tmp_path / "b.wav", 1.0), "full", [(0.0, 1.0, "all of it")])
    path = _write([_cut(audio, "c0", [(2.0, 4.65, "hello")]), full], tmp_path / "cuts.jsonl.gz")
    with caplog.at_level(logging.WARNING):
        load_source(path)
    text = caplog.text
    assert (
        "cuts.jsonl.gz" in text and "1 of 2 cuts" in text and "5.86 s" in text and "supervised span" in text
    )


def test_manifest_stats_reports_uncovered_seconds(tmp_path, capsys):
    from speechlm.cli import main

    audio = _wav(tmp_path / "a.wav", 10.51)
    path = _write([_cut(audio, "c0", [(2.0, 4.65, "hello")], language="English")], tmp_path / "cuts.json")
    assert main(["manifest", "stats", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["languages"].keys() == {"en"}
    cov = stats["lhotse_coverage"]
    assert (cov["cuts"], cov["trimmed_cuts"]) == (1, 1)
    assert cov["cut_s"] == pytest.approx(10.51) and cov["left_out_s"] == pytest.approx(10.51 - 4.65)
    assert main(["manifest", "stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not covered by a supervision" in out and "5.86 s left out" in out


def _shar(tmp_path: Path, cut) -> Path:
    from lhotse.shar import SharWriter

    out = tmp_path / "shar"
    out.mkdir()
    with SharWriter(str(out), fields={"recording": "flac"}, shard_size=8) as writer:
        writer.write(cut)
    return out


def test_shar_refuses_a_partly_supervised_cut(tmp_path):
    """A Shar member holds the whole cut's audio and is read whole: a cut with uncovered audio cannot be
    trained on its span there, so it is refused with the fix (old code trained on the whole cut)."""
    cut = _cut(_wav(tmp_path / "a.wav", 3.0), "c0", [(1.0, 1.0, "hello")])
    with pytest.raises(ManifestError) as e:
        load_source(_shar(tmp_path, cut))
    msg = str(e.value)
    assert "cut 'c0'" in msg and "trim_to_supervisions" in msg


def test_shar_joins_supervisions_that_cover_the_cut(tmp_path):
    cut = _cut(
        _wav(tmp_path / "a.wav", 2.0), "c0", [(1.0, 1.0, "world"), (0.0, 1.0, "hello")], language="English"
    )
    row = load_source(_shar(tmp_path, cut)).to_pylist()[0]
    assert (row["text"], row["lang"]) == ("<|en|> hello world", "en")


def test_docs_list_every_language_name():
    from speechlm.data.lang_names import LANGUAGE_NAMES

    docs = (Path(__file__).resolve().parents[2] / "docs/data.md").read_text()
    missing = [
        f"{name} {code}" for name, code in LANGUAGE_NAMES.items() if f"{name.title()} `{code}`" not in docs
    ]
    assert not missing
