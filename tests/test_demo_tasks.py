"""The demo's translation task (speechlm.demo.tasks) and its wiring into `speechlm demo`."""

from __future__ import annotations

import importlib.util
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import record_demo_commands

from speechlm.data.manifest.schema import MANIFEST_SCHEMA, ManifestError
from speechlm.demo.tasks import (
    AST_INSTRUCTION,
    GLOSSARY,
    MIX_FILE,
    translate_transcript,
    write_demo_tasks,
)

REPO = Path(__file__).resolve().parents[1]
AST_LANGS = {"hi", "bn", "ta", "te"}


def _corpus_script():
    """scripts/make_demo_corpus.py as a module (its VOCAB and sentence generator)."""
    spec = importlib.util.spec_from_file_location("make_demo_corpus", REPO / "scripts/make_demo_corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_demo_corpus", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def manifest_dir(demo_data, tmp_path: Path) -> Path:
    """A copy of the session's demo manifest folder (train/val parquet), so the generator writes here."""
    out = tmp_path / "demo_manifest"
    out.mkdir()
    shutil.copy(demo_data["train"], out / "train.parquet")
    shutil.copy(demo_data["val"], out / "val.parquet")
    return out


# ------------------------------------------------------------------------------------------------
# the glossary


def test_every_non_english_demo_word_has_exactly_one_gloss() -> None:
    vocab = _corpus_script().VOCAB
    assert set(GLOSSARY) == set(vocab) - {"en"}
    english_letters = set("".join(vocab["en"]))
    for lang, glossary in GLOSSARY.items():
        assert set(glossary) == set(vocab[lang]), lang  # every word glossed, no word the corpus lacks
        for word, gloss in glossary.items():
            # one lower-case English word, spelt with letters the corpus' English text has (so the demo's
            # tokenizer, trained on the transcripts, encodes it without <unk>)
            assert gloss.isalpha() and gloss.islower() and set(gloss) <= english_letters, (lang, word, gloss)
        # word for word both ways: no two words of a language share a gloss
        assert len(set(glossary.values())) == len(glossary), Counter(glossary.values()).most_common(2)


def test_the_four_languages_gloss_the_same_concepts() -> None:
    """The four word lists were written as translations of one concept list: their glosses agree (a typo in
    one gloss would show up here), apart from the words some languages lack: Hindi है "is", "and" in
    Hindi/Bengali, happy (adjective) against happiness (noun), Telugu's "rice" for the others' "food"."""
    glosses = {lang: set(g.values()) for lang, g in GLOSSARY.items()}
    common = set.intersection(*glosses.values())
    assert len(common) >= 44
    extra = {lang: sorted(g - common) for lang, g in glosses.items()}
    assert extra == {
        "hi": ["and", "food", "happy", "is"],
        "bn": ["and", "food", "happy"],
        "ta": ["food", "happiness"],
        "te": ["happiness", "rice"],
    }


def test_translate_drops_tags_and_punctuation_and_glosses_word_by_word() -> None:
    assert translate_transcript('<|hi|> [laugh] पानी, "घर" और किताब।', "hi") == "water house and book"
    assert translate_transcript("<|te|> నీరు ఇల్లు?", "te") == "water house"
    # raw sentences exactly as the corpus generator writes them (quotes, commas, danda, '?', tags)
    script = _corpus_script()
    for lang in sorted(GLOSSARY):
        rng = random.Random(f"test/{lang}")
        for _ in range(40):
            raw, spoken = script.make_sentence(rng, lang)
            words = [w.strip('",.?।') for w in spoken.split()]
            assert translate_transcript(raw, lang) == " ".join(GLOSSARY[lang][w] for w in words), raw


def test_a_word_without_a_gloss_is_an_error_naming_the_row_and_word() -> None:
    with pytest.raises(ManifestError, match=r"m\.parquet, segment x.*'नमस्ते' \(hi\) has no English gloss"):
        translate_transcript("<|hi|> पानी नमस्ते", "hi", where="m.parquet, segment x")
    with pytest.raises(ManifestError, match="language 'en' has no English glossary"):
        translate_transcript("<|en|> water", "en")
    with pytest.raises(ManifestError, match="no words to translate"):
        translate_transcript("<|hi|> [noise] ।", "hi")


# ------------------------------------------------------------------------------------------------
# the generated manifests


def test_ast_manifests_hold_the_translation_rows_with_the_task_columns(manifest_dir: Path, demo_data) -> None:
    from speechlm.data.manifest.load import read_parquet_manifest
    from speechlm.data.tokenizer import Tokenizer

    paths = write_demo_tasks(manifest_dir)
    for split in ("train", "val"):
        asr = pq.read_table(manifest_dir / f"{split}.parquet").to_pylist()
        ast = pq.read_table(paths[f"ast_{split}"]).to_pylist()
        source = [r for r in asr if r["lang"] in AST_LANGS]
        assert len(ast) == len(source) > 0 and {r["lang"] for r in ast} <= AST_LANGS
        for row, src in zip(ast, source):
            assert row["segment_id"] == src["segment_id"] + "-ast"
            assert (row["task"], row["instruction"]) == ("ast", AST_INSTRUCTION)
            assert row["answer"] == translate_transcript(src["text"], src["lang"])
            # the clip and its transcript (the CTC target) are the ASR row's
            for key in ("audio_filepath", "duration", "text", "lang", "shard_id", "source"):
                assert row[key] == src[key], key
        # training reads them as manifests (the task columns are extra, optional columns)
        assert read_parquet_manifest(paths[f"ast_{split}"]).num_rows == len(ast)
    assert pq.read_schema(paths["ast_train"]).names == [
        *MANIFEST_SCHEMA.names,
        "task",
        "instruction",
        "answer",
    ]
    # the AST answers are English words the demo tokenizer knows
    tok = Tokenizer(demo_data["tok"])
    answers = pq.read_table(paths["ast_train"], columns=["answer"]).column("answer").to_pylist()
    assert all(tok.unk_id not in tok.encode(a) for a in answers)


def test_validation_set_covers_both_tasks(manifest_dir: Path) -> None:
    paths = write_demo_tasks(manifest_dir)
    val = pq.read_table(manifest_dir / "val.parquet").to_pylist()
    rows = pq.read_table(paths["val_tasks"]).to_pylist()
    ast_val = pq.read_table(paths["ast_val"]).to_pylist()
    assert rows == [{**r, "task": "asr", "instruction": None, "answer": None} for r in val] + ast_val
    assert Counter(r["task"] for r in rows) == {"asr": len(val), "ast": len(ast_val)}
    assert len({r["segment_id"] for r in rows}) == len(rows)


def test_generation_is_deterministic_and_replaces_its_outputs(manifest_dir: Path, tmp_path: Path) -> None:
    first = {k: p.read_bytes() for k, p in write_demo_tasks(manifest_dir).items()}
    other = tmp_path / "other"
    shutil.copytree(manifest_dir, other)
    (other / "ast_train.parquet").write_bytes(b"stale")  # a previous file is replaced, not read
    again = {k: p.read_bytes() for k, p in write_demo_tasks(other).items()}
    assert first == again
    assert sorted(p.name for p in other.iterdir()) == sorted(
        [
            "train.parquet",
            "val.parquet",
            "ast_train.parquet",
            "ast_val.parquet",
            "val_tasks.parquet",
            MIX_FILE,
        ]
    )


def test_an_interrupted_generation_leaves_no_partial_file(manifest_dir: Path, monkeypatch) -> None:
    """SIGTERM/Ctrl-C while a file is written: the file is absent (or the previous one), no temp file is
    left behind, and the next run writes everything."""
    import speechlm.demo.tasks as demo_tasks

    real_write = pq.write_table
    calls = []

    def write_then_stop(table: pa.Table, where: Path) -> None:
        calls.append(where)
        real_write(table, where)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(demo_tasks.pq, "write_table", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        write_demo_tasks(manifest_dir)
    names = sorted(p.name for p in manifest_dir.iterdir())
    assert names == ["ast_train.parquet", "train.parquet", "val.parquet"], names
    monkeypatch.setattr(demo_tasks.pq, "write_table", real_write)
    assert all(p.exists() for p in write_demo_tasks(manifest_dir).values())


def test_a_missing_or_corrupt_asr_manifest_is_an_error_naming_it(manifest_dir: Path) -> None:
    (manifest_dir / "val.parquet").unlink()
    with pytest.raises(ManifestError, match=r"val\.parquet does not exist: build the demo manifest first"):
        write_demo_tasks(manifest_dir)
    (manifest_dir / "val.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ManifestError, match=r"val\.parquet is not a readable parquet file"):
        write_demo_tasks(manifest_dir)
    assert not (manifest_dir / "ast_train.parquet").exists()


# ------------------------------------------------------------------------------------------------
# the mix and `speechlm demo`


def test_the_demo_mix_loads_with_both_tasks_weighted_equally(manifest_dir: Path, capsys) -> None:
    from speechlm.cli import main
    from speechlm.data.sources.input_cfg import load_input_cfg, mix_of_table

    paths = write_demo_tasks(manifest_dir)
    table = load_input_cfg(str(paths["mix"]))
    n_asr = pq.read_metadata(manifest_dir / "train.parquet").num_rows
    n_ast = pq.read_metadata(paths["ast_train"]).num_rows
    assert table.num_rows == n_asr + n_ast
    mix = mix_of_table(table)
    assert mix.names == ("asr", "ast") and mix.shares == (0.5, 0.5)
    assert main(["plan", "--config", str(REPO / "configs/demo.yaml"), "--input-cfg", str(paths["mix"])]) == 0
    out = capsys.readouterr().out
    shares = {
        line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("asr ", "ast "))
    }
    assert shares["asr"][:3] == [str(n_asr), f"{100 * n_asr / (n_asr + n_ast):.2f}%", "50.00%"]
    assert shares["ast"][:3] == [str(n_ast), f"{100 * n_ast / (n_asr + n_ast):.2f}%", "50.00%"]


def _demo_commands(monkeypatch, argv: list[str]) -> tuple[int, list[list[str]]]:
    """`speechlm demo --shards <bundled corpus> ARGV` with its steps recorded (tests/test_demo_synth.py runs it on
    a synthesized corpus)."""
    return record_demo_commands(monkeypatch, ["--shards", str(REPO / "data/demo/shards"), *argv])


def test_demo_trains_the_asr_ast_mix_and_validates_both_tasks(tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "m"
    rc, seen = _demo_commands(monkeypatch, ["--with-ast", "--out", str(out), "trainer.max_steps=3"])
    assert rc == 0
    assert [s[0] for s in seen] == ["manifest", "tokenizer", "plan", "train"]
    assert seen[2][-2:] == ["--input-cfg", str(out / MIX_FILE)]
    train = seen[3]
    assert train[1] == str(REPO / "configs/demo.yaml")
    assert "data.train_manifest=null" in train and f"data.input_cfg={out / MIX_FILE}" in train
    assert f"data.val_manifest={out / 'val_tasks.parquet'}" in train
    assert train[-1] == "trainer.max_steps=3"  # the user's overrides come last, so they win
    printed = capsys.readouterr().out
    assert f"$ python -m speechlm.demo.tasks {out}" in printed
    assert "ast " in printed and "asr " in printed  # the plan's per-dataset table


def test_demo_no_train_and_asr_only(tmp_path: Path, monkeypatch, capsys) -> None:
    rc, seen = _demo_commands(monkeypatch, ["--with-ast", "--out", str(tmp_path / "a"), "--no-train"])
    assert rc == 0 and [s[0] for s in seen] == ["manifest", "tokenizer", "plan"]
    assert (tmp_path / "a" / MIX_FILE).is_file()
    rc, seen = _demo_commands(monkeypatch, ["--out", str(tmp_path / "b"), "--asr-only"])
    assert rc == 0
    assert seen[2][-2:] == ["--manifest", str(tmp_path / "b" / "train.parquet")]
    assert f"data.train_manifest={tmp_path / 'b' / 'train.parquet'}" in seen[3]
    assert f"data.val_manifest={tmp_path / 'b' / 'val.parquet'}" in seen[3]
    assert not (tmp_path / "b" / MIX_FILE).exists() and not (tmp_path / "b" / "ast_train.parquet").exists()
    # after training, the CTC head alone on the held-out split (issue 38: beside the LLM-alone and joint WERs)
    assert seen[4] == [
        "evaluate",
        "runs/demo",
        "--manifest",
        str(tmp_path / "b" / "val.parquet"),
        "--ctc-weight",
        "1",
    ]
    rc, default = _demo_commands(
        monkeypatch, ["--out", str(tmp_path / "b")]
    )  # ASR only by default (issue 24)
    assert rc == 0 and default[2][-2:] == seen[2][-2:] and default[3] == seen[3]


def test_the_docs_show_the_mix_and_row_counts_the_demo_writes(manifest_dir: Path) -> None:
    """docs/training.md's "A mixed ASR+AST input_cfg" shows the generated mix file and its row counts."""
    import re

    import yaml

    doc = (REPO / "docs/training.md").read_text(encoding="utf-8")
    section = doc[doc.index("### A mixed ASR+AST input_cfg") :]
    section = section[: section.index("\n### ")]
    shown = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert shown is not None
    paths = write_demo_tasks(manifest_dir)
    assert yaml.safe_load(shown.group(1)) == yaml.safe_load(paths["mix"].read_text(encoding="utf-8"))
    for key in ("ast_train", "ast_val", "val_tasks"):
        rows = pq.read_metadata(paths[key]).num_rows
        assert f"| `{paths[key].name}` | {rows} |" in section, (key, rows)
