"""The demo's second task: translating the hi/bn/ta/te clips to English (AST), generated from the corpus.

The demo corpus (`scripts/make_demo_corpus.py`) speaks sentences of 3-7 words drawn from about fifty
common words per language. Every non-English word has one English gloss in `GLOSSARY`, so a
transcript translates word by word (`translate_transcript`): the language tag, the non-speech tags and
the punctuation go (`speechlm.data.text.clean_text`), then each word is replaced by its gloss::

    <|hi|> पानी, घर और किताब।   ->   water house and book

This is a **gloss, not fluent English**: word order stays the source language's (Hindi, Bengali,
Tamil and Telugu put the verb last), there are no articles and no inflection, and each word has
exactly one meaning (``कल``/``কাল``, "yesterday" or "tomorrow", is glossed "tomorrow" as the Tamil and
Telugu lists' ``நாளை``/``రేపు`` are; Tamil ``மகிழ்ச்சி`` and Telugu ``సంతోషం`` are nouns, "happiness"; Tamil
``சூடு`` and Telugu ``వేడి``, "heat" or "hot", are "hot" like Hindi/Bengali ``गरम``/``গরম``; Telugu ``అన్నం``
is cooked rice, "rice", where the other languages have "food"). The glossary was written from
dictionary meanings, not reviewed by native speakers. The target is deterministic, so BLEU/chrF
against it measure whether the model learnt the words.

`write_demo_tasks(manifest_dir)` reads the ASR manifests that `speechlm manifest build` wrote there
(``train.parquet``, ``val.parquet``) and writes, next to them:

    ast_train.parquet   the hi/bn/ta/te rows of train.parquet as translation rows: segment_id
    ast_val.parquet     ``<id>-ast``, task "ast", instruction `AST_INSTRUCTION`, answer the gloss; text
                        stays the tagged transcript (the clip's CTC target), every other column as is
    val_tasks.parquet   the validation set of both tasks: val.parquet's rows (task "asr") followed by
                        ast_val.parquet's, with the task/instruction/answer columns (null where the
                        ASR row takes the defaults: data.instruction, and its text as the answer)
    asr_ast.yaml        the training mix, a data.input_cfg file: train.parquet (ASR) and
                        ast_train.parquet (AST), weighted `MIX_WEIGHTS`

Each file is written to a hidden temporary name and renamed into place, so an interrupted run
(SIGTERM, SIGKILL) leaves the previous file or none, never a partial one; running it again writes
the same bytes. A row whose language is not in `GLOSSARY` stays ASR only; a word of a hi/bn/ta/te row
that has no gloss is a ManifestError naming the manifest, the row and the word (the generator is
for the demo corpus' vocabulary only).

Run by `speechlm demo`, or by hand: ``python -m speechlm.demo.tasks data/demo_manifest``.
"""

from __future__ import annotations

import argparse
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from speechlm.data.manifest.load import read_parquet_manifest
from speechlm.data.manifest.outputs import write_atomic
from speechlm.data.manifest.schema import ManifestError
from speechlm.data.text import clean_text, split_lang_tag

__all__ = [
    "AST_INSTRUCTION",
    "GLOSSARY",
    "MIX_FILE",
    "MIX_WEIGHTS",
    "ast_table",
    "translate_transcript",
    "write_demo_tasks",
]

AST_INSTRUCTION = "Translate the speech to English."
TASK_COLUMNS = ("task", "instruction", "answer")
AST_SUFFIX = "-ast"  # segment_id of the translation row of clip <id>: "<id>-ast"
MIX_FILE = "asr_ast.yaml"
# equal shares of an epoch for the two tasks (the natural mix would be about 2:1, English having no AST
# rows). Measured once each on 2 CPU cores (docs/training.md): 1:1 ended at ASR WER 64.6% / AST BLEU 94.4
# on the training split, 3:1 at 91.2% / 15.6 (its CTC loss had not converged within the 10 minutes)
MIX_WEIGHTS = {"asr": 1.0, "ast": 1.0}

# One English gloss per word of scripts/make_demo_corpus.py's VOCAB, in its order
# (tests/test_demo_tasks.py checks that the keys are exactly that vocabulary).
_GLOSSES: dict[str, tuple[tuple[str, str], ...]] = {
    "hi": (
        ("पानी", "water"), ("घर", "house"), ("किताब", "book"), ("लड़का", "boy"), ("लड़की", "girl"),
        ("माँ", "mother"), ("पिता", "father"), ("दोस्त", "friend"), ("सूरज", "sun"), ("चाँद", "moon"),
        ("पेड़", "tree"), ("नदी", "river"), ("शहर", "city"), ("गाँव", "village"), ("स्कूल", "school"),
        ("दिन", "day"), ("रात", "night"), ("खाना", "food"), ("दूध", "milk"), ("रोटी", "bread"),
        ("आम", "mango"), ("फूल", "flower"), ("पक्षी", "bird"), ("मछली", "fish"), ("कुत्ता", "dog"),
        ("बिल्ली", "cat"), ("बड़ा", "big"), ("छोटा", "small"), ("अच्छा", "good"), ("नया", "new"),
        ("पुराना", "old"), ("लाल", "red"), ("नीला", "blue"), ("हरा", "green"), ("ठंडा", "cold"),
        ("गरम", "hot"), ("खुश", "happy"), ("है", "is"), ("और", "and"), ("बहुत", "very"),
        ("आज", "today"), ("कल", "tomorrow"), ("सुबह", "morning"), ("शाम", "evening"), ("बारिश", "rain"),
        ("दरवाज़ा", "door"), ("खिड़की", "window"), ("मेज़", "table"), ("आकाश", "sky"),
    ),
    "bn": (
        ("জল", "water"), ("বাড়ি", "house"), ("বই", "book"), ("ছেলে", "boy"), ("মেয়ে", "girl"),
        ("মা", "mother"), ("বাবা", "father"), ("বন্ধু", "friend"), ("সূর্য", "sun"), ("চাঁদ", "moon"),
        ("গাছ", "tree"), ("নদী", "river"), ("শহর", "city"), ("গ্রাম", "village"), ("স্কুল", "school"),
        ("দিন", "day"), ("রাত", "night"), ("খাবার", "food"), ("দুধ", "milk"), ("রুটি", "bread"),
        ("আম", "mango"), ("ফুল", "flower"), ("পাখি", "bird"), ("মাছ", "fish"), ("কুকুর", "dog"),
        ("বিড়াল", "cat"), ("বড়", "big"), ("ছোট", "small"), ("ভালো", "good"), ("নতুন", "new"),
        ("পুরনো", "old"), ("লাল", "red"), ("নীল", "blue"), ("সবুজ", "green"), ("ঠান্ডা", "cold"),
        ("গরম", "hot"), ("খুশি", "happy"), ("আর", "and"), ("খুব", "very"), ("আজ", "today"),
        ("কাল", "tomorrow"), ("সকাল", "morning"), ("সন্ধ্যা", "evening"), ("বৃষ্টি", "rain"), ("দরজা", "door"),
        ("জানালা", "window"), ("টেবিল", "table"), ("আকাশ", "sky"),
    ),
    "ta": (
        ("தண்ணீர்", "water"), ("வீடு", "house"), ("புத்தகம்", "book"), ("பையன்", "boy"), ("பெண்", "girl"),
        ("அம்மா", "mother"), ("அப்பா", "father"), ("நண்பன்", "friend"), ("சூரியன்", "sun"), ("நிலா", "moon"),
        ("மரம்", "tree"), ("ஆறு", "river"), ("நகரம்", "city"), ("கிராமம்", "village"), ("பள்ளி", "school"),
        ("நாள்", "day"), ("இரவு", "night"), ("சாப்பாடு", "food"), ("பால்", "milk"), ("ரொட்டி", "bread"),
        ("மாம்பழம்", "mango"), ("பூ", "flower"), ("பறவை", "bird"), ("மீன்", "fish"), ("நாய்", "dog"),
        ("பூனை", "cat"), ("பெரிய", "big"), ("சிறிய", "small"), ("நல்ல", "good"), ("புதிய", "new"),
        ("பழைய", "old"), ("சிவப்பு", "red"), ("நீலம்", "blue"), ("பச்சை", "green"), ("குளிர்", "cold"),
        ("சூடு", "hot"), ("மகிழ்ச்சி", "happiness"), ("மிகவும்", "very"), ("இன்று", "today"), ("நாளை", "tomorrow"),
        ("காலை", "morning"), ("மாலை", "evening"), ("மழை", "rain"), ("கதவு", "door"), ("ஜன்னல்", "window"),
        ("மேசை", "table"), ("வானம்", "sky"),
    ),
    "te": (
        ("నీరు", "water"), ("ఇల్లు", "house"), ("పుస్తకం", "book"), ("అబ్బాయి", "boy"), ("అమ్మాయి", "girl"),
        ("అమ్మ", "mother"), ("నాన్న", "father"), ("స్నేహితుడు", "friend"), ("సూర్యుడు", "sun"),
        ("చంద్రుడు", "moon"), ("చెట్టు", "tree"), ("నది", "river"), ("నగరం", "city"), ("గ్రామం", "village"),
        ("బడి", "school"), ("రోజు", "day"), ("రాత్రి", "night"), ("అన్నం", "rice"), ("పాలు", "milk"),
        ("రొట్టె", "bread"), ("మామిడి", "mango"), ("పువ్వు", "flower"), ("పక్షి", "bird"), ("చేప", "fish"),
        ("కుక్క", "dog"), ("పిల్లి", "cat"), ("పెద్ద", "big"), ("చిన్న", "small"), ("మంచి", "good"),
        ("కొత్త", "new"), ("పాత", "old"), ("ఎరుపు", "red"), ("నీలం", "blue"), ("ఆకుపచ్చ", "green"),
        ("చల్లని", "cold"), ("వేడి", "hot"), ("సంతోషం", "happiness"), ("చాలా", "very"), ("ఈరోజు", "today"),
        ("రేపు", "tomorrow"), ("ఉదయం", "morning"), ("సాయంత్రం", "evening"), ("వర్షం", "rain"), ("తలుపు", "door"),
        ("కిటికీ", "window"), ("బల్ల", "table"), ("ఆకాశం", "sky"),
    ),
}  # fmt: skip

# language -> {native word (NFC, as clean_text leaves it): English gloss}
GLOSSARY: dict[str, dict[str, str]] = {
    lang: {unicodedata.normalize("NFC", word): gloss for word, gloss in pairs}
    for lang, pairs in _GLOSSES.items()
}


def translate_transcript(text: str, lang: str, *, where: str = "transcript") -> str:
    """The English gloss of a demo transcript of language `lang`, word by word.

    `text` may carry a leading language tag, non-speech tags and punctuation (all dropped). A word
    without a gloss is a ManifestError naming `where`, the word and the language."""
    glossary = GLOSSARY.get(lang)
    if glossary is None:
        raise ManifestError(
            f"{where}: language {lang!r} has no English glossary (the demo translates {', '.join(GLOSSARY)})"
        )
    _, rest = split_lang_tag(text)
    words = clean_text(rest).split()
    missing = [w for w in words if w not in glossary]
    if missing:
        raise ManifestError(
            f"{where}: word {missing[0]!r} ({lang}) has no English gloss in speechlm.demo.tasks.GLOSSARY; "
            "the translation task is generated for the demo corpus' vocabulary only "
            "(scripts/make_demo_corpus.py): use the bundled corpus, or add the word to the glossary"
        )
    if not words:
        raise ManifestError(f"{where}: {text!r} has no words to translate")
    return " ".join(glossary[w] for w in words)


def ast_table(asr: pa.Table, where: str) -> pa.Table:
    """The translation rows of ASR manifest table `asr` (rows in `GLOSSARY`'s languages, in order)."""
    langs = asr.column("lang").cast(pa.string())
    rows = asr.filter(pc.is_in(langs, value_set=pa.array(list(GLOSSARY), pa.string())))
    ids = rows.column("segment_id").to_pylist()
    answers = [
        translate_transcript(text, lang, where=f"{where}, segment {seg}")
        for seg, text, lang in zip(
            ids, rows.column("text").to_pylist(), rows.column("lang").cast(pa.string()).to_pylist()
        )
    ]
    rows = rows.set_column(
        rows.schema.get_field_index("segment_id"), "segment_id", pa.array([f"{s}{AST_SUFFIX}" for s in ids])
    )
    n = rows.num_rows
    return _with_task_columns(rows, ["ast"] * n, [AST_INSTRUCTION] * n, answers)


def _with_task_columns(
    table: pa.Table, task: Sequence[str], instruction: Sequence[str | None], answer: Sequence[str | None]
) -> pa.Table:
    for name, values in zip(TASK_COLUMNS, (task, instruction, answer)):
        table = table.append_column(pa.field(name, pa.string()), pa.array(values, pa.string()))
    return table


def _read_manifest(path: Path) -> pa.Table:
    """An ASR manifest of `speechlm manifest build` (its schema's columns; other columns are not read)."""
    if not path.is_file():
        raise ManifestError(
            f"{path} does not exist: build the demo manifest first "
            f"(`speechlm manifest build data/demo/shards --out {path.parent}`)"
        )
    return read_parquet_manifest(path)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _write_parquet(table: pa.Table, path: Path) -> None:
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def write_demo_tasks(manifest_dir: str | Path) -> dict[str, Path]:
    """Write the AST manifests, the two-task validation set and the mix (module docstring); their paths."""
    out = Path(manifest_dir)
    train, val = _read_manifest(out / "train.parquet"), _read_manifest(out / "val.parquet")
    ast_train = ast_table(train, str(out / "train.parquet"))
    ast_val = ast_table(val, str(out / "val.parquet"))
    if ast_train.num_rows == 0:
        raise ManifestError(
            f"{out / 'train.parquet'} has no row in {', '.join(GLOSSARY)}: nothing to translate"
        )
    n = val.num_rows
    val_asr = _with_task_columns(val, ["asr"] * n, [None] * n, [None] * n)
    val_tasks = pa.concat_tables([val_asr, ast_val.cast(val_asr.schema)]).combine_chunks()
    paths = {
        "ast_train": out / "ast_train.parquet",
        "ast_val": out / "ast_val.parquet",
        "val_tasks": out / "val_tasks.parquet",
        "mix": out / MIX_FILE,
    }
    _write_parquet(ast_train, paths["ast_train"])
    _write_parquet(ast_val, paths["ast_val"])
    _write_parquet(val_tasks, paths["val_tasks"])
    mix = [
        {"path": "train.parquet", "name": "asr", "weight": MIX_WEIGHTS["asr"]},
        {"path": "ast_train.parquet", "name": "ast", "weight": MIX_WEIGHTS["ast"]},
    ]
    text = (
        "# The demo's training mix (written by speechlm.demo.tasks): ASR on every clip, AST (speech to\n"
        "# English gloss) on the hi/bn/ta/te clips; each row carries its task, instruction and answer.\n"
        + yaml.safe_dump(mix, sort_keys=False, allow_unicode=True)
    )
    write_atomic(paths["mix"], lambda tmp: _write_text(tmp, text))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m speechlm.demo.tasks", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    ap.add_argument("manifest_dir", help="folder holding the demo's train.parquet and val.parquet")
    args = ap.parse_args(argv)
    paths = write_demo_tasks(args.manifest_dir)
    rows = {k: pq.read_metadata(p).num_rows for k, p in paths.items() if p.suffix == ".parquet"}
    print(
        f"wrote {paths['ast_train']} ({rows['ast_train']} rows), {paths['ast_val']} ({rows['ast_val']}), "
        f"{paths['val_tasks']} ({rows['val_tasks']}: both tasks), {paths['mix']} (ASR + AST mix)"
    )
    return 0


if __name__ == "__main__":
    from speechlm.errors import run_guarded

    sys.exit(run_guarded(lambda: main()))
