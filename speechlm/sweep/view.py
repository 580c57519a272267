"""`speechlm sweep status` and `speechlm sweep report`: what every job is doing and how well it does.

Progress comes from each run's own `metrics.jsonl` (lines of `kind` "train" carry the optimizer `step`,
lines of `kind` "val" the validation `wer`) and, once a run has finished, its `eval.json` (the final
evaluation's `wer` on the val split, after `steps` steps), so the status needs nothing from the running jobs.
A job's score is its final WER where it has one, else its best validation WER.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from speechlm.sweep.spec import read_matrix
from speechlm.sweep.store import StatusStore, mark_stale


def read_progress(metrics_path: Path) -> dict[str, Any]:
    """Last optimizer step, latest and best validation WER, and the final WER of `eval.json` next to
    `metrics_path` (None where there is none yet)."""
    out: dict[str, Any] = {"step": None, "wer": None, "best_wer": None, "best_step": None}
    out.update(read_final(metrics_path.parent / "eval.json"))
    try:
        lines = metrics_path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        if m.get("kind") == "train" and isinstance(m.get("step"), int):
            out["step"] = m["step"]
        elif m.get("kind") == "val" and m.get("wer") is not None:
            out["wer"] = float(m["wer"])
            if out["best_wer"] is None or out["wer"] < out["best_wer"]:
                out["best_wer"], out["best_step"] = out["wer"], m.get("step")
    return out


def read_final(eval_path: Path) -> dict[str, Any]:
    """`final_wer` and `final_step` of a finished run's `eval.json` (its top-level record is the val
    split's; docs/training.md), None without one. A file that is not JSON (being written, or damaged)
    counts as absent here: `sweep status` must not stop on one job's file."""
    out: dict[str, Any] = {"final_wer": None, "final_step": None}
    try:
        record = json.loads(eval_path.read_text())
    except (OSError, ValueError):
        return out
    if isinstance(record, dict) and isinstance(record.get("wer"), (int, float)):
        out["final_wer"], out["final_step"] = float(record["wer"]), record.get("steps")
    return out


def score(row: dict[str, Any]) -> float | None:
    """What a job is ranked by: its final WER (eval.json) where it has one, else its best validation WER."""
    return row["final_wer"] if row.get("final_wer") is not None else row.get("best_wer")


def collect_status(sweep_dir: Path, *, stale_after: float | None = None) -> list[dict[str, Any]]:
    """One record per job: id, state, host, slots, step, wer, best_wer, elapsed_s, log, axes.

    With `stale_after`, running jobs of dispatchers that stopped are first marked stale (under the lock)."""
    store = StatusStore(sweep_dir)
    if stale_after is not None:
        with store.locked() as state:
            mark_stale(state, now=time.time(), timeout=stale_after, host=socket.gethostname())
    status = store.read()
    rows = []
    now = time.time()
    for job in read_matrix(sweep_dir)["jobs"]:
        st = status["jobs"].get(job["id"], {"state": "queued"})
        started, ended = st.get("started"), st.get("ended")
        elapsed = None
        if started:
            elapsed = (now if st["state"] == "running" else (ended or now)) - started
        rows.append(
            {
                "id": job["id"],
                "state": st["state"],
                "host": st.get("host"),
                "slots": st.get("slots"),
                "pid": st.get("pid"),
                "exit_code": st.get("exit_code"),
                "attempts": st.get("attempts", 0),
                "elapsed_s": round(elapsed, 1) if elapsed is not None else None,
                "log": str(sweep_dir / job["log"]),
                "axes": job.get("axes", {}),
                **read_progress(sweep_dir / job["run_dir"] / "metrics.jsonl"),
            }
        )
    return rows


def pct(x: Any) -> str:
    """A WER as a percentage with one decimal, "-" for none."""
    return f"{100 * x:.1f}%" if x is not None else "-"


def format_status(rows: list[dict[str, Any]]) -> str:
    def dur(s: Any) -> str:
        if s is None:
            return "-"
        m, sec = divmod(int(s), 60)
        h, m = divmod(m, 60)
        return f"{h}:{m:02d}:{sec:02d}"

    header = ("job", "state", "host/slots", "step", "WER", "best WER", "final WER", "elapsed")
    table = [header]
    for r in rows:
        where = f"{r['host']}/{','.join(r['slots'])}" if r["host"] and r["slots"] else "-"
        step = str(r["step"]) if r["step"] is not None else "-"
        table.append(
            (
                r["id"],
                r["state"],
                where,
                step,
                pct(r["wer"]),
                pct(r["best_wer"]),
                pct(r["final_wer"]),
                dur(r["elapsed_s"]),
            )  # fmt: skip
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" ({len(rows)} jobs)")
    failed = [r for r in rows if r["state"] == "failed"]
    for r in failed:
        lines.append(f"failed: {r['id']} (exit {r['exit_code']}), log {r['log']}")
    return "\n".join(lines)


def format_report(rows: list[dict[str, Any]]) -> str:
    """One line per scored job, best first: its final WER and its best validation WER; then the jobs
    with no WER yet, by state."""

    scored = sorted((r for r in rows if score(r) is not None), key=lambda r: (score(r), r["id"]))
    lines = []
    for r in scored:
        final = (
            f"final WER {pct(r['final_wer'])} at step {r['final_step']}" if r["final_wer"] is not None else ""
        )
        best = (
            f"best validation WER {pct(r['best_wer'])} at step {r['best_step']}"
            if r["best_wer"] is not None
            else ""
        )
        lines.append(f"{r['id']}: {'; '.join(p for p in (final, best) if p)}")
    if not scored:
        lines.append(
            "no job has a WER yet: neither a validation line in metrics.jsonl (trainer.val_every) nor a "
            "finished run's eval.json"
        )
    unscored = [r for r in rows if score(r) is None]
    if unscored and scored:
        waiting = ", ".join(f"{r['id']} ({r['state']})" for r in unscored)
        lines.append(f"no WER yet: {waiting}")
    return "\n".join(lines)


def plot_report(rows: list[dict[str, Any]], out: Path) -> Path:
    """Each job's score (`score`: final WER, else best validation WER), and per value of every grid axis
    the best job with that value."""
    import matplotlib  # lazy: matplotlib (slow to import; only `sweep report --plot`)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above, after the Agg backend is chosen

    scores = {r["id"]: s for r in rows if (s := score(r)) is not None}
    scored = [r for r in rows if r["id"] in scores]
    if not scored:
        raise ValueError(
            "no job has a WER yet (no metrics.jsonl line of kind 'val' and no eval.json); nothing to plot"
        )
    axes_keys = sorted({k for r in rows for k in r["axes"]})
    fig, axs = plt.subplots(1, 1 + len(axes_keys), figsize=(5 + 4 * len(axes_keys), 4), squeeze=False)
    ax = axs[0][0]
    ax.barh([r["id"] for r in scored], [100 * scores[r["id"]] for r in scored])
    ax.set_xlabel("WER (%): final, else best validation")
    ax.set_title("per job")
    for i, key in enumerate(axes_keys, start=1):
        best: dict[str, float] = {}
        for r in scored:
            if key in r["axes"]:
                v = json.dumps(r["axes"][key])
                best[v] = min(best.get(v, float("inf")), scores[r["id"]])
        a = axs[0][i]
        a.bar(list(best), [100 * w for w in best.values()])
        a.set_xlabel(key)
        a.set_ylabel("best WER (%)")
        a.set_title(f"best over the other axes: {key}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
