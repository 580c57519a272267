"""The demo corpus' words (`speechlm.demo.corpus`): what is said, in which language, how often, and what goes wrong.

`VOCAB` holds 47-50 common words per language in the native script; a sentence is a random walk of 3-7
of them (`walk`) decorated now and then with quotes, a comma, a final stop or question mark and a
non-speech tag (`decorate`). The ordered word pairs of each language are split once, by the seed, into
training and held-out pairs (`split_pairs`, `pair_graphs`), so that no held-out sentence, and no pair of
adjacent words in one, occurs in training. `LANG_SHARES` skews the training utterances per language,
`BAD_ROWS` are the deliberately bad rows, and `CorpusSettings` the size and seed that decide the rest.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass, field

HELDOUT_PAIR_FRACTION = 0.2


@dataclass(frozen=True)
class CorpusSettings:
    """What decides the corpus' bytes (with the espeak-ng build)."""

    utterances: int = 6000  # valid training utterances, over all languages (`LANG_SHARES`)
    heldout: int = 100  # held-out utterances per language
    seed: int = 1234
    sentences: int = (
        0  # distinct training sentences over all languages, each spoken several times; 0: all new
    )


# --------------------------------------------------------------------------------------------
# Vocabularies: common, distinct words in the native script of each language.
# --------------------------------------------------------------------------------------------
VOCAB: dict[str, list[str]] = {
    "en": (
        "cat dog sun moon water tree house red blue green big small happy run walk eat see "
        "book girl boy bird fish river road school city day night good old new cold hot rain "
        "milk bread apple door window table chair friend mother father child sleep play sing "
        "sky flower"
    ).split(),
    "hi": (
        "पानी घर किताब लड़का लड़की माँ पिता दोस्त सूरज चाँद पेड़ नदी शहर गाँव स्कूल दिन रात "
        "खाना दूध रोटी आम फूल पक्षी मछली कुत्ता बिल्ली बड़ा छोटा अच्छा नया पुराना लाल नीला "
        "हरा ठंडा गरम खुश है और बहुत आज कल सुबह शाम बारिश दरवाज़ा खिड़की मेज़ आकाश"
    ).split(),
    "bn": (
        "জল বাড়ি বই ছেলে মেয়ে মা বাবা বন্ধু সূর্য চাঁদ গাছ নদী শহর গ্রাম স্কুল দিন রাত খাবার "
        "দুধ রুটি আম ফুল পাখি মাছ কুকুর বিড়াল বড় ছোট ভালো নতুন পুরনো লাল নীল সবুজ ঠান্ডা "
        "গরম খুশি আর খুব আজ কাল সকাল সন্ধ্যা বৃষ্টি দরজা জানালা টেবিল আকাশ"
    ).split(),
    "ta": (
        "தண்ணீர் வீடு புத்தகம் பையன் பெண் அம்மா அப்பா நண்பன் சூரியன் நிலா மரம் ஆறு நகரம் "
        "கிராமம் பள்ளி நாள் இரவு சாப்பாடு பால் ரொட்டி மாம்பழம் பூ பறவை மீன் நாய் பூனை பெரிய "
        "சிறிய நல்ல புதிய பழைய சிவப்பு நீலம் பச்சை குளிர் சூடு மகிழ்ச்சி மிகவும் இன்று நாளை "
        "காலை மாலை மழை கதவு ஜன்னல் மேசை வானம்"
    ).split(),
    "te": (
        "నీరు ఇల్లు పుస్తకం అబ్బాయి అమ్మాయి అమ్మ నాన్న స్నేహితుడు సూర్యుడు చంద్రుడు చెట్టు నది "
        "నగరం గ్రామం బడి రోజు రాత్రి అన్నం పాలు రొట్టె మామిడి పువ్వు పక్షి చేప కుక్క పిల్లి పెద్ద "
        "చిన్న మంచి కొత్త పాత ఎరుపు నీలం ఆకుపచ్చ చల్లని వేడి సంతోషం చాలా ఈరోజు రేపు ఉదయం "
        "సాయంత్రం వర్షం తలుపు కిటికీ బల్ల ఆకాశం"
    ).split(),
}
VOCAB = {lang: [unicodedata.normalize("NFC", w) for w in words] for lang, words in VOCAB.items()}

FULL_STOP = {"en": ".", "hi": "।", "bn": "।", "ta": ".", "te": "."}
TAGS = ("[laugh]", "[music]", "[noise]")
TAG_RE = re.compile(r"\[[^\]]*\]")
# share of the training utterances per language: skewed (en 3x te) so that language balancing has work
LANG_SHARES = {"en": 0.30, "hi": 0.25, "bn": 0.20, "ta": 0.15, "te": 0.10}


@dataclass
class BadRow:
    """An extra row that must be dropped somewhere downstream."""

    shard: str
    kind: str
    reason: str
    params: dict = field(default_factory=dict)


# Rows that the manifest build drops (filters / join / de-duplication) ...
BAD_ROWS: list[BadRow] = [
    BadRow("en_000", "short", "duration 0.3 s < 0.5 s minimum", {"dur": 0.30}),
    BadRow("ta_000", "short", "duration 0.25 s < 0.5 s minimum", {"dur": 0.25}),
    BadRow("hi_000", "long", "duration > 20 s maximum (about 24 s)", {"dur": 24.0}),
    BadRow("bn_000", "low_quality", "tx_quality_score 0.1 < 0.5 threshold", {"q": 0.10}),
    BadRow("en_001", "low_quality", "tx_quality_score 0.2 < 0.5 threshold", {"q": 0.20}),
    BadRow("hi_001", "low_quality", "tx_quality_score 0.05 < 0.5 threshold", {"q": 0.05}),
    BadRow("ta_000", "empty_text", "empty transcription ''", {"text": ""}),
    BadRow("te_000", "blank_text", "whitespace-only transcription", {"text": "   \t "}),
    BadRow("en_000", "null_text", "null transcription", {"text": None}),
    BadRow("hi_000", "null_text", "null transcription", {"text": None}),
    BadRow("hi_001", "no_audio_index", "metadata row without an audio_index entry (inner join drops it)"),
    BadRow("bn_000", "duplicate", "second metadata row with an already used segment_id"),
    # ... and rows that pass the manifest filters but whose audio cannot be decoded: the dataset
    # drops and counts them.
    BadRow("en_001", "random_bytes", "audio file is random bytes with a .flac name (undecodable)"),
    BadRow("hi_000", "truncated_flac", "audio file is the first 100 bytes of a FLAC (undecodable)"),
]
N_DROPPED_BY_BUILD = sum(b.kind not in ("random_bytes", "truncated_flac") for b in BAD_ROWS)


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------
def decorate(rng: random.Random, lang: str, words: list[str]) -> tuple[str, str]:
    """(raw transcription, text to speak) of `words`: now and then quotes, a comma, a final stop or
    question mark, and a non-speech tag (in the transcription only, never spoken)."""
    words = list(words)
    n = len(words)
    if rng.random() < 0.08:
        i = rng.randrange(n)
        words[i] = f'"{words[i]}"'
    if n >= 4 and rng.random() < 0.25:
        i = rng.randrange(1, n - 1)
        words[i] = words[i] + ","
    end = "?" if rng.random() < 0.15 else (FULL_STOP[lang] if rng.random() < 0.75 else "")
    text = " ".join(words) + end
    if rng.random() < 0.08:
        tag = rng.choice(TAGS)
        text = f"{tag} {text}" if rng.random() < 0.5 else f"{text} {tag}"
    spoken = " ".join(TAG_RE.sub(" ", text).split())
    return text, spoken


def make_sentence(rng: random.Random, lang: str) -> tuple[str, str]:
    """A sentence of 3-7 words drawn uniformly from `VOCAB[lang]` (the bundled corpus' generator)."""
    vocab = VOCAB[lang]
    return decorate(rng, lang, [rng.choice(vocab) for _ in range(sentence_length(rng, lang))])


def split_pairs(lang: str, seed: int, fraction: float = HELDOUT_PAIR_FRACTION) -> set[tuple[str, str]]:
    """The held-out ordered word pairs of `lang`: a seeded `fraction` of all of them."""
    vocab = VOCAB[lang]
    pairs = [(a, b) for a in vocab for b in vocab]
    random.Random(f"{seed}/{lang}/pairs").shuffle(pairs)
    return set(pairs[: round(fraction * len(pairs))])


def walk(rng: random.Random, lang: str, n: int, successors: dict[str, list[str]]) -> list[str]:
    """`n` words whose every adjacent pair is an edge of `successors` (a random walk; restarts at a
    word without successors)."""
    vocab = VOCAB[lang]
    while True:
        words = [rng.choice(vocab)]
        while len(words) < n and successors[words[-1]]:
            words.append(rng.choice(successors[words[-1]]))
        if len(words) == n:
            return words


def pair_graphs(lang: str, seed: int) -> dict[str, dict[str, list[str]]]:
    """The successor lists of the training walk and of the held-out walk."""
    held = split_pairs(lang, seed)
    vocab = VOCAB[lang]
    return {
        split: {a: [b for b in vocab if ((a, b) in held) == (split == "val")] for a in vocab}
        for split in ("train", "val")
    }


def sentence_length(rng: random.Random, lang: str) -> int:
    return rng.randint(4, 7) if lang == "en" else rng.choice([3, 4, 4, 5, 5, 6, 6, 7])
