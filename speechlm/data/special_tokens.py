"""The speech side's special tokens and the errors both tokenizers raise (SentencePiece
`speechlm.data.tokenizer.Tokenizer` and the LLM's `speechlm.data.hf_tokenizer.HFTokenizer`).

``<|audio|>`` is the audio placeholder; ``<|xx|>`` the tag of language ``xx``. Both are written in
transcripts and instructions with the syntax `_TAG_RE` reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from speechlm.errors import DataError

TAG_OPEN, TAG_CLOSE = "<|", "|>"  # the tag syntax of both tokenizers, written by `format_lang_tag` only


def format_lang_tag(name: str) -> str:
    """Return the tag token of a language code: "hi" -> "<|hi|>" (the one place the syntax is written;
    the audio placeholder `AUDIO` is the tag of "audio")."""
    return f"{TAG_OPEN}{name}{TAG_CLOSE}"


AUDIO = format_lang_tag("audio")

_TAG_RE = re.compile(re.escape(TAG_OPEN) + r"([^|<>\s]+)" + re.escape(TAG_CLOSE))
_LANG_RE = re.compile(r"[A-Za-z0-9_\-]+")


class TokenizerFileError(DataError, FileNotFoundError):
    """A tokenizer file (.model or its .json sidecar) that does not exist (exit 1, no traceback)."""


class TokenizerError(DataError, ValueError):
    """A tokenizer's files that cannot be used together (corrupt sidecar, ids that do not match)."""


class UnknownLanguageError(KeyError):
    """A language the tokenizer has no tag for (a KeyError whose message prints without quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_langs(langs: Sequence[str]) -> list[str]:
    """Validate language codes and drop repeats, keeping the first-seen order."""
    if isinstance(langs, str):
        raise TypeError(
            f"langs must be a sequence of language codes, got the string {langs!r}; wrap it in a list"
        )
    out: list[str] = []
    for lang in langs:
        if not isinstance(lang, str) or not _LANG_RE.fullmatch(lang):
            raise ValueError(
                f"language code {lang!r} is not valid: use letters, digits, '_' or '-' only "
                f"(a bare code like 'hi', not a tag like '<|hi|>')"
            )
        if lang == "audio":
            raise ValueError("'audio' cannot be a language code: <|audio|> is the audio placeholder")
        if lang not in out:
            out.append(lang)
    if not out:
        raise ValueError("no languages given: pass at least one language code, e.g. langs=['hi']")
    return out


def encode_with_tags(
    text: str,
    encode_plain: Callable[[str], list[int]],
    ids_of_tag: Callable[[str], list[int] | None],
    unknown: Callable[[str], str],
) -> list[int]:
    """Both tokenizers' `encode`: the text between `<|...|>` tags through `encode_plain`, each tag to
    ``ids_of_tag(tag)`` (one id, or none to drop it); a tag it does not know (None) is a ValueError
    with the message ``unknown(tag)``."""
    ids: list[int] = []
    pos = 0
    for m in _TAG_RE.finditer(text):
        ids.extend(encode_plain(text[pos : m.start()]))
        tag_ids = ids_of_tag(m.group(0))
        if tag_ids is None:
            raise ValueError(unknown(m.group(0)))
        ids.extend(tag_ids)
        pos = m.end()
    ids.extend(encode_plain(text[pos:]))
    return ids


def decode_in_runs(
    ids: Iterable[int],
    decode_run: Callable[[list[int]], str],
    *,
    lang_by_id: Mapping[int, str],
    is_word: Callable[[int], bool],
    keep_lang_tag: bool,
) -> str:
    """Text of `ids`: runs of word ids (`is_word`) decoded by `decode_run`, the language tags between
    them kept (``keep_lang_tag``) or dropped, other ids dropped; the pieces joined by one space."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()  # a tensor or an array
    parts: list[str] = []
    run: list[int] = []
    for raw in ids:
        i = int(raw)
        lang = lang_by_id.get(i)
        if lang is None:
            if is_word(i):
                run.append(i)
            continue
        if run:
            parts.append(decode_run(run))
            run = []
        if keep_lang_tag:
            parts.append(format_lang_tag(lang))
    if run:
        parts.append(decode_run(run))
    return " ".join(p.strip() for p in parts if p.strip())
