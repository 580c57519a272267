"""The demo corpus synthesized at demo time (speechlm/demo/: corpus, vocabulary, synthesis, writing): deterministic, cached, with the bad
rows the build and the loader drop, and a held-out split sharing no sentence and no word pair with training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import record_demo_commands

from speechlm.data.manifest.build import build_manifest
from speechlm.data.text import clean_text, split_lang_tag
from speechlm.demo import corpus as dc
from speechlm.demo import synthesis as synth
from speechlm.demo import vocabulary as vocab
from speechlm.demo import writing
from speechlm.demo.run import DEMO_VOCAB_SIZE
from speechlm.errors import UsageError

pytest.importorskip("espeakng_loader", reason="the corpus is synthesized with espeakng-loader (a dependency)")

SMALL = vocab.CorpusSettings(utterances=40, heldout=4, seed=7)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "corpus"
    writing.generate_corpus(out, SMALL)
    return out


def _rows(root: Path) -> list[dict]:
    rows = []
    for meta in sorted(root.glob("*/metadata.parquet")):
        rows += pq.read_table(meta).to_pylist()
    return rows


def _words(text: str) -> list[str]:
    return clean_text(split_lang_tag(text)[1] if text.startswith("<|") else text).split()


def test_same_seed_same_bytes_other_seed_other_bytes(corpus: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    writing.generate_corpus(again, SMALL)
    assert writing.digest(again) == writing.digest(corpus)
    other = tmp_path / "other"
    writing.generate_corpus(other, vocab.CorpusSettings(utterances=40, heldout=4, seed=8))
    assert writing.digest(other) != writing.digest(corpus)


def test_sizes_languages_and_stamp(corpus: Path) -> None:
    stamp = json.loads((corpus / writing.STAMP).read_text())
    assert stamp["key"]["espeak_ng"].startswith("1.52")
    assert stamp["summary"]["train_utterances"] == SMALL.utterances
    assert stamp["summary"]["heldout_utterances"] == SMALL.heldout * len(vocab.LANG_SHARES)
    rows = _rows(corpus)
    per_lang: dict[str, int] = {}
    for r in rows:
        if r["split"] == "train" and r["segment_id"].split("_")[1] != "heldout":
            per_lang[r["segment_id"].split("_")[0]] = per_lang.get(r["segment_id"].split("_")[0], 0) + 1
    assert set(per_lang) == set(vocab.LANG_SHARES)
    assert per_lang["en"] > per_lang["te"]  # skewed, so that language balancing has work


def test_heldout_shares_no_sentence_and_no_word_pair_with_training(corpus: Path) -> None:
    rows = [r for r in _rows(corpus) if r["transcription_native"] and r["transcription_native"].strip()]
    by_split: dict[str, dict[str, list[list[str]]]] = {"train": {}, "val": {}}
    for r in rows:
        words = _words(r["transcription_native"])
        if words:
            by_split[r["split"]].setdefault(r["segment_id"].split("_")[0], []).append(words)
    assert set(by_split["val"]) == set(vocab.LANG_SHARES)
    for lang, held in by_split["val"].items():
        train = by_split["train"][lang]
        train_pairs = {p for s in train for p in zip(s, s[1:])}
        train_sentences = {" ".join(s) for s in train}
        for s in held:
            assert " ".join(s) not in train_sentences
            assert not set(zip(s, s[1:])) & train_pairs, (lang, s)
    # the construction, at the size the demo uses: the pair sets are disjoint by definition
    graphs = vocab.pair_graphs("hi", SMALL.seed)
    for a in vocab.VOCAB["hi"]:
        assert not set(graphs["train"][a]) & set(graphs["val"][a])
        assert set(graphs["train"][a]) | set(graphs["val"][a]) == set(vocab.VOCAB["hi"])


def test_the_build_drops_the_bad_rows_and_puts_exactly_the_heldout_rows_in_val(
    corpus: Path, tmp_path: Path
) -> None:
    build_manifest(corpus, tmp_path / "m")
    report = json.loads((tmp_path / "m" / "build_report.json").read_text())
    assert report["total_dropped"] == vocab.N_DROPPED_BY_BUILD == 12
    expected: dict[str, dict[str, int]] = {}
    reason_of = {
        "short": "too_short",
        "long": "too_long",
        "low_quality": "low_quality",
        "empty_text": "empty_text",
        "blank_text": "empty_text",
        "null_text": "empty_text",
        "duplicate": "duplicate",
        "no_audio_index": "no_audio_index",
    }
    for b in vocab.BAD_ROWS:
        if b.kind in reason_of:
            lang = b.shard.split("_")[0]
            expected.setdefault(reason_of[b.kind], {}).setdefault(lang, 0)
            expected[reason_of[b.kind]][lang] += 1
    assert report["dropped"] == expected
    val = pq.read_table(tmp_path / "m" / "val.parquet").column("segment_id").to_pylist()
    train = pq.read_table(tmp_path / "m" / "train.parquet").column("segment_id").to_pylist()
    assert sorted(val) == sorted(
        f"{lang}_heldout_{i:05d}" for lang in vocab.LANG_SHARES for i in range(SMALL.heldout)
    )
    # every valid training utterance is kept, plus the two undecodable files the dataset drops and counts
    assert len(train) == SMALL.utterances + 2
    assert not any("_heldout_" in s for s in train)


def test_a_second_run_synthesizes_nothing(corpus: Path, capsys, monkeypatch) -> None:
    before = {p: p.stat().st_mtime_ns for p in corpus.rglob("*")}

    def no_pool(*a, **k):
        raise AssertionError("synthesized again")

    monkeypatch.setattr(writing, "write_shard", no_pool)
    writing.generate_corpus(corpus, SMALL)
    assert "up to date" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in corpus.rglob("*")} == before


def test_a_missing_file_or_other_settings_rebuild_and_a_foreign_folder_is_never_replaced(
    corpus: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "c"
    subprocess.run(["cp", "-r", str(corpus), str(copy)], check=True)
    victim = next((copy / "te_000" / "audio").iterdir())
    victim.unlink()
    assert writing.cached(copy, json.loads((copy / writing.STAMP).read_text())["key"]) is None
    writing.generate_corpus(copy, SMALL)
    assert victim.is_file() and writing.digest(copy) == writing.digest(corpus)

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not a generated demo corpus"):
        writing.generate_corpus(foreign, SMALL)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_a_killed_run_leaves_only_partial_and_the_next_run_completes(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "k"
    env = {**os.environ, "PYTHONPATH": str(Path(dc.__file__).resolve().parent.parent)}
    cmd = [
        sys.executable,
        "-m",
        "speechlm.demo.corpus",
        "--corpus",
        str(out),
        "--utterances",
        "600",
        "--heldout",
        "4",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    partial = out.with_name("k.partial")
    deadline = time.time() + 60
    while time.time() < deadline and not any(partial.glob("*/audio/*.flac")):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the pool's workers too
    proc.wait()
    assert partial.is_dir() and not out.exists()
    writing.generate_corpus(out, SMALL)
    assert not partial.exists()
    assert writing.digest(out) == writing.digest(corpus)


def test_without_espeakng_loader_the_error_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    with pytest.raises(UsageError, match=f"pip install espeakng-loader=={synth.ESPEAKNG_LOADER_VERSION}"):
        synth.Espeak()


def test_settings_are_checked() -> None:
    import argparse

    with pytest.raises(UsageError, match="at least 5 training"):
        dc.settings_of(argparse.Namespace(utterances=3, heldout=1, seed=0))


def test_demo_synthesizes_then_builds_the_heldout_split_and_trains_on_it(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from speechlm.cli import main

    corpus, out = tmp_path / "corpus", tmp_path / "m"
    argv = [
        "demo",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--utterances",
        "40",
        "--heldout",
        "4",
        "--seed",
        "7",
    ]
    rc, seen = record_demo_commands(monkeypatch, [*argv[1:], "--asr-only", "trainer.max_steps=2"])
    assert rc == 0
    assert [s[0] for s in seen] == ["manifest", "tokenizer", "plan", "train", "evaluate"]
    assert seen[0][2] == str(corpus)
    assert seen[1][-3:] == [
        "--vocab-size",
        str(DEMO_VOCAB_SIZE),
        "--overwrite",
    ]  # about one piece per character
    assert f"data.val_manifest={out / 'val.parquet'}" in seen[3]
    val = pq.read_table(out / "val.parquet").column("segment_id").to_pylist()
    assert len(val) == 4 * len(vocab.LANG_SHARES) and all("_heldout_" in v for v in val)
    printed = capsys.readouterr().out
    assert "held-out word coverage" in printed
    # a second demo finds the corpus and synthesizes nothing; `speechlm demo corpus` is the first step alone
    assert main([*argv, "--no-train"]) == 0
    assert "is up to date" in capsys.readouterr().out
    assert (
        main(
            ["demo", "corpus", "--corpus", str(corpus), "--utterances", "40", "--heldout", "4", "--seed", "7"]
        )
        == 0
    )
    assert "is up to date" in capsys.readouterr().out


def test_a_sentence_pool_repeats_training_sentences_in_other_voices_and_keeps_heldout_apart(
    tmp_path: Path,
) -> None:
    settings = vocab.CorpusSettings(utterances=60, heldout=3, seed=7, sentences=10)
    writing.generate_corpus(tmp_path / "p", settings)
    rows = _rows(tmp_path / "p")
    train = [r for r in rows if r["split"] == "train" and r["segment_id"].split("_")[1] != "heldout"]
    n_valid = {
        j.name: j.valid for j in writing.shard_jobs(settings)
    }  # bad rows are numbered after the valid ones
    valid = [
        r
        for r in train
        if int(r["segment_id"].rsplit("_", 1)[1]) < n_valid[r["segment_id"].rsplit("_", 1)[0]]
    ]
    by_lang: dict[str, set[str]] = {}
    for r in valid:
        by_lang.setdefault(r["segment_id"].split("_")[0], set()).add(
            " ".join(_words(r["transcription_native"]))
        )
    pools = {j.lang: j.pool for j in writing.shard_jobs(settings) if j.split == "train"}
    for lang, sentences in by_lang.items():
        assert 1 <= len(sentences) <= pools[lang]
    held = [_words(r["transcription_native"]) for r in rows if r["split"] == "val"]
    train_pairs = {p for r in valid for s in [_words(r["transcription_native"])] for p in zip(s, s[1:])}
    assert held and not any(set(zip(s, s[1:])) & train_pairs for s in held)


@pytest.mark.slow
def test_the_demo_reports_heldout_and_training_wer_side_by_side(tmp_path: Path, monkeypatch, capsys) -> None:
    """`speechlm demo` end to end on a small synthesized corpus with a short budget: the final evaluation
    scores the held-out split (sentences never trained on) and a training subset of the same size, per
    language, in eval.json and in the printed side-by-side lines; the learning curve has both splits.
    (It checks the wiring, not the WER: the tiny model does not learn in 30 steps; docs/training.md has
    the measured figures.)"""
    from speechlm.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["demo", "--asr-only", "--utterances", "100", "--heldout", "4", "trainer.max_steps=30"]
    assert main([*argv, "trainer.max_minutes=0", "trainer.val_every=15", "trainer.ckpt_every=0"]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "runs/demo/eval.json").read_text())
    assert record["split"] == "val" and record["train"]["split"] == "train"
    for lang in vocab.LANG_SHARES:
        assert f"wer_{lang}" in record and f"wer_{lang}" in record["train"]
        assert any(line.split()[:2] == [lang, "val"] for line in out.splitlines()), out[-2000:]
    decodes = [json.loads(line) for line in (tmp_path / "runs/demo/eval_decodes.jsonl").open()]
    held = [d["ref"] for d in decodes if d["split"] == "val"]
    train_refs = {d["ref"] for d in decodes if d["split"] == "train"}
    assert len(held) == 4 * len(vocab.LANG_SHARES) and not set(held) & train_refs
    assert len(train_refs) > 0
    val_records = [json.loads(line) for line in (tmp_path / "runs/demo/metrics.jsonl").open()]
    val_records = [r for r in val_records if r.get("kind") == "val"]
    assert val_records and all("train_wer" in r and "wer" in r for r in val_records)
    assert (tmp_path / "runs/demo/learning_curve.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(2400)  # about 7 minutes alone on 2 cores; far more beside other jobs
def test_the_demo_learns_to_transcribe_sentences_it_never_heard(tmp_path: Path, monkeypatch) -> None:
    """`speechlm demo` on a smaller synthesized corpus for 500 steps (about 6 minutes on 2 cores): the
    held-out sentences, which share no sentence and no word pair with training, are transcribed with a
    WER far below the ~100% of a model that memorises or only writes plausible words (docs/training.md:
    the full demo reaches a few percent). Loose bounds: this is learning, not a benchmark."""
    from speechlm.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["demo", "--utterances", "3000", "--heldout", "20", "trainer.max_steps=500"]
    assert main([*argv, "trainer.max_minutes=0", "trainer.val_every=0", "trainer.ckpt_every=0"]) == 0
    record = json.loads((tmp_path / "runs/demo/eval.json").read_text())
    assert record["split"] == "val"
    assert record["wer"] < 0.3, record
    for lang in vocab.LANG_SHARES:
        assert record[f"wer_{lang}"] < 0.5, (lang, record)


@pytest.mark.parametrize(
    ("case", "damaged", "size"),
    [("DMC_trunc", "en_000/audio/en_000_00000.flac", 100), ("DMC_meta", "en_000/metadata.parquet", 50)],
)
def test_a_truncated_file_in_the_cache_is_named_and_synthesized_again(
    case: str, damaged: str, size: int, corpus: Path, tmp_path: Path, capsys
) -> None:
    """DMC_trunc, DMC_meta (audit 2026-11-28): a truncated FLAC was "up to date, nothing to synthesize" (the
    clip then dropped at training), a truncated metadata.parquet the same, then the build's raw-shard
    advice. The stamp records every file's size: the damaged file is named and the corpus rebuilt."""
    copy = tmp_path / "c"
    subprocess.run(["cp", "-r", str(corpus), str(copy)], check=True)
    os.truncate(copy / damaged, size)
    writing.generate_corpus(copy, SMALL)
    printed = capsys.readouterr().out
    assert f"{copy} is damaged ({copy / damaged} has {size} bytes" in printed, printed
    assert "synthesizing it again" in printed and "up to date" not in printed
    assert writing.digest(copy) == writing.digest(corpus)


def test_a_shard_table_changed_in_place_or_a_stamp_without_sizes_is_synthesized_again(
    corpus: Path, tmp_path: Path, capsys
) -> None:
    copy = tmp_path / "c"
    subprocess.run(["cp", "-r", str(corpus), str(copy)], check=True)
    table = copy / "hi_000" / "audio_index.parquet"
    data = bytearray(table.read_bytes())
    data[-5] ^= 0xFF  # the same size, one byte of the footer flipped
    table.write_bytes(bytes(data))
    key = json.loads((copy / writing.STAMP).read_text())["key"]
    assert writing.cached(copy, key) is None
    assert f"{table} changed since it was written" in capsys.readouterr().out
    stamp = json.loads((copy / writing.STAMP).read_text())
    del stamp["files"]  # a corpus stamped before sizes were recorded
    (copy / writing.STAMP).write_text(json.dumps(stamp))
    assert writing.cached(copy, key) is None
    assert "records no file sizes" in capsys.readouterr().out


def test_a_read_only_corpus_folder_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    """DM08: `demo --corpus` on a read-only file system was exit 70 with an OSError traceback."""
    import errno

    from speechlm.cli import main
    from speechlm.errors import EXIT_OUTPUT

    real_mkdir = Path.mkdir

    def read_only(self: Path, *args, **kwargs) -> None:
        if str(self).startswith(str(tmp_path / "rofs")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    corpus = tmp_path / "rofs" / "corpus"
    argv = [
        "demo",
        "--corpus",
        str(corpus),
        "--utterances",
        "40",
        "--heldout",
        "4",
        "--out",
        str(tmp_path / "m"),
    ]
    assert main([*argv, "--no-train"]) == EXIT_OUTPUT
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: cannot write the demo corpus")
    assert f"--corpus {corpus} ({corpus}.partial: Read-only file system)" in err
    assert not (tmp_path / "m").exists()
