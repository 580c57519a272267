"""The project's SentencePiece tokenizer written as a Hugging Face tokenizer, beside an exported LLM.

An export keeps the LLM's tokenizer where Hugging Face looks for it (``AutoTokenizer.from_pretrained(
export/llm)``). A pretrained LLM's tokenizer is already one (`HFTokenizer.save`). A model trained from
scratch has `speechlm tokenizer train`'s SentencePiece model, which transformers cannot read without the
protobuf package; `write_hf_tokenizer` rebuilds it with the `tokenizers` library from the model's own
pieces and scores:

    model          BPE (merges ranked by the merged piece's score, as SentencePiece merges) or Unigram
                   (the pieces' log probabilities), ``<unk>`` for characters the model lacks
    normalizer     whitespace runs to one space and stripped (what `Tokenizer.encode` does first), NFKC
    pre-tokenizer  Metaspace: spaces become "▁" and every run of text gets the word-boundary prefix, as
                   SentencePiece's dummy prefix gives each run between two tags
    added tokens   pad, unk, bos, eos, ``<|audio|>`` and the language tags: special, never split

and checks it before writing anything: `Tokenizer.encode` and the rebuilt tokenizer must give the same
ids for every piece of the vocabulary (as text, alone and in runs with tags). Known differences:
SentencePiece's own normalisation (``nmt_nfkc``) is NFKC plus a few rules for control characters, so
text that differs only there can differ; and, as in every Hugging Face tokenizer, the literal text
``<s>``, ``</s>``, ``<pad>`` or ``<unk>`` is read as that special token (speechlm spells it out). When the check fails, no Hugging Face file is written and the export keeps the
SentencePiece files only (``sentencepiece.model`` / ``.json``, which `speechlm.data.tokenizer.
load_text_tokenizer` reads); `write_hf_tokenizer` says so by returning the first text that differed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

WORD = "▁"  # SentencePiece's word-boundary mark
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_hf_tokenizer(tokenizer: Any) -> Any:
    """A `transformers.PreTrainedTokenizerFast` with the ids of the SentencePiece `tokenizer` (module doc)."""
    table = tokenizer.piece_table()
    if tokenizer.model_type == "unigram":
        model: Any = models.Unigram(
            [(p, s) for p, s, _ in table], unk_id=tokenizer.unk_id, byte_fallback=False
        )
    else:
        learned = {p: (s, i) for i, (p, s, ok) in enumerate(table) if ok}
        ranked = [
            (-score, i, piece[:k], piece[k:])
            for piece, (score, i) in learned.items()
            for k in range(1, len(piece))
            if piece[:k] in learned and piece[k:] in learned
        ]
        model = models.BPE(
            vocab={p: i for i, (p, _, _) in enumerate(table)},
            merges=[(left, right) for _, _, left, right in sorted(ranked)],
            unk_token=table[tokenizer.unk_id][0],
            fuse_unk=True,
            byte_fallback=False,
        )
    rust = RustTokenizer(model)
    rust.normalizer = normalizers.Sequence(
        [normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip(), normalizers.NFKC()]
    )
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD, prepend_scheme="always", split=False)
    rust.decoder = decoders.Metaspace(replacement=WORD, prepend_scheme="always", split=False)
    specials = sorted(tokenizer.special_pieces().items(), key=lambda kv: kv[1])
    rust.add_special_tokens([AddedToken(p, special=True, normalized=False) for p, _ in specials])
    pieces = [p for p, _, _ in table]
    return PreTrainedTokenizerFast(
        tokenizer_object=rust,
        pad_token=pieces[tokenizer.pad_id],
        unk_token=pieces[tokenizer.unk_id],
        bos_token=pieces[tokenizer.bos_id],
        eos_token=pieces[tokenizer.eos_id],
    )


def check_texts(tokenizer: Any) -> list[str]:
    """Every learned piece as text, alone and in runs between tags (what the check encodes both ways)."""
    words = [p.replace(WORD, " ") for p, _, ok in tokenizer.piece_table() if ok]
    tags = [p for p in tokenizer.special_pieces() if p.startswith("<|")]  # <|audio|> and the language tags
    runs = [" ".join(words[i : i + 7]) for i in range(0, len(words), 7)]
    with_tags = [f"{tags[i % len(tags)]} {run}{tags[(i + 1) % len(tags)]}" for i, run in enumerate(runs)]
    return [*words, *runs, *with_tags, "  two  spaces\tand a tab ", ""]


def first_difference(tokenizer: Any, directory: Path) -> str | None:
    """The first check text whose ids differ between `tokenizer` and ``AutoTokenizer(directory)``."""
    auto = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for text in check_texts(tokenizer):
        if tokenizer.encode(text) != auto.encode(text, add_special_tokens=False):
            return text
    return None


def write_hf_tokenizer(tokenizer: Any, directory: Path) -> str | None:
    """Write `tokenizer` (SentencePiece) as Hugging Face tokenizer files into `directory` when the rebuilt
    tokenizer gives its ids on every check text; returns None then, else the first text that differed
    (and writes nothing)."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=".hf-tokenizer-") as tmp:
        build_hf_tokenizer(tokenizer).save_pretrained(tmp)
        differs = first_difference(tokenizer, Path(tmp))
        if differs is not None:
            return differs
        for name in HF_TOKENIZER_FILES:
            if (Path(tmp) / name).is_file():
                shutil.move(str(Path(tmp) / name), str(directory / name))
    return None
