"""Metrics per task: WER/CER, BLEU/chrF, accuracy, each from per-utterance sufficient statistics.

Every decoded utterance is scored on its own into integer statistics (`score_utterance`); a corpus
score is computed from their sums (`corpus_score`). Sums of integers do not depend on the order or
on how the utterances were split over ranks, so a sharded evaluation gives exactly the single-rank
figures. The statistics per metric:

| metric | statistics of one utterance | corpus score |
| --- | --- | --- |
| wer | (S + D + I word errors, reference words), jiwer | errors / words (a fraction) |
| cer | (S + D + I character errors, reference characters), jiwer | errors / characters |
| bleu | sacrebleu's (hyp length, ref length, n-gram matches 1..4, n-gram totals 1..4) | sacrebleu BLEU, 0..100 |
| chrf | sacrebleu's (hyp, ref, match) character n-gram counts, orders 1..6 | sacrebleu chrF2, 0..100 |
| accuracy | (1 if hypothesis == reference else 0, 1) | correct / utterances (a fraction) |

BLEU and chrF use sacrebleu's own defaults (`corpus_bleu`: 13a tokenizer, exp smoothing; `corpus_chrf`:
chrF2), so a score here is the score sacrebleu gives the same hypotheses and references.

Text normalisation (`normalize_text`), per task, applied to reference and hypothesis alike before
scoring; the operations, always in this order: ``nfc`` or ``nfkc`` (Unicode normal form), ``lowercase``,
``strip_punct`` (delete every Unicode punctuation character, category P*), then whitespace is
collapsed (always: the decoded texts already are). An utterance whose normalised reference is empty
is not scored (counted as an empty reference).

Keys (`metric_key`): ``<task>/<metric>`` over all the task's utterances and ``<task>/<metric>_<lang>``
per language; ASR's word error rate also under today's names ``wer`` and ``wer_<lang>``. A language
listed in `cer_langs` (languages written without spaces between words) is scored with ``cer`` where
its task asks for ``wer`` (codes compared in lower case, as the data's language checks do: ``EN`` is
``en``). Which way is better: lower for wer, cer and loss, higher for bleu, chrf,
accuracy (`lower_is_better`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from speechlm.errors import UsageError

METRICS = ("wer", "cer", "bleu", "chrf", "accuracy")
LOWER_IS_BETTER = frozenset({"wer", "cer", "loss"})
PERCENT_METRICS = frozenset({"wer", "cer", "accuracy"})  # fractions, printed as percentages
NORMALIZE_OPS = ("nfc", "nfkc", "lowercase", "strip_punct")
DEFAULT_TASK = "asr"  # the task of a row that names none

# per-task defaults; `trainer.eval_metrics` / `trainer.eval_normalize` entries replace a task's entry
DEFAULT_METRICS: dict[str, tuple[str, ...]] = {
    "asr": ("wer",),
    "ast": ("bleu", "chrf"),
    "qa": ("accuracy",),
    "lid": ("accuracy",),
    "cls": ("accuracy",),
}
DEFAULT_NORMALIZE: dict[str, tuple[str, ...]] = {
    "asr": (),  # today's WER: the decoded texts as they are (tag stripped, spaces collapsed)
    "ast": (),  # sacrebleu tokenizes itself; BLEU is case- and punctuation-sensitive by convention
    "qa": ("lowercase", "strip_punct"),
    "lid": ("lowercase", "strip_punct"),
    "cls": ("lowercase", "strip_punct"),
}

_TASK = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_LANG = r"[a-z][a-z0-9_-]*"
_NAME = re.compile(rf"^(?:(?P<task>{_TASK})/)?(?P<metric>[a-z]+)(?:_(?P<lang>{_LANG}))?$")


def normalize_text(text: str, ops: Iterable[str]) -> str:
    """`text` under the operations `ops` (any subset of NORMALIZE_OPS, applied in that order), spaces collapsed."""
    ops = set(ops)
    unknown = ops - set(NORMALIZE_OPS)
    if unknown:
        raise ValueError(f"unknown normalisation {sorted(unknown)}; known: {', '.join(NORMALIZE_OPS)}")
    if "nfc" in ops:
        text = unicodedata.normalize("NFC", text)
    if "nfkc" in ops:
        text = unicodedata.normalize("NFKC", text)
    if "lowercase" in ops:
        text = text.lower()
    if "strip_punct" in ops:
        text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
    return " ".join(text.split())


# --- per-utterance statistics ---------------------------------------------------------------------


def word_error_counts(ref: str, hyp: str) -> tuple[int, int]:
    """(errors S + D + I, reference words) of one utterance; (0, 0) for an empty reference."""
    import jiwer  # lazy: only when scoring (config imports this module at CLI start-up)

    if not ref.strip():
        return 0, 0
    out = jiwer.process_words(ref, hyp if hyp.strip() else "<empty>")
    return int(out.substitutions + out.deletions + out.insertions), int(
        out.hits + out.substitutions + out.deletions
    )


def char_error_counts(ref: str, hyp: str) -> tuple[int, int]:
    """(character errors S + D + I, reference characters, spaces included, as jiwer.cer counts them)."""
    import jiwer  # lazy: only when scoring (config imports this module at CLI start-up)

    if not ref.strip():
        return 0, 0
    out = jiwer.process_characters(ref, hyp)
    return int(out.substitutions + out.deletions + out.insertions), int(
        out.hits + out.substitutions + out.deletions
    )


@cache
def _sacrebleu(metric: str) -> Any:
    from sacrebleu.metrics import BLEU, CHRF  # lazy: only when scoring translations

    return BLEU() if metric == "bleu" else CHRF()


def sentence_stats(metric: str, ref: str, hyp: str) -> list[int]:
    """The sufficient statistics of one (already normalised) utterance for `metric` (module doc)."""
    if metric == "wer":
        return list(word_error_counts(ref, hyp))
    if metric == "cer":
        return list(char_error_counts(ref, hyp))
    if metric == "accuracy":
        return [int(hyp == ref), 1]
    if metric in ("bleu", "chrf"):  # sacrebleu's segment statistics, exactly what corpus_score sums
        return [int(x) for x in _sacrebleu(metric)._extract_corpus_statistics([hyp], [[ref]])[0]]
    raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")


def corpus_score(metric: str, stats: Sequence[int]) -> float:
    """The corpus score of `metric` from its statistics summed over the utterances."""
    if metric in ("wer", "cer", "accuracy"):
        return stats[0] / stats[1] if stats[1] else 0.0
    if metric in ("bleu", "chrf"):
        return float(_sacrebleu(metric)._compute_score_from_stats(list(stats)).score)
    raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")


# --- what each task is scored with -----------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    """The metrics and the normalisation of each task, and the languages scored by character."""

    metrics: Mapping[str, tuple[str, ...]]
    normalize: Mapping[str, tuple[str, ...]]
    cer_langs: frozenset[str] = frozenset()

    @classmethod
    def build(
        cls,
        metrics: Mapping[str, Sequence[str]] | None = None,
        normalize: Mapping[str, Sequence[str]] | None = None,
        cer_langs: Iterable[str] = (),
    ) -> MetricSpec:
        """The defaults with the tasks named in `metrics` / `normalize` replaced."""
        m = {**DEFAULT_METRICS, **{t: tuple(v) for t, v in (metrics or {}).items()}}
        n = {**DEFAULT_NORMALIZE, **{t: tuple(v) for t, v in (normalize or {}).items()}}
        return cls(m, n, frozenset(str(x).strip().lower() for x in cer_langs))  # EN is en, as data-side

    @classmethod
    def from_config(cls, cfg: Any) -> MetricSpec:
        """From an ExperimentConfig's `trainer.eval_metrics`, `trainer.eval_normalize`, `trainer.eval_cer_langs`."""
        t = cfg.trainer
        return cls.build(t.eval_metrics, t.eval_normalize, t.eval_cer_langs)

    def check_task(self, task: str, where: str, how: str | None = None) -> None:
        """UsageError when `task` (found in `where`) has no metric; `how` says how to give it one (default:
        training's trainer.eval_metrics)."""
        if task not in self.metrics:
            how = how or (
                f"add it to trainer.eval_metrics, e.g. trainer.eval_metrics='{{{task}: [accuracy]}}'"
            )
            raise UsageError(
                f"{where} has rows of task {task!r}, which has no metric: {how} (metrics: {', '.join(METRICS)}; "
                f"tasks with a metric: {', '.join(sorted(self.metrics))})"
            )

    def row_metrics(self, task: str, lang: str) -> tuple[str, ...]:
        """The metrics an utterance of (task, lang) is scored with: its task's, wer -> cer in `cer_langs`."""
        self.check_task(task, "the evaluated split")
        names = self.metrics[task]
        if lang.strip().lower() in self.cer_langs:
            names = tuple(dict.fromkeys("cer" if m == "wer" else m for m in names))
        return names

    def score_utterance(self, task: str, lang: str, ref: str, hyp: str) -> dict[str, list[int]] | None:
        """{metric: statistics} of one utterance; None when its normalised reference is empty (not scored)."""
        ops = self.normalize.get(task, ())
        ref, hyp = normalize_text(ref, ops), normalize_text(hyp, ops)
        if not ref:
            return None
        return {m: sentence_stats(m, ref, hyp) for m in self.row_metrics(task, lang)}

    def metric_names(self, pairs: Iterable[tuple[str, str]]) -> list[str]:
        """Every key `aggregate` gives for utterances of these (task, lang) pairs, and `loss`."""
        keys = {"loss"}
        for task, lang in pairs:
            for m in self.row_metrics(task, lang):
                keys.update(metric_keys(task, m, lang))
        return sorted(keys)

    def check_best_metric(self, name: str, pairs: set[tuple[str, str]], where: str) -> None:
        """UsageError when `name` is not a key the validation of `where` (whose rows are `pairs`) produces."""
        produced = self.metric_names(pairs)
        if name not in produced:
            tasks = ", ".join(sorted({t for t, _ in pairs}))
            raise UsageError(
                f"trainer.best_metric={name!r} is not a metric the validation of {where} produces (tasks: "
                f"{tasks}); it produces: {', '.join(produced)}. Set trainer.best_metric to one of these"
            )


def metric_keys(task: str, metric: str, lang: str) -> tuple[str, ...]:
    """The keys an utterance of (task, lang) adds to for `metric`: overall and per language (+ legacy wer)."""
    legacy = ("wer", f"wer_{lang}") if task == "asr" and metric == "wer" else ()
    return (f"{task}/{metric}", f"{task}/{metric}_{lang}", *legacy)


def aggregate(rows: Iterable[tuple[str, str, Mapping[str, Sequence[int]]]]) -> dict[str, float]:
    """Corpus scores from (task, lang, {metric: statistics}) rows: every `metric_keys` key, sorted."""
    sums: dict[tuple[str, str], list[int]] = {}
    for task, lang, stats in rows:
        for metric, s in stats.items():
            for key in metric_keys(task, metric, lang):
                acc = sums.setdefault((key, metric), [0] * len(s))
                for i, v in enumerate(s):
                    acc[i] += int(v)
    return {key: corpus_score(metric, s) for (key, metric), s in sorted(sums.items())}


# --- metric names: form and direction ----------------------------------------------------------------


def check_metric_name(name: str) -> str | None:
    """None when `name` has the form of a validation metric (`loss`, `wer[_<lang>]`,
    `<task>/<metric>[_<lang>]`), else why not."""
    if name == "loss":
        return None
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        return "not of the form 'loss', 'wer[_<lang>]' or '<task>/<metric>[_<lang>]'"
    if m["metric"] not in METRICS:
        return f"{m['metric']!r} is not a metric ({', '.join(METRICS)})"
    if m["task"] is None and m["metric"] != "wer":
        return f"name the task: e.g. 'ast/{m['metric']}' (only 'wer' and 'loss' stand alone)"
    return None


def lower_is_better(name: str) -> bool:
    """True for loss, wer and cer names; False for bleu, chrf, accuracy."""
    m = _NAME.match(name)
    return name == "loss" or (m is not None and m["metric"] in LOWER_IS_BETTER)


def split_metric_name(name: str) -> tuple[str | None, str, str | None] | None:
    """`ast/bleu_hi` -> ("ast", "bleu", "hi"); `wer` -> (None, "wer", None); None for other keys."""
    m = _NAME.match(name)
    if m is None or m["metric"] not in METRICS:
        return None
    return m["task"], m["metric"], m["lang"]


def table_pairs(table: Any) -> set[tuple[str, str]]:
    """The (task, lang) pairs of a manifest table (no `task` column, or a null: the row is ASR)."""
    langs = [str(x) for x in table.column("lang").to_pylist()]
    if "task" not in table.column_names:
        return {(DEFAULT_TASK, lang) for lang in langs}
    tasks = table.column("task").to_pylist()
    return {(str(t) if t else DEFAULT_TASK, lang) for t, lang in zip(tasks, langs)}
