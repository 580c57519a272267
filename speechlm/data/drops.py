"""Samples dropped from a batch, as every message about them says it: the counts by reason
(`drop_reasons`), the first dropped rows (`drop_listing`), and what to do about those reasons
(`drop_advice`). Training's micro-batch and epoch checks and the evaluation's split check all word their
errors with these."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

# what to do about a dropped sample, by the reason it was dropped (the first that applies is said first)
_FILE_REASONS = frozenset(
    {"missing_file", "undecodable", "empty_audio", "missing_shard", "truncated_shard", "stale_index",
     "segment_beyond_audio"}
)  # fmt: skip
_TEXT_REASONS = frozenset({"invalid_text", "empty_text", "missing_tag", "tag_mismatch"})


def drop_reasons(dropped: Mapping[str, int]) -> str:
    """Drop counts by reason, as every drop message gives them: ``missing_file 3, too_many_tokens 1``."""
    return ", ".join(f"{k} {v}" for k, v in sorted(dropped.items()))


def drop_listing(rows: Sequence[str], limit: int = 20) -> str:
    """The first `limit` dropped rows (each with its reason and detail), one a line, and how many more."""
    more = f"\n  ... and {len(rows) - limit} more" if len(rows) > limit else ""
    return "\n  ".join(rows[:limit]) + more


def drop_advice(reasons: Mapping[str, int] | Iterable[str]) -> str:
    """What to do about samples dropped for `reasons` (each line of the listing says what is wrong with
    its row): restore files only when files are the cause, fix texts or durations, or raise the token
    limit, so the advice never sends a user after the wrong thing."""
    got = set(reasons)
    advice = []
    if got & _FILE_REASONS:
        advice.append(
            "restore or remove the unreadable audio (then rebuild the manifest with `speechlm manifest build`)"
        )
    if "duration_mismatch" in got:
        advice.append("fix the durations (or audio paths) of those rows")
    if got & _TEXT_REASONS:
        advice.append(
            "fix the texts of those rows as each line says (`speechlm manifest build` tags and cleans)"
        )
    if "too_many_tokens" in got:
        advice.append("raise data.max_tokens or shorten those samples")
    known = _FILE_REASONS | _TEXT_REASONS | {"duration_mismatch", "too_many_tokens"}
    if got - known or not advice:
        advice.append("fix those rows as each line says")
    return "; ".join(advice)
