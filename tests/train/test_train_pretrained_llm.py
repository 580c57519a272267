"""Training from a pretrained LLM directory on its own tokenizer (issue 22, item 1), end to end:
`speechlm train` with model.llm.pretrained and no data.tokenizer, the refusal of a SentencePiece
tokenizer with it, and what `speechlm validate` says."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import SMOKE, read_train_metrics, run_train, train_in_process
from pretrained_helpers import make_tiny_pretrained

from speechlm.cli import main

LANGS = ["bn", "en", "hi", "ta", "te"]  # the demo corpus' languages


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("llm"), langs=LANGS)


def manifests(d: dict[str, str]) -> list[str]:
    return [f"data.train_manifest={d['train']}", f"data.val_manifest={d['val']}"]


@pytest.mark.slow
def test_train_a_few_steps_on_the_llms_own_tokenizer(demo_data, llm_dir, tmp_path):
    """~25 s: two optimizer steps, then greedy WER on 12 validation utterances."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speechlm.data.tokenizer import load_text_tokenizer

    run_dir = tmp_path / "run"
    r = run_train(
        [
            SMOKE,
            *manifests(demo_data),
            f"model.llm.pretrained={llm_dir}",
            "data.instruction=Transcribe the audio.",
            "data.system_prompt=You write down speech.",
            "trainer.max_steps=2",
            "trainer.final_eval_split=val",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_train_metrics(run_dir)
    assert len(rows) == 2 and all(math.isfinite(x["loss"]) and math.isfinite(x["ctc"]) for x in rows)
    # the run's tokenizer is the LLM's, plus <|audio|> and one tag per language, saved with the run
    auto = AutoTokenizer.from_pretrained(llm_dir, local_files_only=True)
    tok = load_text_tokenizer(run_dir / "tokenizer")
    assert tok.langs == tuple(LANGS) and tok.vocab_size == len(auto) + 1 + len(LANGS)
    assert tok.encode("<|en|> moon blue")[1:] == auto.encode("moon blue", add_special_tokens=False)
    saved = AutoTokenizer.from_pretrained(run_dir / "tokenizer", local_files_only=True)
    assert (
        saved.convert_tokens_to_ids("<|te|>") == tok.lang_id("te")
        and saved.chat_template == auto.chat_template
    )
    # the LLM in the checkpoint has one row per token of that tokenizer (the pretrained rows + added ones)
    from speechlm.train.checkpoint import read_dcp_metadata

    meta = read_dcp_metadata(next((run_dir / "checkpoints").glob("step_*/.metadata")))
    shape = next(m.size for k, m in meta.state_dict_metadata.items() if k.endswith("embed_tokens.weight"))
    base = AutoModelForCausalLM.from_pretrained(llm_dir).get_input_embeddings().weight
    assert tuple(shape) == (tok.vocab_size, base.shape[1])
    # evaluation decoded these ids back to words: the references are the manifest's transcripts
    decodes = [json.loads(x) for x in (run_dir / "eval_decodes.jsonl").read_text().splitlines()]
    assert len(decodes) == 12 and all(d["ref"] and "<|" not in d["ref"] + d["hyp"] for d in decodes)
    assert "prompt: chat template of" in r.stdout and "stop <|im_end|>" in r.stdout


def test_pretrained_llm_with_a_sentencepiece_tokenizer_is_refused(demo_data, llm_dir, capsys):
    args = [
        SMOKE,
        *manifests(demo_data),
        f"model.llm.pretrained={llm_dir}",
        f"data.tokenizer={demo_data['tok']}",
    ]
    r = train_in_process([*args, "--dry-run"], capsys)
    assert r.returncode != 0
    assert "data.allow_sentencepiece_with_pretrained=true" in r.stderr and "Traceback" not in r.stderr
    ok = train_in_process([*args, "data.allow_sentencepiece_with_pretrained=true", "--dry-run"], capsys)
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_validate_reports_the_tokenizer_rules(demo_data, llm_dir, tmp_path, capsys):
    args = [*manifests(demo_data), f"model.llm.pretrained={llm_dir}"]
    assert main(["validate", SMOKE, *args, f"data.tokenizer={demo_data['tok']}"]) == 1
    assert "pretrained-llm-sentencepiece-tokenizer" in capsys.readouterr().out
    assert main(["validate", SMOKE, *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["findings"] == []
    bare = make_tiny_pretrained(tmp_path / "base", langs=["en"], chat_template=False)
    assert main(["validate", SMOKE, *manifests(demo_data), f"model.llm.pretrained={bare}"]) == 0
    assert "chat-template-missing" in capsys.readouterr().out


def test_validate_of_a_recipe_whose_llm_is_on_another_machine(demo_data, tmp_path, capsys):
    """`speechlm validate` of a config whose model.llm.pretrained is not on this machine (data.tokenizer
    unset: the LLM's own) checks the layout and says nothing about SentencePiece (it used to report
    pretrained-llm-sentencepiece-tokenizer); `speechlm train` then names the missing directory."""
    absent = tmp_path / "not-here"
    args = [SMOKE, *manifests(demo_data), f"model.llm.pretrained={absent}"]
    assert main(["validate", *args, "data.tokenizer=null"]) == 0
    assert "sentencepiece" not in capsys.readouterr().out.lower()
    r = train_in_process([*args, "data.tokenizer=null", "--dry-run"], capsys)
    assert r.returncode != 0 and "Traceback" not in r.stderr and str(absent) in r.stderr


def test_lang_tags_none_and_a_broken_template_file(demo_data, llm_dir, tmp_path, capsys):
    args = [SMOKE, *manifests(demo_data), f"model.llm.pretrained={llm_dir}", "--dry-run"]
    assert train_in_process([*args, "data.lang_tags=none"], capsys).returncode == 0
    r = train_in_process([*args, f"data.chat_template={tmp_path / 'missing.jinja'}"], capsys)
    assert r.returncode != 0 and "data.chat_template" in r.stderr and "Traceback" not in r.stderr
    sp = train_in_process([SMOKE, *manifests(demo_data), f"data.tokenizer={demo_data['tok']}",
                           "data.lang_tags=none", "--dry-run"], capsys)  # fmt: skip
    assert sp.returncode != 0 and "data.lang_tags=none" in sp.stderr


def test_pretrained_dir_without_a_tokenizer_names_the_key(demo_data, tmp_path, capsys):
    weights_only = make_tiny_pretrained(tmp_path / "w", langs=["en"], with_tokenizer=False)
    r = train_in_process(
        [SMOKE, *manifests(demo_data), f"model.llm.pretrained={weights_only}", "--dry-run"], capsys
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert (
        "model.llm.pretrained (its own tokenizer)" in r.stderr and "tokenizer.json does not exist" in r.stderr
    )
