"""What the validator hands back: the levels, a `Finding`, `ValidationError` and the readable table."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Level = Literal["error", "warning"]
ERROR: Level = "error"
WARNING: Level = "warning"


@dataclass(frozen=True)
class Finding:
    level: Level
    rule_id: str
    reason: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return {"level": self.level, "rule_id": self.rule_id, "reason": self.reason, "fix": self.fix}


class ValidationError(RuntimeError):
    """The layout cannot run; `findings` holds every finding (errors and warnings)."""

    def __init__(self, message: str, findings: Sequence[Finding], report: str = ""):
        super().__init__(message)
        self.findings = list(findings)
        self.report = report or message


def format_findings(findings: Sequence[Finding], width: int = 100) -> str:
    """A readable table: level and rule id, then the reason and the fix wrapped underneath."""
    lines = []
    for f in findings:
        lines.append(f"{f.level.upper():<8} {f.rule_id}")
        for label, text in (("reason", f.reason), ("fix", f.fix)):
            lines.extend(
                textwrap.wrap(
                    text,
                    width=width,
                    initial_indent=f"         {label + ':':<8}",
                    subsequent_indent=" " * 17,
                    break_on_hyphens=False,
                )
            )
    return "\n".join(lines)
