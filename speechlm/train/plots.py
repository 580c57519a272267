"""Learning-curve plot from `metrics.jsonl` (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_learning_curve(metrics_path: Path, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train: list[dict] = []
    val: list[dict] = []
    lines = Path(metrics_path).read_text().splitlines() if Path(metrics_path).is_file() else []
    for line in filter(str.strip, lines):  # an evaluation-only run into a new run dir has no history
        rec = json.loads(line)
        (val if rec.get("kind") == "val" else train).append(rec)
    fig, ax = plt.subplots(1, 2 if val else 1, figsize=(11 if val else 6, 4), squeeze=False)
    ax[0][0].plot([r["step"] for r in train], [r["loss"] for r in train], label="loss")
    if any(r.get("ce") is not None for r in train):
        ax[0][0].plot([r["step"] for r in train], [r["ce"] for r in train], label="text CE", alpha=0.7)
    ax[0][0].set_xlabel("optimizer step")
    ax[0][0].set_yscale("log")
    ax[0][0].set_title("training loss")
    ax[0][0].legend()
    if val:
        keys = sorted({k for r in val for k in r if k.startswith("wer")})
        for k in keys:
            ax[0][1].plot([r["step"] for r in val], [100 * r[k] for r in val], marker="o", label=k)
        ax[0][1].set_xlabel("optimizer step")
        ax[0][1].set_ylabel("WER %")
        ax[0][1].set_title("greedy WER")
        ax[0][1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
