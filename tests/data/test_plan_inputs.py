"""`speechlm.data.plan.inputs`: the text lengths counted from the Arrow column (offsets when ASCII), and
`speechlm plan` reading them on a second thread while it builds a plan whose budget is seconds."""

from __future__ import annotations

import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import speechlm.data.plan.inputs as plan_inputs
from speechlm.cli import main
from speechlm.errors import DataError

TEXTS = [
    "hello world",
    "",
    "नमस्ते दुनिया",  # Devanagari: 3 bytes a character, combining marks count as characters
    "café",
    "😀 ok",  # 4 bytes
    "",
    "தமிழ்",
    "plain ascii again",
]


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_text_lengths_count_characters_as_python_does(kind):
    texts = pa.array(TEXTS, kind)
    cases = {
        "mixed": texts,
        "ascii only": pa.array(["abc", "", "de f", "x" * 300], kind),
        "empty strings only": pa.array(["", "", ""], kind),
        "no rows": pa.array([], kind),
        "a slice, not ascii": texts.slice(2, 4),
        "an ascii slice of a non-ascii buffer": texts.slice(0, 2),
        "the last ascii row after non-ascii ones": texts.slice(7, 1),
    }
    for name, array in cases.items():
        got = plan_inputs.text_lengths(array)
        assert got.tolist() == [len(t) for t in array.to_pylist()], name
        assert got.tolist() == pc.utf8_length(array).to_pylist(), name


def test_ascii_texts_are_counted_from_the_offsets(monkeypatch):
    """An all-ASCII piece never goes through utf8_length; one non-ASCII byte sends it there."""
    calls = []
    real = pc.utf8_length
    monkeypatch.setattr(pc, "utf8_length", lambda a: calls.append(len(a)) or real(a))
    ascii_texts = pa.array(["one", "two words", "", "x" * 1000])
    assert plan_inputs.text_lengths(ascii_texts).tolist() == [3, 9, 0, 1000]
    assert calls == []
    assert plan_inputs.text_lengths(pa.array(["one", "twö"])).tolist() == [3, 3]
    assert calls == [2]


def _write(path, texts, durations=None):
    n = len(texts)
    durations = np.linspace(1, 15, n).astype(np.float32) if durations is None else durations
    pq.write_table(
        pa.table({"duration": durations, "lang": ["en"] * n, "text": texts}), path, row_group_size=7
    )


def test_text_lengths_read_in_pieces_across_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_inputs, "TEXT_PIECE_ROWS", 4)  # pieces inside row groups of 7 rows
    texts = [TEXTS[i % len(TEXTS)] * (i % 3) for i in range(40)]
    _write(tmp_path / "m.parquet", texts)
    inputs, read_text = plan_inputs.read_plan_columns(tmp_path / "m.parquet")
    assert inputs.text_chars is None and read_text is not None  # not read yet
    assert read_text().tolist() == [len(t) for t in texts]
    again, read_again = plan_inputs.read_plan_columns(tmp_path / "m.parquet")  # kept in the cache
    assert read_again is None and again.text_chars.tolist() == [len(t) for t in texts]


def test_plan_reads_the_texts_on_a_second_thread_while_planning(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(3)
    n = 3000
    texts = [TEXTS[i % len(TEXTS)] * int(k) for i, k in enumerate(rng.integers(1, 6, n))]
    path = tmp_path / "m.parquet"
    _write(path, texts, rng.uniform(1, 15, n).astype(np.float32))
    threads = []
    real = plan_inputs.read_text_chars

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(plan_inputs, "read_text_chars", recording)
    plans = []
    for run in ("cold", "cached"):
        out = tmp_path / f"{run}.json"
        assert main(["plan", "--manifest", str(path), "--dp-size", "2", "--json", str(out)]) == 0
        plans.append((capsys.readouterr().out.replace(str(out), "OUT"), json.loads(out.read_text())))
    assert len(threads) == 1 and threads[0].startswith("plan-texts")  # the cached run read no text
    assert plans[0] == plans[1]  # read beside the plan or from the cache: the same figures
    assert plans[0][1]["padding"]["text_tokens_estimated"]
    # a token budget needs the text lengths to plan: they are read first, on the main thread
    path.touch()  # a new mtime: the cache misses
    assert main(["plan", "--manifest", str(path), "--dp-size", "2", "--max-batch-tokens", "4000"]) == 0
    assert threads[1] == threading.main_thread().name


def test_a_null_text_read_beside_the_plan_names_its_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plan_inputs, "TEXT_PIECE_ROWS", 8)
    texts: list[str | None] = ["some words"] * 60
    texts[37] = None
    _write(tmp_path / "nulls.parquet", texts)
    assert main(["plan", "--manifest", str(tmp_path / "nulls.parquet"), "--dp-size", "1"]) == 1
    err = capsys.readouterr().err
    assert "nulls.parquet, row 37: column 'text' is null" in err and "Traceback" not in err
    with pytest.raises(DataError, match=r"row 37: column 'text' is null"):
        plan_inputs.read_plan_inputs(tmp_path / "nulls.parquet")


def test_the_text_reader_gives_each_piece_back_before_the_next(tmp_path, monkeypatch):
    """The reader runs beside the epoch plan's peak: Arrow's pool returns each piece's memory to the system
    at once (without it, a cold 10M-row plan peaked at ~612 MiB instead of ~515)."""
    monkeypatch.setattr(plan_inputs, "TEXT_PIECE_ROWS", 5)
    _write(tmp_path / "m.parquet", ["words"] * 33)  # row groups of 7 (the last of 5): 9 pieces
    pool = pa.default_memory_pool()
    released = []

    class Counting:
        def release_unused(self):
            released.append(1)
            pool.release_unused()

    monkeypatch.setattr(pa, "default_memory_pool", Counting)
    assert plan_inputs.read_text_chars(tmp_path / "m.parquet", 33).tolist() == [5] * 33
    assert len(released) == 9
