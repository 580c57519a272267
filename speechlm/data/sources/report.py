"""`SourceReport`: what indexing a source dropped, per shard and reason.

Every reader of a tar-based or list-based source (`shards`, `join`, `nemo_tarred`, `lhotse_shar`,
`wenet`, `lhotse_cuts`) counts its drops here, and `detect.load_source` logs them. A module of its own
so that the readers and the join helpers import it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceReport:
    """What loading a source dropped, per shard and reason (printed by the loader, never silent)."""

    dropped: dict[str, dict[str, int]] = field(default_factory=dict)  # shard -> reason -> rows

    def drop(self, shard: str, reason: str, n: int = 1) -> None:
        if n:
            per = self.dropped.setdefault(shard, {})
            per[reason] = per.get(reason, 0) + int(n)

    @property
    def total(self) -> int:
        return sum(sum(v.values()) for v in self.dropped.values())

    def lines(self) -> list[str]:
        return [
            f"{shard}: " + ", ".join(f"{n} {reason}" for reason, n in sorted(per.items()))
            for shard, per in sorted(self.dropped.items())
        ]
