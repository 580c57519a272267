"""Transcript cleaning and language tags.

Every transcript that enters a training manifest goes through `clean_text` once, at manifest build
time, and then gets exactly one language tag in front (`tag_text`): ``"<|hi|> नमस्ते दुनिया"``.

Cleaning works on Unicode categories, not on per-script lists, so it treats every script alike:

1. Drop invisible format characters (category Cf: zero-width space, BOM, soft hyphen, bidi marks)
   and private-use/unassigned code points (Co, Cn, Cs), EXCEPT zero-width joiner U+200D and
   zero-width non-joiner U+200C, which select conjunct/half forms in Indic scripts and are part of
   the spelling. Then normalise to NFC, so the same word always has the same code points (for
   example Devanagari ``क़`` U+0958 becomes ``क`` + nukta, as NFC prescribes).
2. Remove annotation tags: ``[laugh]``, ``[music]``, ``[background noise]`` (anything in square
   brackets) and angle tags without spaces such as ``<unk>``, ``<noise>``, ``<sil>``. Angle tags are
   markers of non-speech or unintelligible speech, never words, so they go. A language tag of our
   own form ``<|xx|>`` is also an angle tag and is removed too: the language of a row comes from its
   metadata, and `tag_text` adds the one tag the model sees. (`split_lang_tag` reads such a tag off
   an already tagged text before cleaning, for readers that accept tagged input.)
3. Keep an apostrophe that sits between two letters (``don't``, ``rock'n'roll``, ``l'homme``), mapped
   to ASCII ``'`` whatever its code point (``’``, ``‘``, a backtick, ``´``, ``′``); the apostrophe changes
   the word, and a tokenizer should see ``don't`` not ``don t``. Every other apostrophe is a quote
   and is removed.
4. Replace every other punctuation (P*: ``. , ! ? ; :``, dashes ``- – —``, all quotes, brackets,
   danda ``।``, double danda ``॥``, ideographic ``。 ， 、``, ...) and every symbol (S*: ``$ % + = ~``,
   emoji, ...) by a space, as well as separators (Z*) and control characters (Cc: tab, newline).
   A space, not nothing: ``well-known`` becomes ``well known``, never ``wellknown``.
5. Collapse runs of spaces to one and strip the ends.

Letters (L*), digits and other numbers (N*) and all combining marks (M*: Indic vowel signs,
viramas, anusvara, nukta, Latin accents) are kept, so ``हिन्दी``, ``বাংলা``, ``தமிழ்`` survive intact.
Case is kept. `clean_text` is idempotent: cleaning a cleaned text changes nothing.

Training targets (`normalize_target`, the rule of ``data.text_normalize``). Every answer and transcript a
run trains on, and the reference and hypothesis its evaluation scores, go through one rule, applied to
the text between ``<|...|>`` tags (tags are kept as they are):

    none          the text as it is (the default; the demo corpus is cleaned and lower-case already)
    lower         lower-cased (``str.lower``: every script with case)
    clean         `clean_text` (the manifest builder's cleaning above; case kept)
    clean_lower   lower-cased, then `clean_text`

The pre-flight (`speechlm.data.tokenizer_checks.coverage_problems`) refuses a run whose normalised targets hold a
character the tokenizer cannot encode, so none is trained as ``<unk>``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any

from speechlm.data.special_tokens import _TAG_RE, TAG_CLOSE, TAG_OPEN, format_lang_tag

ZWNJ = "\u200c"
ZWJ = "\u200d"
_APOSTROPHE_PLACEHOLDER = "\ue000"  # private use; step 1 deletes any in the input
_APOSTROPHES = "'\u2019\u2018\u0060\u00b4\u2032"

_SQUARE_TAG = re.compile(r"\[[^\[\]]*\]")
_ANGLE_TAG = re.compile(r"<[^<>\s]*>")
# an apostrophe-like character between two word characters; `_keep_inner_apostrophe` then requires both
# neighbours to be letters (str.isalpha): `re`'s \w also matches other numbers such as "²"
_INNER_APOSTROPHE = re.compile(rf"(?<=(\w))[{_APOSTROPHES}](?=(\w))")


def _keep_inner_apostrophe(m: re.Match[str]) -> str:
    return _APOSTROPHE_PLACEHOLDER if m.group(1).isalpha() and m.group(2).isalpha() else m.group(0)


_SPACES = re.compile(r" {2,}")
_LANG_TAG = re.compile(
    r"^\s*" + re.escape(TAG_OPEN) + r"([A-Za-z][A-Za-z0-9_-]*)" + re.escape(TAG_CLOSE) + r"\s*"
)
_LANG_CODE = re.compile(r"^[a-z][a-z0-9_-]*$")


def _map_char(ch: str) -> str | None:
    """What step 1 and step 4 do with one code point: None deletes it, a string replaces it."""
    if ch == _APOSTROPHE_PLACEHOLDER:
        return "'"
    if ch in (ZWJ, ZWNJ):
        return ch
    cat = unicodedata.category(ch)
    major = cat[0]
    if major in "LMN":
        return ch
    if major in "PSZ" or cat == "Cc":
        return " "
    return None  # Cf, Co, Cn, Cs


class _DropTable(dict):
    """`str.translate` table for step 1: deletes Cf/Co/Cn/Cs except ZWJ and ZWNJ; filled lazily."""

    def __missing__(self, code: int) -> int | None:
        ch = chr(code)
        keep = ch in (ZWJ, ZWNJ) or unicodedata.category(ch) not in ("Cf", "Co", "Cn", "Cs")
        self[code] = code if keep else None
        return self[code]


class _SpaceTable(dict):
    """`str.translate` table for step 4: punctuation, symbols, separators and controls -> space."""

    def __missing__(self, code: int) -> str | None:
        self[code] = _map_char(chr(code))
        return self[code]


_DROP = _DropTable()
_SPACE = _SpaceTable()


def clean_text(text: str) -> str:
    """Return `text` cleaned by the rules in the module docstring (tags, punctuation, spaces)."""
    text = text.translate(_DROP)
    text = unicodedata.normalize("NFC", text)
    text = _SQUARE_TAG.sub(" ", text)
    text = _ANGLE_TAG.sub(" ", text)
    text = _INNER_APOSTROPHE.sub(_keep_inner_apostrophe, text)
    text = text.translate(_SPACE)
    return _SPACES.sub(" ", text).strip()


TEXT_NORMALIZE = ("none", "lower", "clean", "clean_lower")  # data.text_normalize (config.TextNormalize)


def normalize_piece(text: str, rule: str) -> str:
    """`text` (holding no ``<|...|>`` tag) under the rule `rule` of `TEXT_NORMALIZE`."""
    if rule == "none":
        return text
    if rule == "lower":
        return text.lower()
    if rule == "clean":
        return clean_text(text)
    if rule == "clean_lower":
        return clean_text(text.lower())
    raise ValueError(f"data.text_normalize={rule!r}: not a rule; use one of {', '.join(TEXT_NORMALIZE)}")


def normalize_target(text: str, rule: str) -> str:
    """An answer or transcript as the run trains on it and scores it (module doc): `normalize_piece` on
    the text between the ``<|...|>`` tags, the tags kept; ``none`` returns `text` itself."""
    if rule == "none":
        return text
    done, end = [], 0
    for m in _TAG_RE.finditer(text):  # the tag syntax of both tokenizers
        done += [normalize_piece(text[end : m.start()], rule), m.group(0)]
        end = m.end()
    done.append(normalize_piece(text[end:], rule))
    if rule == "lower":
        return "".join(done)
    return " ".join(p for p in done if p)  # clean_text strips each piece


def normalize_lang(lang: str | None) -> str | None:
    """Return `lang` stripped and lower-cased if it is a usable language code, else None.

    A usable code starts with a letter and holds only ``a-z 0-9 _ -`` (``hi``, ``en``, ``zh-cn``).
    """
    if lang is None:
        return None
    code = lang.strip().lower()
    return code if _LANG_CODE.match(code) else None


def lang_tag(lang: str) -> str:
    """Return the language tag the model sees, ``"<|hi|>"`` for ``"hi"`` (case and spaces ignored)."""
    code = normalize_lang(lang)
    if code is None:
        raise ValueError(
            f"language code {lang!r} cannot be made into a tag: use a code that starts with a letter "
            "and holds only letters, digits, '_' or '-' (for example 'hi', 'en', 'zh-cn')"
        )
    return format_lang_tag(code)


def tag_text(text: str, lang: str) -> str:
    """Return `text` with its language tag and one space in front; the bare tag if `text` is empty."""
    tag = lang_tag(lang)
    return f"{tag} {text}" if text else tag


def as_transcript(text: str, lang: str) -> str:
    """A clip's transcript as readers store it: an untagged text (as NeMo, Lhotse and most corpora write
    it) cleaned (`clean_text`) and tagged with `lang`; a text that starts with a ``<|xx|>`` tag is kept
    as written (`check_transcript` then checks its tag against the sample's language)."""
    tagged, _ = split_lang_tag(text)
    return text if tagged is not None else tag_text(clean_text(text), lang)


def split_lang_tag(text: str) -> tuple[str | None, str]:
    """Split a leading ``<|xx|>`` tag off `text`: ``("hi", "rest")``, or ``(None, text)`` if none."""
    match = _LANG_TAG.match(text)
    if match is None:
        return None, text
    return match.group(1).lower(), text[match.end() :]


TRANSCRIPT_DROP_REASONS = ("empty_text", "missing_tag", "tag_mismatch")


def check_transcript(text: str, lang: str) -> str | None:
    """Why a tagged transcript cannot be trained on, or None: the one rule of every source format.

    `text` is a manifest transcript, ``"<|xx|> words"``, and `lang` the row's language. Returns
    ``'missing_tag'`` when it does not start with a language tag, ``'tag_mismatch'`` when the tag is
    not `lang`, ``'empty_text'`` when nothing is left after the tag once cleaned (`clean_text`).
    Readers and converters drop such rows and count them under that reason.
    """
    tag, rest = split_lang_tag(text)
    if tag is None:
        return "missing_tag"
    if tag != normalize_lang(lang):
        return "tag_mismatch"
    if not clean_text(rest):
        return "empty_text"
    return None


def strip_lang_tag(text: str) -> str:
    """`text` without a leading ``<|xx|>`` tag, spaces collapsed (a reference or hypothesis for WER)."""
    text = text.strip()
    if text.startswith(TAG_OPEN) and TAG_CLOSE in text:
        text = text[text.index(TAG_CLOSE) + len(TAG_CLOSE) :]
    return " ".join(text.split())


def decode_hypothesis(tokenizer: Any, ids: Iterable[int]) -> str:
    """The text of greedy-decoded `ids` as evaluation scores it and `speechlm transcribe` prints it."""
    return strip_lang_tag(tokenizer.decode(list(ids)))
