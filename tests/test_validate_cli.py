"""`speechlm validate`: exit codes 0/1/2, the table and JSON output, flags, and the fit-start entry point."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from parallel.validator import ValidationError
from speechlm.config import load_config
from speechlm.preflight import validate as cli

# a 64-GPU layout: 2 replicas x 4 shards x cp 2 x tp 4
LAYOUT_64: dict[str, Any] = {
    "model": {
        "packed_sequences": True,
        "attention_backend": "reference",
        "llm": {"num_heads": 32, "num_kv_heads": 8},
    },
    "parallel": {"dp_replicate": 2, "dp_shard": -1, "cp_size": 2, "tp_size": 4},
}
FLAGS = ["--device-capability", "9.0", "--assume-installed", "torch=2.13.0"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("WORLD_SIZE", "NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN"):
        monkeypatch.delenv(key, raising=False)


def write_config(tmp_path: Path, data: dict[str, Any], name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_valid_layout_prints_one_ok_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, write_config(tmp_path, LAYOUT_64), "--world-size", "64", *FLAGS)
    assert code == 0
    assert out.strip() == "OK: layout valid (dp=8, cp=2, tp=4, world=64, backend=reference, packed=true)"


def test_errors_print_a_table_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, LAYOUT_64)
    code, out, _ = run(capsys, cfg, "--world-size", "64", *FLAGS, "model.packed_sequences=false")
    assert code == 1
    assert "ERROR    bshd-with-cp" in out and "fix:" in out and "model.packed_sequences=true" in out
    assert "1 error(s), 0 warning(s)" in out and "OK:" not in out


def test_warnings_only_still_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, {"model": {"attention_backend": "te"}})
    code, out, _ = run(capsys, cfg, "--device-capability", "9.0", "--assume-installed", "te=2.5")
    assert code == 0
    assert "WARNING  te-fused-attn" in out and out.strip().endswith("1 warning(s) above")


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, {"model": {"attention_backend": "te"}})
    argv = [cfg, "--json", "--device-capability", "12.0", "--assume-installed", "transformer-engine=2.5"]
    argv += ["--assume-installed", "flash-attn=2.8.3"]  # te's THD path once NVTE_FUSED_ATTN=0
    code, out, _ = run(capsys, *argv, "--env", "SECRET_TOKEN=abc")
    assert code == 1
    doc = json.loads(out)
    assert doc["valid"] is False
    assert [f["rule_id"] for f in doc["findings"]] == ["te-fused-attn-sm120"]
    assert set(doc["findings"][0]) == {"level", "rule_id", "reason", "fix"}
    ctx = doc["context"]
    assert ctx["device_capability"] == "12.0" and ctx["attention_backend"] == "te" and ctx["world_size"] == 1
    assert ctx["installed"]["transformer-engine"] == "2.5" and ctx["config"] == cfg
    assert "SECRET_TOKEN" not in out  # only the variables the rules read are echoed

    code, out, _ = run(capsys, *argv, "--env", "NVTE_FUSED_ATTN=0")
    doc = json.loads(out)
    assert code == 0 and doc == {**doc, "valid": True, "findings": []}
    assert doc["context"]["env"] == {"NVTE_FUSED_ATTN": "0"}


def test_unreadable_config_exits_2_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope.yaml")
    code, out, err = run(capsys, missing, *FLAGS)
    assert code == 2 and missing in err and out == ""

    typo = write_config(tmp_path, {"parallel": {"cp_sise": 2}}, "typo.yaml")
    code, _, err = run(capsys, typo, *FLAGS)
    assert code == 2 and "typo.yaml" in err and "parallel.cp_sise" in err

    broken = tmp_path / "broken.yaml"
    broken.write_text("parallel: [1, 2\n")
    code, _, err = run(capsys, str(broken), *FLAGS)
    assert code == 2 and "broken.yaml" in err

    code, _, err = run(capsys, write_config(tmp_path, {}), *FLAGS, "model.packed_sequence=false")
    assert code == 2 and "model.packed_sequence" in err


def test_an_input_cfg_list_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """README (issue 36): `speechlm validate configs/mix_example.yaml` said only "the top level must be a
    mapping of sections"; the file is a data.input_cfg list, and the error says how to use it."""
    mix = str(Path(__file__).resolve().parent.parent / "configs" / "mix_example.yaml")
    code, out, err = run(capsys, mix, *FLAGS)
    assert code == 2 and out == ""
    assert f"{mix}: this is a data.input_cfg list" in err
    assert f"use it as data.input_cfg={mix} with a config" in err
    other = tmp_path / "list.yaml"
    other.write_text("- 1\n- 2\n")  # a list, but not of datasets
    code, _, err = run(capsys, str(other), *FLAGS)
    assert code == 2 and "the top level must be a mapping of sections" in err


def test_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, {})
    code, _, err = run(capsys, cfg, "--device-capability", "hopper")
    assert code == 2 and "--device-capability" in err
    code, _, err = run(capsys, cfg, *FLAGS, "NVTE_FUSED_ATTN=0")
    assert code == 2 and "--env NVTE_FUSED_ATTN=0" in err
    code, _, err = run(capsys, cfg, *FLAGS, "--assume-installed", "flash-attn")
    assert code == 2 and "NAME=VALUE" in err
    code, _, err = run(capsys, cfg, *FLAGS, "--world-size", "0")
    assert code == 2 and "world size" in err


def test_overrides_may_follow_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, LAYOUT_64)
    code, out, _ = run(
        capsys,
        cfg,
        "model.attention_backend=reference",
        "--world-size",
        "64",
        *FLAGS,
        "--json",
        "model.packed_sequences=false",
    )
    assert code == 1 and [f["rule_id"] for f in json.loads(out)["findings"]] == ["bshd-with-cp"]


def test_cp_and_tp_flags_set_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, LAYOUT_64)
    code, out, _ = run(capsys, cfg, "--world-size", "64", "--cp-size", "4", "--tp-size", "8", *FLAGS)
    assert code == 0 and "dp=2, cp=4, tp=8, world=64" in out
    code, out, _ = run(capsys, cfg, "--world-size", "64", "--tp-size", "3", *FLAGS)
    assert code == 1 and "world-size-mismatch" in out and "heads-not-divisible-by-tp" in out


def test_world_size_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, LAYOUT_64)
    code, out, _ = run(capsys, cfg, *FLAGS)  # as configured: dp_shard=-1 counts as 1
    assert code == 0 and "world=16" in out
    monkeypatch.setenv("WORLD_SIZE", "32")
    code, out, _ = run(capsys, cfg, *FLAGS, "--json")
    ctx = json.loads(out)["context"]
    assert (
        ctx["world_size"] == 32 and ctx["world_size_source"] == "WORLD_SIZE" and ctx["dp_shard_resolved"] == 2
    )
    monkeypatch.setenv("WORLD_SIZE", "many")
    code, _, err = run(capsys, cfg, *FLAGS)
    assert code == 2 and "WORLD_SIZE" in err


def test_env_flag_sets_and_unsets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, {"model": {"attention_backend": "te"}})
    flags = [
        "--device-capability",
        "12.0",
        "--assume-installed",
        "te=2.5",
        "--assume-installed",
        "flash-attn=2.8",
    ]
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    assert run(capsys, cfg, *flags)[0] == 0
    code, out, _ = run(capsys, cfg, *flags, "--env", "NVTE_FUSED_ATTN")
    assert code == 1 and "te-fused-attn-sm120" in out and "NVTE_FUSED_ATTN unset" in out
    code, out, _ = run(capsys, cfg, *flags, "--env", "NVTE_FUSED_ATTN=")
    assert code == 1 and "set to ''" in out


def test_assume_installed_none_means_absent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, {"model": {"attention_backend": "flash"}})
    code, out, _ = run(capsys, cfg, "--device-capability", "9.0", "--assume-installed", "flash-attn=none")
    assert code == 1 and "backend-not-installed" in out and "speechlm[flash]" in out
    code, out, _ = run(capsys, cfg, "--device-capability", "9.0", "--assume-installed", "flash_attn=2.5.9")
    assert code == 1 and "backend-version-unsupported" in out
    code, _, _ = run(capsys, cfg, "--device-capability", "9.0", "--assume-installed", "flash-attn=2.8.3")
    assert code == 0


def test_defaults_come_from_this_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    import torch

    cfg = write_config(tmp_path, {"model": {"attention_backend": "flash"}})
    code, out, _ = run(capsys, cfg, "--json", "--assume-installed", "flash-attn=2.8.3")
    doc = json.loads(out)
    assert doc["context"]["installed"]["torch"] == importlib.metadata.version("torch")
    if not torch.cuda.is_available():
        assert doc["context"]["device_capability"] is None
        assert code == 1 and [f["rule_id"] for f in doc["findings"]] == ["backend-needs-gpu"]


def test_detect_device_capability_on_this_machine() -> None:
    torch = pytest.importorskip("torch")
    cap = cli.detect_device_capability()
    if torch.cuda.is_available():
        assert cap == tuple(torch.cuda.get_device_capability())
    else:
        assert cap is None


def test_format_cudnn_version() -> None:
    assert cli.format_cudnn_version(90100) == "9.1.0"
    assert cli.format_cudnn_version(91002) == "9.10.2"
    assert cli.format_cudnn_version(8902) == "8.9.2"
    assert cli.format_cudnn_version(None) is None


def test_speechlm_cli_dispatches_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from speechlm.cli import main

    cfg = write_config(tmp_path, LAYOUT_64)
    assert main(["validate", cfg, "--world-size", "64", *FLAGS]) == 0
    assert "OK: layout valid" in capsys.readouterr().out
    assert main(["validate", cfg, "--world-size", "64", *FLAGS, "model.packed_sequences=false"]) == 1


def test_validate_at_fit_start(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, LAYOUT_64))
    logged: list[str] = []
    assert (
        cli.validate_at_fit_start(config, 64, rank=0, log=logged.append, device_capability=None, env={}) == []
    )
    assert logged == []
    config.model.packed_sequences = False
    for rank in (0, 5):
        with pytest.raises(ValidationError, match="bshd-with-cp"):
            cli.validate_at_fit_start(
                config, 64, rank=rank, log=logged.append, device_capability=None, env={}
            )
    assert len(logged) == 1 and "model.packed_sequences=true" in logged[0]
