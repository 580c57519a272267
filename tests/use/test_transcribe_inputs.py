"""`speechlm transcribe` inputs without transcripts, long clips, cut transcripts and --out checks (issue 36:
TR09, TR10, TR12, TR13, TA07).

The model is a stand-in (`load_model` patched): it "decodes" each clip to the word ``w<10+k>``, where k is
the clip's first sample times 10, so the tests see which audio reached the decoder, cut how, and in what
order; marker 9 never ends (it fills ``--max-new-tokens``). Everything else (reading the inputs, batching,
windows, joining, the output file, the exit codes) is the command's own code through `speechlm.cli.main`.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

SR = 16000
TAG = 1  # the fake tokenizer's <|en|>
ENDLESS = 9  # the marker of a clip whose decoding never reaches its stop token


class FakeTokenizer:
    langs = ("en",)
    tag_tokens = True

    def lang_id(self, lang: str) -> int:
        return TAG

    def decode(self, ids: list[int]) -> str:
        return " ".join("<|en|>" if i == TAG else f"w{i}" for i in ids)


class FakeModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.lengths: list[int] = []  # samples of every clip or window it decoded

    def generate_greedy(self, audio_BN, lens_B, *, max_new_tokens, lang_id=None):
        out = []
        for a, n in zip(audio_BN, lens_B):
            self.lengths.append(int(n))
            k = round(float(a[0]) * 10)
            ids = [TAG] + ([50] * max_new_tokens if k == ENDLESS else [10 + k])
            out.append(ids[:max_new_tokens])
        return out


@pytest.fixture
def fake(monkeypatch) -> FakeModel:
    from speechlm.use import transcribe

    model = FakeModel()
    um = transcribe.UsableModel(model, FakeTokenizer(), SR, 100.0)
    monkeypatch.setattr(transcribe, "load_model", lambda path, device: um)
    return model


def wav(path: Path, seconds: float, marker: int | list[int]) -> str:
    """`seconds` of audio whose samples hold `marker`/10 (a list: equal consecutive parts, one per marker)."""
    markers = [marker] if isinstance(marker, int) else marker
    n = int(seconds * SR)
    x = np.concatenate([np.full(n * (k + 1) // len(markers) - n * k // len(markers), m / 10) for k, m in
                        enumerate(markers)]).astype(np.float32)  # fmt: skip
    sf.write(path, x, SR, subtype="FLOAT")
    return str(path)


def run(args: list[str], capsys) -> tuple[int, list[dict], str]:
    from speechlm.cli import main

    rc = main(["transcribe", "model", *args, "--device", "cpu"])
    captured = capsys.readouterr()
    return rc, [json.loads(x) for x in captured.out.splitlines() if x.startswith("{")], captured.err


def test_a_nemo_manifest_of_new_audio_needs_no_transcript(fake, tmp_path, capsys):
    """TR12 (text "" dropped, exit 0, no output) and TR13 (no text key refused)."""
    a, b = wav(tmp_path / "a.wav", 1.0, 1), wav(tmp_path / "b.wav", 1.5, 2)
    rows = [
        {"audio_filepath": a, "duration": 1.0, "text": "", "lang": "en"},
        {"audio_filepath": "b.wav", "lang": "en"},  # no text, no duration; relative to the manifest
        {"audio_filepath": a, "text": "an old transcript is ignored"},
    ]
    manifest = tmp_path / "new.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, lines, err = run(["--manifest", str(manifest)], capsys)
    assert rc == 0, err
    assert [(x["row"], x["path"], x["text"]) for x in lines] == [(0, a, "w11"), (1, b, "w12"), (2, a, "w11")]
    assert all(x["lang"] == "en" for x in lines)


def test_a_list_of_paths_is_transcribed_and_a_bad_line_gets_its_error(fake, tmp_path, capsys):
    a = wav(tmp_path / "a.wav", 1.0, 3)
    paths = tmp_path / "new_audio.txt"
    paths.write_text(f"# new recordings\n{a}\n\nmissing.flac\n")
    rc, lines, err = run(["--manifest", str(paths)], capsys)
    assert rc == 1  # one input failed: exit 1 after writing every line
    assert lines[0] == {"row": 0, "path": a, "lang": "en", "text": "w13"}
    assert lines[1]["path"] == str(tmp_path / "missing.flac") and "does not exist" in lines[1]["error"]
    assert "1 of 2 inputs could not be transcribed" in err

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"audio_filepath": a}) + "\n" + json.dumps({"text": "no audio"}) + "\n{oops\n")
    rc, lines, err = run(["--manifest", str(bad)], capsys)
    assert rc == 1 and lines[0]["text"] == "w13"
    assert "no 'audio_filepath'" in lines[1]["error"] and "bad.jsonl:3" in lines[2]["error"]


def test_a_parquet_without_text_is_transcribed(fake, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = wav(tmp_path / "a.wav", 1.0, 4)
    pq.write_table(pa.table({"audio_filepath": ["a.wav", "a.wav"]}), tmp_path / "new.parquet")
    rc, lines, err = run(["--manifest", str(tmp_path / "new.parquet")], capsys)
    assert rc == 0, err
    assert [(x["row"], x["path"], x["text"]) for x in lines] == [(0, a, "w14"), (1, a, "w14")]


def test_a_conversation_manifest_without_transcripts_gives_a_line_per_clip(fake, tmp_path, capsys):
    """TR10: conversation rows were refused row by row (missing_tag); transcription needs their clips only."""
    wav(tmp_path / "c0.wav", 1.0, 5)
    wav(tmp_path / "c1.wav", 1.2, 6)
    row = {
        "id": "s0",
        "lang": "en",
        "conversations": [
            {"from": "User", "type": "audio", "value": "c0.wav", "duration": 1.0},
            {"from": "User", "type": "audio", "value": "c1.wav", "duration": 1.2},
            {"from": "User", "type": "text", "value": "Transcribe both clips."},
            {"from": "Assistant", "type": "text", "value": "anything"},
        ],
    }
    manifest = tmp_path / "conv.jsonl"
    manifest.write_text(json.dumps(row) + "\n")
    rc, lines, err = run(["--manifest", str(manifest)], capsys)
    assert rc == 0, err
    assert [(x["row"], x["clip"], Path(x["path"]).name, x["text"]) for x in lines] == [
        (0, 0, "c0.wav", "w15"),
        (0, 1, "c1.wav", "w16"),
    ]


def test_no_input_at_all_is_an_error_not_an_empty_success(fake, tmp_path, capsys):
    for name, text in (("empty.txt", "# nothing yet\n\n"), ("empty.jsonl", "")):
        (tmp_path / name).write_text(text)
        rc, lines, err = run(["--manifest", str(tmp_path / name)], capsys)
        assert rc == 1 and lines == []
        assert "holds no audio to transcribe (0 inputs)" in err


def test_a_long_clip_is_refused_unless_chunked_then_windows_are_joined_in_order(fake, tmp_path, capsys):
    """TA07: a clip over --max-duration is not decoded whole (its line says why, exit 1); with --chunk it is
    cut into ceil(d / chunk) equal windows whose texts are joined with a space, in order."""
    short = wav(tmp_path / "short.wav", 1.0, 1)
    long = wav(tmp_path / "long.wav", 10.0, [1, 2, 3, 4])
    rc, lines, err = run([short, long, "--max-duration", "6"], capsys)
    assert rc == 1 and lines[0]["text"] == "w11"
    assert "10.0 s long, more than --max-duration 6 s" in lines[1]["error"] and "--chunk" in lines[1]["error"]
    assert fake.lengths == [SR]  # the long clip never reached the decoder

    fake.lengths.clear()
    rc, lines, err = run([short, long, "--max-duration", "6", "--chunk", "3"], capsys)
    assert rc == 0, err
    assert lines[1] == {"path": long, "lang": "en", "text": "w11 w12 w13 w14", "windows": 4}
    assert sorted(fake.lengths) == [SR, *[int(2.5 * SR)] * 4]  # 4 windows of 2.5 s, none over 3 s

    rc, _, err = run([short, "--chunk", "90", "--max-duration", "60"], capsys)
    assert rc == 2 and "--chunk 90.0" in err


def test_a_transcript_cut_at_max_new_tokens_is_marked_and_warned(fake, tmp_path, capsys):
    ends, endless = wav(tmp_path / "ends.wav", 1.0, 2), wav(tmp_path / "endless.wav", 1.0, ENDLESS)
    rc, lines, err = run([ends, endless, "--max-new-tokens", "4"], capsys)
    assert rc == 0
    assert "truncated" not in lines[0] and lines[1]["truncated"] is True
    assert "1 input(s) stopped at --max-new-tokens 4" in err and endless in err


def read_only(monkeypatch, folder: Path, *methods: str) -> None:
    """Path `methods` fail with EROFS under `folder`, as on a read-only mount (we run as root: chmod stops
    nothing)."""
    for name in methods:
        original = getattr(Path, name)

        def fail(self, *args, _original=original, **kwargs):
            if str(self).startswith(str(folder)):
                raise OSError(errno.EROFS, "Read-only file system")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Path, name, fail)


def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """TR09: the refusal came after the whole transcription, as exit 70."""
    from speechlm.use import transcribe

    def no_model(*args):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(transcribe, "load_model", no_model)
    read_only(monkeypatch, tmp_path, "open")
    rc, _, err = run([str(tmp_path / "a.wav"), "--out", str(tmp_path / "hyps.jsonl")], capsys)
    assert rc == 4
    assert f"--out {tmp_path / 'hyps.jsonl'} cannot be written (Read-only file system)" in err
    assert "nothing was transcribed" in err


def test_an_out_that_fails_at_the_end_says_the_lines_were_not_written(fake, tmp_path, capsys, monkeypatch):
    a = wav(tmp_path / "a.wav", 1.0, 1)
    out = tmp_path / "hyps.jsonl"
    out.write_text("previous\n")
    read_only(monkeypatch, tmp_path, "write_text", "unlink")  # the disk went read-only while decoding
    rc, _, err = run([a, "--out", str(out)], capsys)
    assert rc == 4 and "Traceback" not in err
    assert f"cannot write {out}: Read-only file system; the 1 lines decoded were not written" in err
    assert out.read_bytes() == b"previous\n"
