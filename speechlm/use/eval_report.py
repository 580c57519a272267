"""What an evaluation reports (training's validation and final evaluation, and `speechlm evaluate`): the
metrics table per task and language (`format_eval_table`), the val and training split side by side
(`format_side_by_side`), the counts eval.json records (`count_record`), and eval.json /
eval_decodes.jsonl themselves (`write_eval_outputs`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from speechlm.config import TRAIN_PREFIX
from speechlm.data.drops import drop_reasons
from speechlm.errors import OutputError
from speechlm.metrics import DEFAULT_TASK, METRICS, PERCENT_METRICS, aggregate, split_metric_name

RELIANCE = "audio_reliance"  # the audio reliance's key stem (`reliance_scores`)
LLM_ALONE = "llm_"  # the prefix of a metric decoded by the LLM alone (`llm_alone_scores`)


def wer_from_counts(rows: Iterable[tuple[str, int, int]]) -> dict[str, float]:
    """Corpus WER overall (`wer`) and per language (`wer_<lang>`) from (lang, errors, words) rows of ASR
    utterances (a row with no reference words is not scored)."""
    scored = ((DEFAULT_TASK, lang, {"wer": (e, n)}) for lang, e, n in rows if n > 0)
    return {k: v for k, v in aggregate(scored).items() if "/" not in k}


def reliance_scores(ce: dict[tuple[str, str], float], tokens: dict[tuple[str, str], int]) -> dict[str, float]:
    """`audio_reliance` and `audio_reliance_<lang>` (every task), `<task>/audio_reliance` and
    `<task>/audio_reliance_<lang>`: nats per labelled token, from the summed CE differences and token counts
    per (task, lang); absent where no token was counted (no batch of two clips or more)."""
    groups: dict[str, list[float]] = {}
    for (task, lang), n in tokens.items():
        for key in (RELIANCE, f"{RELIANCE}_{lang}", f"{task}/{RELIANCE}", f"{task}/{RELIANCE}_{lang}"):
            acc = groups.setdefault(key, [0.0, 0])
            acc[0] += ce.get((task, lang), 0.0)
            acc[1] += n
    return {key: d / n for key, (d, n) in sorted(groups.items()) if n > 0}


def llm_alone_scores(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The ASR metrics of the LLM-alone decodes, each key with its metric prefixed `llm_`: `llm_wer`,
    `llm_wer_<lang>`, `asr/llm_wer`, `asr/llm_wer_<lang>` (`asr/llm_cer_<lang>` for a CER language)."""
    scores = aggregate((r["task"], r["lang"], r["stats"]) for r in rows if r["stats"])
    out = {}
    for key, value in scores.items():
        task, slash, name = key.rpartition("/")
        out[f"{task}{slash}{LLM_ALONE}{name}"] = value
    return out


def with_prefix(scores: dict[str, Any], prefix: str = TRAIN_PREFIX) -> dict[str, Any]:
    """The scores of the training split as a validation logs them: `train_wer`, `train_asr/wer_hi`, ..."""
    return {prefix + k: v for k, v in scores.items()}


def _cell(metric: str, value: float | None, width: int) -> str:
    if value is None:
        return "n/a".rjust(width)
    if metric == RELIANCE:  # nats per labelled token
        return f"{value:.2f}".rjust(width)
    text = f"{100 * value:5.1f}%" if metric in PERCENT_METRICS else f"{value:5.1f}"
    return text.rjust(width)


LABELS = {
    "wer": "WER",
    "cer": "CER",
    "bleu": "BLEU",
    "chrf": "chrF",
    "accuracy": "accuracy",
    RELIANCE: "reliance",
}


def format_eval_table(metrics: dict[str, Any], counts: dict[str, Any] | None = None) -> str:
    """The evaluation table: per task a block with one row per language, then `all`, one column per
    metric (WER/CER/accuracy in %, BLEU/chrF 0-100). An ASR-only run gets today's WER table, without a
    task heading. Where the metrics hold LLM-alone scores (`llm_alone_scores`: joint CTC/attention decoding
    on), the task's block gives each of its metrics twice, `LLM WER` (the LLM alone) then `joint WER`; with
    the audio reliance (`reliance_scores`), a last column `reliance` in nats per labelled token.
    `counts` is `Evaluator.last_counts` (scored and dropped utterances per task and language,
    drop reasons) or a plain {lang: utterances} mapping; `metrics` may hold only `wer`/`wer_<lang>`."""
    if counts is not None and "scored" not in counts:
        counts = {"scored": counts, "dropped": {}, "dropped_reasons": {}}
    by_task: dict[str, dict[str, dict[str, float]]] = {}  # task -> column -> lang ("" for all) -> value
    for key, value in metrics.items():
        task, _, name = key.rpartition("/")
        alone = name.startswith(LLM_ALONE)  # a column of the LLM-alone decodes (`llm_alone_scores`)
        metric, _, lang = name.removeprefix(LLM_ALONE).partition("_")
        if task and name.startswith(RELIANCE):  # the audio reliance (`reliance_scores`), after the metrics
            by_task.setdefault(task, {}).setdefault(RELIANCE, {})[name[len(RELIANCE) + 1 :]] = value
        elif metric in METRICS and (task or (metric == "wer" and not any("/" in k for k in metrics))):
            column = LLM_ALONE + metric if alone else metric
            by_task.setdefault(task or DEFAULT_TASK, {}).setdefault(column, {})[lang] = value
    blocks = []
    for task in sorted(by_task, key=lambda t: (t != DEFAULT_TASK, t)):
        per_task = counts is not None and "scored_by_task" in counts
        scored = dict(
            (counts["scored_by_task"].get(task, {}) if per_task else counts["scored"]) if counts else {}
        )
        dropped = dict(
            (counts["dropped_by_task"].get(task, {}) if per_task else counts["dropped"]) if counts else {}
        )
        names = [c for m in METRICS for c in (LLM_ALONE + m, m) if c in by_task[task]]
        if not names:  # a task with a reliance but no metric (its rows were not scored): no block
            continue
        names += [RELIANCE] if RELIANCE in by_task[task] else []
        joint = any(c.startswith(LLM_ALONE) for c in names)
        labels = [column_label(c, joint) for c in names]
        widths = [max(6, len(label)) for label in labels]
        langs = sorted(
            {lang for m in names for lang in by_task[task][m] if lang} | {k for k, v in dropped.items() if v}
        )
        lines = [] if set(by_task) == {DEFAULT_TASK} else [f"task {task}:"]
        lines.append(
            "  ".join(
                ["language", "utterances", *(label.ljust(w) for label, w in zip(labels, widths))]
            ).rstrip()
        )
        lines.append("  ".join(["-" * 8, "-" * 10, *("-" * w for w in widths)]))
        for lang in [*langs, ""]:
            values = [by_task[task][m].get(lang) for m in names]
            if not lang and all(v is None for v in values):
                continue
            n = "" if counts is None else str(sum(scored.values()) if not lang else scored.get(lang, 0))
            cells = [_cell(m.removeprefix(LLM_ALONE), v, w) for m, v, w in zip(names, values, widths)]
            note = f"  ({dropped[lang]} dropped)" if lang and dropped.get(lang) else ""
            lines.append(f"{lang or 'all':<8}  {n:>10}  " + "  ".join(cells) + note)
        blocks.append("\n".join(lines))
    out = "\n\n".join(blocks)
    n_dropped = int(sum(int(v) for v in counts["dropped"].values())) if counts is not None else 0
    if counts is not None and n_dropped:
        out += f"\ndropped (not scored): {n_dropped} utterances ({drop_reasons(counts['dropped_reasons'])})"
    return out


def column_label(column: str, joint: bool) -> str:
    """A table column's heading: `WER`; beside an LLM-alone column (``joint``), `LLM WER` and `joint WER`."""
    label = LABELS[column.removeprefix(LLM_ALONE)]
    if column.startswith(LLM_ALONE):
        return f"LLM {label}"
    return f"joint {label}" if joint and column in METRICS else label


format_wer_table = format_eval_table  # its name before the metrics per task


def sum_over_tasks(by_task: dict[str, dict[str, int]]) -> dict[str, int]:
    """{task: {lang: n}} -> {lang: n}."""
    out: dict[str, int] = {}
    for per_lang in by_task.values():
        for lang, n in per_lang.items():
            out[lang] = out.get(lang, 0) + n
    return out


def with_totals(per_lang: dict[str, int]) -> dict[str, int]:
    """{lang: n} and "all": their sum (eval.json's utterance counts)."""
    return {**per_lang, "all": sum(per_lang.values())}


def count_record(counts: dict[str, Any]) -> dict[str, Any]:
    """The utterance counts of eval.json and `speechlm evaluate --json`: per language (and all), per task."""
    tasks = sorted(set(counts["scored_by_task"]) | set(counts["dropped_by_task"]))
    record: dict[str, Any] = {
        "utterances": with_totals(counts["scored"]),
        "dropped": with_totals(counts["dropped"]),
        "dropped_reasons": counts["dropped_reasons"],
        "tasks": {
            t: {
                "utterances": with_totals(counts["scored_by_task"].get(t, {})),
                "dropped": with_totals(counts["dropped_by_task"].get(t, {})),
            }
            for t in tasks
        },
    }
    if counts.get("empty_reference"):
        record["empty_reference"] = counts["empty_reference"]
    return record


def format_side_by_side(val: dict[str, Any], train: dict[str, Any]) -> str:
    """One line per language (then `all`) with the val and training-split score of each per-language metric:
    `hi  val 12.3%  train 4.1%` for WER; `hi  ast/bleu  val 20.1  train 35.2` for another task's metric."""
    lines = []
    for overall in (False, True):
        for key in val:
            name = split_metric_name(key)
            if name is None or key.startswith("asr/wer") or (name[2] is None) != overall:
                continue  # not a metric; asr/wer* repeat wer*; per-language lines first, then the overall
            task, metric, lang = name
            what = "" if task is None else f"  {task}/{metric}"
            cells = [
                f"{s} {_cell(metric, d.get(key), 0).strip()}" for s, d in (("val", val), ("train", train))
            ]
            lines.append(f"{lang or 'all':<8}{what}  " + "  ".join(cells))
    return "\n".join(lines)


def write_eval_outputs(
    run_dir: Path,
    record: dict[str, Any],
    decodes: list[tuple[str, str, str]],
    tasks: list[str] | None = None,
    *,
    splits: list[str] | None = None,
) -> None:
    """eval.json and eval_decodes.jsonl (with `splits`, each decode names its `split`); a path that cannot
    be written (full disk, a folder in the way, no permission) is an OutputError naming it (the weights are
    in the end-of-training checkpoint)."""
    path = run_dir / "eval.json"
    try:
        path.write_text(json.dumps(record, indent=2))
        path = run_dir / "eval_decodes.jsonl"
        with path.open("w") as f:
            for i, (lang, ref, hyp) in enumerate(decodes):
                task = tasks[i] if tasks else DEFAULT_TASK
                row = {"task": task, "lang": lang, "ref": ref, "hyp": hyp}
                if splits:
                    row = {"split": splits[i], **row}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    except OSError as e:
        raise OutputError(
            f"cannot write {path} ({e.strerror or e}); the trained weights are in {run_dir / 'checkpoints'} "
            f"(latest): free space or fix the path, then evaluate with trainer.resume=auto "
            f"trainer.validate_only=true"
        ) from None
