"""The demo corpus synthesized at demo time: thousands of utterances in five languages, with a held-out split.

`speechlm demo` (and ``speechlm demo corpus``) speaks sentences drawn from the demo vocabularies (`VOCAB`,
47-50 common words per language in the native script) with libespeak-ng through ctypes. The library and its
voice data come inside the ``espeakng-loader`` wheel (espeak-ng 1.52; GPL-3.0-or-later, loaded at run
time, never linked into speechlm), so nothing is installed with apt.

Every utterance gets its own voice variant (`VARIANTS`: the language's voice with one of espeak's male
and female variants), speaking rate, pitch and pitch range, a random gain and light white noise (SNR
20-40 dB), and is written as 16 kHz mono 16-bit FLAC into the raw-shard layout `speechlm manifest build`
reads (data/demo/README.md): ``<out>/<lang>_<NNN>/metadata.parquet``, ``audio_index.parquet`` and
``audio/<segment_id>.flac``.

**The held-out split tests generalisation.** For each language the ordered word pairs are split once,
by the seed, into training pairs and held-out pairs (`HELDOUT_PAIR_FRACTION` of them). A training
sentence is a random walk over training pairs only, a held-out sentence a walk over held-out pairs only,
so no held-out sentence, and no pair of adjacent words in one, occurs in training; every word still
occurs in both (the coverage is counted and printed). Held-out rows live in their own shards
(``<lang>_heldout``) and carry ``split = "val"`` in their metadata (training rows ``"train"``), so the
manifest build puts exactly them in ``val.parquet``.

**Bad rows.** The training shards carry the same deliberately bad rows as the bundled corpus
(`BAD_ROWS`: too short, too long, low quality, blank/null text, missing index entry, duplicate id,
undecodable audio), which the manifest build and the loader must drop and count.

**Deterministic and cached.** Texts, voices, rates, pitches, noise and bad rows depend only on the seed;
the audio bytes also on the espeak-ng build, which the pinned ``espeakng-loader`` version fixes. espeak-ng
keeps state from one utterance to the next inside a process, so each shard is synthesized in a fresh
process (two at a time). The corpus is written to ``<out>.partial`` and renamed into place, with
``corpus.json`` (settings, versions, counts) written last: a second run with the same settings finds
it and synthesizes nothing; an interrupted run (SIGTERM, SIGKILL, a full disk) leaves only the
``.partial`` folder, which the next run removes and rebuilds; a write that fails (a read-only or full
disk) removes it and is an OutputError naming the path (exit 4). ``corpus.json`` records every file's
size and the sha256 of the shard tables: a cached corpus with a file missing, truncated or changed is
named and synthesized again (an audio file changed in place at the same size is not detected; the
loader drops it as undecodable). A folder that is not a generated corpus (no ``corpus.json``) is never
overwritten.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speechlm.io import sha256_of

__all__ = [
    "BAD_ROWS",
    "VOCAB",
    "CorpusSettings",
    "generate_corpus",
    "make_sentence",
    "split_pairs",
]

GENERATOR_VERSION = 1  # bump when a change alters the bytes for a seed
ESPEAKNG_LOADER_VERSION = "0.2.4"  # pinned in pyproject.toml: it fixes the espeak-ng build, hence the audio
TARGET_SR = 16000
MIN_UTT_S = 1.0
MAX_UTT_S = 8.0
KEEP_EDGE_S = 0.05  # silence kept at each end after trimming
SILENCE_THRESHOLD = 0.01
HELDOUT_PAIR_FRACTION = 0.2
SHARD_UTTERANCES = 500  # valid training utterances per shard

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
# espeak's own variants of every voice (espeak-ng-data/voices/!v): "" is the language's default voice
VARIANTS = ("", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4")
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


# --------------------------------------------------------------------------------------------
# Synthesis (libespeak-ng from the espeakng-loader wheel, through ctypes)
# --------------------------------------------------------------------------------------------
class Espeak:
    """libespeak-ng in this process, synchronous mode: `speak` returns float32 mono samples at 16 kHz."""

    AUDIO_OUTPUT_SYNCHRONOUS = 2
    INITIALIZE_DONT_EXIT = 0x8000
    CHARS_UTF8 = 1
    RATE, PITCH, RANGE = 1, 3, 4

    def __init__(self) -> None:
        import ctypes

        try:
            import espeakng_loader
        except ImportError:
            from speechlm.errors import UsageError

            raise UsageError(
                "the demo corpus is synthesized with libespeak-ng from the espeakng-loader package, which is "
                f"not installed: pip install espeakng-loader=={ESPEAKNG_LOADER_VERSION} (or pass --shards "
                "data/demo/shards to use the small bundled corpus)"
            ) from None
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.lib.espeak_Info.restype = ctypes.c_char_p
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self.sample_rate = self.lib.espeak_Initialize(
            self.AUDIO_OUTPUT_SYNCHRONOUS,
            0,
            espeakng_loader.get_data_path().encode(),
            self.INITIALIZE_DONT_EXIT,
        )
        if self.sample_rate <= 0:
            raise RuntimeError(f"libespeak-ng failed to initialise (status {self.sample_rate})")
        self._chunks: list[Any] = []
        callback_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
        )
        self._callback = callback_type(self._collect)  # kept alive on self
        self.lib.espeak_SetSynthCallback(self._callback)
        self.version = self.lib.espeak_Info(None).decode()

    def _collect(self, wav: Any, n: int, _events: Any) -> int:
        import numpy as np

        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def speak(self, text: str, voice: str, rate: int, pitch: int, pitch_range: int, seed: int) -> Any:
        import numpy as np
        import soxr

        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"libespeak-ng has no voice {voice!r}")
        self.lib.espeak_ng_SetRandSeed(seed)
        self.lib.espeak_SetParameter(self.RATE, rate, 0)
        self.lib.espeak_SetParameter(self.PITCH, pitch, 0)
        self.lib.espeak_SetParameter(self.RANGE, pitch_range, 0)
        self._chunks.clear()
        data = text.encode()
        status = self.lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, self.CHARS_UTF8, None, None)
        self.lib.espeak_Synchronize()
        if status != 0 or not self._chunks:
            raise RuntimeError(
                f"libespeak-ng could not speak {text!r} with voice {voice!r} (status {status})"
            )
        audio = np.concatenate(self._chunks).astype(np.float32) / 32768.0
        return soxr.resample(audio, self.sample_rate, TARGET_SR).astype(np.float32)


def espeak_version() -> str:
    """The libespeak-ng version the loader ships, read in a throwaway process (this one stays clean)."""
    import subprocess

    code = "from speechlm.demo.corpus import Espeak; print(Espeak().version)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "espeak failed")
    return out.stdout.strip()


def trim_silence(audio: Any) -> Any:
    import numpy as np

    loud = np.flatnonzero(np.abs(audio) > SILENCE_THRESHOLD)
    if loud.size == 0:
        return audio
    keep = int(KEEP_EDGE_S * TARGET_SR)
    return audio[max(0, int(loud[0]) - keep) : min(audio.size, int(loud[-1]) + 1 + keep)]


def flac_bytes(audio: Any) -> bytes:
    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.clip(audio, -1.0, 1.0), TARGET_SR, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def utterance(tts: Espeak, rng: random.Random, lang: str, spoken: str) -> Any:
    """Speak `spoken` with a random variant, rate, pitch and range; trim, fit into [MIN_UTT_S, MAX_UTT_S],
    then a random gain and white noise at 20-40 dB SNR."""
    import numpy as np

    variant = rng.choice(VARIANTS)
    voice = lang + (f"+{variant}" if variant else "")
    rate, pitch, pitch_range = rng.randint(135, 195), rng.randint(25, 75), rng.randint(30, 80)
    seed = rng.randrange(2**31)
    for _ in range(6):
        audio = trim_silence(tts.speak(spoken, voice, rate, pitch, pitch_range, seed))
        if audio.size <= MAX_UTT_S * TARGET_SR:
            break
        rate = int(rate * 1.2)
    audio = audio[: int(MAX_UTT_S * TARGET_SR)]
    min_len = int((MIN_UTT_S + 0.05) * TARGET_SR)
    if audio.size < min_len:
        audio = np.concatenate([audio, np.zeros(min_len - audio.size, dtype=np.float32)])
    peak = float(np.abs(audio).max()) or 1.0
    audio = audio * (rng.uniform(0.3, 0.9) / peak)
    power = float(np.mean(audio**2)) or 1e-8
    snr_db = rng.uniform(20.0, 40.0)
    noise = np.random.default_rng(rng.randrange(2**32)).standard_normal(audio.size).astype(np.float32)
    return (audio + noise * np.sqrt(power / 10 ** (snr_db / 10))).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CorpusSettings:
    """What decides the corpus' bytes (with the espeak-ng build)."""

    utterances: int = 6000  # valid training utterances, over all languages (`LANG_SHARES`)
    heldout: int = 100  # held-out utterances per language
    seed: int = 1234
    sentences: int = (
        0  # distinct training sentences over all languages, each spoken several times; 0: all new
    )


@dataclass(frozen=True)
class ShardJob:
    name: str  # <lang>_<NNN> or <lang>_heldout
    lang: str
    split: str  # "train" or "val"
    valid: int
    seed: int
    bad: tuple[BadRow, ...] = ()  # the rows of BAD_ROWS in this shard
    pool: int = 0  # distinct training sentences of the language (0: every utterance a new one)


def shard_jobs(settings: CorpusSettings) -> list[ShardJob]:
    """The shards of the corpus: each language's training utterances in shards of `SHARD_UTTERANCES`,
    then its held-out shard; every bad row of `BAD_ROWS` in its named shard (or the language's last one
    when the corpus has fewer shards)."""
    jobs: list[ShardJob] = []
    for lang, share in LANG_SHARES.items():
        total = max(1, round(settings.utterances * share))
        n_shards = -(-total // SHARD_UTTERANCES)
        names = [f"{lang}_{i:03d}" for i in range(n_shards)]
        bad: dict[str, list[BadRow]] = {}
        for b in BAD_ROWS:
            if b.shard.split("_")[0] == lang:
                name = b.shard if b.shard in names else names[-1]
                bad.setdefault(name, []).append(b)
        pool = max(1, round(settings.sentences * share)) if settings.sentences else 0
        for i, name in enumerate(names):
            valid = total // n_shards + (i < total % n_shards)
            jobs.append(ShardJob(name, lang, "train", valid, settings.seed, tuple(bad.get(name, ())), pool))
        if settings.heldout > 0:
            jobs.append(ShardJob(f"{lang}_heldout", lang, "val", settings.heldout, settings.seed))
    return jobs


def write_shard(job: ShardJob, root: str) -> dict[str, Any]:
    """Synthesize one shard into `root`/<name> (runs in a fresh process: espeak-ng keeps state)."""
    import numpy as np

    tts = Espeak()
    sdir = Path(root) / job.name
    (sdir / "audio").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{job.seed}/{job.name}")
    successors = pair_graphs(job.lang, job.seed)[job.split]
    meta: list[dict[str, Any]] = []
    index: list[dict[str, Any]] = []
    words_seen: list[str] = []
    seconds = 0.0

    def add(seg: str, text: str | None, audio_bytes: bytes | None, dur: float, q: float, lang: str | None):
        meta.append(
            {
                "segment_id": seg,
                "transcription_native": text,
                "duration_s": dur,
                "tx_quality_score": q,
                "segment_language": lang,
                "split": job.split,
            }
        )
        if audio_bytes is not None:
            member = f"audio/{seg}.flac"
            (sdir / member).write_bytes(audio_bytes)
            index.append({"segment_id": seg, "tar_member_name": member})

    sentence_pool: list[list[str]] = []
    if job.pool:  # the language's distinct sentences, the same in each of its shards
        pool_rng = random.Random(f"{job.seed}/{job.lang}/pool")
        sentence_pool = [
            walk(pool_rng, job.lang, sentence_length(pool_rng, job.lang), successors) for _ in range(job.pool)
        ]
    for i in range(job.valid):
        if sentence_pool:
            words = rng.choice(sentence_pool)
        else:
            words = walk(rng, job.lang, sentence_length(rng, job.lang), successors)
        words_seen += words
        text, spoken = decorate(rng, job.lang, words)
        audio = utterance(tts, rng, job.lang, spoken)
        seconds += audio.size / TARGET_SR
        # a few rows leave the language null: the reader falls back to the shard name's prefix
        null_lang = job.split == "train" and i % 17 == 5
        q = round(rng.uniform(0.6, 1.0), 3)
        add(
            f"{job.name}_{i:05d}",
            text,
            flac_bytes(audio),
            audio.size / TARGET_SR,
            q,
            None if null_lang else job.lang,
        )

    for j, b in enumerate(job.bad):
        kind = b.kind
        seg = f"{job.name}_{job.valid + j:05d}"
        text, spoken = decorate(rng, job.lang, walk(rng, job.lang, 4, successors))
        q = float(b.params.get("q", round(rng.uniform(0.6, 1.0), 3)))
        text = b.params.get("text", text)
        if kind == "duplicate":
            meta.append(dict(meta[0]))  # an exact copy of the shard's first row
            continue
        if kind == "long":
            parts: list[Any] = []
            while sum(p.size for p in parts) < b.params["dur"] * TARGET_SR:
                t, s = decorate(rng, job.lang, walk(rng, job.lang, 6, successors))
                parts.append(utterance(tts, rng, job.lang, s))
                text += " " + t
            audio = np.concatenate(parts)[: int(b.params["dur"] * TARGET_SR)]
            data, dur = flac_bytes(audio), audio.size / TARGET_SR
        elif kind == "random_bytes":
            data, dur = b"\0" + rng.randbytes(5999), 2.5
        else:
            audio = utterance(tts, rng, job.lang, spoken)
            if kind == "short":
                audio = audio[: int(b.params["dur"] * TARGET_SR)]
            data, dur = flac_bytes(audio), audio.size / TARGET_SR
            if kind == "truncated_flac":
                data = data[:100]
        add(seg, text, None if kind == "no_audio_index" else data, float(dur), q, job.lang)

    write_shard_tables(sdir, meta, index, split_column=True)
    return {
        "name": job.name,
        "lang": job.lang,
        "split": job.split,
        "valid": job.valid,
        "bad": [b.kind for b in job.bad],
        "seconds": round(seconds, 2),
        "files": len(index),
        "words": words_seen,
    }


def write_shard_tables(
    sdir: Path, meta: list[dict[str, Any]], index: list[dict[str, Any]], *, split_column: bool
) -> None:
    """A shard's ``metadata.parquet`` (with the ``split`` column when asked) and ``audio_index.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [
        ("segment_id", pa.string()),
        ("transcription_native", pa.string()),
        ("duration_s", pa.float64()),
        ("tx_quality_score", pa.float64()),
        ("segment_language", pa.string()),
    ]
    meta_schema = pa.schema(columns + ([("split", pa.string())] if split_column else []))
    index_schema = pa.schema([("segment_id", pa.string()), ("tar_member_name", pa.string())])
    pq.write_table(pa.Table.from_pylist(meta, schema=meta_schema), sdir / "metadata.parquet")
    pq.write_table(pa.Table.from_pylist(index, schema=index_schema), sdir / "audio_index.parquet")


def _write_shard_star(args: tuple[ShardJob, str]) -> dict[str, Any]:
    return write_shard(*args)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------
STAMP = "corpus.json"


def stamp_key(settings: CorpusSettings, version: str) -> dict[str, Any]:
    return {
        "generator_version": GENERATOR_VERSION,
        "espeak_ng": version,
        **asdict(settings),
    }


def record_files(root: Path) -> dict[str, Any]:
    """Every file under `root` (the stamp aside) with its size, and the sha256 of the shard tables: what
    `damage` compares a cached corpus with (a stat per file, the small tables read)."""
    files = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    files.pop(STAMP, None)
    tables = {name: sha256_of(root / name) for name in files if name.endswith(".parquet")}
    return {"sizes": files, "tables_sha256": tables}


def damage(out: Path, stamp: dict[str, Any]) -> str | None:
    """Why the corpus in `out` is not what its stamp says was written (a file missing, truncated or
    changed), or None when it is whole."""
    recorded = stamp.get("files")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sizes"), dict):
        return f"{out / STAMP} records no file sizes (written by an older speechlm)"
    for name, size in recorded["sizes"].items():
        path = out / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} when it was written"
    for name, sha in recorded.get("tables_sha256", {}).items():
        if sha256_of(out / name) != sha:
            return f"{out / name} changed since it was written"
    return None


def cached(out: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The stamp of a complete, undamaged corpus in `out` made with `key`, else None (a damaged one is
    named: it is synthesized again)."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or stamp.get("key") != key:
        return None
    why = damage(out, stamp)
    if why is not None:
        print(f"demo corpus: {out} is damaged ({why}): synthesizing it again", flush=True)
        return None
    return stamp


def coverage(shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per language: held-out sentences' words, the share of them that occur in training, and the number
    of held-out adjacent pairs seen in training (0 by construction)."""
    out: dict[str, dict[str, Any]] = {}
    for lang in LANG_SHARES:
        train = [w for s in shards if s["lang"] == lang and s["split"] == "train" for w in s["words"]]
        val = [w for s in shards if s["lang"] == lang and s["split"] == "val" for w in s["words"]]
        known = set(train)
        out[lang] = {
            "vocabulary": len(VOCAB[lang]),
            "train_words_used": len(known),
            "heldout_word_tokens": len(val),
            "heldout_word_coverage": round(sum(w in known for w in val) / len(val), 4) if val else None,
        }
    return out


def generate_corpus(
    out: str | os.PathLike[str], settings: CorpusSettings, *, workers: int = 2
) -> dict[str, Any]:
    """Synthesize the corpus into `out` unless an identical one is there; return its stamp (module doc)."""
    out = Path(out)
    version = espeak_version()
    key = stamp_key(settings, version)
    stamp = cached(out, key)
    if stamp is not None:
        print(f"demo corpus: {out} is up to date ({stamp['summary']}), nothing to synthesize", flush=True)
        return stamp
    if out.exists() and not (out / STAMP).is_file() and any(out.iterdir()):
        from speechlm.errors import UsageError

        raise UsageError(
            f"{out} exists and is not a generated demo corpus (no {STAMP}); refusing to replace it: "
            "pass another --corpus folder, or remove it"
        )
    partial = out.with_name(out.name + ".partial")
    try:
        stamp = synthesize(out, partial, settings, key, workers)
    except OSError as e:  # a read-only or full disk: nothing half-written is left under --corpus
        shutil.rmtree(partial, ignore_errors=True)
        from speechlm.errors import OutputError

        raise OutputError(
            f"cannot write the demo corpus --corpus {out} ({e.filename or partial}: {e.strerror or e}); "
            "pass a --corpus folder on a disk you can write to, with room for it"
        ) from None
    print_summary(stamp)
    return stamp


def synthesize(
    out: Path, partial: Path, settings: CorpusSettings, key: dict[str, Any], workers: int
) -> dict[str, Any]:
    """Write the corpus into `partial`, stamp it and rename it to `out` (module doc); its stamp."""
    import multiprocessing

    version = key["espeak_ng"]
    if partial.exists():
        print(f"demo corpus: removing {partial}, left by an interrupted run", flush=True)
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    jobs = shard_jobs(settings)
    n_utts = sum(j.valid + len(j.bad) for j in jobs)
    print(
        f"demo corpus: synthesizing {n_utts} utterances ({settings.utterances} training, {settings.heldout} "
        f"held-out per language, seed {settings.seed}) with libespeak-ng {version} into {out}",
        flush=True,
    )
    start = time.perf_counter()
    shards: list[dict[str, Any]] = []
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(max(1, workers), maxtasksperchild=1) as pool:
        for done in pool.imap(_write_shard_star, [(j, str(partial)) for j in jobs]):
            shards.append(done)
            utts = sum(s["valid"] + len(s["bad"]) for s in shards)
            print(
                f"  {done['name']:<11} {done['valid']:>5} utterances, {done['seconds'] / 60:5.1f} min"
                f"   [{utts}/{n_utts}, {time.perf_counter() - start:.0f} s]",
                flush=True,
            )
    cover = coverage(shards)
    summary = {
        "train_utterances": sum(s["valid"] for s in shards if s["split"] == "train"),
        "heldout_utterances": sum(s["valid"] for s in shards if s["split"] == "val"),
        "bad_rows": sum(len(s["bad"]) for s in shards),
        "train_hours": round(sum(s["seconds"] for s in shards if s["split"] == "train") / 3600, 3),
        "heldout_hours": round(sum(s["seconds"] for s in shards if s["split"] == "val") / 3600, 3),
    }
    stamp = {
        "key": key,
        "summary": summary,
        "coverage": cover,
        "shards": [{k: v for k, v in s.items() if k != "words"} for s in shards],
        "seconds_to_generate": round(time.perf_counter() - start, 1),
    }
    stamp["files"] = record_files(partial)
    (partial / STAMP).write_text(json.dumps(stamp, indent=2, ensure_ascii=False))
    if out.exists():
        shutil.rmtree(out)  # an older generated corpus (it has a stamp): replaced
    partial.rename(out)
    return stamp


def print_summary(stamp: dict[str, Any]) -> None:
    s = stamp["summary"]
    print(
        f"demo corpus: {s['train_utterances']} training utterances ({s['train_hours']:.2f} h), "
        f"{s['heldout_utterances']} held-out ({s['heldout_hours']:.2f} h), {s['bad_rows']} bad rows; "
        f"{stamp['seconds_to_generate']:.0f} s",
        flush=True,
    )
    print(
        "held-out word coverage (share of held-out words that occur in training; no held-out word pair does):"
    )
    for lang, c in stamp["coverage"].items():
        cov = c["heldout_word_coverage"]
        print(
            f"  {lang}  {'-' if cov is None else f'{100 * cov:.1f}%':>6} of {c['heldout_word_tokens']} words"
            f"  ({c['train_words_used']}/{c['vocabulary']} vocabulary words in training)",
            flush=True,
        )


def digest(folder: str | os.PathLike[str]) -> str:
    """sha256 over every file's relative path and bytes (the determinism check)."""
    h = hashlib.sha256()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.name == STAMP:
            continue  # holds the time it took
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = CorpusSettings()
    p.add_argument(
        "--utterances", type=int, default=d.utterances, help="valid training utterances (default %(default)s)"
    )
    p.add_argument(
        "--heldout",
        type=int,
        default=d.heldout,
        help="held-out utterances per language (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of texts, voices and noise (default %(default)s)"
    )
    p.add_argument(
        "--sentences",
        type=int,
        default=d.sentences,
        help="distinct training sentences over all languages, each spoken several times in different voices; "
        "0: every training utterance is a new sentence (default %(default)s)",
    )


def settings_of(args: argparse.Namespace) -> CorpusSettings:
    from speechlm.errors import UsageError

    if args.utterances < len(LANG_SHARES) or args.heldout < 0:
        raise UsageError(
            f"--utterances {args.utterances} --heldout {args.heldout}: give at least {len(LANG_SHARES)} training "
            "utterances (one per language) and 0 or more held-out ones"
        )
    return CorpusSettings(
        utterances=args.utterances,
        heldout=args.heldout,
        seed=args.seed,
        sentences=args.sentences,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speechlm demo corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="data/demo_corpus", help="output folder (default %(default)s)")
    add_arguments(p)
    args = p.parse_args(argv)
    generate_corpus(args.corpus, settings_of(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
