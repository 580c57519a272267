"""Issue 20, data tools: bad input to `speechlm manifest build|convert|stats`, the Lhotse adapter,
`speechlm shards write` and `speechlm tokenizer train` gives one clear error naming the input (and
its exit code), or a counted drop; nothing is half-written or overwritten.

Each case runs `speechlm.cli.main([...])` in-process; the table rows carry the audit case ids
(shared/audits/bad-input-2026-11-25.md) where one exists.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speechlm.cli import main
from speechlm.errors import EXIT_DATA, EXIT_OUTPUT, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data/demo/shards"
A = DEMO / "en_000/audio/en_000_00000.flac"  # 2.0 s
B = DEMO / "en_000/audio/en_000_00001.flac"


def _nemo(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _manifest(path: Path, audio: list[str], durations: list[float], texts: list[str] | None = None) -> Path:
    from speechlm.data.manifest import build_manifest_table

    n = len(audio)
    texts = texts or ["<|en|> hello world"] * n
    table = build_manifest_table(
        [f"u{i}" for i in range(n)], audio, durations, texts, ["en"] * n, shard_ids="s", source="nemo"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def _real_duration(path: Path) -> float:
    import soundfile as sf

    return float(sf.info(str(path)).duration)


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error(err: str) -> None:
    assert "Traceback" not in err
    assert err.strip().startswith("error:"), err


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad_data_tools")
    f: dict[str, Path] = {"dir": d}
    for name, value in (("neg", -4), ("nan", float("nan")), ("inf", float("inf")), ("zero", 0)):
        rows = [
            {"audio_filepath": str(B), "duration": 2.0, "text": "good day", "lang": "en"},
            {"audio_filepath": str(A), "duration": value, "text": "hello world", "lang": "en"},
        ]
        f[f"nemo_{name}"] = _nemo(d / f"nemo/{name}.json", rows)
    afile = d / "afile"
    afile.write_text("not a folder\n")
    f["afile"] = afile
    f["good_json"] = _nemo(
        d / "nemo/good.json",
        [{"audio_filepath": str(A), "duration": 2.0, "text": "hello world", "lang": "en"}],
    )
    f["good_parquet"] = _manifest(d / "good.parquet", [str(A), str(B)], [2.0, _real_duration(B)])
    return f


# ------------------------------------------------------------------------------ 1. durations
@pytest.mark.parametrize("case", ["neg", "nan", "inf", "zero"])
def test_convert_refuses_bad_duration(files, capsys, tmp_path, case):
    """O4b_neg/nan/inf/zero: the error names file:line and the value; nothing is written."""
    out = tmp_path / "x.parquet"
    code, _, err = _run(capsys, ["manifest", "convert", str(files[f"nemo_{case}"]), "--out", str(out)])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert f"{files[f'nemo_{case}']}:2" in err
    assert "duration" in err
    assert not out.exists()


def _bad_duration_parquet(tmp_path: Path, value: float) -> Path:
    # written directly (the converters now refuse such rows)
    return _manifest(tmp_path / "bad.parquet", [str(B), str(A)], [2.0, value])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -4.0], ids=["O4c_nan", "O4c_inf", "O4c_neg"])
def test_stats_refuses_bad_duration(capsys, tmp_path, value):
    path = _bad_duration_parquet(tmp_path, value)
    code, out, err = _run(capsys, ["manifest", "stats", str(path)])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert "row 1" in err and "u1" in err and str(path) in err
    assert "-0.00" not in out


def test_duration_mismatch_rule():
    from speechlm.data.manifest.schema import duration_mismatch

    assert not duration_mismatch(2.0, 2.4)  # within 0.5 s
    assert duration_mismatch(1.0, 24.0)
    assert not duration_mismatch(20.0, 21.9)  # within 10 %
    assert duration_mismatch(20.0, 22.1)
    assert duration_mismatch(float("nan"), 2.0)
    assert not duration_mismatch(2.0, 2.9, tolerance_s=1.0)


def test_shards_write_refuses_duration_far_from_audio(capsys, tmp_path):
    """O4f: rows claiming 0.5 s for 2 s files are refused, naming the row, both durations and the file."""
    path = _manifest(tmp_path / "lie.parquet", [str(B), str(A)], [_real_duration(B), 0.5])
    out = tmp_path / "tars"
    code, _, err = _run(capsys, ["shards", "write", str(path), "--out", str(out)])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert "row 1" in err and str(A) in err and "0.5" in err and "2.0" in err
    assert f"{path} row 1" in err  # the manifest is named
    assert not (out / "index.parquet").exists()


def test_shards_write_index_holds_real_duration(capsys, tmp_path):
    path = _manifest(tmp_path / "m.parquet", [str(A)], [1.8])  # within tolerance
    out = tmp_path / "tars"
    code, _, _ = _run(capsys, ["shards", "write", str(path), "--out", str(out)])
    assert code == 0
    assert pq.read_table(out / "index.parquet")["duration"].to_pylist() == [
        pytest.approx(_real_duration(A), abs=1e-4)
    ]


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0.0])
def test_shards_write_refuses_bad_duration(capsys, tmp_path, value):
    path = _bad_duration_parquet(tmp_path, value)
    code, _, err = _run(capsys, ["shards", "write", str(path), "--out", str(tmp_path / "tars")])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert "row 1" in err and "duration" in err


# ------------------------------------------------------------------------------ 5. output paths
def test_build_out_is_a_file(files, capsys):
    """O6h1"""
    code, _, err = _run(capsys, ["manifest", "build", str(DEMO), "--out", str(files["afile"])])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert str(files["afile"]) in err
    assert files["afile"].read_text() == "not a folder\n"


def test_build_out_unwritable(capsys):
    """O6h2"""
    code, _, err = _run(capsys, ["manifest", "build", str(DEMO), "--out", "/proc/speechlm_out"])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert "/proc/speechlm_out" in err


def test_tokenizer_out_under_a_file(files, capsys):
    """O6h4"""
    out = files["afile"] / "tok"
    code, _, err = _run(
        capsys, ["tokenizer", "train", "--manifest", str(files["good_parquet"]), "--out", str(out)]
    )
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert str(files["afile"]) in err


def test_convert_out_under_a_file(files, capsys):
    """O6h5"""
    out = files["afile"] / "x.parquet"
    code, _, err = _run(capsys, ["manifest", "convert", str(files["good_json"]), "--out", str(out)])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert str(files["afile"]) in err


def test_convert_out_unwritable(files, capsys):
    code, _, err = _run(
        capsys, ["manifest", "convert", str(files["good_json"]), "--out", "/proc/x/y.parquet"]
    )
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert "/proc/x" in err


def test_shards_out_is_a_file(files, capsys):
    """O6h7"""
    code, _, err = _run(capsys, ["shards", "write", str(files["good_parquet"]), "--out", str(files["afile"])])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert str(files["afile"]) in err
    assert files["afile"].read_text() == "not a folder\n"


def test_stats_plot_under_a_file(files, capsys):
    """O6h8"""
    png = files["afile"] / "x.png"
    code, _, err = _run(capsys, ["manifest", "stats", str(files["good_parquet"]), "--plot", str(png)])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert str(png) in err


# ------------------------------------------------------------------------------ 6. tokenizer
@pytest.fixture(scope="module")
def tok_dir(files) -> Path:
    """A trained tokenizer (the good manifest's two rows are too few: train on a made-up corpus)."""
    from speechlm.data.tokenizer import train_tokenizer

    texts = [f"<|en|> hello world number {i} good day to you" for i in range(50)]
    model = train_tokenizer(texts, files["dir"] / "tok/tokenizer", langs=["en", "hi"], vocab_size=60)
    return model.parent


def _broken_tokenizer(tok_dir: Path, tmp_path: Path, case: str) -> Path:
    d = tmp_path / case
    d.mkdir()
    shutil.copy(tok_dir / "tokenizer.model", d)
    if case == "TK1":
        return d / "tokenizer.model"
    shutil.copy(tok_dir / "tokenizer.json", d)
    sidecar = d / "tokenizer.json"
    if case == "TK2":
        sidecar.write_bytes(sidecar.read_bytes()[:40])
    elif case == "TK3":
        meta = json.loads(sidecar.read_text())
        meta["lang_ids"].update(en=meta["lang_ids"]["hi"], hi=meta["lang_ids"]["en"])
        sidecar.write_text(json.dumps(meta))
    elif case == "TK_keys":
        sidecar.write_text('{"format": 1}')
    return d / "tokenizer.model"


@pytest.mark.parametrize(
    "case, words",
    [
        ("TK1", ["tokenizer.json", "is missing", "retrain"]),
        ("TK2", ["tokenizer.json", "not valid JSON", "retrain"]),
        ("TK3", ["tokenizer.json", "does not match", "retrain", "'<|en|>': sidecar"]),
        ("TK_keys", ["tokenizer.json", "lacks", "retrain"]),
    ],
)
def test_broken_tokenizer_is_a_data_error(tok_dir, tmp_path, case, words):
    """What `speechlm train` shows (run_guarded prints the message, exit 1): names the file and the fix."""
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.errors import DataError, run_guarded

    model = _broken_tokenizer(tok_dir, tmp_path, case)
    with pytest.raises(DataError) as info:
        Tokenizer(model)
    for word in words:
        assert word in str(info.value)
    assert str(model.parent) in str(info.value)
    assert run_guarded(lambda: Tokenizer(model)) == EXIT_DATA


def test_missing_tokenizer_model_is_a_data_error(tmp_path):
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.errors import DataError

    with pytest.raises(DataError, match="speechlm tokenizer train"):
        Tokenizer(tmp_path / "none.model")


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--vocab-size", "0"], ["--vocab-size 0"]),  # X17
        (["--vocab-size", "5"], ["vocab_size=5", "reserved"]),  # X18
        (["--character-coverage", "2"], ["--character-coverage 2", "0.98"]),  # X21
        (["--character-coverage", "0.5"], ["--character-coverage 0.5"]),
    ],
    ids=["X17", "X18", "X21", "X21_low"],
)
def test_tokenizer_bad_flags_are_usage_errors(files, capsys, tmp_path, flags, words, monkeypatch):
    import sentencepiece as spm

    def never(*_a, **_k):
        raise AssertionError("SentencePiece must not run")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", never)
    argv = ["tokenizer", "train", "--manifest", str(files["good_parquet"]), "--out", str(tmp_path / "t")]
    code, _, err = _run(capsys, argv + flags)
    assert code == EXIT_USAGE
    _assert_one_error(err)
    for word in words:
        assert word in err


def test_tokenizer_missing_manifest(capsys, tmp_path):
    """newcomer 146"""
    code, _, err = _run(capsys, ["tokenizer", "train", "--manifest", str(tmp_path / "missing.parquet")])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert "missing.parquet" in err and "does not exist" in err


def test_tokenizer_reads_a_nemo_manifest(capsys, tmp_path):
    """X22: a NeMo .json is read like any manifest the project reads."""
    rows = [
        {"audio_filepath": str(A), "duration": 2.0, "text": f"hello world number {i} good day", "lang": "en"}
        for i in range(40)
    ]
    path = _nemo(tmp_path / "train.json", rows)
    code, out, err = _run(
        capsys,
        ["tokenizer", "train", "--manifest", str(path), "--out", str(tmp_path / "t"), "--vocab-size", "40"],
    )
    assert code == 0, err
    assert (tmp_path / "t.model").is_file() and "languages: en" in out


def test_tokenizer_not_a_manifest(capsys, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    code, _, err = _run(capsys, ["tokenizer", "train", "--manifest", str(path)])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert "notes.txt" in err


# ------------------------------------------------------------------------------ 2. invalid UTF-8
def _bad_utf8_parquet(tmp_path: Path) -> Path:
    path = _manifest(tmp_path / "u.parquet", [str(A), str(B), str(A)], [2.0, 2.0, 2.0])
    t = pq.read_table(path)
    texts = [s.encode() for s in t["text"].to_pylist()]
    texts[2] = b"<|en|> \xff\xfe bad"
    i = t.schema.get_field_index("text")
    pq.write_table(t.set_column(i, "text", pa.array(texts, pa.binary()).view(pa.string())), path)
    return path


def test_tokenizer_names_the_bad_utf8_row(capsys, tmp_path):
    """U1"""
    path = _bad_utf8_parquet(tmp_path)
    code, _, err = _run(capsys, ["tokenizer", "train", "--manifest", str(path), "--out", str(tmp_path / "t")])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert str(path) in err and "'text'" in err and "row 2" in err and "UTF-8" in err


@pytest.fixture
def utf8_shards(tmp_path) -> Path:
    """The demo shards, links to their audio, one transcript of en_000 not UTF-8 (row 3)."""
    root = tmp_path / "sh_utf8"
    for shard in sorted(DEMO.iterdir()):
        (root / shard.name).mkdir(parents=True)
        for f in shard.glob("*.parquet"):
            shutil.copy(f, root / shard.name)
        (root / shard.name / "audio").symlink_to(shard / "audio")
    p = root / "en_000/metadata.parquet"
    t = pq.read_table(p)
    x = [s.encode() if s is not None else None for s in t["transcription_native"].to_pylist()]
    x[3] = b"hello \xff\xfe world"
    i = t.schema.get_field_index("transcription_native")
    pq.write_table(t.set_column(i, "transcription_native", pa.array(x, pa.binary()).view(pa.string())), p)
    return root


def test_build_names_shard_column_and_row_of_bad_utf8(utf8_shards, capsys, tmp_path):
    """O6i3"""
    code, _, err = _run(capsys, ["manifest", "build", str(utf8_shards), "--out", str(tmp_path / "m")])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert str(utf8_shards / "en_000/metadata.parquet") in err
    assert "'transcription_native'" in err and "row 3" in err
    assert not (tmp_path / "m/train.parquet").exists()


def test_build_skips_the_bad_utf8_shard(utf8_shards, capsys, tmp_path):
    """O6i4"""
    out = tmp_path / "m"
    code, stdout, err = _run(
        capsys, ["manifest", "build", str(utf8_shards), "--out", str(out), "--skip-bad-shards"]
    )
    assert code == 0, err
    assert "failed shards (1, skipped)" in stdout and "en_000" in stdout
    shards = set(pq.read_table(out / "train.parquet")["shard_id"].to_pylist())
    assert "en_000" not in shards and "en_001" in shards


# ------------------------------------------------------------------------------ 3/4. shards write
def test_shards_write_never_copies_a_non_audio_file(capsys, tmp_path):
    """O6j2: the error names the row and the RESOLVED path; no tar is written."""
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0\n" * 100)
    sub = tmp_path / "ds/sub"
    path = _nemo(
        sub / "escape.json",
        [
            {"audio_filepath": str(A), "duration": 2.0, "text": "hello", "lang": "en"},
            {"audio_filepath": "../../secret.txt", "duration": 2.0, "text": "good day", "lang": "en"},
        ],
    )
    out = tmp_path / "tars"
    code, _, err = _run(capsys, ["shards", "write", str(path), "--out", str(out)])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert "row 1" in err and str(secret) in err and "not an audio file" in err
    assert str(path) in err
    assert not out.exists() or not any(out.iterdir())


def test_convert_resolves_relative_paths_against_the_manifest_folder(capsys, tmp_path, caplog):
    """O6j1: stored absolute, resolved as NeMo does; a path outside the folder is flagged."""
    sub = tmp_path / "ds/sub"
    path = _nemo(
        sub / "m.json",
        [
            {"audio_filepath": "a.flac", "duration": 2.0, "text": "hello", "lang": "en"},
            {"audio_filepath": "../../elsewhere.flac", "duration": 2.0, "text": "hello", "lang": "en"},
        ],
    )
    out = tmp_path / "m.parquet"
    with caplog.at_level("WARNING"):
        code, _, _ = _run(capsys, ["manifest", "convert", str(path), "--out", str(out)])
    assert code == 0
    assert pq.read_table(out)["audio_filepath"].to_pylist() == [
        str(sub / "a.flac"),
        str(tmp_path / "elsewhere.flac"),
    ]
    assert "outside the manifest's folder" in caplog.text and str(tmp_path / "elsewhere.flac") in caplog.text


def test_shards_write_missing_audio_gives_true_advice(capsys, tmp_path):
    """T1, newcomer 151/153: the advice is to restore the file or remove the row."""
    path = _manifest(tmp_path / "m.parquet", [str(A), str(tmp_path / "gone.flac")], [2.0, 2.0])
    code, _, err = _run(capsys, ["shards", "write", str(path), "--out", str(tmp_path / "tars")])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert str(tmp_path / "gone.flac") in err and "row 1" in err
    assert "remove" in err and "restore" in err
    assert "drops missing files" not in err


@pytest.mark.parametrize("fmt", ["speechlm", "nemo"])
def test_shards_write_refuses_an_earlier_shard_set(files, capsys, tmp_path, fmt):
    """T10: the earlier set is left byte for byte; exit 4 names the folder."""
    out = tmp_path / "tars"
    argv = ["shards", "write", str(files["good_parquet"]), "--out", str(out), "--format", fmt]
    assert _run(capsys, argv + ["--shard-size", "1"])[0] == 0
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    one = _manifest(tmp_path / "one.parquet", [str(B)], [_real_duration(B)])
    code, _, err = _run(capsys, ["shards", "write", str(one), "--out", str(out), "--format", fmt])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert str(out) in err and "already holds a shard set" in err
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_shards_write_refuses_a_folder_with_other_files(files, capsys, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    code, _, err = _run(capsys, ["shards", "write", str(files["good_parquet"]), "--out", str(out)])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert "notes.txt" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_shards_write_killed_midway_is_refused_then_rerun(files, tmp_path):
    """SIGKILL after the first tar: no index, readers refuse the folder, a re-run completes it."""
    out = tmp_path / "tars"
    script = (
        "import os, signal, sys\n"
        "import speechlm.data.sources.shards as s\n"
        "real = s.write_one_tar\n"
        "def once(path, members):\n"
        "    r = real(path, members)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "s.write_one_tar = once\n"
        "from speechlm.cli import main\n"
        f"sys.exit(main(['shards', 'write', {str(files['good_parquet'])!r}, '--out', {str(out)!r}, '--shard-size', '1']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert (out / "shard-000000.tar").is_file() and not (out / "index.parquet").exists()

    from speechlm.data.manifest import ManifestError
    from speechlm.data.sources.shards import read_shards

    with pytest.raises(ManifestError, match="interrupted; run it again"):
        read_shards(out)
    assert main(["shards", "write", str(files["good_parquet"]), "--out", str(out), "--shard-size", "1"]) == 0
    assert len(read_shards(out)) == 2


# ------------------------------------------------------------------------------ 2. transcripts
def test_check_transcript_rule():
    from speechlm.data.text import check_transcript

    assert check_transcript("<|en|> hello", "en") is None
    assert check_transcript("hello", "en") == "missing_tag"
    assert check_transcript("<|hi|> hello", "en") == "tag_mismatch"
    assert check_transcript("<|en|> [noise] ...", "en") == "empty_text"
    assert check_transcript("<|en|>", "en") == "empty_text"


def test_convert_drops_and_counts_bad_transcripts(capsys, tmp_path):
    """N_emptytext, and a tag that disagrees with 'lang': dropped, counted in the printed report."""
    path = _nemo(
        tmp_path / "t.json",
        [
            {"audio_filepath": str(A), "duration": 2.0, "text": "", "lang": "en"},
            {"audio_filepath": str(B), "duration": 2.0, "text": "[noise] ...", "lang": "en"},
            {"audio_filepath": str(A), "duration": 2.0, "text": "<|hi|> hello", "lang": "en"},
            {"audio_filepath": str(B), "duration": 2.0, "text": "good day", "lang": "en"},
        ],
    )
    out = tmp_path / "t.parquet"
    code, stdout, _ = _run(capsys, ["manifest", "convert", str(path), "--out", str(out)])
    assert code == 0
    assert pq.read_table(out)["text"].to_pylist() == ["<|en|> good day"]
    assert "1 rows" in stdout and "dropped 3 rows" in stdout
    assert "2 empty_text" in stdout and "1 tag_mismatch" in stdout


def test_convert_refuses_when_every_row_is_dropped(capsys, tmp_path):
    """N_emptytext: a manifest of nothing is not written; the error says what was dropped."""
    rows = [{"audio_filepath": str(A), "duration": 2.0, "text": t, "lang": "en"} for t in ("", "[noise] ...")]
    path = _nemo(tmp_path / "t.json", rows)
    out = tmp_path / "t.parquet"
    code, _, err = _run(capsys, ["manifest", "convert", str(path), "--out", str(out)])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert str(path) in err and "2 empty_text" in err
    assert not out.exists()


def test_shards_write_skip_bad_audio_counts_and_names_rows(capsys, tmp_path):
    """--skip-bad-audio: the non-audio file and the far-off duration are left out, counted and named."""
    junk = tmp_path / "junk.flac"
    junk.write_bytes(os.urandom(3000))
    path = _manifest(tmp_path / "m.parquet", [str(A), str(junk), str(B)], [_real_duration(A), 2.0, 9.0])
    out = tmp_path / "tars"
    code, stdout, err = _run(capsys, ["shards", "write", str(path), "--out", str(out), "--skip-bad-audio"])
    assert code == 0, err
    assert "skipped 2 rows (1 duration_mismatch, 1 not_audio)" in stdout
    assert f"row 1 (segment u1) {junk}" in stdout and "row 2 (segment u2)" in stdout
    assert "wrote 1 utterances" in stdout
    index = pq.read_table(out / "index.parquet")
    assert index["segment_id"].to_pylist() == ["u0"]
    import tarfile

    assert [m.name for m in tarfile.open(out / "shard-000000.tar")] == ["u0.flac"]


# ------------------------------------------------------------------------------ 7. Lhotse
def _cuts_file(
    path: Path, *, start: float = 0.0, texts: tuple[str, ...] = ("hello world", "good day")
) -> Path:
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    cuts = []
    for k, (audio, text) in enumerate(zip((A, B), texts)):
        rec = Recording.from_file(str(audio), recording_id=f"r{k}")
        sup = SupervisionSegment(
            id=f"c{k}", recording_id=rec.id, start=0, duration=rec.duration, text=text, language="en"
        )
        cuts.append(
            MonoCut(id=f"c{k}", start=0, duration=rec.duration, channel=0, supervisions=[sup], recording=rec)
        )
    d = cuts[0].to_dict()
    d["start"] = start
    CutSet.from_dicts([d] + [c.to_dict() for c in cuts[1:]]).to_file(path)
    return path


def test_lhotse_not_gzip(capsys, tmp_path):
    """L_notgz"""
    path = tmp_path / "notgz.jsonl.gz"
    path.write_text("not gzip at all\n")
    code, _, err = _run(
        capsys, ["manifest", "convert", str(path), "--format", "lhotse", "--out", str(tmp_path / "x.parquet")]
    )
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert str(path) in err and "not a readable Lhotse cuts file" in err
    assert not (tmp_path / "x.parquet").exists()


def test_lhotse_convert_on_a_nemo_json(files, capsys, tmp_path):
    """X27"""
    code, _, err = _run(
        capsys,
        [
            "manifest",
            "convert",
            str(files["good_json"]),
            "--format",
            "lhotse",
            "--out",
            str(tmp_path / "x.parquet"),
        ],
    )
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert str(files["good_json"]) in err and "--format nemo" in err


def test_lhotse_cut_beyond_its_recording(capsys, tmp_path):
    """L_beyond: a cut starting 50 s into a 2 s recording is named, with both spans."""
    path = _cuts_file(tmp_path / "beyond.jsonl.gz", start=50.0)
    out = tmp_path / "x.parquet"
    code, _, err = _run(capsys, ["manifest", "convert", str(path), "--format", "lhotse", "--out", str(out)])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert "cut 'c0'" in err and "50.000" in err and str(A) in err
    assert not out.exists()


def test_lhotse_convert_drops_and_counts_bad_transcripts(capsys, tmp_path):
    """N_emptytext in the Lhotse format: the same rule (check_transcript), the same report."""
    path = _cuts_file(tmp_path / "c.jsonl.gz", texts=("[noise] ...", "good day"))
    out = tmp_path / "x.parquet"
    code, stdout, _ = _run(
        capsys, ["manifest", "convert", str(path), "--format", "lhotse", "--out", str(out)]
    )
    assert code == 0
    assert pq.read_table(out)["text"].to_pylist() == ["<|en|> good day"]
    assert "dropped 1 rows (1 empty_text)" in stdout


# ------------------------------------------------------------------------------ build: durations and tags
def _one_shard(root: Path, rows: list[dict]) -> Path:
    """A raw shard `en_000` whose rows all point at A."""
    shard = root / "en_000"
    (shard / "audio").mkdir(parents=True)
    shutil.copy(A, shard / "audio/a.flac")
    n = len(rows)
    pq.write_table(
        pa.table(
            {
                "segment_id": [r["id"] for r in rows],
                "transcription_native": [r["text"] for r in rows],
                "duration_s": pa.array([r.get("duration", 2.0) for r in rows], pa.float64()),
                "tx_quality_score": [0.9] * n,
                "segment_language": ["en"] * n,
            }
        ),
        shard / "metadata.parquet",
    )
    pq.write_table(
        pa.table({"segment_id": [r["id"] for r in rows], "tar_member_name": ["audio/a.flac"] * n}),
        shard / "audio_index.parquet",
    )
    return root


def test_build_drops_zero_duration_even_with_min_duration_0(capsys, tmp_path):
    """O4b_zero on the build side: 0 s is an invalid duration, not a short clip."""
    root = _one_shard(
        tmp_path / "s", [{"id": "a", "text": "hello"}, {"id": "z", "text": "hi", "duration": 0.0}]
    )
    out = tmp_path / "m"
    code, stdout, err = _run(
        capsys, ["manifest", "build", str(root), "--out", str(out), "--min-duration", "0"]
    )
    assert code == 0, err
    report = json.loads((out / "build_report.json").read_text())
    assert report["dropped"]["invalid_duration"] == {"en": 1}
    assert "z" not in pq.read_table(out / "train.parquet")["segment_id"].to_pylist()


def test_build_drops_a_tag_that_disagrees_with_the_language(capsys, tmp_path):
    """The transcript rule in raw shards: '<|hi|> ...' in an en row is tag_mismatch, not relabelled."""
    rows = [
        {"id": "a", "text": "hello"},
        {"id": "b", "text": "<|en|> good day"},
        {"id": "m", "text": "<|hi|> hello"},
    ]
    root = _one_shard(tmp_path / "s", rows)
    out = tmp_path / "m"
    code, stdout, err = _run(
        capsys, ["manifest", "build", str(root), "--out", str(out), "--val-fraction", "0"]
    )
    assert code == 0, err
    assert "tag_mismatch" in stdout
    report = json.loads((out / "build_report.json").read_text())
    assert report["dropped"] == {"tag_mismatch": {"en": 1}}
    assert pq.read_table(out / "train.parquet")["text"].to_pylist() == ["<|en|> hello", "<|en|> good day"]


def test_shards_write_full_disk_is_an_output_error_and_rerun_completes(files, capsys, tmp_path, monkeypatch):
    """A full disk mid-write: exit 4 naming the tar and the fix, no index; a re-run completes the set."""
    import speechlm.data.sources.shards as shards

    real = shards.write_one_tar
    calls = {"n": 0}

    def full_on_second(path, members):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(path, members)

    monkeypatch.setattr(shards, "write_one_tar", full_on_second)
    out = tmp_path / "tars"
    argv = ["shards", "write", str(files["good_parquet"]), "--out", str(out), "--shard-size", "1"]
    code, _, err = _run(capsys, argv)
    assert code == EXIT_OUTPUT
    assert err.startswith("shards: 1/2 written") and err.count("\n") == 2  # progress, then the error
    _assert_one_error(err.splitlines()[-1])
    assert str(out / "shard-000001.tar") in err and "No space left" in err and "run" in err
    assert not (out / "index.parquet").exists()
    monkeypatch.undo()
    assert _run(capsys, argv)[0] == 0
    assert (out / "index.parquet").is_file()


def test_convert_failing_mid_write_leaves_nothing(files, capsys, tmp_path, monkeypatch):
    """A full disk while the parquet is written: exit 4 naming --out, no half file under any name."""
    import pyarrow.parquet as pq_module

    def half_then_full(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq_module, "write_table", half_then_full)
    out = tmp_path / "o" / "x.parquet"
    code, _, err = _run(capsys, ["manifest", "convert", str(files["good_json"]), "--out", str(out)])
    assert code == EXIT_OUTPUT
    _assert_one_error(err)
    assert str(out) in err and "No space left" in err
    assert list((tmp_path / "o").iterdir()) == []


def test_convert_check_audio_refuses_a_claimed_duration_far_from_the_file(capsys, tmp_path):
    """O4e_huge, converter side: --check-audio reads each header and refuses 1e6 s for a 2 s file."""
    rows = [
        {
            "audio_filepath": str(B),
            "duration": _real_duration(B),
            "text": "good day",
            "lang": "en",
            "id": "ok",
        },
        {"audio_filepath": str(A), "duration": 1e6, "text": "hello world", "lang": "en", "id": "huge"},
    ]
    path = _nemo(tmp_path / "huge.json", rows)
    out = tmp_path / "x.parquet"
    code, _, err = _run(capsys, ["manifest", "convert", str(path), "--out", str(out), "--check-audio"])
    assert code == EXIT_DATA
    _assert_one_error(err)
    assert str(path) in err and "huge" in err and "1000000.000" in err and str(A) in err
    assert not out.exists()
    assert _run(capsys, ["manifest", "convert", str(path), "--out", str(out)])[0] == 0  # opt-in: not read
