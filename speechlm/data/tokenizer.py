"""SentencePiece tokenizer with fixed special ids and one whole token per language tag.

Vocabulary layout (ids are fixed, whatever the corpus):

    0 <pad>   1 <unk>   2 <s> (bos)   3 </s> (eos)   4 <|audio|>   5.. <|xx|> one per language, in order
    then the learned pieces (BPE or unigram)

`<|audio|>` and the language tags are SentencePiece *user-defined* symbols, so the model never splits
them. SentencePiece still prepends its word-boundary piece "▁" to text that starts with a tag, which
would cost one useless token per utterance; `Tokenizer.encode` therefore cuts the text at the special
symbols, maps each symbol straight to its id, and hands only the text between them to SentencePiece.
Training sees exactly that text (the symbols removed), so the learned pieces match what `encode`
asks of them.

Files written by `train_tokenizer(texts, "dir/tokenizer", ...)`:

    dir/tokenizer.model   the SentencePiece model
    dir/tokenizer.vocab   one "piece<TAB>score" line per id
    dir/tokenizer.json    languages, special ids, model type, vocabulary size

`Tokenizer` pickles as its path and reloads the model in the receiving process (DataLoader workers).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import sentencepiece as spm

from speechlm.data.manifest_cli import add_overwrite_argument
from speechlm.data.special_tokens import (  # noqa: F401 (re-exported: the names' historical home)
    _LANG_RE,
    _TAG_RE,
    AUDIO,
    TokenizerError,
    TokenizerFileError,
    UnknownLanguageError,
    _check_langs,
    decode_in_runs,
    encode_with_tags,
    format_lang_tag,
)
from speechlm.errors import DataError, UsageError
from speechlm.io import atomic_path
from speechlm.progress import Progress

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SIDECAR_FORMAT = 1
SP_SAVED = "sentencepiece"  # file names (.model, .json) of `Tokenizer.save` in a directory


class TokenizerTrainingError(DataError, RuntimeError):
    """SentencePiece refused the corpus (empty, tiny, too many characters for the vocabulary)."""


MIN_CHARACTER_COVERAGE = 0.98  # SentencePiece's own lower bound


def _strip_special(text: str) -> str:
    """Remove special symbols and collapse the whitespace around them (the text SentencePiece sees)."""
    return " ".join(_TAG_RE.sub(" ", text).split())


def _iterate_training_text(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if text is None:
            continue
        plain = _strip_special(str(text))
        if plain:
            yield plain


def _counted(texts: Iterable[str], bar: Progress) -> Iterator[str]:
    """`texts`, counting each on `bar`; once all are read, the bar says the pieces are being learned."""
    for text in texts:
        bar.update(1)
        yield text
    bar.set_fields(now="learning the pieces")


def _split_prefix(out_prefix: str | Path) -> Path:
    prefix = Path(out_prefix)
    if prefix.suffix in (".model", ".vocab", ".json"):
        prefix = prefix.with_suffix("")
    return prefix


def train_tokenizer(
    texts: Iterable[str],
    out_prefix: str | Path,
    *,
    langs: Sequence[str],
    vocab_size: int = 500,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
) -> Path:
    """Train a SentencePiece model on `texts` and write `<out_prefix>.{model,vocab,json}`.

    `texts` are cleaned transcripts, usually starting with a language tag; the tags are not learned as
    pieces (they are reserved symbols). Training is single-threaded and reads every sentence, so the
    same texts give the same model byte for byte. `vocab_size` is a soft limit: a small corpus gets
    fewer pieces instead of an error. Returns the path of the `.model` file.
    """
    langs = _check_langs(langs)
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type={model_type!r} is not supported: use 'bpe' or 'unigram'")
    reserved = 4 + 1 + len(langs)
    if not MIN_CHARACTER_COVERAGE <= character_coverage <= 1.0:
        raise UsageError(
            f"character_coverage={character_coverage} (--character-coverage) is outside "
            f"[{MIN_CHARACTER_COVERAGE}, 1]: SentencePiece accepts no other value; use 1.0 for small "
            "alphabets or e.g. 0.9995 for large ones"
        )
    if vocab_size <= reserved:
        raise UsageError(
            f"vocab_size={vocab_size} leaves no room for learned pieces: {reserved} ids are reserved "
            f"(pad, unk, bos, eos, audio and {len(langs)} language tags); use a larger vocab_size "
            f"(--vocab-size), e.g. {max(reserved + 100, 300)}"
        )
    prefix = _split_prefix(out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    user_symbols = [AUDIO] + [format_lang_tag(lang) for lang in langs]
    # on a terminal, a display counts the texts SentencePiece reads, then the elapsed time while it
    # learns the pieces (a call that reports nothing: the heartbeat redraws); nothing in logs
    bar = Progress(len(texts) if isinstance(texts, Sized) else None, "tokenizer", "texts read")
    sentences = _iterate_training_text(_counted(texts, bar))
    try:
        with bar, bar.heartbeat():
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences,
                model_prefix=str(prefix),
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                hard_vocab_limit=False,
                pad_id=0,
                unk_id=1,
                bos_id=2,
                eos_id=3,
                pad_piece=PAD,
                unk_piece=UNK,
                bos_piece=BOS,
                eos_piece=EOS,
                user_defined_symbols=user_symbols,
                num_threads=1,
                input_sentence_size=0,
                shuffle_input_sentence=False,
                max_sentence_length=1 << 16,
                minloglevel=2,
            )
    except RuntimeError as e:
        raise TokenizerTrainingError(
            f"SentencePiece training for {prefix}.model failed: {e}. If the corpus is empty or tiny, "
            f"check the text column; if it says the vocabulary is too small for the characters, raise "
            f"vocab_size (now {vocab_size}) or lower character_coverage (now {character_coverage})"
        ) from e
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    sidecar = {
        "format": SIDECAR_FORMAT,
        "model_type": model_type,
        "vocab_size": sp.get_piece_size(),
        "langs": langs,
        "special": {name: sp.piece_to_id(name) for name in (PAD, UNK, BOS, EOS, AUDIO)},
        "lang_ids": {lang: sp.piece_to_id(format_lang_tag(lang)) for lang in langs},
    }
    Path(f"{prefix}.json").write_text(json.dumps(sidecar, indent=2, ensure_ascii=False) + "\n")
    return Path(f"{prefix}.model")


class Tokenizer:
    """A trained SentencePiece model plus its special ids; `encode` adds no bos/eos."""

    def __init__(self, path: str | Path) -> None:
        self._load(path)

    def _load(self, path: str | Path) -> None:
        prefix = _split_prefix(path)
        self.path = Path(f"{prefix}.model")
        self._sidecar_path = Path(f"{prefix}.json")
        if not self.path.is_file():
            raise TokenizerFileError(
                f"tokenizer model {self.path} does not exist: train one with "
                f"`speechlm tokenizer train --manifest PATH` or pass the prefix used for train_tokenizer"
            )
        if not self._sidecar_path.is_file():
            raise TokenizerFileError(
                f"{self._sidecar_path} (languages and special ids) is missing next to {self.path}: "
                f"it is written by `speechlm tokenizer train` with the model; restore it from where the "
                f"model came from, or retrain the tokenizer"
            )
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise TokenizerError(
                f"tokenizer model {self.path} cannot be loaded ({e}); restore it or retrain the tokenizer"
            ) from None
        meta = self._read_sidecar()
        self.langs: tuple[str, ...] = tuple(meta["langs"])
        self.model_type = str(meta.get("model_type") or "bpe")  # "bpe" or "unigram" (sidecar format 1)
        self.pad_id = self._piece_id(PAD)
        self.unk_id = self._piece_id(UNK)
        self.bos_id = self._piece_id(BOS)
        self.eos_id = self._piece_id(EOS)
        self.audio_id = self._piece_id(AUDIO)
        self._lang_ids = {lang: self._piece_id(format_lang_tag(lang)) for lang in self.langs}
        expected = {**meta["special"], **{format_lang_tag(k): v for k, v in meta["lang_ids"].items()}}
        actual = {
            PAD: self.pad_id,
            UNK: self.unk_id,
            BOS: self.bos_id,
            EOS: self.eos_id,
            AUDIO: self.audio_id,
        }
        actual.update({format_lang_tag(k): v for k, v in self._lang_ids.items()})
        if expected != actual:
            diff = ", ".join(
                f"{tok!r}: sidecar {expected.get(tok)} vs model {actual.get(tok)}"
                for tok in sorted(set(expected) | set(actual))
                if expected.get(tok) != actual.get(tok)
            )
            raise TokenizerError(
                f"{self._sidecar_path} does not match {self.path} ({diff}): "
                f"the two files come from different trainings; restore the .json that came with this "
                f".model, or retrain the tokenizer"
            )
        self._special_ids = {tok: i for tok, i in actual.items()}
        self._lang_by_id = {i: lang for lang, i in self._lang_ids.items()}
        self._dropped_ids = frozenset((self.pad_id, self.bos_id, self.eos_id, self.audio_id))

    def _read_sidecar(self) -> dict[str, Any]:
        """The sidecar's content, checked for the keys `_load` uses (TokenizerError naming the file)."""
        fix = "restore it from where the model came from, or retrain the tokenizer"
        try:
            meta = json.loads(self._sidecar_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(
                f"tokenizer sidecar {self._sidecar_path} is not valid JSON ({e}); it is truncated or "
                f"corrupt: {fix}"
            ) from None
        ok = (
            isinstance(meta, dict)
            and isinstance(meta.get("langs"), list)
            and all(isinstance(x, str) for x in meta["langs"])
            and isinstance(meta.get("special"), dict)
            and isinstance(meta.get("lang_ids"), dict)
        )
        if not ok:
            raise TokenizerError(
                f"tokenizer sidecar {self._sidecar_path} lacks 'langs', 'special' or 'lang_ids' (or they "
                f"have the wrong type): {fix}"
            )
        return meta

    def _piece_id(self, piece: str) -> int:
        i = self._sp.piece_to_id(piece)
        if i == self._sp.unk_id() and piece != UNK:
            raise TokenizerError(
                f"{self.path} has no piece {piece!r}: it was not trained by `speechlm tokenizer train` "
                f"(or {self._sidecar_path} names a language it lacks); retrain the tokenizer"
            )
        return int(i)

    # pickling: carry the path only; the receiving process reloads the model
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._load(state["path"])

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, langs={list(self.langs)})"

    @property
    def tag_tokens(self) -> int:
        """Tokens of the language tag that starts an encoded transcript (CTC skips them)."""
        return 1

    @property
    def ctc_blank_id(self) -> int:
        return self.pad_id

    def save(self, directory: str | Path) -> Path:
        """Copy the model and its sidecar into `directory` (as sentencepiece.model / sentencepiece.json,
        names no Hugging Face file has); returns the copied .model path. `load_text_tokenizer` loads
        the directory or that path."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for src, name in ((self.path, f"{SP_SAVED}.model"), (self._sidecar_path, f"{SP_SAVED}.json")):
            if src.resolve() != (out / name).resolve():
                with atomic_path(out / name) as tmp:
                    shutil.copyfile(src, tmp)
        return out / f"{SP_SAVED}.model"

    def piece_table(self) -> list[tuple[str, float, bool]]:
        """Every id's (piece, score, learned) in id order; learned: a piece the model type segments text
        into (not pad/unk/bos/eos, the placeholder or a tag). What a conversion to another tokenizer
        library needs (`speechlm.use.hf_export`)."""
        fixed = set(self._special_ids.values())
        sp = self._sp
        return [
            (str(sp.id_to_piece(i)), float(sp.get_score(i)), not (i in fixed or sp.is_control(i) or
             sp.is_unknown(i) or sp.is_unused(i)))
            for i in range(self.vocab_size)
        ]  # fmt: skip

    def special_pieces(self) -> dict[str, int]:
        """pad, unk, bos, eos, the audio placeholder and the language tags: piece -> id."""
        return dict(self._special_ids)

    def lang_id(self, lang: str) -> int:
        """Return the id of the tag token `<|lang|>`."""
        try:
            return self._lang_ids[lang]
        except KeyError:
            raise UnknownLanguageError(
                f"language {lang!r} is not in tokenizer {self.path} (known: {', '.join(self.langs)}); "
                f"retrain the tokenizer on a manifest that contains it"
            ) from None

    def id_to_piece(self, i: int) -> str:
        return str(self._sp.id_to_piece(int(i)))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special symbols (`<|hi|>`, `<|audio|>`) become one id each, no bos/eos."""
        return encode_with_tags(
            text,
            self._encode_plain,
            lambda tag: [self._special_ids[tag]] if tag in self._special_ids else None,
            lambda tag: (
                f"text contains the tag {tag!r}, which tokenizer {self.path} does not know "
                f"(languages: {', '.join(self.langs)}); retrain the tokenizer with this language or "
                f"fix the text: {text[:80]!r}"
            ),
        )

    def _encode_plain(self, text: str) -> list[int]:
        text = " ".join(text.split())
        return list(self._sp.encode(text)) if text else []

    def decode(self, ids: Iterable[int], *, keep_lang_tag: bool = False) -> str:
        """Text of `ids`, without pad/bos/eos/audio; language tags only with `keep_lang_tag=True`."""
        n = self.vocab_size

        def is_word(i: int) -> bool:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is out of range for tokenizer {self.path} (0..{n - 1})")
            return i not in self._dropped_ids

        return decode_in_runs(
            ids,
            lambda run: str(self._sp.decode(run)),
            lang_by_id=self._lang_by_id,
            is_word=is_word,
            keep_lang_tag=keep_lang_tag,
        )


def load_text_tokenizer(
    path: str | Path, *, langs: Sequence[str] | None = None, lang_tags: str | None = None
) -> Any:
    """The tokenizer at `path`: a SentencePiece model (a .model file or its prefix) -> `Tokenizer`; a
    Hugging Face tokenizer directory -> `speechlm.data.hf_tokenizer.HFTokenizer` (`langs`, `lang_tags`:
    the languages to add tags for, beyond those its ``speechlm_tokenizer.json`` names, and the tag mode).
    A SentencePiece model takes neither: its languages and tags are fixed at training."""
    from speechlm.data.hf_tokenizer import HFTokenizer, is_hf_tokenizer_dir  # lazy: tokenizers, jinja2 (CLI)

    p = Path(path)
    if p.is_dir():
        if (p / f"{SP_SAVED}.model").is_file():
            return Tokenizer(p / f"{SP_SAVED}.model")  # a directory written by Tokenizer.save
        if is_hf_tokenizer_dir(p):
            return HFTokenizer(p, langs=langs, lang_tags=lang_tags)
        raise TokenizerFileError(
            f"{p} is a directory with no tokenizer: give a Hugging Face tokenizer directory "
            "(tokenizer.json) or a SentencePiece .model file of `speechlm tokenizer train`"
        )
    if lang_tags not in (None, "special"):
        raise UsageError(
            f"data.lang_tags={lang_tags} needs the LLM's own tokenizer: the SentencePiece model {p} has "
            "one tag token per language built in; use data.lang_tags=special"
        )
    return Tokenizer(p)


# ---------------------------------------------------------------------------------------------------
# CLI: speechlm tokenizer train --manifest PATH


def add_parser(subparsers: Any) -> None:
    """Register `speechlm tokenizer train`."""
    parser = subparsers.add_parser("tokenizer", help="train the SentencePiece tokenizer")
    sub = parser.add_subparsers(dest="tokenizer_command", metavar="SUBCOMMAND")
    train = sub.add_parser(
        "train",
        help="train on the text column of a training manifest",
        description="Train a SentencePiece tokenizer (with one tag token per language of the manifest).",
    )
    train.add_argument(
        "--manifest",
        required=True,
        type=Path,
        help="training manifest (parquet, NeMo .json, Lhotse cuts, shards)",
    )
    train.add_argument(
        "--out", type=Path, default=None, help="output prefix (default: <manifest dir>/tokenizer)"
    )
    train.add_argument("--vocab-size", type=int, default=500, help="soft vocabulary size (default: 500)")
    train.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe", help="default: bpe")
    train.add_argument(
        "--character-coverage", type=float, default=1.0, help="share of characters kept (default: 1.0)"
    )

    add_overwrite_argument(train)
    train.set_defaults(func=run_train_command)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def run_train_command(args: argparse.Namespace) -> int:
    from speechlm.data.manifest import commands, outputs  # lazy: pyarrow (CLI start-up)

    manifest = Path(args.manifest)
    out = args.out if args.out is not None else manifest.resolve().parent / "tokenizer"
    if args.vocab_size < 1:
        raise UsageError(f"--vocab-size {args.vocab_size} must be a positive number of pieces, e.g. 500")
    if not MIN_CHARACTER_COVERAGE <= args.character_coverage <= 1.0:
        raise UsageError(
            f"--character-coverage {args.character_coverage} is outside [{MIN_CHARACTER_COVERAGE}, 1]: "
            "SentencePiece accepts no other value; use 1.0 for small alphabets or e.g. 0.9995 for large ones"
        )
    prefix = _split_prefix(out)
    settings = {k: getattr(args, k) for k in ("vocab_size", "model_type", "character_coverage")}
    by = outputs.command_identity("tokenizer train --manifest", manifest, settings)
    written = [Path(f"{prefix}{suffix}") for suffix in (".model", ".vocab", ".json")]
    outputs.check_replaceable(written, by, overwrite=args.overwrite)
    outputs.prepare_parent(f"{prefix}.model", "--out")
    texts, langs = commands.read_manifest_text(manifest)
    if not texts:
        raise DataError(f"manifest {manifest} has no non-empty text: nothing to train a tokenizer on")
    with outputs.owned_outputs(written, by, overwrite=args.overwrite):
        model_path = train_tokenizer(texts, out, langs=langs, **settings)
    tok = Tokenizer(model_path)
    sample = texts[0]
    ids = tok.encode(sample)
    print(f"model: {model_path}")
    print(f"vocab size: {tok.vocab_size} ({len(texts)} texts, languages: {', '.join(langs)})")
    print(f"sample: {sample}")
    print(f"  ids:    {ids}")
    print(f"  pieces: {[tok.id_to_piece(i) for i in ids]}")
    return 0
