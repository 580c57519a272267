"""What a Lhotse cut trains on: its supervised span, and how much of the cut no supervision covers.

A Lhotse cut may hold more audio than its supervisions describe (a 10.51 s cut whose one supervision
covers 4.65 s of it; AMI-style cuts with several utterances and silence between them). Training on
the whole cut would teach the model that the silence or the unlabelled speech around the words
transcribes to nothing, so the rule is **train on the supervised span**:

- the clip is the extent of the cut's supervisions, from the earliest start to the latest end
  (`SupervisedSpan.start` / `end`, seconds into the cut); a span within `SUPERVISION_TOLERANCE_S`
  of the cut's edges is the whole cut (supervision times are often rounded to 10 ms);
- its text is the supervisions' texts in time order (by start, then end), each without its leading
  ``<|xx|>`` tag, joined by one space; the seconds between supervisions stay in the clip (they are
  counted, `between_supervisions_s`);
- its language is the supervisions' one language (a name becomes a code, `speechlm.data.lang_names`);
  supervisions in two languages are refused, as are overlapping supervisions (one transcript cannot
  be written for two voices at once), a supervision that reaches outside its cut (its text would
  hold words the clip lacks) and one without a positive, finite duration. Each error names the cut,
  the supervisions and the fix (usually ``cuts.trim_to_supervisions()``).

`Coverage` sums, over the cuts of one source, the seconds the cuts hold, the seconds trained and the
seconds no supervision covers (left out around the span, or kept between supervisions); the readers
log it when a cut is trimmed and attach it to the table they return, where `speechlm manifest stats`
reads it (`COVERAGE_KEY` in the schema metadata).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from speechlm.data.lang_names import checked_language_code
from speechlm.data.manifest import ManifestError
from speechlm.data.manifest.stats import COVERAGE_KEY
from speechlm.data.text import split_lang_tag

logger = logging.getLogger(__name__)

SUPERVISION_TOLERANCE_S = 0.01  # rounding of supervision times in recipes; see the module docstring


@dataclass(frozen=True)
class SupervisedSpan:
    """The part of a cut its supervisions cover, their joined text, tags and language (module docstring)."""

    start: float  # seconds into the cut
    end: float
    text: str  # the supervisions' texts in time order, tags removed, joined by one space
    tags: tuple[str, ...]  # the leading <|xx|> tags the texts carried
    lang: str | None  # the supervisions' language code; None when none of them names one
    covered_s: float  # seconds under at least one supervision

    @property
    def duration(self) -> float:
        return self.end - self.start


def _sup_where(sup: Any) -> str:
    return f"{sup.id!r} ({float(sup.start):.3f}-{float(sup.start) + float(sup.duration):.3f} s)"


def supervised_span(cut: Any, where: str) -> SupervisedSpan:
    """The supervised span of `cut` (at least one supervision), or ManifestError naming `where`."""
    length = float(cut.duration)
    tol = SUPERVISION_TOLERANCE_S
    sups = sorted(cut.supervisions, key=lambda s: (float(s.start), float(s.start) + float(s.duration)))
    texts: list[str] = []
    tags: list[str] = []
    langs: list[str] = []
    covered, reach, last = 0.0, -math.inf, None
    for sup in sups:
        s, d = float(sup.start), float(sup.duration)
        if not (math.isfinite(s) and math.isfinite(d) and d > 0):
            raise ManifestError(
                f"{where}: supervision {sup.id!r} has start {sup.start!r} and duration {sup.duration!r}; "
                "a supervision needs a finite start and a positive, finite duration: fix or remove it"
            )
        if s < -tol or s + d > length + tol:
            raise ManifestError(
                f"{where}: supervision {sup.id!r} spans {s:.3f}-{s + d:.3f} s but the cut is {length:.3f} s "
                "long: its text holds words the cut's audio lacks; make one cut per supervision "
                "(cuts.trim_to_supervisions()) or fix the supervision's start/duration"
            )
        if last is not None and s < reach - tol:
            raise ManifestError(
                f"{where}: supervisions {_sup_where(last)} and {_sup_where(sup)} overlap: one transcript "
                "cannot be written for overlapping speech; make one cut per supervision "
                "(cuts.trim_to_supervisions(keep_overlapping=False)) or remove one of them"
            )
        lo, hi = max(s, 0.0), min(s + d, length)
        covered += max(0.0, hi - max(lo, reach))
        if s + d > reach:
            reach, last = s + d, sup
        tag, text = split_lang_tag(sup.text or "")
        texts += [text.strip()] if text.strip() else []
        tags += [tag] if tag else []
        if sup.language:
            code = checked_language_code(sup.language, f"{where}: supervision {sup.id!r} has language")
            langs += [code] if code not in langs else []
    if len(langs) > 1:
        raise ManifestError(
            f"{where}: its supervisions are in {len(langs)} languages ({', '.join(map(repr, langs))}) but a "
            "clip has one; make one cut per supervision (cuts.trim_to_supervisions())"
        )
    start = max(float(sups[0].start), 0.0)
    end = min(reach, length)
    if start <= tol and end >= length - tol:
        start, end = 0.0, length
    return SupervisedSpan(start, end, " ".join(texts), tuple(tags), langs[0] if langs else None, covered)


@dataclass
class Coverage:
    """Seconds of the cuts of one source: held, trained on, and not covered by a supervision."""

    cuts: int = 0
    cut_s: float = 0.0  # the cuts' own durations
    trained_s: float = 0.0  # their supervised spans
    trimmed_cuts: int = 0  # cuts whose span is shorter than the cut
    left_out_s: float = 0.0  # uncovered seconds outside the spans: not trained on
    between_supervisions_s: float = 0.0  # uncovered seconds inside the spans: trained on, no words
    _where: list[str] = field(default_factory=list, repr=False)  # the first trimmed cuts, for the warning

    def add(self, cut_s: float, span: SupervisedSpan, where: str) -> None:
        self.cuts += 1
        self.cut_s += cut_s
        self.trained_s += span.duration
        self.left_out_s += cut_s - span.duration
        self.between_supervisions_s += max(0.0, span.duration - span.covered_s)
        if span.duration < cut_s:
            self.trimmed_cuts += 1
            if len(self._where) < 3:
                self._where.append(f"{where}: {span.start:.2f}-{span.end:.2f} s of {cut_s:.2f} s")

    def as_dict(self) -> dict[str, float | int]:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}

    def finish(self, table: pa.Table, source: str) -> pa.Table:
        """`table` with this coverage in its schema metadata; a warning naming `source` if a cut was trimmed."""
        if self.trimmed_cuts:
            logger.warning(
                "%s: %d of %d cuts have audio that no supervision covers; each trains on its supervised "
                "span only (docs/data.md, 'Lhotse cuts'): %.2f s of %.2f s left out, %.2f s between "
                "supervisions kept. First: %s",
                source, self.trimmed_cuts, self.cuts, self.left_out_s, self.cut_s,
                self.between_supervisions_s, "; ".join(self._where),
            )  # fmt: skip
        metadata = {**(table.schema.metadata or {}), COVERAGE_KEY: json.dumps(self.as_dict()).encode()}
        return table.replace_schema_metadata(metadata)
