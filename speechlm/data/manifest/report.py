"""`BuildReport`: what `build_manifest` kept and dropped, per language and per reason in
`DROP_REASONS` order, as JSON and as plain-text tables (`_format_table`, also used by `format_stats`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DROP_REASONS = (
    "no_audio_index",
    "missing_language",
    "other_language",  # `manifest build --lang`: a language not asked for
    "invalid_duration",
    "too_short",
    "too_long",
    "low_quality",
    "empty_text",
    "empty_after_cleaning",
    "tag_mismatch",
    "duplicate",
)
UNKNOWN_LANG = "?"  # report key for rows whose language could not be determined


@dataclass
class BuildReport:
    """What `build_manifest` kept and dropped, per language; `format()` renders it as tables."""

    shards_dir: str
    out_dir: str
    settings: dict[str, float | int | list[str]] = field(default_factory=dict)
    shards_read: int = 0
    rows_read: int = 0
    kept: dict[str, dict[str, int]] = field(default_factory=dict)  # lang -> {"train": n, "val": n}
    kept_hours: dict[str, float] = field(default_factory=dict)  # lang -> hours, train + val
    # lang -> {"column": {"train": n, "val": n}, "hash": {...}}: placed by metadata's `split` or the hash
    split_source: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)  # reason -> lang -> n
    failed_shards: dict[str, str] = field(default_factory=dict)  # shard path -> error message
    elapsed_s: float = 0.0

    @property
    def total_kept(self) -> int:
        return sum(c["train"] + c["val"] for c in self.kept.values())

    @property
    def total_dropped(self) -> int:
        return sum(sum(per_lang.values()) for per_lang in self.dropped.values())

    def dropped_count(self, reason: str, lang: str | None = None) -> int:
        """Rows dropped for `reason` (one of `DROP_REASONS`), in `lang` or in all languages."""
        per_lang = self.dropped.get(reason, {})
        return sum(per_lang.values()) if lang is None else per_lang.get(lang, 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total_kept": self.total_kept, "total_dropped": self.total_dropped}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")

    def _placed(self, lang: str) -> list[int]:
        """[rows of `lang` placed by the metadata's split column, rows placed by the hash]."""
        source = self.split_source.get(lang, {})
        return [sum(source.get(how, {}).values()) for how in ("column", "hash")]

    def format(self) -> str:
        """Readable summary: totals, kept per language, dropped per reason and language, failures."""
        train = sum(c["train"] for c in self.kept.values())
        val = sum(c["val"] for c in self.kept.values())
        lines = [
            f"manifest build: {self.shards_dir} -> {self.out_dir}",
            f"  shards read {self.shards_read}, failed {len(self.failed_shards)}; rows read {self.rows_read}, "
            f"kept {self.total_kept} (train {train}, val {val}), dropped {self.total_dropped}; "
            f"{self.elapsed_s:.1f} s",
            "  settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
            "",
        ]
        rows = [
            [lang, c["train"], c["val"], f"{self.kept_hours.get(lang, 0.0):.2f}", *self._placed(lang)]
            for lang, c in self.kept.items()
        ]
        totals = [sum(col) for col in zip(*(self._placed(lang) for lang in self.kept))] or [0, 0]
        rows.append(["total", train, val, f"{sum(self.kept_hours.values()):.2f}", *totals])
        lines += _format_table(["kept", "train", "val", "hours", "by column", "by hash"], rows) + [""]
        langs = sorted({lang for per_lang in self.dropped.values() for lang in per_lang})
        drop_rows = [
            [
                reason,
                *(self.dropped.get(reason, {}).get(lang, 0) for lang in langs),
                self.dropped_count(reason),
            ]
            for reason in DROP_REASONS
        ]
        drop_rows.append(
            [
                "total",
                *(sum(self.dropped.get(r, {}).get(lang, 0) for r in DROP_REASONS) for lang in langs),
                self.total_dropped,
            ]
        )
        lines += _format_table(["dropped", *langs, "total"], drop_rows)
        if self.failed_shards:
            lines += ["", f"failed shards ({len(self.failed_shards)}, skipped):"]
            lines += [f"  {path}: {msg}" for path, msg in self.failed_shards.items()]
        return "\n".join(lines)


def _format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-align the first column, right-align the others."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = []
    for row in cells:
        first = row[0].ljust(widths[0])
        out.append(("  " + "  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))])).rstrip())
    return out
