"""speechlm.data.run_inputs: the run's inputs built once from the config (the chat template read once)."""

from __future__ import annotations

import pytest

from speechlm.config import load_config
from speechlm.data.run_inputs import read_chat_template, tokenizer_prefix
from speechlm.errors import UsageError


def test_the_chat_template_is_read_from_its_file_once_and_auto_none_pass_through(tmp_path):
    f = tmp_path / "chat.jinja"
    f.write_text("{{ messages }}", encoding="utf-8")
    assert read_chat_template(load_config(None, [f"data.chat_template={f}"])) == "{{ messages }}"
    for word in ("auto", "none"):
        assert read_chat_template(load_config(None, [f"data.chat_template={word}"])) == word
    f.unlink()
    with pytest.raises(UsageError, match=r"data.chat_template=.*chat.jinja cannot be read"):
        read_chat_template(load_config(None, [f"data.chat_template={f}"]))


def test_tokenizer_prefix_drops_the_files_suffix(tmp_path):
    assert tokenizer_prefix(tmp_path / "sp.model") == tmp_path / "sp"
    assert tokenizer_prefix(tmp_path / "sp") == tmp_path / "sp"
