"""A manifest's rows against the run's tokenizer: what a table must hold before a run trains on it or an
evaluation scores it. The pre-flight (`speechlm.preflight.checks.check_inputs`) refuses a run on these
problems, and `speechlm evaluate` (`speechlm.use.evaluation`) a manifest.

- `check_table`: null values (audio path, text, language), languages the tokenizer does not know, and
  `<|...|>` tags it does not know in the transcripts, instructions and answers (`unknown_tag_rows`: a
  scan over the Arrow text column with pyarrow.compute, a slice at a time);
- `coverage_problems` and `uncovered_targets`: characters of the answers and transcripts the tokenizer
  cannot encode under a data.text_normalize rule (`speechlm.data.text_coverage`), with the rows named
  the way every message here names them (`row_name`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from speechlm.data.run_inputs import RunTokenizer
from speechlm.data.text_coverage import coverage_problems as problems_of
from speechlm.data.text_coverage import find_uncovered
from speechlm.data.tokenizer import AUDIO, format_lang_tag

# the tag syntax `Tokenizer.encode` reads as one special token (speechlm.data.tokenizer._TAG_RE)
TAG_PATTERN = r"<\|[^|<>\s]+\|>"
_TAG_RE = re.compile(TAG_PATTERN)
SCAN_ROWS = 1 << 18  # rows per slice of the vectorised text scan (bounds the temporary strings)
SHOW = 3  # bad rows quoted per problem


def known_tags(tokenizer: RunTokenizer) -> list[str]:
    """The `<|...|>` tags `tokenizer.encode` accepts: one per language, and `<|audio|>`."""
    return [AUDIO, *(format_lang_tag(lang) for lang in tokenizer.langs)]


def unknown_tags_in(text: str, known: set[str]) -> list[str]:
    return [m.group(0) for m in _TAG_RE.finditer(text) if m.group(0) not in known]


def row_name(table: pa.Table, row: int) -> str:
    if "segment_id" in table.column_names:
        seg = table.column("segment_id")[row]
        if seg.is_valid:
            return f"row {row} (segment {seg.as_py()})"
    return f"row {row}"


def _null_problems(table: pa.Table, name: str) -> list[str]:
    out = []
    for col in ("audio_filepath", "text", "lang"):
        if col not in table.column_names:
            continue
        column = table.column(col)
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            out.append(
                f"{name}, {row_name(table, row)}: column {col} is null ({column.null_count} null row(s) "
                "in all); fix those rows or rebuild the manifest"
            )
    return out


def _language_problems(table: pa.Table, name: str, tokenizer: RunTokenizer) -> list[str]:
    lang = table.column("lang")
    present: set[str] = set()
    for chunk in lang.chunks:
        present.update(x for x in pc.unique(chunk).to_pylist() if x is not None)
    unknown = sorted(present - set(tokenizer.langs))
    if not unknown:
        return []
    as_text = lang.cast(pa.string()) if pa.types.is_dictionary(lang.type) else lang
    parts = []
    for code in unknown:
        hits = pc.equal(as_text, code)
        parts.append(
            f"{code!r} ({pc.sum(hits).as_py()} row(s), first {row_name(table, pc.index(hits, True).as_py())})"
        )
    return [
        f"{name} has language(s) that tokenizer {tokenizer.path} does not know: {'; '.join(parts)} (it knows "
        f"{', '.join(tokenizer.langs)}); retrain the tokenizer on a manifest with these languages "
        "(`speechlm tokenizer train --manifest ...`) or remove those rows"
    ]


def unknown_tag_rows(texts: pa.ChunkedArray, known: list[str]) -> tuple[int, list[int]]:
    """(rows whose text has a tag not in `known`, the first SHOW of them), scanning with pyarrow.compute.

    Each slice of SCAN_ROWS rows takes two passes of RE2 over the Arrow strings: the first keeps the
    rows that are plainly clean (an optional known leading tag, then no `<|`: nearly every row); the
    rest have their known tags removed and are searched for any tag left. Null texts count as clean
    here (`_null_problems` names them). Measured: 0.6-0.8 s per million 70-character texts, one CPU core
    (a one-pass replace-then-match over every row took 1.7 s).
    """
    known_re = "|".join(re.escape(t) for t in known)  # never empty: <|audio|> is always known
    clean_re = rf"^\s*(?:{known_re})?(?:[^<]|<[^|])*<?$"
    count, first = 0, []  # type: int, list[int]
    offset = 0
    for chunk in texts.chunks:
        for start in range(0, len(chunk), SCAN_ROWS):
            piece = chunk.slice(start, SCAN_ROWS)
            clean = pc.fill_null(pc.match_substring_regex(piece, clean_re), True)
            suspects = np.flatnonzero(~clean.to_numpy(zero_copy_only=False))
            if not len(suspects):
                continue
            rest = pc.replace_substring_regex(pc.take(piece, suspects), pattern=known_re, replacement="")
            hit = pc.fill_null(pc.match_substring_regex(rest, TAG_PATTERN), False)
            rows = suspects[hit.to_numpy(zero_copy_only=False)]
            count += len(rows)
            first.extend(int(offset + start + r) for r in rows[: SHOW - len(first)])
        offset += len(chunk)
    return count, first


def _tag_problems(table: pa.Table, name: str, tokenizer: RunTokenizer, column: str = "text") -> list[str]:
    known = known_tags(tokenizer)
    texts = table.column(column)
    count, rows = unknown_tag_rows(texts, known)
    if not count:
        return []
    quoted = []
    tags: dict[str, None] = {}
    for row in rows:
        text = texts[row].as_py()
        bad = unknown_tags_in(text, set(known))
        tags.update(dict.fromkeys(bad))
        where = "" if column == "text" else f"column {column}, "
        quoted.append(f"{where}{row_name(table, row)}: {', '.join(bad)} in {text[:60]!r}")
    return [
        f"{name}: {count} {'rows hold' if count > 1 else 'row holds'} a tag that tokenizer {tokenizer.path} does not "
        f"know ({', '.join(tags)}{', ...' if count > len(rows) else ''}; it knows {', '.join(known)}): "
        f"{'; '.join(quoted)}{'; ...' if count > len(rows) else ''}; fix those transcripts or retrain the "
        "tokenizer with those languages"
    ]


def check_table(table: pa.Table, name: str, tokenizer: RunTokenizer) -> list[str]:
    """Problems of one manifest against the tokenizer: null values, unknown languages, unknown tags (in the
    transcripts and in the optional instructions and answers)."""
    nulls = _null_problems(table, name)
    tags = [
        p
        for col in ("text", "instruction", "answer")
        if col in table.column_names
        for p in _tag_problems(table, name, tokenizer, col)
    ]
    return [*nulls, *_language_problems(table, name, tokenizer), *tags]


def coverage_problems(table: pa.Table, name: str, tokenizer: RunTokenizer, rule: str) -> list[str]:
    """Characters of the answers and transcripts of `table` that `tokenizer` cannot encode under the
    data.text_normalize rule `rule` (`speechlm.data.text_coverage`): they would be trained as <unk>."""
    return problems_of(table, name, tokenizer, rule, lambda row: row_name(table, row))


def uncovered_targets(table: pa.Table, tokenizer: RunTokenizer, rule: str) -> Any:
    """`speechlm.data.text_coverage.find_uncovered` with the rows named as the pre-flight names them."""
    return find_uncovered(table, tokenizer, rule, lambda row: row_name(table, row))
