"""Learning-curve plot from `metrics.jsonl` (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path

from speechlm.config import TRAIN_PREFIX
from speechlm.metrics import PERCENT_METRICS, split_metric_name
from speechlm.use.eval_report import LLM_ALONE, RELIANCE


def is_train_curve(key: str) -> bool:
    """A training-split curve (`train_wer`, `train_ast/bleu`): drawn dashed in its val curve's colour."""
    return key.startswith(TRAIN_PREFIX)


def validation_series(val: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The curves of the validation records, per panel: "greedy WER" (`wer`, `wer_<lang>`, in %, and with
    joint decoding the LLM alone's `llm_wer`), when other tasks were scored "other tasks" (each task's
    overall score: `ast/bleu`, `qa/accuracy` in %, ...), and "audio reliance" (`audio_reliance`, nats per
    token: docs/metrics.md).
    The training-split curves of `trainer.val_train_batches` (`train_wer`, `train_wer_<lang>`,
    `train_ast/bleu`, ...) go in the panel of the key they prefix (`is_train_curve`: drawn dashed).
    A record without a key (a language absent from a cut validation) leaves a gap, not an error."""
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in val:
        for k, v in r.items():
            base = k.removeprefix(TRAIN_PREFIX)
            name = split_metric_name(base)
            if base in (f"{LLM_ALONE}wer", RELIANCE) and v is not None:
                title = "greedy WER" if base != RELIANCE else "audio reliance"
                value = 100 * v if base != RELIANCE else v
                panels.setdefault(title, {}).setdefault(k, []).append((r["step"], value))
                continue
            if name is None or v is None:
                continue
            task, metric, lang = name
            if task is None:
                title = "greedy WER"
            elif lang is None and base != "asr/wer":
                title = "other tasks"
            else:
                continue
            value = 100 * v if metric in PERCENT_METRICS else v
            panels.setdefault(title, {}).setdefault(k, []).append((r["step"], value))
    titles = ("greedy WER", "other tasks", "audio reliance")
    return {t: dict(sorted(panels[t].items())) for t in titles if t in panels}


def plot_learning_curve(metrics_path: Path, out_png: Path) -> Path:
    import matplotlib  # lazy: matplotlib (optional, heavy)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib (optional, heavy)

    train: list[dict] = []
    val: list[dict] = []
    lines = Path(metrics_path).read_text().splitlines() if Path(metrics_path).is_file() else []
    for line in filter(str.strip, lines):  # an evaluation-only run into a new run dir has no history
        rec = json.loads(line)
        (val if rec.get("kind") == "val" else train).append(rec)
    series = validation_series(val)
    n = 1 + len(series)
    fig, ax = plt.subplots(1, n, figsize=(6 + 5 * (n - 1), 4), squeeze=False)
    ax[0][0].plot([r["step"] for r in train], [r["loss"] for r in train], label="loss")
    if any(r.get("ce") is not None for r in train):
        ax[0][0].plot([r["step"] for r in train], [r["ce"] for r in train], label="text CE", alpha=0.7)
    ax[0][0].set_xlabel("optimizer step")
    ax[0][0].set_yscale("log")
    ax[0][0].set_title("training loss")
    ax[0][0].legend()
    for panel, (title, curves) in zip(ax[0][1:], series.items()):
        colours: dict[str, str] = {}  # one colour per metric key, shared by its val and train curves
        for k in sorted(curves, key=is_train_curve):  # val first: it picks the colour
            points, base = curves[k], k.removeprefix(TRAIN_PREFIX)
            dashed = is_train_curve(k)
            line = panel.plot(
                [s for s, _ in points],
                [v for _, v in points],
                marker="x" if dashed else "o",
                linestyle="--" if dashed else "-",
                color=colours.get(base),
                label=f"{base} ({'train' if dashed else 'val'})",
            )[0]
            colours.setdefault(base, line.get_color())
        panel.set_xlabel("optimizer step")
        panel.set_ylabel({"greedy WER": "%", "audio reliance": "nats per token"}.get(title, "score"))
        panel.set_title(title)
        panel.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
