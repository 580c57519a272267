"""Typed config: YAML loading, dotted overrides, unknown keys named in the error."""

import pytest

from speechlm.config import ConfigError, ExperimentConfig, load_config, to_dict


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(
        None,
        [
            "model.packed_sequences=false",
            "sampler.max_batch_tokens=4000",
            "sampler.bucket_boundaries=[1, 2.5]",
            "trainer.resume=none",
            "trainer.precision=32",
        ],
    )
    assert cfg.model.packed_sequences is False
    assert cfg.sampler.max_batch_tokens == 4000
    assert cfg.sampler.bucket_boundaries == [1.0, 2.5]
    assert cfg.trainer.resume is None
    assert cfg.trainer.precision == "32"  # strings stay strings even when they look like numbers


def test_yaml_round_trip(tmp_path):
    import yaml

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"parallel": {"cp_size": 2}, "model": {"llm": {"num_kv_heads": 2}}}))
    cfg = load_config(p)
    assert cfg.parallel.cp_size == 2 and cfg.model.llm.num_kv_heads == 2
    again = tmp_path / "d.yaml"
    again.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(again) == cfg


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  packed_sequence: true\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "model.packed_sequence" in str(e.value)
    assert "packed_sequences" in str(e.value)  # lists the valid keys


def test_unknown_override_key_and_bad_type():
    with pytest.raises(ConfigError, match="model.packd"):
        load_config(None, ["model.packd=1"])
    with pytest.raises(ConfigError, match="parallel.cp_size"):
        load_config(None, ["parallel.cp_size=two"])
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["model.dropout"])


def test_invalid_choice_rejected():
    with pytest.raises(ConfigError, match="attention_backend"):
        load_config(None, ["model.attention_backend=magic"])
    with pytest.raises(ConfigError, match="data.read_mode='random'.*'streaming'"):
        load_config(None, ["data.read_mode=random"])
    with pytest.raises(ConfigError, match="trainer.eval_batch_duration=0"):
        load_config(None, ["trainer.eval_batch_duration=0"])
    with pytest.raises(ConfigError, match="data.shuffle_buffer=0"):
        load_config(None, ["data.read_mode=streaming", "data.shuffle_buffer=0"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "x.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_shipped_configs_load():
    from pathlib import Path

    for p in sorted(Path(__file__).resolve().parent.parent.glob("configs/*.yaml")):
        if p.name == "mix_example.yaml":  # a data.input_cfg list, not an experiment config
            continue
        if p.name == "sweep_example.yaml":  # a sweep spec: named as one
            with pytest.raises(ConfigError, match="this is a sweep spec .* `speechlm sweep init"):
                load_config(p)
            continue
        assert isinstance(load_config(p), ExperimentConfig), p


def test_eval_batch_duration_defaults_to_four_training_budgets():
    from speechlm.config import eval_batch_duration

    assert eval_batch_duration(load_config(None, ["sampler.max_batch_duration=32"])) == 128.0
    assert eval_batch_duration(load_config(None, ["trainer.eval_batch_duration=50"])) == 50.0
