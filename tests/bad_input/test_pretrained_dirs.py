"""A pretrained LLM directory that is damaged or does not belong with its tokenizer, and LoRA target
modules that name nothing, are refused before the model is built (issue 36, items 5 and 7).

Audit cases (bad-input-2026-11-28): PL05 a truncated model.safetensors, PL07 no config.json, PL08 no
weights (each an exit-70 traceback before), PL10 a tokenizer larger than the model's vocabulary (the
embeddings were resized silently), PL04/PL04b another model's tokenizer (trained on ids that mean other
tokens), LR04t/LR12 a LoRA target_modules typo (`validate` said OK, `train` failed after loading).
`train` and `validate` run in-process with the smoke config; the model is never built ("model:" unprinted).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import SMOKE
from pretrained_helpers import make_tiny_pretrained

from speechlm.cli import main
from speechlm.data.hf_tokenizer import HFTokenizer
from speechlm.errors import DataError, UsageError
from speechlm.model.pretrained_dir import (
    PretrainedDirError,
    check_tokenizer_fits_llm,
    read_llm_dir,
    tokenizer_model_problems,
)

LANGS = ["bn", "en", "hi", "ta", "te"]  # the demo corpus' languages


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("llm"), langs=LANGS)


def copy_of(llm_dir: Path, tmp_path: Path, name: str = "copy") -> Path:
    out = tmp_path / name
    shutil.copytree(llm_dir, out)
    return out


def edit_config(directory: Path, **changes: object) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def train_argv(demo_data: dict[str, str], llm: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "train",
        SMOKE,
        f"data.train_manifest={demo_data['train']}",
        f"data.val_manifest={demo_data['val']}",
        f"model.llm.pretrained={llm}",
        f"trainer.run_dir={tmp_path / 'run'}",
        *extra,
    ]


# --- damaged directories: PL05, PL07, PL08 ---------------------------------------------------------
def truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def no_config(d: Path) -> None:
    (d / "config.json").unlink()


def no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def broken_header(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")


def missing_shard(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


DAMAGE = [
    ("PL05_truncated", truncate, ("model.safetensors", "truncated or damaged", "bytes", "download it again")),
    ("PL07_no_config", no_config, ("has no config.json", "copy the directory again")),
    ("PL08_no_weights", no_weights, ("holds no weights", "model.safetensors")),
    ("header_not_json", broken_header, ("model.safetensors", "header is not valid JSON")),
    ("missing_shard", missing_shard, ("model-00002-of-00002.safetensors", "does not exist")),
]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_directory_is_named_with_the_fix(damage, llm_dir: Path, tmp_path: Path) -> None:
    _, spoil, needles = damage
    d = copy_of(llm_dir, tmp_path)
    spoil(d)
    with pytest.raises(PretrainedDirError) as e:
        read_llm_dir(d)
    for needle in (*needles, str(d)):
        assert needle in str(e.value), (needle, str(e.value))
    assert e.value.exit_code == 1


def test_build_llm_gives_the_same_clear_errors(llm_dir: Path, tmp_path: Path) -> None:
    """evaluate, export and estimate build the LLM without the pre-flight: the same errors there."""
    from speechlm.config import LLMConfig
    from speechlm.model.llm import build_llm

    d = copy_of(llm_dir, tmp_path)
    truncate(d)
    for path in (d, tmp_path / "gone"):
        with pytest.raises(PretrainedDirError, match=str(path)):
            build_llm(
                LLMConfig(pretrained=str(path)),
                vocab_size=500,
                pad_id=0,
                bos_id=None,
                eos_id=2,
                dropout=0.0,
                attn_implementation="eager",
            )


@pytest.mark.parametrize("damage", DAMAGE[:3], ids=[d[0] for d in DAMAGE[:3]])
def test_train_and_validate_refuse_a_damaged_directory(
    damage, demo_data: dict[str, str], llm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, spoil, needles = damage
    d = copy_of(llm_dir, tmp_path)
    spoil(d)
    rc, out, err = run(train_argv(demo_data, d, tmp_path), capsys)
    assert rc == 1 and needles[0] in err and "internal error" not in err, err
    assert "model:" not in out
    rc, out, err = run(["validate", *train_argv(demo_data, d, tmp_path)[1:]], capsys)
    assert rc == 1 and needles[0] in err and "internal error" not in err, err


# --- the tokenizer against the model: PL10, PL04 -----------------------------------------------------
def test_the_llms_own_tokenizer_with_the_rows_the_run_adds_fits(llm_dir: Path, tmp_path: Path) -> None:
    """<|audio|> and the language tags are past the LLM's vocabulary: the only difference allowed."""
    tok = HFTokenizer(llm_dir, langs=LANGS)
    config = read_llm_dir(llm_dir)
    assert tok.vocab_size == config["vocab_size"] + 1 + len(LANGS)
    assert tokenizer_model_problems(tok, config, llm_dir) == []
    tok.save(tmp_path / "run_tokenizer")  # a run's saved copy records its added ids
    assert tokenizer_model_problems(HFTokenizer(tmp_path / "run_tokenizer"), config, llm_dir) == []
    # a matrix padded past the tokenizer (Qwen's) fits too
    edit_config(d := copy_of(llm_dir, tmp_path), vocab_size=config["vocab_size"] + 64)
    assert tokenizer_model_problems(tok, read_llm_dir(d), d) == []


def test_PL10_a_tokenizer_larger_than_the_vocabulary_is_refused(llm_dir: Path, tmp_path: Path) -> None:
    d = copy_of(llm_dir, tmp_path)
    rows = json.loads((d / "config.json").read_text())["vocab_size"]
    edit_config(d, vocab_size=rows - 100)
    tok = HFTokenizer(d, langs=LANGS)
    with pytest.raises(DataError) as e:
        check_tokenizer_fits_llm(tok, read_llm_dir(d), d, key="the LLM's own")
    msg = str(e.value)
    assert f"{rows} tokens of its own (plus 6 the run adds)" in msg and f"{rows - 100} embedding rows" in msg
    assert str(d) in msg and "restore tokenizer.json" in msg


def test_PL04_another_models_special_ids_are_refused(llm_dir: Path, tmp_path: Path) -> None:
    """The tokenizer's EOS is not the one the model was trained with (config.json): another model's."""
    d = copy_of(llm_dir, tmp_path)
    tok = HFTokenizer(d, langs=LANGS)
    edit_config(d, eos_token_id=tok.eos_id + 1, bos_token_id=None)
    (d / "generation_config.json").unlink()  # save_pretrained's copy of config.json's ids
    problems = tokenizer_model_problems(tok, read_llm_dir(d), d)
    assert problems == [
        f"its eos token '<|im_end|>' is id {tok.eos_id}, but the LLM was trained with eos_token_id={tok.eos_id + 1}"
    ]
    # generation_config.json's list of stop ids counts as the model's (Llama 3 Instruct lists several)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id + 1, tok.eos_id]}))
    assert tokenizer_model_problems(tok, read_llm_dir(d), d) == []


def test_PL04b_train_and_validate_refuse_another_models_tokenizer(
    demo_data: dict[str, str], llm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.tokenizer names a tokenizer directory of another model (here: one whose ids are all shifted
    by its extra special tokens), which trained to exit 0 before."""
    other = copy_of(llm_dir, tmp_path, "other_tok")
    tok = HFTokenizer(other)
    edit_config(llm_dir_copy := copy_of(llm_dir, tmp_path, "model"), eos_token_id=tok.eos_id + 1)
    (llm_dir_copy / "generation_config.json").unlink()
    argv = train_argv(demo_data, llm_dir_copy, tmp_path, f"data.tokenizer={other}", "data.max_tokens=512")
    rc, out, err = run(argv, capsys)
    assert rc == 1 and "model:" not in out, err
    assert (
        "does not belong to the LLM" in err and f"data.tokenizer={other}" in err and str(llm_dir_copy) in err
    )
    assert "eos_token_id" in err and "internal error" not in err
    rc, out, err = run(["validate", *argv[1:]], capsys)
    assert rc == 1 and "does not belong to the LLM" in err, err


# --- LoRA target modules: LR04t, LR12 ------------------------------------------------------------------
@pytest.mark.parametrize("targets", ["[foo_proj]", "[q_proj,foo_proj]"], ids=["LR04t", "LR12"])
def test_a_lora_target_typo_is_refused_by_validate_and_train(
    targets: str,
    demo_data: dict[str, str],
    llm_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = train_argv(
        demo_data, llm_dir, tmp_path, "model.llm.train=lora", f"model.llm.lora.target_modules={targets}"
    )
    rc, out, err = run(["validate", *argv[1:]], capsys)
    assert rc == 2 and "OK" not in out, (out, err)
    assert "model.llm.lora.target_modules: foo_proj name no module of the LLM (LlamaForCausalLM)" in err
    assert "q_proj" in err.split("its linear layers are:")[1]
    rc, out, err = run(argv, capsys)
    assert rc == 2 and "model:" not in out and "internal error" not in err, err
    assert "foo_proj name no module" in err


def test_a_lora_target_typo_on_an_llm_built_from_the_config_is_refused(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(
        [
            "validate",
            SMOKE,
            f"data.train_manifest={demo_data['train']}",
            f"data.tokenizer={demo_data['tok']}",
            "model.llm.train=lora",
            "model.llm.lora.target_modules=[qproj]",
        ],
        capsys,
    )
    assert rc == 2 and "qproj name no module of the LLM" in err, (out, err)


def test_good_lora_targets_pass(llm_dir: Path) -> None:
    from speechlm.config import load_config
    from speechlm.model.llm_preflight import check_pretrained_llm

    cfg = load_config(SMOKE, [f"model.llm.pretrained={llm_dir}", "model.llm.train=lora"])
    check_pretrained_llm(cfg, HFTokenizer(llm_dir, langs=LANGS))  # the default targets: no error
    cfg = load_config(
        SMOKE,
        [f"model.llm.pretrained={llm_dir}", "model.llm.train=lora", "model.llm.lora.target_modules=[x]"],
    )
    with pytest.raises(UsageError):
        check_pretrained_llm(cfg)


# --- PX04: evaluate / export / transcribe of a run whose base directory moved ------------------------
def test_PX04_a_checkpoint_whose_base_moved_is_refused_naming_the_path_and_the_config(
    demo_data: dict[str, str], llm_dir: Path, tmp_path: Path
) -> None:
    """The checkpoint of a LoRA run does not hold its base: `load_checkpoint` (evaluate, export,
    transcribe) refuses a base that is gone or damaged before building anything (it was a
    FileNotFoundError traceback, exit 70)."""
    import yaml

    from speechlm.config import load_config, to_dict
    from speechlm.use.checkpoint import check_pretrained_parts

    base = copy_of(llm_dir, tmp_path, "base")
    cfg = load_config(SMOKE, [f"model.llm.pretrained={base}", "model.llm.train=lora"])
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    check_pretrained_parts(cfg, ckpt)  # in place: nothing to say
    base.rename(tmp_path / "base.away")
    with pytest.raises(DataError) as e:
        check_pretrained_parts(cfg, ckpt)
    msg = str(e.value)
    assert f"checkpoint {ckpt} was trained on model.llm.pretrained={base}" in msg
    assert "not a directory here" in msg and str(tmp_path / "run" / "config.yaml") in msg
    (tmp_path / "base.away").rename(base)
    truncate(base)
    with pytest.raises(DataError, match="cannot be loaded: .*model.safetensors is truncated"):
        check_pretrained_parts(cfg, ckpt)


def test_an_architecture_that_cannot_be_built_here_leaves_the_check_to_the_load() -> None:
    """No skeleton (a model type this transformers lacks, a quantized config): inject_lora checks later."""
    from speechlm.config import LLMConfig, LoRAConfig
    from speechlm.model.llm_preflight import check_lora_targets

    llm_cfg = LLMConfig(pretrained="x", train="lora", lora=LoRAConfig(target_modules=["foo_proj"]))
    check_lora_targets(llm_cfg, {"model_type": "no-such-architecture"})
    with pytest.raises(UsageError, match="foo_proj name no module"):
        check_lora_targets(
            llm_cfg,
            {
                "model_type": "llama",
                "vocab_size": 16,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "intermediate_size": 16,
            },
        )


def test_validate_for_another_machine_notes_a_pretrained_dir_absent_here(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As for the manifests and the tokenizer: what is not here is said, not refused (train refuses it)."""
    elsewhere = tmp_path / "on_the_cluster"
    argv = train_argv(demo_data, elsewhere, tmp_path, "model.llm.train=lora")
    rc, out, err = run(["validate", *argv[1:]], capsys)
    assert rc == 0 and f"note: model.llm.pretrained {elsewhere} not checked" in err, (out, err)
    rc, out, err = run(argv, capsys)
    assert rc == 1 and str(elsewhere) in err and "model:" not in out, err
