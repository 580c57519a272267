"""Tokenizer: special ids, one token per language tag, round trips, errors, pickling, CLI."""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speechlm.data.tokenizer import Tokenizer, add_parser, train_tokenizer

LANGS = ["hi", "bn", "ta", "en"]
TEXTS = [
    "<|hi|> नमस्ते दुनिया यह एक छोटा परीक्षण है",
    "<|hi|> आज मौसम बहुत अच्छा है और हम बाहर जाएंगे",
    "<|bn|> আমি বাংলায় কথা বলি এবং গান গাই",
    "<|bn|> আজ আকাশ খুব পরিষ্কার",
    "<|ta|> வணக்கம் உலகம் இது ஒரு சோதனை",
    "<|ta|> நான் தமிழ் பேசுகிறேன்",
    "<|en|> hello world this is a small test",
    "<|en|> the weather is nice today and we will go out",
] * 5


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    return Tokenizer(train_tokenizer(TEXTS, out, langs=LANGS, vocab_size=300))


def test_writes_model_vocab_and_sidecar(tmp_path: Path) -> None:
    model = train_tokenizer(iter(TEXTS), tmp_path / "sp", langs=LANGS, vocab_size=300)
    assert model == tmp_path / "sp.model"
    assert (tmp_path / "sp.vocab").is_file()
    meta = json.loads((tmp_path / "sp.json").read_text())
    assert meta["langs"] == LANGS
    assert meta["special"] == {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, "<|audio|>": 4}
    assert meta["lang_ids"] == {"hi": 5, "bn": 6, "ta": 7, "en": 8}


def test_special_ids(tok: Tokenizer) -> None:
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id, tok.audio_id) == (0, 1, 2, 3, 4)
    assert [tok.lang_id(lang) for lang in LANGS] == [5, 6, 7, 8]
    assert tok.langs == tuple(LANGS)
    assert len(tok) == tok.vocab_size <= 300
    assert tok.id_to_piece(tok.audio_id) == "<|audio|>"


@pytest.mark.parametrize("lang", LANGS)
def test_language_tag_is_one_token(tok: Tokenizer, lang: str) -> None:
    text = next(t for t in TEXTS if t.startswith(f"<|{lang}|>"))
    ids = tok.encode(text)
    assert ids[0] == tok.lang_id(lang)
    assert tok.id_to_piece(ids[0]) == f"<|{lang}|>"
    assert tok.lang_id(lang) not in ids[1:]
    # no stray word-boundary piece before the tag, and none of the text's pieces is special
    assert all(i > 8 for i in ids[1:])
    # SentencePiece itself also keeps the tag whole (it is a user-defined symbol)
    assert f"<|{lang}|>" in tok._sp.encode(text, out_type=str)


def test_round_trip(tok: Tokenizer) -> None:
    for text in set(TEXTS):
        ids = tok.encode(text)
        assert tok.decode(ids, keep_lang_tag=True) == text
        assert tok.decode(ids) == text.split(" ", 1)[1]


def test_encode_adds_no_bos_eos_and_decode_drops_specials(tok: Tokenizer) -> None:
    ids = tok.encode("<|en|> hello world")
    assert tok.bos_id not in ids and tok.eos_id not in ids
    noisy = [tok.bos_id, *ids[:2], tok.audio_id, *ids[2:], tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode(noisy) == "hello world"
    assert tok.decode(noisy, keep_lang_tag=True) == "<|en|> hello world"
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_audio_placeholder_and_whitespace(tok: Tokenizer) -> None:
    ids = tok.encode("<|en|>  hello <|audio|>world ")
    assert ids.count(tok.audio_id) == 1
    assert ids == [tok.lang_id("en"), *tok.encode("hello"), tok.audio_id, *tok.encode("world")]


def test_unknown_language_errors_name_known_languages(tok: Tokenizer) -> None:
    with pytest.raises(KeyError, match="'fr'.*known: hi, bn, ta, en"):
        tok.lang_id("fr")
    with pytest.raises(ValueError, match=r"<\|fr\|>.*hi, bn, ta, en"):
        tok.encode("<|fr|> bonjour")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_pickle_carries_path_and_reloads(tok: Tokenizer) -> None:
    blob = pickle.dumps(tok)
    assert len(blob) < 1000  # the path, not the model
    clone = pickle.loads(blob)
    assert clone.path == tok.path
    assert clone.encode(TEXTS[0]) == tok.encode(TEXTS[0])
    assert clone.lang_id("ta") == tok.lang_id("ta")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_training_is_deterministic(tmp_path: Path, model_type: str) -> None:
    first = train_tokenizer(TEXTS, tmp_path / "t", langs=LANGS, vocab_size=200, model_type=model_type)
    blob, vocab = first.read_bytes(), (tmp_path / "t.vocab").read_bytes()
    again = train_tokenizer(TEXTS, tmp_path / "t", langs=LANGS, vocab_size=200, model_type=model_type)
    assert again.read_bytes() == blob and (tmp_path / "t.vocab").read_bytes() == vocab
    tok = Tokenizer(tmp_path / "t")  # the prefix works as well as the .model path
    assert tok.encode(TEXTS[0])[0] == tok.lang_id("hi")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not valid"):
        train_tokenizer(TEXTS, tmp_path / "t", langs=["<|hi|>"])
    with pytest.raises(TypeError, match="wrap it in a list"):
        train_tokenizer(TEXTS, tmp_path / "t", langs="hi")
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer(TEXTS, tmp_path / "t", langs=LANGS, model_type="word")
    with pytest.raises(ValueError, match="reserved"):
        train_tokenizer(TEXTS, tmp_path / "t", langs=LANGS, vocab_size=9)
    with pytest.raises(FileNotFoundError, match="speechlm tokenizer train"):
        Tokenizer(tmp_path / "nothing.model")


def test_missing_sidecar_is_an_error(tmp_path: Path) -> None:
    train_tokenizer(TEXTS, tmp_path / "t", langs=LANGS, vocab_size=200)
    (tmp_path / "t.json").unlink()
    with pytest.raises(FileNotFoundError, match="t.json"):
        Tokenizer(tmp_path / "t.model")


def test_cli_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    langs = [t[2:4] for t in TEXTS]
    table = pa.table({"text": TEXTS, "lang": pa.array(langs).dictionary_encode()})
    manifest = tmp_path / "manifest.parquet"
    pq.write_table(table, manifest)
    parser = argparse.ArgumentParser(prog="speechlm")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tokenizer", "train", "--manifest", str(manifest), "--vocab-size", "200"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"model: {tmp_path / 'tokenizer.model'}" in out and "vocab size:" in out
    tok = Tokenizer(tmp_path / "tokenizer.model")
    assert tok.langs == ("bn", "en", "hi", "ta")  # sorted languages of the manifest
    assert tok.encode(TEXTS[0])[0] == tok.lang_id("hi")
