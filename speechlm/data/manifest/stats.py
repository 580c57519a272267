"""Manifest statistics: hours, utterances and a duration histogram per language and in total
(`manifest_stats`), rendered as text (`format_stats`) or saved as a PNG (`plot_stats`).

A table read from Lhotse cuts carries, under `COVERAGE_KEY` in its schema metadata, how many of the
cuts' seconds no supervision covers (`speechlm.data.lhotse_span.Coverage`); the statistics report it as
``lhotse_coverage``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import pyarrow as pa

from speechlm.data.manifest.checks import check_durations
from speechlm.data.manifest.load import manifest_arrays, task_codes
from speechlm.data.manifest.report import _format_table
from speechlm.data.manifest.schema import row_contents
from speechlm.data.sampler.cost import CHARS_PER_TOKEN

COVERAGE_KEY = b"speechlm.lhotse_coverage"


def _count_bins(longest: float, width: float) -> int:
    """Bins of `width` from 0 s such that `longest` falls inside the last one (not on its top edge)."""
    return int(np.floor(longest / width + 1e-9)) + 1


def manifest_stats(
    table: pa.Table, *, bin_width: float | None = None, where: str = "manifest"
) -> dict[str, Any]:
    """Hours and utterances per language and in total, and a duration histogram per language; per task
    (``tasks``, only for a manifest with a ``task`` column) utterances, hours and their shares; for a
    table read from Lhotse cuts, ``lhotse_coverage`` (the seconds no supervision covers, see the module).

    The histogram bins start at 0 s; `bin_width` defaults to the smallest of 0.1, 0.25, 0.5, 1, 2, 5,
    10 s that needs at most 40 bins. A duration that is NaN, Inf or <= 0 is a ManifestError naming
    the row of `where` (such hours would be meaningless).
    """
    check_durations(table, where)
    arr = manifest_arrays(table)
    d = arr.durations.astype(np.float64)
    if bin_width is None:
        longest = float(d.max(initial=0.0))
        bin_width = next((w for w in (0.1, 0.25, 0.5, 1.0, 2.0, 5.0) if _count_bins(longest, w) <= 40), 10.0)
    edges = np.round(np.arange(_count_bins(float(d.max(initial=0.0)), bin_width) + 1) * bin_width, 6)
    languages: dict[str, Any] = {}
    for code, name in enumerate(arr.lang_names):
        dl = d[arr.lang_codes == code]
        languages[name] = {
            "utterances": int(dl.size),
            "hours": round(float(dl.sum()) / 3600.0, 4),
            "mean_duration_s": round(float(dl.mean()), 3) if dl.size else 0.0,
            "min_duration_s": round(float(dl.min()), 3) if dl.size else 0.0,
            "max_duration_s": round(float(dl.max()), 3) if dl.size else 0.0,
            "histogram": np.histogram(dl, bins=edges)[0].tolist(),
        }
    tasks = task_codes(table)
    by_task: dict[str, Any] = {}
    codes, names = tasks if tasks is not None else (None, [])
    contents = row_contents(table) if tasks is not None else None
    for code, name in enumerate(names):
        rows = codes == code
        dt = d[rows]
        assert contents is not None
        answer_chars = int(contents.answer_chars[rows].sum(dtype=np.int64))
        by_task[name] = {
            "utterances": int(dt.size),
            "samples": int(dt.size),
            "clips": int(contents.clips[rows].sum(dtype=np.int64)),
            "clips_with_transcript": int(contents.ctc_clips[rows].sum(dtype=np.int64)),
            "answer_tokens_est": math.ceil(answer_chars / CHARS_PER_TOKEN),
            "hours": round(float(dt.sum()) / 3600.0, 4),
            "utterance_share": round(dt.size / max(d.size, 1), 4),
            "hours_share": round(float(dt.sum()) / max(float(d.sum()), 1e-12), 4),
        }
    coverage = (table.schema.metadata or {}).get(COVERAGE_KEY)
    return {
        "utterances": int(d.size),
        "hours": round(float(d.sum()) / 3600.0, 4),
        "mean_duration_s": round(float(d.mean()), 3) if d.size else 0.0,
        "languages": languages,
        **({"tasks": by_task} if by_task else {}),
        **({"lhotse_coverage": json.loads(coverage)} if coverage else {}),
        "histogram": {"bin_edges_s": edges.tolist(), "counts": np.histogram(d, bins=edges)[0].tolist()},
    }


def format_stats(stats: dict[str, Any]) -> str:
    """`manifest_stats` as a table plus a text histogram."""
    rows = [
        [
            name,
            s["utterances"],
            f"{s['hours']:.2f}",
            f"{s['mean_duration_s']:.2f}",
            f"{s['min_duration_s']:.2f}",
            f"{s['max_duration_s']:.2f}",
        ]
        for name, s in stats["languages"].items()
    ]
    rows.append(
        ["total", stats["utterances"], f"{stats['hours']:.2f}", f"{stats['mean_duration_s']:.2f}", "", ""]
    )
    lines = _format_table(["lang", "utterances", "hours", "mean s", "min s", "max s"], rows)
    if stats.get("tasks"):  # a manifest with a task column (issue 23): the share of each task
        task_rows = [
            [
                name,
                t["samples"],
                f"{100 * t['utterance_share']:.1f}%",
                f"{t['hours']:.2f}",
                f"{100 * t['hours_share']:.1f}%",
                t["clips"],
                t["clips_with_transcript"],
                t["answer_tokens_est"],
            ]
            for name, t in stats["tasks"].items()
        ]
        head = [
            "task",
            "samples",
            "share",
            "hours",
            "hours share",
            "clips",
            "with transcript",
            "answer tokens~",
        ]
        lines += ["", *_format_table(head, task_rows)]
        lines.append(
            "  (with transcript: clips with a CTC target; answer tokens~: answer characters / "
            f"{CHARS_PER_TOKEN:g}, the sampler's estimate)"
        )
    if stats.get("lhotse_coverage"):
        lines += ["", _format_coverage(stats["lhotse_coverage"])]
    edges, counts = stats["histogram"]["bin_edges_s"], stats["histogram"]["counts"]
    peak = max(counts, default=0) or 1
    first = next((i for i, c in enumerate(counts) if c), 0)  # leading empty bins are not printed
    lines += ["", "  duration histogram (s):"]
    for lo, hi, c in zip(edges[first:-1], edges[first + 1 :], counts[first:]):
        lines.append(f"  {lo:6.2f}-{hi:<6.2f} {c:>9}  {'#' * round(40 * c / peak)}".rstrip())
    return "\n".join(lines)


def _format_coverage(c: dict[str, Any]) -> str:
    """The Lhotse coverage line: seconds of the cuts not covered by a supervision, left out or kept."""
    uncovered = c["left_out_s"] + c["between_supervisions_s"]
    return (
        f"  Lhotse cuts: {c['cut_s']:.2f} s in {c['cuts']} cuts, {uncovered:.2f} s not covered by a "
        f"supervision: {c['trimmed_cuts']} cuts train on their supervised span only "
        f"({c['left_out_s']:.2f} s left out), {c['between_supervisions_s']:.2f} s between supervisions kept"
    )


def plot_stats(stats: dict[str, Any], path: str | os.PathLike[str], fmt: str | None = None) -> None:
    """Save a PNG (or `fmt`, e.g. "svg"; None: from `path`'s suffix): hours per language (bars) and the
    duration histogram stacked by language."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib is slow to import
    from matplotlib.figure import Figure  # lazy: as above

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_hours, ax_hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    names = list(stats["languages"])
    hours = [stats["languages"][n]["hours"] for n in names]
    bars = ax_hours.bar(names, hours, color="#4c72b0")
    for bar, name in zip(bars, names):
        ax_hours.annotate(
            f"{stats['languages'][name]['utterances']}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_hours.set_title(f"hours per language ({stats['hours']:.2f} h, {stats['utterances']} utt.)")
    ax_hours.set_ylabel("hours")
    edges = np.asarray(stats["histogram"]["bin_edges_s"])
    bottom = np.zeros(max(edges.size - 1, 0))
    for name in names:
        counts = np.asarray(stats["languages"][name]["histogram"], dtype=float)
        ax_hist.bar(edges[:-1], counts, width=np.diff(edges), bottom=bottom, align="edge", label=name)
        bottom += counts
    ax_hist.set_title("duration histogram")
    ax_hist.set_xlabel("seconds")
    ax_hist.set_ylabel("utterances")
    if names:
        ax_hist.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110, format=fmt)
