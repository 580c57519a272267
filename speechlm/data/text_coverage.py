"""Coverage of the training targets by the tokenizer: characters that would be trained as ``<unk>``.

A run trains on its answers and transcripts after the rule ``data.text_normalize``
(`speechlm.data.text.normalize_target`). A character the tokenizer cannot encode after that rule (a
SentencePiece piece that maps to ``<unk>``; a Hugging Face tokenizer's ``unk_id``: a byte-level BPE has
none and covers everything) would silently become ``<unk>``; `coverage_problems` finds such
characters before step 1, with the rows that hold them, so that the pre-flight can refuse the run.

The scan is vectorised over unique characters, never an encode per row:

1. The target texts of a manifest: the ``text`` column (the transcript, and the answer where ``answer``
   is null), the ``answer`` column, and, in a ``conversation`` row, every assistant turn's text and every
   clip's transcript (that JSON is parsed per such row), a slice of `SCAN_ROWS` rows at a time.
2. The distinct characters of each slice (`CharScan`): its UTF-8 data decoded once and marked, as UTF-16
   code units, into a table of the 65536 BMP code points (numpy; astral characters by a regex, only in a
   slice that has some). ``<``, ``|`` and ``>`` count only outside ``<|..|>`` tags (counted with
   `bytes.count`, not cut out); a regex removes the tags first only where a tag name holds a character
   the tokenizer may lack, and, under the ``clean`` rules, the ``[..]``/``<..>`` annotations that
   `clean_text` removes.
3. Each distinct character is normalised on its own (`normalize_piece`; a lone apostrophe also as the
   ``'`` it becomes between letters under ``clean``, ``Σ`` also as the final ``ς`` under ``lower``) and
   every character of the result encoded once (cached): one that gives the tokenizer's unk id is
   uncovered. A letter followed by a combining mark that Unicode composes (NFC or NFKC: ``e`` + U+0301
   is ``é``) is checked as the pair too when the pair occurs in the text (a byte search per slice),
   since normalisation (ours, or the tokenizer's own) composes it.
4. Only when something is uncovered are rows looked for: per slice, the tags (and annotations) removed
   and one RE2 match of the uncovered characters (pyarrow) give the count of rows and the first `SHOW`
   of them, which the message quotes.

The message names the manifest, the count of rows, the first rows (segment ids) with their
characters and text, and the fix: the ``data.text_normalize`` rule that covers every character when one
does, else retraining the tokenizer or fixing the rows. Measured when nothing is uncovered: about four
times the tag scan of the same column (`speechlm.data.tokenizer_checks.unknown_tag_rows`), 4 s per million
48-character transcripts on a shared, heavily loaded CPU core. Limits: a character is judged on its own
(and as a composing pair), so a WordPiece vocabulary that has a character but not its ``##``
continuation piece is not caught; the suggested rule is judged on the characters as the current rule
leaves them.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from speechlm.data.special_tokens import _TAG_RE, AUDIO, TAG_CLOSE, TAG_OPEN, format_lang_tag
from speechlm.data.text import _ANGLE_TAG, _APOSTROPHES, _SQUARE_TAG, TEXT_NORMALIZE, normalize_piece
from speechlm.data.tokenizer import Tokenizer

SCAN_ROWS = 1 << 18  # rows per slice (bounds the temporary strings and code points)
SHOW = 3  # rows quoted per manifest
SHOW_CHARS = 12  # characters named in the message
_CLEAN_RULES = ("clean", "clean_lower")
_LOWER_RULES = ("lower", "clean_lower")


def _removed_pattern(rule: str) -> str:
    """What a text loses before its characters count: the tags, and the annotations `clean` drops."""
    tag = _TAG_RE.pattern.replace("(", "(?:")
    if rule in _CLEAN_RULES:
        return "|".join((tag, _SQUARE_TAG.pattern, _ANGLE_TAG.pattern))
    return tag


def _as_strings(chunk: Any) -> Any:
    return chunk.cast(pa.string()) if pa.types.is_dictionary(chunk.type) else chunk


def _slices(column: Any) -> Iterator[tuple[int, Any]]:
    """(first row, a slice of `SCAN_ROWS` texts of `column`)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    offset = 0
    for chunk in chunks:
        chunk = _as_strings(chunk)
        for start in range(0, len(chunk), SCAN_ROWS):
            yield offset + start, chunk.slice(start, SCAN_ROWS)
        offset += len(chunk)


def _utf8(texts: Any) -> bytes:
    """The UTF-8 data of a string array slice, its rows one after the other (no separator)."""
    texts = pc.cast(texts, pa.large_string())
    data = texts.buffers()[2] if len(texts) else None
    if data is None:
        return b""
    offsets = np.frombuffer(texts.buffers()[1], dtype=np.int64, count=len(texts) + 1, offset=8 * texts.offset)
    return bytes(memoryview(data)[int(offsets[0]) : int(offsets[-1])])


_TAG_SYNTAX = TAG_OPEN + TAG_CLOSE


class CharScan:
    """The distinct characters of target texts outside their ``<|..|>`` tags (module doc, step 2).

    Each slice's text (decoded once) is marked into a table of the 65536 BMP code points (UTF-16 code
    units; a surrogate sends the slice's astral characters through a regex). Tags are not cut out: ``<``,
    ``|`` and ``>`` count only where a slice holds more of them than its ``<|`` and ``|>`` (`str.count`).
    A slice is cleaned by a regex first only where that is not enough: a tag name holds a character the
    tokenizer may lack (`suspect`), or, under the clean rules, the slice holds a ``[..]`` or ``<..>``
    annotation."""

    def __init__(self, tags: list[str], rule: str, suspect: Callable[[str], bool]) -> None:
        self.rule = rule
        self.seen = np.zeros(1 << 16, dtype=bool)
        self.astral: set[str] = set()
        names = {c for t in tags for c in t} - set(_TAG_SYNTAX)
        self.always_regex = any(suspect(c) for c in names)
        self.outside: set[str] = set()  # "<", "|", ">" seen outside a tag

    def add(self, data: bytes) -> None:
        """Mark the characters of one slice's UTF-8 data (`_utf8`)."""
        opened, closed = data.count(TAG_OPEN.encode()), data.count(TAG_CLOSE.encode())
        annotated = self.rule in _CLEAN_RULES and (b"[" in data or data.count(b"<") > opened)
        text = data.decode("utf-8", "ignore")  # text that is not UTF-8 is dropped elsewhere
        if self.always_regex or annotated:
            text = re.sub(_removed_pattern(self.rule), " ", text)
            data, opened, closed = text.encode(), 0, 0
        code_units = np.frombuffer(text.encode("utf-16-le"), dtype=np.uint16)
        self.seen[code_units] = True
        if self.seen[0xD800:0xE000].any():
            self.astral.update(re.findall("[\\U00010000-\\U0010FFFF]", text))
        for c, in_tags in (("<", opened), (">", closed), ("|", opened + closed)):
            if c not in self.outside and data.count(c.encode()) > in_tags:
                self.outside.add(c)

    def chars(self) -> list[str]:
        """The characters seen outside tags, in code point order."""
        bmp = (chr(int(cp)) for cp in np.flatnonzero(self.seen) if not 0xD800 <= cp < 0xE000)
        tag_only = set(_TAG_SYNTAX) - self.outside
        return sorted({c for c in bmp if c not in tag_only} | self.astral)


def _conversation_targets(column: Any) -> tuple[Any, np.ndarray]:
    """(the assistant texts and clip transcripts of the conversation rows, the row of each)."""
    texts: list[str] = []
    rows: list[int] = []
    row = 0
    for chunk in column.chunks:
        for value in chunk.to_pylist():
            if value is not None:
                try:
                    doc = json.loads(value)
                    found = [
                        str(part["text"])
                        for turn in doc.get("turns", [])
                        if turn.get("role") == "assistant"
                        for part in turn.get("parts", [])
                        if "text" in part
                    ]
                    found += [str(c["transcript"]) for c in doc.get("clips", []) if c.get("transcript")]
                except (json.JSONDecodeError, AttributeError, TypeError):
                    found = []  # the reader names a row that is not a conversation
                texts += found
                rows += [row] * len(found)
            row += 1
    return pa.array(texts, pa.string()), np.asarray(rows, dtype=np.int64)


def target_columns(table: Any) -> list[tuple[str, Any, np.ndarray | None]]:
    """(column name, its target texts, the manifest row of each text or None: one per row)."""
    out: list[tuple[str, Any, np.ndarray | None]] = [
        (name, table.column(name), None) for name in ("text", "answer") if name in table.column_names
    ]
    if "conversation" in table.column_names and table.column("conversation").null_count < len(table):
        texts, rows = _conversation_targets(table.column("conversation"))
        out.append(("conversation", texts, rows))
    return out


class Coverage:
    """Which characters a tokenizer can encode, each asked once (`covers`); `unk_id` None covers all."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.unk_id = getattr(tokenizer, "unk_id", None)
        self._known: dict[str, bool] = {}

    def covers(self, text: str) -> bool:
        """Whether `text` encodes without the unk id (whitespace always does)."""
        if self.unk_id is None or not text.strip():
            return True
        if text not in self._known:
            self._known[text] = int(self.unk_id) not in self.tokenizer.encode(text)
        return self._known[text]

    def uncovered(self, chars: list[str], pairs: list[str], rule: str) -> list[str]:
        """The characters of `chars` whose normalised form under `rule` holds something the tokenizer
        cannot encode, then the letter + mark `pairs` (`composing_pairs`) whose normalised form does
        (unless their letter or mark is uncovered already): module doc, step 3."""
        if self.unk_id is None:
            return []
        bad = [c for c in chars if not all(self.covers(x) for x in _images(c, rule))]
        flagged = set(bad)
        bad += [p for p in pairs if not (set(p) & flagged) and not self.covers(normalize_piece(p, rule))]
        return bad


def composing_pairs(chars: list[str]) -> list[str]:
    """Letter + combining mark pairs of `chars` that Unicode composes into one character (NFC or NFKC)."""
    letters = [c for c in chars if unicodedata.category(c)[0] == "L"]
    marks = [c for c in chars if unicodedata.category(c)[0] == "M"]
    return [
        b + m
        for m in marks
        for b in letters
        if len(unicodedata.normalize("NFC", b + m)) == 1 or len(unicodedata.normalize("NFKC", b + m)) == 1
    ]


def _present(columns: list[tuple[str, Any, np.ndarray | None]], items: list[str]) -> list[str]:
    """The strings of `items` that occur in some target text (a byte search of each slice's UTF-8 data)."""
    left, found = {x: x.encode() for x in items}, set[str]()
    for _, texts, _ in columns:
        for _, piece in _slices(texts):
            if not left:
                break
            data = _utf8(piece)
            found.update(x for x, raw in left.items() if raw in data)
            left = {x: raw for x, raw in left.items() if x not in found}
    return [x for x in items if x in found]


def _images(char: str, rule: str) -> list[str]:
    """The characters `char` can become under `rule` (module doc, step 3)."""
    out = normalize_piece(char, rule)
    if rule in _CLEAN_RULES and char in _APOSTROPHES:
        out += "'"  # an apostrophe between two letters stays, as ASCII '
    if rule in _LOWER_RULES and char == "Σ":
        out += "ς"  # the final sigma of a word
    return list(out)


def _show_char(item: str) -> str:
    if len(item) == 1:
        return f"{item!r} (U+{ord(item):04X})"
    parts = " + ".join(f"U+{ord(c):04X}" for c in item)
    return f"{unicodedata.normalize('NFC', item)!r} ({parts})"


@dataclass(frozen=True)
class Uncovered:
    """What `find_uncovered` found: rows, characters, the rows quoted, and the fix (`describe` words it)."""

    rows: int
    chars: str  # the characters named, with their code points
    quoted: str  # the first rows: where, which characters, the text
    fix: str  # a data.text_normalize rule that covers every character, else how to fix the data

    def describe(self, name: str, tokenizer: Any, rule: str) -> str:
        """``NAME: N rows hold characters that tokenizer T cannot encode under data.text_normalize=R
        (the characters)``."""
        rows = f"{self.rows} {'rows hold' if self.rows != 1 else 'row holds'}"
        return (
            f"{name}: {rows} characters that tokenizer {getattr(tokenizer, 'path', tokenizer)} cannot encode "
            f"under data.text_normalize={rule} ({self.chars})"
        )


def find_uncovered(table: Any, tokenizer: Any, rule: str, row_name: Callable[[int], str]) -> Uncovered | None:
    """The targets of `table` that `tokenizer` cannot encode under `rule` (module doc), or None;
    `row_name(row)` names a row in `Uncovered.quoted`."""
    if rule not in TEXT_NORMALIZE:
        raise ValueError(f"data.text_normalize={rule!r}: not one of {', '.join(TEXT_NORMALIZE)}")
    cov = Coverage(tokenizer)
    if cov.unk_id is None:
        return None
    columns = target_columns(table)
    tags = [AUDIO, *(format_lang_tag(lang) for lang in getattr(tokenizer, "langs", ()))]
    scan = CharScan(tags, rule, lambda c: any(cov.uncovered([c], [], r) for r in TEXT_NORMALIZE))
    for _, texts, _ in columns:
        for _, piece in _slices(texts):
            scan.add(_utf8(piece))
    chars = scan.chars()
    pairs = composing_pairs(chars)
    pairs = _present(columns, [p for p in pairs if any(cov.uncovered([], [p], r) for r in TEXT_NORMALIZE)])
    bad = cov.uncovered(chars, pairs, rule)
    if not bad:
        return None
    count, quoted = _rows_holding(columns, bad, rule, len(table), row_name)
    if not count:  # a pair found only across two rows' boundary
        return None
    more = f", ... {len(bad)} in all" if len(bad) > SHOW_CHARS else ""
    return Uncovered(
        rows=count,
        chars=", ".join(_show_char(b) for b in bad[:SHOW_CHARS]) + more,
        quoted="; ".join(quoted) + ("; ..." if count > len(quoted) else ""),
        fix=_fix(cov, chars, pairs, rule),
    )


def coverage_problems(
    table: Any, name: str, tokenizer: Any, rule: str, row_name: Callable[[int], str]
) -> list[str]:
    """The pre-flight's problem (one string, or none): `find_uncovered`, worded for training."""
    found = find_uncovered(table, tokenizer, rule, row_name)
    if found is None:
        return []
    return [
        f"{found.describe(name, tokenizer, rule)}, which would be trained as <unk>: {found.quoted}; "
        f"{found.fix}"
    ]


def _rows_holding(
    columns: list[tuple[str, Any, np.ndarray | None]],
    bad: list[str],
    rule: str,
    n_rows: int,
    row_name: Callable[[int], str],
) -> tuple[int, list[str]]:
    """(rows whose targets hold an item of `bad` outside tags, the first `SHOW` of them quoted): module
    doc, step 4."""
    rows_hit = np.zeros(n_rows, dtype=bool)
    quoted: dict[int, str] = {}
    pattern = "|".join(re.escape(b) for b in sorted(bad, key=len, reverse=True))
    for column, texts, rows in columns:
        for start, piece in _slices(texts):
            stripped = pc.replace_substring_regex(piece, pattern=_removed_pattern(rule), replacement=" ")
            hit = pc.fill_null(pc.match_substring_regex(stripped, pattern), False)
            where = np.flatnonzero(hit.to_numpy(zero_copy_only=False))
            manifest_rows = where + start if rows is None else rows[where + start]
            rows_hit[manifest_rows] = True
            for k, row in zip(where, manifest_rows):
                if len(quoted) < SHOW and int(row) not in quoted:
                    text, plain = piece[int(k)].as_py(), stripped[int(k)].as_py()
                    found = ", ".join(repr(b) for b in bad if b in plain)
                    where_ = "" if column == "text" else f"column {column}, "
                    quoted[int(row)] = f"{where_}{row_name(int(row))}: {found} in {text[:60]!r}"
    return int(rows_hit.sum()), [quoted[r] for r in sorted(quoted)]


def _fix(cov: Coverage, chars: list[str], pairs: list[str], rule: str) -> str:
    """The advice: a rule under which every character is covered, else retrain or fix the rows."""
    for other in ("lower", "clean", "clean_lower"):
        if other != rule and not cov.uncovered(chars, pairs, other):
            return (
                f"set data.text_normalize={other} (under it every character of the manifest is one the "
                "tokenizer has; evaluation scores under the same rule), or fix those rows"
            )
    if isinstance(cov.tokenizer, Tokenizer):
        return (
            "retrain the tokenizer on text with these characters (`speechlm tokenizer train --manifest M`), "
            "or fix those rows (data.text_normalize=lower/clean/clean_lower do not remove them all)"
        )
    return (
        "fix those rows, or use a tokenizer that has these characters (no data.text_normalize rule removes "
        "them all)"
    )
