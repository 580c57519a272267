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


@pytest.fixture(scope="module")
def hf_tok(tiny_llm):
    from speechlm.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(tiny_llm, langs=["en", "hi"])


def _auto(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def test_ids_are_the_llm_tokenizers_ids(tiny_llm, hf_tok):
    auto = _auto(tiny_llm)
    words = "moon blue sun river"
    ids = hf_tok.encode(f"<|en|> {words}")
    assert ids[1:] == auto.encode(words, add_special_tokens=False)  # the LLM's own ids for the words
    assert ids[0] == hf_tok.lang_id("en") == len(auto) + 1  # added after the vocabulary, <|audio|> first
    assert hf_tok.audio_id == len(auto) and hf_tok.vocab_size == len(auto) + 3
    assert hf_tok.added_ids == (len(auto), len(auto) + 1, len(auto) + 2)
    assert hf_tok.decode(ids) == words and hf_tok.decode(ids, keep_lang_tag=True) == f"<|en|> {words}"


def test_no_pad_token_pads_with_eos_and_ctc_blank_is_the_placeholder(hf_tok):
    assert hf_tok.pad_id == hf_tok.eos_id and hf_tok.bos_id is None
    assert hf_tok.ctc_blank_id == hf_tok.audio_id != hf_tok.pad_id
    assert hf_tok.tag_tokens == 1


def test_decode_drops_template_tokens_and_ids_past_the_vocabulary(hf_tok):
    ids = hf_tok.encode("<|hi|> moon") + [hf_tok.eos_id, 1, hf_tok.vocab_size + 7]  # <|im_end|>, <|im_start|>
    assert hf_tok.decode(ids) == "moon"


def test_template_render_matches_transformers(tiny_llm, hf_tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "<|audio|>\nhi"}]
    messages.append({"role": "assistant", "content": "moon"})
    assert hf_tok.render_chat(messages) == _auto(tiny_llm).apply_chat_template(messages, tokenize=False)


def test_lang_tags_none_drops_the_tag(tiny_llm):
    from speechlm.data.hf_tokenizer import HFTokenizer
    from speechlm.data.tokenizer import UnknownLanguageError

    tok = HFTokenizer(tiny_llm, langs=["en"], lang_tags="none")
    assert tok.encode("<|en|> moon blue") == _auto(tiny_llm).encode("moon blue", add_special_tokens=False)
    assert tok.tag_tokens == 0 and tok.vocab_size == len(_auto(tiny_llm)) + 1  # only <|audio|> added
    with pytest.raises(UnknownLanguageError, match="no language tags"):
        tok.lang_id("en")
    with pytest.raises(ValueError, match="does not know"):
        tok.encode("<|ta|> moon")


def test_save_then_load_keeps_ids_for_transformers_and_for_us(tmp_path, hf_tok):
    import pickle

    from speechlm.data.tokenizer import load_text_tokenizer

    out = hf_tok.save(tmp_path / "tok")
    again = load_text_tokenizer(out)  # languages from speechlm_tokenizer.json
    # the copy records the rows the LLM lacks (evaluate/export rebuild the model with them from it)
    assert again.langs == ("en", "hi") and again.added_ids == hf_tok.added_ids != ()
    text = "<|hi|> moon blue"
    assert again.encode(text) == hf_tok.encode(text) and again.vocab_size == hf_tok.vocab_size
    auto = _auto(out)
    assert auto.convert_tokens_to_ids(["<|audio|>", "<|en|>", "<|hi|>"]) == [
        hf_tok.audio_id,
        hf_tok.lang_id("en"),
        hf_tok.lang_id("hi"),
    ]
    assert auto.chat_template == hf_tok.chat_template
    more = load_text_tokenizer(out, langs=["ta"])  # a new language is appended, old ids kept
    assert more.langs == ("en", "hi", "ta") and more.lang_id("hi") == hf_tok.lang_id("hi")
    assert more.added_ids == (*hf_tok.added_ids, hf_tok.vocab_size)
    restored = pickle.loads(pickle.dumps(more))  # DataLoader workers
    assert restored.encode("<|ta|> moon") == more.encode("<|ta|> moon")


def test_sentencepiece_save_and_load_text_tokenizer(tmp_path, demo_data):
    from speechlm.data.tokenizer import Tokenizer, load_text_tokenizer
    from speechlm.errors import UsageError

    sp = load_text_tokenizer(demo_data["tok"])
    assert isinstance(sp, Tokenizer) and sp.ctc_blank_id == sp.pad_id and sp.tag_tokens == 1
    saved = sp.save(tmp_path / "sp")
    assert load_text_tokenizer(tmp_path / "sp").encode("<|en|> moon") == sp.encode("<|en|> moon")
    assert load_text_tokenizer(saved).langs == sp.langs
    with pytest.raises(UsageError, match="data.lang_tags=none"):
        load_text_tokenizer(demo_data["tok"], lang_tags="none")


def test_bad_directories_name_the_file(tmp_path, tiny_llm):
    import shutil

    from speechlm.data.hf_tokenizer import HFTokenizer
    from speechlm.data.tokenizer import TokenizerError, TokenizerFileError, load_text_tokenizer

    with pytest.raises(TokenizerFileError, match="no tokenizer"):
        load_text_tokenizer(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llm, broken)
    (broken / "tokenizer.json").write_text('{"model": ')  # truncated
    with pytest.raises(TokenizerError, match="tokenizer.json cannot be loaded"):
        HFTokenizer(broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(TokenizerFileError, match="tokenizer.json does not exist"):
        HFTokenizer(broken)
    shutil.copy(tiny_llm / "tokenizer.json", broken / "tokenizer.json")
    (broken / "speechlm_tokenizer.json").write_text("{")
    with pytest.raises(TokenizerError, match="speechlm_tokenizer.json is not valid JSON"):
        HFTokenizer(broken)
