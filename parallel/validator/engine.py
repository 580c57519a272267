"""Running a rule table: `evaluate` a context, `validate` a config, `has_errors`, and `check_or_raise`.

The default table is `PARALLEL_RULES`; `speechlm.preflight.rules.RULES` adds the training rules and is
what `speechlm validate` and the trainer pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parallel.validator.context import ValidationContext, build_context
from parallel.validator.report import ERROR, Finding, ValidationError, format_findings
from parallel.validator.rules import PARALLEL_RULES, Rule


def evaluate(ctx: ValidationContext, rules: Sequence[Rule] = PARALLEL_RULES) -> list[Finding]:
    """Run every rule over the context; errors first, each level in table order."""
    findings = []
    for rule in rules:
        hit = rule.applies(ctx)
        if not hit:
            continue
        details = "; ".join(hit) if isinstance(hit, list) else (hit if isinstance(hit, str) else "")
        findings.append(rule.render(ctx, details))
    return sorted(findings, key=lambda f: f.level != ERROR)


def validate(
    config: Any,
    world_size: int,
    env: Mapping[str, str],
    device_capability: Any,
    installed: Mapping[str, str | None],
    *,
    manifest_summary: Mapping[str, Any] | None = None,
    rules: Sequence[Rule] = PARALLEL_RULES,
) -> list[Finding]:
    """Findings for running `config` on `world_size` processes; pure (nothing read from the machine).

    env: environment variables of the ranks; device_capability: (major, minor), 9.0, "12.0" or None
    (CPU); installed: distribution name -> version or None (torch, transformer-engine, flash-attn,
    cudnn); manifest_summary: optional {"n_rows", "max_duration", "max_tokens"} of the training manifest;
    rules: the table to run (default: the parallel rules only).
    """
    ctx = build_context(config, world_size, env, device_capability, installed, manifest_summary)
    return evaluate(ctx, rules)


def has_errors(findings: Sequence[Finding]) -> bool:
    return any(f.level == ERROR for f in findings)


def check_or_raise(findings: Sequence[Finding], log: Callable[[str], Any] = print, rank: int = 0) -> None:
    """At fit start: rank 0 logs the warnings and the errors once; every rank raises on an error.

    The `ValidationError` message is one line naming the rule ids (so 64 ranks do not print 64 tables);
    the full table is `error.report` and was logged by rank 0.
    """
    errors = [f for f in findings if f.level == ERROR]
    warnings = [f for f in findings if f.level != ERROR]
    if rank == 0 and warnings:
        log(f"pre-flight: {len(warnings)} warning(s)\n" + format_findings(warnings))
    if not errors:
        return
    report = f"pre-flight failed: {len(errors)} error(s)\n" + format_findings(errors)
    if rank == 0:
        log(report)
    ids = ", ".join(f.rule_id for f in errors)
    raise ValidationError(
        f"pre-flight failed ({ids}): the layout or the data cannot be trained as configured; rank 0 "
        "logged the reasons and fixes above, and `speechlm validate CONFIG` with the same overrides "
        "shows them too",
        findings,
        report,
    )
