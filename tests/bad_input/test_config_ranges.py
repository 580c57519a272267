"""Issue 20, config values and paths: every key has a declared range or choice set (declared on its field,
`speechlm.config.KEYS`), checked by `load_config` for `speechlm validate` and `speechlm train` alike;
the data paths have no demo defaults; paths in a config file resolve against the file's folder."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import train_in_process

from speechlm.cli import main as cli_main
from speechlm.config import (
    KEYS,
    ConfigError,
    ExperimentConfig,
    final_eval_split,
    leaf_keys,
    load_config,
    require_inputs,
    to_dict,
)

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")


def _dataclass_leaves(cls: type, prefix: str = "") -> list[str]:
    """Every field of the config that is not a section, walked independently of the config module."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _dataclass_leaves(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            out.append(prefix + f.name)
    return out


def test_every_config_field_has_a_declared_range_or_choice_set():
    keys = _dataclass_leaves(ExperimentConfig)
    missing = [k for k in keys if k not in KEYS]
    stale = [k for k in KEYS if k not in keys]
    assert not missing, f"fields without a declared range/choice in speechlm.config.KEYS: {missing}"
    assert not stale, f"KEYS entries for keys that do not exist: {stale}"
    assert sorted(leaf_keys()) == sorted(keys)
    for key, spec in KEYS.items():
        assert spec.doc and spec.rule.describe(), key
        default = _default(key)
        assert spec.rule.check(default) is None, f"the default {key}={default!r} is outside its own range"


def _default(key: str):
    obj = ExperimentConfig()
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


# (case id, overrides, key named, value as shown, words of the valid range)
BAD_VALUES = [
    ("TC03", ["optim.lr=-1"], "optim.lr", "-1", "> 0"),
    ("TC04", ["optim.lr=nan"], "optim.lr", "nan", "> 0"),
    ("lr0", ["optim.lr=0"], "optim.lr", "0", "> 0"),
    ("encoder_lr", ["optim.encoder_lr=-0.1"], "optim.encoder_lr", "-0.1", "> 0"),
    ("TC05", ["optim.warmup_steps=-5"], "optim.warmup_steps", "-5", ">= 0"),
    ("enc_warmup", ["optim.encoder_warmup_steps=-1"], "optim.encoder_warmup_steps", "-1", ">= 0"),
    ("unfreeze", ["optim.unfreeze_step=-1"], "optim.unfreeze_step", "-1", ">= 0"),
    ("TC07", ["trainer.keep_last=-1", "trainer.ckpt_every=1"], "trainer.keep_last", "-1", ">= 1"),
    ("keep0", ["trainer.keep_last=0", "trainer.ckpt_every=1"], "trainer.keep_last", "0", ">= 1"),
    ("TC08", ["trainer.ckpt_every=-1"], "trainer.ckpt_every", "-1", ">= 0"),
    ("TC09", ["trainer.val_every=-1"], "trainer.val_every", "-1", ">= 0"),
    ("TC10", ["trainer.max_minutes=-1"], "trainer.max_minutes", "-1", ">= 0"),
    ("TC11", ["sampler.temperature=nan"], "sampler.temperature", "nan", "> 0"),
    ("temp0", ["sampler.temperature=0"], "sampler.temperature", "0", "> 0"),
    ("TC14", ["sampler.bucket_boundaries=[8,3]"], "sampler.bucket_boundaries", "[8.0, 3.0]", "increasing"),
    ("bucket_neg", ["sampler.bucket_boundaries=[-1,3]"], "sampler.bucket_boundaries", "[-1.0, 3.0]", "> 0"),
    ("bucket_inf", ["sampler.bucket_boundaries=[1,.inf]"], "sampler.bucket_boundaries", "inf", "> 0"),
    ("TC15", ["data.max_tokens=0"], "data.max_tokens", "0", ">= 1"),
    ("TC16", ["data.sample_rate=0"], "data.sample_rate", "0", "16000"),
    ("sr8k", ["data.sample_rate=8000"], "data.sample_rate", "8000", "16000"),
    ("TC17", ["data.num_workers=-1"], "data.num_workers", "-1", ">= 0"),
    ("TC18", ["sampler.epoch_size=0"], "sampler.epoch_size", "0", ">= 1"),
    ("TC19", ["trainer.early_stopping_patience=-1"], "trainer.early_stopping_patience", "-1", ">= 0"),
    ("TC20", ["optim.min_lr_ratio=2"], "optim.min_lr_ratio", "2", "<= 1"),
    ("TC21", ["optim.betas=[1.5,2]"], "optim.betas", "[1.5, 2.0]", "< 1"),
    ("betas3", ["optim.betas=[0.9,0.99,0.999]"], "optim.betas", "[0.9, 0.99, 0.999]", "2 numbers"),
    ("TC22", ["optim.weight_decay=-1"], "optim.weight_decay", "-1", ">= 0"),
    ("TC23", ["model.projector_stack=0"], "model.projector_stack", "0", ">= 1"),
    ("TC25", ["model.encoder.kind=foo"], "model.encoder.kind", "'foo'", "'parakeet', 'whisper', 'nemo'"),
    ("TC26", ["model.llm.family=foo"], "model.llm.family", "'foo'", "'llama', 'qwen2'"),
    ("TC28", ["trainer.log_every=0"], "trainer.log_every", "0", ">= 1"),
    ("TC30", ["optim.grad_clip=-1"], "optim.grad_clip", "-1", ">= 0"),
    ("TC35", ["trainer.val_max_batches=-1"], "trainer.val_max_batches", "-1", ">= 1"),
    ("TC41", ["sampler.length_penalty=-1"], "sampler.length_penalty", "-1", ">= 0"),
    ("TC42", ["trainer.seed=-1"], "trainer.seed", "-1", ">= 0"),
    ("seed_big", ["sampler.seed=4294967296"], "sampler.seed", "4294967296", "<= 4294967295"),
    ("TC45", ["trainer.max_steps=-1"], "trainer.max_steps", "-1", ">= 0"),
    ("O5e", ["trainer.max_steps=-10"], "trainer.max_steps", "-10", ">= 0"),
    ("O5d", ["model.ctc_weight=-1"], "model.ctc_weight", "-1", ">= 0"),
    ("O5f", ["model.dropout=nan"], "model.dropout", "nan", "< 1"),
    ("dropout1", ["model.dropout=1"], "model.dropout", "1", "< 1"),
    ("size_neg", ["model.llm.hidden_size=-8"], "model.llm.hidden_size", "-8", ">= 1"),
    ("size_zero", ["model.encoder.num_layers=0"], "model.encoder.num_layers", "0", ">= 1"),
    ("size_nan", ["model.encoder.hidden_size=nan"], "model.encoder.hidden_size", "nan", "integer"),
    (
        "O5a",
        ["trainer.final_eval_split=test"],
        "trainer.final_eval_split",
        "'test'",
        "'auto', 'val', 'train'",
    ),
    ("O5b", ["trainer.best_metric=bleu"], "trainer.best_metric", "'bleu'", "'wer', 'loss'"),
    ("O5c", ["trainer.precision=fp32"], "trainer.precision", "'fp32'", "trainer.precision=32"),
    ("O5c2", ["trainer.precision=bf16-mixed"], "trainer.precision", "'bf16-mixed'", "trainer.precision=bf16"),
    ("fp16", ["trainer.precision=16-mixed"], "trainer.precision", "'16-mixed'", "bf16 or 32"),
    ("budget_dur", ["sampler.max_batch_duration=-5"], "sampler.max_batch_duration", "-5", "> 0"),
    ("budget_tok", ["sampler.max_batch_tokens=0"], "sampler.max_batch_tokens", "0", ">= 1"),
    ("dp_shard", ["parallel.dp_shard=0"], "parallel.dp_shard", "0", ">= 1"),
    ("pad", ["model.pad_to_multiple=0"], "model.pad_to_multiple", "0", ">= 1"),
    ("eval_dur_nan", ["trainer.eval_batch_duration=nan"], "trainer.eval_batch_duration", "nan", "> 0"),
]


def _check_message(msg: str, key: str, shown: str, valid: str) -> None:
    assert f"{key}=" in msg and shown in msg and valid in msg, msg
    assert "Traceback" not in msg


@pytest.mark.parametrize("case,overrides,key,shown,valid", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_value_is_a_config_error_in_load_config(case, overrides, key, shown, valid):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, overrides)
    _check_message(str(e.value), key, shown, valid)
    assert "command line" in str(e.value)  # where the value came from


@pytest.mark.parametrize("case,overrides,key,shown,valid", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_value_exits_2_from_speechlm_validate(case, overrides, key, shown, valid, capsys):
    code = cli_main(["validate", SMOKE, "--world-size", "1", "--device-capability", "none", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, key, shown, valid)


@pytest.mark.parametrize("case,overrides,key,shown,valid", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_value_exits_2_from_speechlm_train_before_anything_is_built(
    case, overrides, key, shown, valid, capsys, tmp_path
):
    run_dir = tmp_path / "run"
    code = cli_main(["train", SMOKE, f"trainer.run_dir={run_dir}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, key, shown, valid)
    assert not run_dir.exists()  # refused before the run dir, the data or the model


# cross-field rules: (case, overrides, words the message must hold)
CROSS_FIELD = [
    ("TC24", ["model.llm.num_heads=3", "model.llm.num_kv_heads=2", "model.llm.hidden_size=48"],
     ["model.llm.num_heads=3", "model.llm.num_kv_heads=2"]),
    ("TC43", ["model.llm.num_kv_heads=3"], ["model.llm.num_heads=4", "model.llm.num_kv_heads=3"]),
    ("llm_hidden", ["model.llm.hidden_size=30"], ["model.llm.hidden_size=30", "model.llm.num_heads=4"]),
    ("llm_head_odd", ["model.llm.hidden_size=36"], ["model.llm.hidden_size=36", "even"]),
    ("enc_odd", ["model.encoder.hidden_size=27", "model.encoder.num_heads=3"], ["model.encoder.hidden_size=27", "even"]),
    ("enc_hidden", ["model.encoder.hidden_size=34", "model.encoder.num_heads=4"],
     ["model.encoder.hidden_size=34", "model.encoder.num_heads=4"]),
    ("O5g", ["trainer.final_eval_split=val"], ["trainer.final_eval_split='val'", "data.val_manifest"]),
    ("val_every", ["trainer.val_every=2"], ["trainer.val_every=2", "data.val_manifest"]),
    ("patience", ["trainer.early_stopping_patience=2", "data.val_manifest=v.parquet"],
     ["trainer.early_stopping_patience=2", "trainer.val_every=0"]),
    ("row155", ["data.input_cfg=mix.yaml", "data.train_manifest=t.parquet"],
     ["data.input_cfg", "data.train_manifest", "data.train_manifest=null"]),
]  # fmt: skip


@pytest.mark.parametrize("case,overrides,words", CROSS_FIELD, ids=[c[0] for c in CROSS_FIELD])
def test_cross_field_rules_in_load_config_and_validate(case, overrides, words, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, overrides)
    for w in words:
        assert w in str(e.value), str(e.value)
    code = cli_main(["validate", SMOKE, "--world-size", "1", "--device-capability", "none", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and words[0] in err, err


def test_heads_of_a_pretrained_llm_are_not_checked(tmp_path):
    cfg = load_config(SMOKE, [f"model.llm.pretrained={tmp_path}", "model.llm.num_kv_heads=3"])
    assert cfg.model.llm.num_kv_heads == 3  # the pretrained model brings its own sizes


def _float_keys() -> list[str]:
    hints: dict[str, typing.Any] = {}

    def walk(cls: type, prefix: str) -> None:
        th = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(th[f.name]):
                walk(th[f.name], f"{prefix}{f.name}.")
            else:
                hints[prefix + f.name] = th[f.name]

    walk(ExperimentConfig, "")
    return [k for k, tp in hints.items() if float in typing.get_args(tp) or tp is float]


@pytest.mark.parametrize("key", _float_keys())
def test_nan_is_refused_for_every_float_key(key):
    value = "[nan, 0.9]" if key == "optim.betas" else "[1, nan]" if key.endswith("boundaries") else "nan"
    with pytest.raises(ConfigError, match=f"{key}="):
        load_config(SMOKE, [f"{key}={value}"])
    with pytest.raises(ConfigError, match=f"{key}="):
        load_config(SMOKE, [f"{key}=inf"] if "[" not in value else [f"{key}={value.replace('nan', '.inf')}"])


def test_nan_in_a_config_file_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: .nan\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "optim.lr=nan" in str(e.value) and str(p) in str(e.value)


def test_good_values_at_the_edges_are_accepted():
    cfg = load_config(
        SMOKE,
        ["trainer.keep_last=1", "optim.min_lr_ratio=1", "optim.min_lr_ratio=0", "optim.betas=[0, 0.999]",
         "trainer.max_steps=0", "model.ctc_weight=0", "trainer.precision=bf16", "trainer.best_metric=loss",
         "trainer.seed=4294967295", "parallel.dp_shard=-1", "parallel.cp_split_threshold=0",
         "trainer.resume=auto", "trainer.final_eval_split=none", "sampler.max_batch_duration=null",
         "sampler.max_batch_tokens=4096", "trainer.max_minutes=0"],
    )  # fmt: skip
    assert cfg.trainer.resume == "auto" and cfg.optim.betas == (0.0, 0.999)
    assert cfg.trainer.max_minutes == 0  # no limit: README's `speechlm faults ... trainer.max_minutes=0`


# --- final_eval_split --------------------------------------------------------------------------------


def test_final_eval_split_defaults_to_auto_val_or_none():
    assert ExperimentConfig().trainer.final_eval_split == "auto"
    assert final_eval_split(load_config(SMOKE, ["data.val_manifest=v.parquet"])) == "val"
    assert final_eval_split(load_config(SMOKE, [])) == "none"
    assert final_eval_split(load_config(SMOKE, ["trainer.final_eval_split=train"])) == "train"
    # the demo scores the held-out split and a training subset beside it (issue 24)
    assert load_config(str(REPO / "configs/demo.yaml")).trainer.final_eval_split == "both"


def test_final_evaluation_without_a_split_says_so_and_scores_nothing(capsys, tmp_path):
    from speechlm.train.evaluate import final_evaluation

    cfg = load_config(SMOKE, [])  # auto, no val manifest
    inputs = SimpleNamespace(train_table=object(), val_table=None)
    assert final_evaluation(cfg, inputs, None, tmp_path, {"steps": 1, "train_minutes": 0.0}, 0) == {}
    assert (
        "no final evaluation (trainer.final_eval_split=auto and no data.val_manifest)"
        in capsys.readouterr().out
    )
    assert not (tmp_path / "eval.json").exists()
    cfg = load_config(SMOKE, ["trainer.final_eval_split=none", "data.val_manifest=v.parquet"])
    inputs = SimpleNamespace(train_table=object(), val_table=object())
    assert final_evaluation(cfg, inputs, None, tmp_path, {"steps": 1, "train_minutes": 0.0}, 0) == {}


# --- defaults that are not the demo's, and null on the command line ----------------------------------


def test_data_paths_default_to_none():
    d = ExperimentConfig().data
    assert d.train_manifest is None and d.val_manifest is None and d.tokenizer is None


def test_missing_train_manifest_or_tokenizer_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mix.yaml").write_text("[]")
    (tmp_path / "t.model").write_bytes(b"")
    with pytest.raises(ConfigError, match="set data.train_manifest=PATH"):
        require_inputs(load_config(SMOKE, ["data.tokenizer=t.model"]))
    with pytest.raises(ConfigError, match="set data.tokenizer=PATH"):
        require_inputs(load_config(SMOKE, ["data.train_manifest=t.parquet"]))
    require_inputs(load_config(SMOKE, ["data.input_cfg=mix.yaml", "data.tokenizer=t.model"]))


def test_train_without_data_exits_2_naming_the_key(capsys):
    code = cli_main(["train", SMOKE, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "set data.train_manifest=PATH" in err and "Traceback" not in err, err


def test_plan_without_data_names_the_flag_and_key(capsys):
    code = cli_main(["plan", "--config", SMOKE])
    err = capsys.readouterr().err
    assert code != 0 and "--manifest" in err and "data.train_manifest" in err and "Traceback" not in err, err


def test_null_on_the_command_line_unsets_an_optional_path():
    """newcomer row 155: `data.train_manifest=null` became the string 'null'."""
    demo = str(REPO / "configs/demo.yaml")
    cfg = load_config(demo, ["data.input_cfg=mix.yaml", "data.train_manifest=null", "data.val_manifest=null",
                             "trainer.val_every=0", "trainer.final_eval_split=train"])  # fmt: skip
    assert cfg.data.train_manifest is None and cfg.data.val_manifest is None
    assert cfg.data.input_cfg == os.path.join(os.getcwd(), "mix.yaml")


# --- paths resolve against the config file's folder ----------------------------------------------------


def _write(tmp_path: Path, data: dict) -> Path:
    d = tmp_path / "exp" / "configs"
    d.mkdir(parents=True)
    p = d / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_paths_in_a_file_resolve_against_its_folder_from_any_working_directory(tmp_path, monkeypatch):
    p = _write(tmp_path, {
        "data": {"train_manifest": "../data/train.parquet", "val_manifest": "../data/val.parquet",
                 "tokenizer": "tok.model",
                 "input_cfg": None},
        "model": {"encoder": {"pretrained": "../enc"}, "llm": {"pretrained": "/abs/llm"}},
        "trainer": {"resume": "../runs/x/checkpoints/best", "run_dir": "runs/out"},
    })  # fmt: skip
    seen = []
    for cwd in (tmp_path, tmp_path / "exp", p.parent):
        monkeypatch.chdir(cwd)
        cfg = load_config(p)
        seen.append(cfg)
        exp = tmp_path / "exp"
        assert cfg.data.train_manifest == str(exp / "data/train.parquet")
        assert cfg.data.val_manifest == str(exp / "data/val.parquet")
        assert cfg.data.tokenizer == str(exp / "configs/tok.model")
        assert cfg.model.encoder.pretrained == str(exp / "enc")
        assert cfg.model.llm.pretrained == "/abs/llm"
        assert cfg.trainer.resume == str(exp / "runs/x/checkpoints/best")
        assert cfg.trainer.run_dir == "runs/out"  # an output: relative to the working directory
    assert seen[0] == seen[1] == seen[2]


def test_resume_auto_and_inline_input_cfg_entries(tmp_path):
    p = _write(tmp_path, {
        "data": {"input_cfg": [{"path": "a.parquet", "weight": 2},
                               {"group": "g", "inputs": [{"path": "/abs/b"}, {"path": "sub/c"}]}]},
        "trainer": {"resume": "auto"},
    })  # fmt: skip
    cfg = load_config(p)
    base = str(p.parent)
    assert cfg.data.input_cfg == [
        {"path": f"{base}/a.parquet", "weight": 2},
        {"group": "g", "inputs": [{"path": "/abs/b"}, {"path": f"{base}/sub/c"}]},
    ]
    assert cfg.trainer.resume == "auto"
    cfg = load_config(_write(tmp_path / "2", {"data": {"input_cfg": "mix.yaml"}}))
    assert cfg.data.input_cfg == str(tmp_path / "2/exp/configs/mix.yaml")


def test_overrides_resolve_against_the_working_directory(tmp_path, monkeypatch):
    p = _write(tmp_path, {"data": {"train_manifest": "t.parquet"}})
    monkeypatch.chdir(tmp_path)
    cfg = load_config(p, ["data.tokenizer=tok/t.model", "data.val_manifest=/x/v.parquet"])
    assert cfg.data.train_manifest == str(p.parent / "t.parquet")
    assert cfg.data.tokenizer == str(tmp_path / "tok/t.model")
    assert cfg.data.val_manifest == "/x/v.parquet"


def test_saved_config_is_self_contained(tmp_path, monkeypatch):
    """RUN_DIR/config.yaml (to_dict of the loaded config) names the same files from anywhere."""
    p = _write(tmp_path, {"data": {"train_manifest": "t.parquet", "tokenizer": "t.model"}})
    cfg = load_config(p)
    saved = tmp_path / "run" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(yaml.safe_dump(to_dict(cfg)))
    monkeypatch.chdir(saved.parent)
    assert load_config(saved) == cfg


def test_demo_config_names_the_repo_demo_data_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs/demo.yaml")
    assert cfg.data.train_manifest == str(REPO / "data/demo_manifest/train.parquet")
    assert cfg.data.tokenizer == str(REPO / "data/demo_manifest/tokenizer.model")


def test_train_dry_run_from_another_directory_reads_the_configs_files(
    demo_data, tmp_path, monkeypatch, capsys
):
    """newcomer row 115: a config with relative paths, run from elsewhere, finds its files."""
    data = Path(demo_data["train"]).parent
    p = data / "rel.yaml"
    base = yaml.safe_load(Path(SMOKE).read_text())
    base["data"].update(train_manifest="train.parquet", val_manifest="val.parquet",
                        tokenizer=Path(demo_data["tok"]).name)  # fmt: skip
    p.write_text(yaml.safe_dump(base))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # `python -m speechlm.train` run from there, in this process
    r = train_in_process([str(p), "--dry-run", f"trainer.run_dir={elsewhere / 'run'}"], capsys)
    assert r.returncode == 0, r.stderr[-3000:]
    assert str(data / "train.parquet") in r.stdout + r.stderr


# --- docs/config.md ----------------------------------------------------------------------------------


def test_config_reference_is_generated_and_current():
    r = subprocess.run([sys.executable, str(REPO / "scripts/gen_config_docs.py"), "--check"],
                       capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    text = (REPO / "docs/config.md").read_text()
    for key, spec in KEYS.items():
        assert f"`{key.rsplit('.', 1)[1]}`" in text and spec.rule.describe().replace("|", "\\|") in text, key
    assert "against the folder of the config file" in text


@pytest.mark.parametrize("override", ["sampler.bucket_boundaries=[1, 2", "optim.lr=...", "optim.betas={a"])
def test_override_that_is_not_yaml_names_the_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}="):
        load_config(SMOKE, [override])


def test_string_override_that_is_not_yaml_is_kept_verbatim():
    assert load_config(SMOKE, ["data.instruction=[say it"]).data.instruction == "[say it"


def test_encoder_rules_that_need_the_pretrained_path():
    with pytest.raises(ConfigError, match="model.encoder.kind='nemo' needs model.encoder.pretrained"):
        load_config(SMOKE, ["model.encoder.kind=nemo"])
    with pytest.raises(ConfigError, match="model.encoder.conv_norm='layer_norm'.*model.encoder.pretrained"):
        load_config(SMOKE, ["model.encoder.pretrained=/x/enc", "model.encoder.conv_norm=layer_norm"])


def test_missing_input_files_are_named_with_the_resolved_path(tmp_path):
    (tmp_path / "t.parquet").write_bytes(b"")
    (tmp_path / "tok.model").write_bytes(b"")
    p = tmp_path / "c.yaml"
    p.write_text(
        "data:\n  train_manifest: t.parquet\n  tokenizer: tok.model\n  val_manifest: nope/val.parquet\n"
    )
    with pytest.raises(ConfigError) as e:
        require_inputs(load_config(p))
    msg = str(e.value)
    assert f"data.val_manifest={tmp_path}/nope/val.parquet" in msg and "does not exist" in msg
    assert "folder" in msg  # says how the path was resolved
    cfg = load_config(p, ["data.val_manifest=null", f"model.llm.pretrained={tmp_path}/no_llm"])
    with pytest.raises(ConfigError, match=f"model.llm.pretrained={tmp_path}/no_llm"):
        require_inputs(cfg)
    require_inputs(load_config(p, ["data.val_manifest=null"]))


@pytest.mark.parametrize("kind", ["binary", "directory", "list", "scalar_section"])
def test_corrupt_config_file_is_a_config_error_naming_it(tmp_path, kind, capsys):
    p = tmp_path / "c.yaml"
    if kind == "binary":
        p.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00garbage")
    elif kind == "directory":
        p.mkdir()
    elif kind == "list":
        p.write_text("- a\n- b\n")
    else:
        p.write_text("trainer: 5\n")
    with pytest.raises(ConfigError, match=str(p)):
        load_config(p)
    assert cli_main(["validate", str(p), "--world-size", "1", "--device-capability", "none"]) == 2
    assert str(p) in capsys.readouterr().err


def test_a_whole_section_override_resolves_its_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(SMOKE, ["data={train_manifest: t.parquet, tokenizer: tok.model}"])
    assert cfg.data.train_manifest == str(tmp_path / "t.parquet")
    assert cfg.data.tokenizer == str(tmp_path / "tok.model")


def test_llm_families_match_the_model_code():
    from speechlm.config import LLM_FAMILIES
    from speechlm.model import llm

    assert LLM_FAMILIES == llm.LLM_FAMILIES
