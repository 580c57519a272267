"""Issue 21, config: choice fields typed as Literal (parsing refuses bad values with the key's message), a
`validate()` per section, one dotted-override parser, and the removed `model.encoder.tensor_parallel`."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest

from parallel.backend_caps import BACKENDS
from speechlm.config import (
    KEYS,
    AttentionBackend,
    ConfigError,
    DataConfig,
    EncoderConfig,
    ExperimentConfig,
    LLMConfig,
    ModelConfig,
    OneOf,
    OptimConfig,
    ParallelConfig,
    SamplerConfig,
    TrainerConfig,
    apply_override,
    leaf_keys,
    load_config,
)


def test_removed_encoder_tensor_parallel_is_named_in_a_file(tmp_path: Path) -> None:
    p = tmp_path / "old.yaml"
    p.write_text("model:\n  encoder:\n    tensor_parallel: true\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "model.encoder.tensor_parallel" in msg
    assert "removed" in msg and "delete" in msg


@pytest.mark.parametrize("value", ["true", "false"])
def test_removed_encoder_tensor_parallel_is_named_on_the_command_line(value: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.encoder\.tensor_parallel.*removed"):
        load_config(None, [f"model.encoder.tensor_parallel={value}"])


# --- choice fields are Literal types; the allowed set has one source --------------------------------


def _choice_fields() -> dict[str, tuple[object, ...]]:
    """Dotted key -> the values its Literal type admits (Literal members of a union included)."""
    out: dict[str, tuple[object, ...]] = {}
    for key in leaf_keys():
        *parents, name = key.split(".")
        cls: type = ExperimentConfig
        for part in parents:
            cls = typing.get_type_hints(cls)[part]
        tp = typing.get_type_hints(cls)[name]
        members = (
            [tp, *typing.get_args(tp)] if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
        )
        allowed = tuple(
            a for m in members if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)
        )
        if allowed:
            out[key] = allowed
    return out


def test_every_choice_field_is_a_literal_and_its_rule_reads_the_type() -> None:
    choices = _choice_fields()
    one_of = {k: s.rule for k, s in KEYS.items() if isinstance(s.rule, OneOf)}
    assert set(one_of) <= set(choices), sorted(set(one_of) - set(choices))
    for key, rule in one_of.items():
        assert rule.choices == choices[key], key
    assert {"trainer.precision", "model.attention_backend", "data.read_mode", "model.encoder.kind"} <= set(
        choices
    )
    assert set(typing.get_args(AttentionBackend)) == set(BACKENDS)


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("trainer.precision=bf16-mixed", ["trainer.precision='bf16-mixed'", "use trainer.precision=bf16"]),
        ("model.attention_backend=magic", ["model.attention_backend='magic'", "'reference'"]),
        ("sampler.mode=greedy", ["sampler.mode='greedy'", "'temperature', 'exhaustive'"]),
        ("data.sample_rate=8000", ["data.sample_rate=8000", "16000"]),
    ],
)
def test_parsing_refuses_a_bad_choice_with_the_fields_message(override: str, words: list[str]) -> None:
    cfg = ExperimentConfig()
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, override)  # parsing alone, before any check_config
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_choice_in_a_file_is_refused_while_parsing(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  precision: fp16\n")
    with pytest.raises(ConfigError, match=r"trainer\.precision='fp16'.*fp16 is not supported"):
        load_config(p)
    p.write_text("trainer:\n  precision: 32\n")  # YAML reads a number; the choice is the string "32"
    assert load_config(p).trainer.precision == "32"


# --- validate() per section ---------------------------------------------------------------------------


def test_each_section_validates_its_own_keys() -> None:
    with pytest.raises(ConfigError, match=r"optim\.lr=-1: out of range; use number > 0"):
        OptimConfig(lr=-1).validate()
    with pytest.raises(ConfigError, match=r"optim\.lr=-1 \(set on the command line\)"):
        OptimConfig(lr=-1).validate({"optim.lr": "on the command line"})
    with pytest.raises(
        ConfigError, match=r"model\.llm\.num_heads=4 is not a multiple of model\.llm\.num_kv_heads=3"
    ):
        LLMConfig(num_kv_heads=3).validate()
    with pytest.raises(ConfigError, match=r"model\.encoder\.hidden_size=27 must be even"):
        EncoderConfig(hidden_size=27, num_heads=3).validate()
    with pytest.raises(ConfigError, match=r"model\.encoder\.hidden_size=27"):
        ModelConfig(
            encoder=EncoderConfig(hidden_size=27, num_heads=3)
        ).validate()  # a section checks its children
    with pytest.raises(ConfigError, match=r"parallel\.dp_shard=0"):
        ParallelConfig(dp_shard=0).validate()
    for section in (
        DataConfig(),
        SamplerConfig(),
        ModelConfig(),
        ParallelConfig(),
        OptimConfig(),
        TrainerConfig(),
    ):
        section.validate()  # the defaults are valid
    # rules across sections stay with the experiment
    TrainerConfig(val_every=2).validate()
    with pytest.raises(ConfigError, match=r"trainer\.val_every=2 but data\.val_manifest"):
        ExperimentConfig(trainer=TrainerConfig(val_every=2)).validate()


# --- one dotted-override parser ---------------------------------------------------------------------


def test_one_override_parser_for_config_sweep_and_validate() -> None:
    from speechlm.config import is_override, split_override
    from speechlm.sweep.dispatch import _matches, parse_only
    from speechlm.sweep.spec import format_override

    assert split_override(" model.x =a=b") == ("model.x", "a=b")  # the key stripped, the value as written
    for bad in ("model.dropout", "=3", " =3"):
        with pytest.raises(ConfigError, match="must look like key.path=value"):
            split_override(bad)
    assert is_override("trainer.max_steps=3") and not is_override("--env=X=1") and not is_override("cfg.yaml")
    # the sweep's --only filter and job matching read overrides the same way (key stripped)
    assert parse_only(["trainer.seed =1"]) == {"trainer.seed": "1"}
    with pytest.raises(ValueError, match="--only 'seed'.*key.path=value"):
        parse_only(["seed"])
    assert _matches({"id": "a", "overrides": [" trainer.seed=1"]}, {"trainer.seed": "1"})
    assert split_override(format_override("optim.betas", [0.9, 0.98])) == ("optim.betas", "[0.9, 0.98]")
    # the origin of a key set with spaces around it is the command line
    with pytest.raises(ConfigError, match=r"optim\.lr=-1.0 \(set on the command line\)"):
        load_config(None, [" optim.lr =-1"])


def test_one_command_line_parser_takes_overrides_after_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`parse_command_line` is what `speechlm`, `python -m speechlm.train` and `python -m
    speechlm.preflight.validate` call: overrides after the flags join `overrides`, in order; other leftover
    words are an argument error that names only them; a command without overrides takes none."""
    import argparse

    from speechlm.config import parse_command_line

    parser = argparse.ArgumentParser(prog="cmd")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--json", action="store_true")
    args = parse_command_line(parser, ["c.yaml", "a.b=1", "--json", "c.d=2", "e.f=3"])
    assert (args.config, args.overrides, args.json) == ("c.yaml", ["a.b=1", "c.d=2", "e.f=3"], True)
    assert parse_command_line(parser, ["c.yaml"]).overrides == []
    with pytest.raises(SystemExit) as e:
        parse_command_line(parser, ["c.yaml", "--json", "c.d=2", "--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith("error: unrecognized arguments: --bogus\n")
    plain = argparse.ArgumentParser(prog="cmd")
    plain.add_argument("config")
    with pytest.raises(SystemExit):
        parse_command_line(plain, ["c.yaml", "a.b=1"])
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: a.b=1\n")


# --- each key declared once: key(default, doc, rule) on the field -------------------------------------


def test_a_key_states_its_rule_or_takes_it_from_its_type() -> None:
    """`key()` is the one declaration of a key: a Literal field's rule lists the Literal's values (also when
    the rule gives only advice), a bool field's is Flag(); any other field without a rule is refused."""
    from dataclasses import dataclass

    from speechlm.config import Flag, Num, Section, key
    from speechlm.config.keys import field_specs

    @dataclass
    class Demo(Section):
        KEY: typing.ClassVar[str] = "demo"
        mode: typing.Literal["a", "b"] = key("a", "a mode")
        near: typing.Literal["x", "y"] = key("x", "advised", OneOf(advice=(("z", "z: use x"),)))
        on: bool = key(True, "a switch")
        n: int = key(1, "a count", Num(lo=1, integer=True))
        names: list[str] = key(["p"], "a list", Num())

    specs = field_specs(Demo)
    assert [specs[k].rule for k in ("mode", "on")] == [OneOf(("a", "b")), Flag()]
    assert specs["n"].rule == Num(lo=1, integer=True)
    assert specs["near"].rule == OneOf(("x", "y"), advice=(("z", "z: use x"),))
    assert specs["n"].advice() == "use integer >= 1 (a count)"
    assert Demo().names == ["p"] and Demo().names is not Demo().names  # a list default is copied
    with pytest.raises(ConfigError, match=r"^demo.near='z' \(the default\): not a valid choice \(z: use x"):
        Demo(near="z").validate({})

    @dataclass
    class NoRule(Section):
        count: int = key(1, "a count")

    with pytest.raises(TypeError, match="NoRule.count: give key"):
        field_specs(NoRule)
