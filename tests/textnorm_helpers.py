"""Manifests of the text-normalisation tests (issue 36 item 1): the audit's MC01 and EV10 inputs."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def set_column(table: pa.Table, name: str, values: list) -> pa.Table:
    arr = pa.array(values, pa.string())
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, arr)
    return table.append_column(name, arr)


def plain(text: str) -> str:
    """A tagged transcript without its tag."""
    return text.split(" ", 1)[1]


def ast_upper(src: str, out: Path) -> Path:
    """MC01's manifest: task ast, an instruction, the answer = the transcript in UPPER CASE."""
    t = pq.read_table(src)
    n = t.num_rows
    answers = [plain(x).upper() for x in t.column("text").to_pylist()]
    t = set_column(
        set_column(set_column(t, "task", ["ast"] * n), "instruction", ["translate"] * n), "answer", answers
    )
    pq.write_table(t, out)
    return out


def upper_transcripts(src: str, out: Path) -> Path:
    """EV10's manifest: the English transcripts in UPPER CASE (their tags as they were)."""
    t = pq.read_table(src)
    texts = [
        x.split(" ", 1)[0] + " " + plain(x).upper() if x.startswith("<|en|>") else x
        for x in t.column("text").to_pylist()
    ]
    pq.write_table(set_column(t, "text", texts), out)
    return out
