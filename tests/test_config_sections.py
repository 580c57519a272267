"""Issue 21, config: choice fields typed as Literal (parsing refuses bad values with the FIELDS message), a
`validate()` per section, one dotted-override parser, and the removed `model.encoder.tensor_parallel`."""

from __future__ import annotations

from pathlib import Path

import pytest

from speechlm.config import ConfigError, load_config


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
