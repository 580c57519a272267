"""The LLM's own tokenizer (`speechlm.data.hf_tokenizer`) and the tiny pretrained directories of the tests."""

from __future__ import annotations

import pytest
from pretrained_helpers import IM_END, make_tiny_pretrained


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    return make_tiny_pretrained(tmp_path_factory.mktemp("tiny_llm"), langs=["en", "hi"])


def test_tiny_pretrained_loads_offline_with_its_template(tiny_llm, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_llm)
    assert tok.chat_template and tok.eos_token == IM_END
    assert tok.pad_token is None and tok.bos_token is None  # as Qwen's: the code must cope
    assert tok.decode(tok.encode("moon blue sun", add_special_tokens=False)) == "moon blue sun"
    model = AutoModelForCausalLM.from_pretrained(tiny_llm)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert (tiny_llm / "model.safetensors").is_file()
