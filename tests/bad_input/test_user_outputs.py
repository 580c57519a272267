"""Issue 36, item 3: nothing a user made is replaced by `speechlm demo`, `manifest build` or `tokenizer
train` (audit bad-input-2026-11-28, DM05b). Each command records what it wrote in the folder's
``speechlm_outputs.json``; a file it does not find there as written (the user's own, or one changed since)
is refused with exit 4 before any work, a re-run of the same command replaces its own files, another
command or other settings need ``--overwrite``, which still never replaces a user's file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from speechlm.cli import main
from speechlm.data.manifest.outputs import STAMP_NAME
from speechlm.errors import EXIT_OUTPUT

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data/demo/shards"


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of each file but the build report (it holds the build's time) and the record."""
    skip = ("build_report.json", STAMP_NAME)
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name not in skip
    }


def _one_error(err: str) -> str:
    assert "Traceback" not in err and err.strip().startswith("error:"), err
    return err


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manifest and a 300-piece tokenizer built by the commands (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("owned") / "m"
    assert main(["manifest", "build", str(DEMO), "--out", str(out)]) == 0
    tok = ["tokenizer", "train", "--manifest", str(out / "train.parquet"), "--out", str(out / "tokenizer")]
    assert main([*tok, "--vocab-size", "300"]) == 0
    return out


def _user_folder(tmp_path: Path, built: Path) -> Path:
    """A folder holding the user's own train.parquet, val.parquet and tokenizer.model, and notes."""
    user = tmp_path / "user"
    user.mkdir()
    for name in ("train.parquet", "val.parquet"):
        (user / name).write_bytes((built / name).read_bytes()[:-8] + b"mine....")
    (user / "tokenizer.model").write_bytes(b"my own sentencepiece model")
    (user / "notes.txt").write_text("keep me")
    return user


def test_the_commands_record_what_they_wrote(built: Path) -> None:
    files = json.loads((built / STAMP_NAME).read_text())["files"]
    assert set(files) == {
        "train.parquet",
        "val.parquet",
        "build_report.json",
        "tokenizer.model",
        "tokenizer.vocab",
        "tokenizer.json",
    }
    assert files["train.parquet"]["by"] == f"manifest build {DEMO.resolve()} --seed 0"
    assert files["train.parquet"]["size"] == (built / "train.parquet").stat().st_size
    assert files["tokenizer.model"]["by"].startswith(f"tokenizer train --manifest {built / 'train.parquet'}")


def test_demo_refuses_a_folder_holding_the_users_manifest_and_tokenizer(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DM05b: was exit 0 with the three files replaced by the demo's."""
    user = _user_folder(tmp_path, built)
    before = _digests(user)
    called: list[list[str]] = []
    monkeypatch.setattr("speechlm.demo.run._run", lambda argv: called.append(argv) or 0)
    code, _, err = _run(capsys, ["demo", "--shards", str(DEMO), "--out", str(user), "--no-train"])
    assert code == EXIT_OUTPUT
    _one_error(err)
    for name in ("train.parquet", "val.parquet", "tokenizer.model"):
        assert str(user / name) in err
    assert "choose another --out" in err
    assert called == []  # refused before any work
    assert _digests(user) == before


def test_the_demo_runs_again_into_its_own_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dm"
    argv = ["demo", "--shards", str(DEMO), "--out", str(out), "--no-train"]
    assert _run(capsys, argv)[0] == 0
    first = _digests(out)
    assert _run(capsys, argv)[0] == 0  # the same demo again: its own files are replaced
    assert _digests(out) == first
    # another vocabulary: the demo's own tokenizer is replaced too (the demo passes --overwrite)
    code, out_text, err = _run(capsys, [*argv, "--vocab-size", "200"])
    assert code == 0, err
    assert "--vocab-size 200 --overwrite" in out_text
    assert _digests(out)["tokenizer.model"] != first["tokenizer.model"]
    # with the translation task: its manifests and mix are recorded too, and a second run replaces them
    assert _run(capsys, [*argv, "--with-ast"])[0] == 0
    assert json.loads((out / STAMP_NAME).read_text())["files"]["asr_ast.yaml"]["by"] == "demo --with-ast"
    code, _, err = _run(capsys, [*argv, "--with-ast"])
    assert code == 0, err


@pytest.mark.parametrize("command", ["manifest", "tokenizer"])
def test_a_users_file_is_refused_even_with_overwrite(
    command: str, built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = _user_folder(tmp_path, built)
    before = _digests(user)
    if command == "manifest":
        argv = ["manifest", "build", str(DEMO), "--out", str(user)]
        named = [user / "train.parquet", user / "val.parquet"]
    else:
        argv = [
            "tokenizer",
            "train",
            "--manifest",
            str(built / "train.parquet"),
            "--out",
            str(user / "tokenizer"),
        ]
        named = [user / "tokenizer.model"]
    for extra in ([], ["--overwrite"]):
        code, _, err = _run(capsys, [*argv, *extra])
        assert code == EXIT_OUTPUT
        _one_error(err)
        assert all(str(p) in err for p in named), err
        assert "speechlm did not write" in err and ("move it away" in err or "move them away" in err)
    assert _digests(user) == before


def test_a_file_changed_after_speechlm_wrote_it_is_the_users(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m"
    out.mkdir()
    for p in built.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    edited = (out / "val.parquet").read_bytes()[:-8] + b"edited.."
    (out / "val.parquet").write_bytes(edited)
    code, _, err = _run(capsys, ["manifest", "build", str(DEMO), "--out", str(out), "--overwrite"])
    assert code == EXIT_OUTPUT
    assert (
        f"{out / 'val.parquet'} exists and speechlm did not write it (or it was changed since"
        in _one_error(err)
    )
    assert (out / "val.parquet").read_bytes() == edited


def test_a_rerun_replaces_its_own_files_and_other_settings_need_overwrite(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m"
    build = ["manifest", "build", str(DEMO), "--out", str(out)]
    assert _run(capsys, build)[0] == 0
    first = _digests(out)
    assert _run(capsys, build)[0] == 0  # a re-run, same inputs
    assert _digests(out) == first
    code, _, err = _run(capsys, [*build, "--val-fraction", "0.2"])
    assert code == EXIT_OUTPUT
    _one_error(err)
    assert f"by `speechlm manifest build {DEMO.resolve()} --seed 0`" in err
    assert "--val-fraction 0.2" in err and "add --overwrite" in err
    assert _digests(out) == first
    assert _run(capsys, [*build, "--val-fraction", "0.2", "--overwrite"])[0] == 0
    assert _digests(out)["val.parquet"] != first["val.parquet"]

    tok = ["tokenizer", "train", "--manifest", str(out / "train.parquet"), "--out", str(out / "tok")]
    assert _run(capsys, [*tok, "--vocab-size", "300"])[0] == 0
    model = (out / "tok.model").read_bytes()
    code, _, err = _run(capsys, [*tok, "--vocab-size", "200"])
    assert code == EXIT_OUTPUT and "--vocab-size 300" in _one_error(err)
    assert (out / "tok.model").read_bytes() == model
    assert _run(capsys, [*tok, "--vocab-size", "200", "--overwrite"])[0] == 0
    assert (out / "tok.model").read_bytes() != model
