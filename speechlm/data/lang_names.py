"""Language names as Lhotse recipes write them (``English``), mapped to the codes the tags are made of (``en``).

A tag is made from a code (`speechlm.data.text.lang_tag`: ``<|en|>``). Lhotse's recipes fill a
supervision's ``language`` with a code in some corpora (``en``, ``yue``) and with an English name in
many others: ``English`` (LibriSpeech, AMI, GigaSpeech, ...), ``Chinese``/``Mandarin`` (AISHELL,
WenetSpeech, ...), ``Spanish``, ``Japanese``, ``Arabic``, ``Korean``, ``Hebrew``, ``Bengali``,
``tibetan``, the Babel names (``Cantonese``, ``Tamil``, ``Telugu``, ...) and MLS's lower-case
``english``, ``german``, ``polish``, .... `language_code` takes either:

- a name in `LANGUAGE_NAMES` (case and surrounding spaces ignored) → its ISO 639-1 code (ISO 639-3
  where 639-1 has none: ``Cantonese`` → ``yue``, ``Cebuano`` → ``ceb``);
- a value shaped like a code, two or three letters optionally followed by ``-``/``_`` and a region or
  script (``en``, ``EN``, ``zh-cn``, ``pt_BR``) → itself, lower-cased;
- anything else (``Klingon``, ``Singaporean English``, ``English-US``) → None: the reader refuses it
  naming the cut, because turning an unknown name into a tag (``<|singaporean english|>``) or
  guessing a code would train a language the model has no other data for.

The table is the documented list of docs/data.md ("Lhotse cuts"); a test keeps the two equal.
"""

from __future__ import annotations

import re

from speechlm.data.manifest.schema import ManifestError

LANGUAGE_NAMES: dict[str, str] = {
    "amharic": "am",
    "arabic": "ar",
    "assamese": "as",
    "bengali": "bn",
    "cantonese": "yue",
    "catalan": "ca",
    "cebuano": "ceb",
    "chinese": "zh",
    "czech": "cs",
    "danish": "da",
    "dutch": "nl",
    "english": "en",
    "finnish": "fi",
    "french": "fr",
    "georgian": "ka",
    "german": "de",
    "greek": "el",
    "gujarati": "gu",
    "haitian": "ht",
    "hebrew": "he",
    "hindi": "hi",
    "hungarian": "hu",
    "igbo": "ig",
    "indonesian": "id",
    "italian": "it",
    "japanese": "ja",
    "javanese": "jv",
    "kannada": "kn",
    "kazakh": "kk",
    "korean": "ko",
    "lao": "lo",
    "lithuanian": "lt",
    "malay": "ms",
    "malayalam": "ml",
    "mandarin": "zh",
    "marathi": "mr",
    "mongolian": "mn",
    "nepali": "ne",
    "odia": "or",
    "pashto": "ps",
    "persian": "fa",
    "polish": "pl",
    "portuguese": "pt",
    "punjabi": "pa",
    "romanian": "ro",
    "russian": "ru",
    "spanish": "es",
    "swahili": "sw",
    "swedish": "sv",
    "tagalog": "tl",
    "tamil": "ta",
    "telugu": "te",
    "thai": "th",
    "tibetan": "bo",
    "turkish": "tr",
    "ukrainian": "uk",
    "urdu": "ur",
    "vietnamese": "vi",
    "zulu": "zu",
}

_CODE = re.compile(r"[a-z]{2,3}([-_][a-z0-9]{2,8})*")


def language_code(value: str) -> str | None:
    """The code of language `value`: a name of `LANGUAGE_NAMES` or a code (module docstring), else None."""
    key = value.strip().lower()
    if key in LANGUAGE_NAMES:
        return LANGUAGE_NAMES[key]
    return key if _CODE.fullmatch(key) else None


def checked_language_code(value: object, what: str) -> str:
    """`language_code(value)`, or ManifestError saying that `what` (``cut 'c0' (cuts.json): supervision
    's0' has language``) holds `value`, which is neither a code nor a known name, and what to write."""
    code = language_code(value) if isinstance(value, str) else None
    if code is None:
        raise ManifestError(
            f"{what} {value!r}, which is neither a language code nor a language name speechlm knows; write "
            "its ISO 639 code instead (e.g. 'en', 'hi', 'zh'), or one of the language names that "
            "docs/data.md lists under 'Lhotse cuts' (English, Hindi, Mandarin, ...; any case)"
        )
    return code
