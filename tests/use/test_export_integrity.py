"""Exports (issue 36, items 4 and 9): every file's SHA-256 recorded and verified (TR05: a speech.safetensors
corrupted in place, same size, is refused naming it); the tokenizer beside the LLM in the Hugging Face
layout (a pretrained LLM's tokenizer, and the SentencePiece model rebuilt for `AutoTokenizer`); files with
the process's umask (safetensors writes 0600); `speechlm_export.json` true of the LLM it holds.

The exports are written by `write_export` from a module built in this process (no training: the weights
are the initial ones), which is what `speechlm export` writes after loading a checkpoint."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from helpers import SMOKE
from pretrained_helpers import make_tiny_pretrained

LANGS = ["bn", "en", "hi", "ta", "te"]


def write_test_export(out: Path, overrides: list[str]) -> Path:
    """`write_export` of a freshly built module of SMOKE + `overrides` into `out` (created)."""
    import torch

    from speechlm.config import load_config
    from speechlm.data.run_inputs import build_run_prompt, load_run_tokenizer, tokenizer_info
    from speechlm.train.module import SpeechLLMModule
    from speechlm.use.checkpoint import LoadedCheckpoint
    from speechlm.use.export import write_export

    cfg = load_config(SMOKE, overrides)
    tokenizer = load_run_tokenizer(cfg, LANGS)
    tok = tokenizer_info(cfg, tokenizer, build_run_prompt(cfg, tokenizer))
    torch.manual_seed(0)
    module = SpeechLLMModule(cfg, tok).eval()
    out.mkdir(parents=True)
    write_export(LoadedCheckpoint(out / "no-checkpoint", 0, cfg, tokenizer, tok, module), out)
    return out


@pytest.fixture(scope="module")
def sp_export(demo_data, tmp_path_factory) -> Path:
    return write_test_export(
        tmp_path_factory.mktemp("sp") / "export",
        [f"data.tokenizer={demo_data['tok']}", f"data.train_manifest={demo_data['train']}"],
    )


@pytest.fixture(scope="module")
def pretrained_export(demo_data, tmp_path_factory) -> tuple[Path, Path]:
    llm = make_tiny_pretrained(tmp_path_factory.mktemp("llm"), langs=LANGS)
    out = write_test_export(
        tmp_path_factory.mktemp("pre") / "export",
        [f"model.llm.pretrained={llm}", f"data.train_manifest={demo_data['train']}", "model.llm.train=lora"],
    )
    return out, llm


def test_a_speech_safetensors_corrupted_in_place_is_refused_naming_it(sp_export, tmp_path, capsys):
    import shutil

    from speechlm.cli import main
    from speechlm.model.exported import ExportError, load_exported

    config = json.loads((sp_export / "speechlm_export.json").read_text())
    assert set(config["sha256"]) == set(config["files"]) and "speech.safetensors" in config["sha256"]
    load_exported(sp_export)  # the export as written loads
    bad = tmp_path / "bad"
    shutil.copytree(sp_export, bad)
    weights = bad / "speech.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:  # 4 kB of 0xff inside the tensor data (NaN weights), same size
        f.seek(size - 5000)
        f.write(b"\xff" * 4096)
    assert weights.stat().st_size == size
    with pytest.raises(ExportError, match="does not match the SHA-256"):
        load_exported(bad)
    assert main(["transcribe", str(bad), str(Path(SMOKE))]) == 3
    err = capsys.readouterr().err
    assert (
        f"{weights} does not match the SHA-256 recorded when it was exported" in err
        and "Traceback" not in err
    )


def test_an_export_without_hashes_still_loads_on_sizes(sp_export, tmp_path):
    """Exports written before the hashes were recorded: sizes only, as before."""
    import shutil

    from speechlm.model.exported import load_exported

    old = tmp_path / "old"
    shutil.copytree(sp_export, old)
    config = json.loads((old / "speechlm_export.json").read_text())
    del config["sha256"]
    (old / "speechlm_export.json").write_text(json.dumps(config))
    load_exported(old)


def test_the_sentencepiece_tokenizer_is_an_hf_tokenizer_beside_the_llm(sp_export, demo_data):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from speechlm.data.tokenizer import load_text_tokenizer

    config = json.loads((sp_export / "speechlm_export.json").read_text())
    assert config["tokenizer"] == "llm" and config["hf_tokenizer"] is True
    ours = load_text_tokenizer(sp_export / config["tokenizer"])
    auto = AutoTokenizer.from_pretrained(sp_export / "llm", local_files_only=True)
    assert len(auto) == ours.vocab_size
    texts = pq.read_table(demo_data["val"]).column("text").to_pylist()
    assert texts and all(ours.encode(t) == auto.encode(t, add_special_tokens=False) for t in texts)
    assert auto.convert_tokens_to_ids("<|hi|>") == ours.lang_id("hi") and auto.eos_token_id == ours.eos_id


def test_a_sentencepiece_tokenizer_without_an_exact_hf_form_is_kept_alone(demo_data, tmp_path, monkeypatch):
    """When the rebuilt tokenizer would give other ids, no Hugging Face file is written, the export says
    so (hf_tokenizer false, a note) and speechlm still loads the SentencePiece files beside the LLM."""
    from speechlm.data.tokenizer import load_text_tokenizer
    from speechlm.use import hf_export

    monkeypatch.setattr(hf_export, "first_difference", lambda tokenizer, directory: "some text")
    out = write_test_export(
        tmp_path / "export",
        [f"data.tokenizer={demo_data['tok']}", f"data.train_manifest={demo_data['train']}"],
    )
    config = json.loads((out / "speechlm_export.json").read_text())
    assert config["hf_tokenizer"] is False
    assert not (out / "llm" / "tokenizer.json").exists() and (out / "llm" / "sentencepiece.model").is_file()
    assert load_text_tokenizer(out / config["tokenizer"]).vocab_size > 0


def test_a_pretrained_llms_export_holds_its_tokenizer_and_its_real_widths(pretrained_export):
    from transformers import AutoConfig, AutoTokenizer

    from speechlm.data.hf_tokenizer import HFTokenizer

    out, llm = pretrained_export
    config = json.loads((out / "speechlm_export.json").read_text())
    auto = AutoTokenizer.from_pretrained(out / "llm", local_files_only=True)
    ours = HFTokenizer(out / config["tokenizer"])
    assert ours.langs == tuple(LANGS) and len(auto) == ours.vocab_size
    assert auto.encode("moon blue", add_special_tokens=False) == ours.encode("moon blue")
    assert auto.convert_tokens_to_ids("<|te|>") == ours.lang_id("te") and auto.chat_template
    hf = AutoConfig.from_pretrained(llm)
    section = config["model"]["llm"]
    assert (section["hidden_size"], section["num_layers"], section["num_heads"], section["num_kv_heads"]) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
    )  # fmt: skip
    assert section["intermediate_size"] == hf.intermediate_size and section["pretrained"] == "llm"
    assert section["train"] == "full" and section["family"] == "llama"


def test_export_files_get_the_process_umask(demo_data, tmp_path):
    previous = os.umask(0o027)
    try:
        out = write_test_export(
            tmp_path / "export",
            [f"data.tokenizer={demo_data['tok']}", f"data.train_manifest={demo_data['train']}"],
        )
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes["speech.safetensors"] == 0o640 and modes["llm/model.safetensors"] == 0o640, modes
    assert all(m == (0o750 if (out / p).is_dir() else 0o640) for p, m in modes.items()), modes


def test_llm_widths_leave_out_a_family_the_config_does_not_name():
    from types import SimpleNamespace

    from speechlm.use.export import llm_widths

    mistral = SimpleNamespace(model_type="mistral", hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)  # fmt: skip
    assert llm_widths(mistral) == {"hidden_size": 64, "num_layers": 3, "num_heads": 8, "num_kv_heads": 2,
                                   "intermediate_size": 128, "max_position_embeddings": 512}  # fmt: skip
    assert llm_widths(SimpleNamespace(**{**vars(mistral), "model_type": "qwen2"}))["family"] == "qwen2"
