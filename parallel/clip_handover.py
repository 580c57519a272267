"""The hand-over of a sharded clip's embeddings from the encoder's slices to the LLM's CP layout (issue 25
item 4). Standard library only; pure functions of lengths and ranks, computed alike on every CP rank.

Letters: A the clip's projected frames (its rows in the LLM sequence), cp the CP size, r a CP rank,
c = S / (2 cp) the chunk length of a split sequence of padded length S, p0 the row of the sequence where
the clip's first frame sits.

The encoder shards a long clip in contiguous slices (`parallel.clip_placement.shard_bounds`, cut on
multiples of the projector's stack): rank r projects rows ``have[r] = [a_r, b_r)`` of the clip. The LLM
needs other rows on each rank:

- the clip's sequence is **split** over the CP group (the usual case for a long clip): rank r keeps
  chunks r and 2cp-1-r of the sequence (`parallel.cp_shard`), so it needs the clip's rows that fall
  in ``[r c, (r+1) c)`` and ``[(2cp-1-r) c, (2cp-r) c)``, shifted by -p0;
- the sequence is **whole** on one rank o: o needs all A rows, the others none.

`Handover` is the exchange that moves exactly the rows a rank needs and did not compute itself, each
once, from the rank that computed it: one all-to-all (`parallel.sharded_clip.hand_over`), whose
backward sends each row's gradient back along the same route. Nothing else moves: a row a rank both
computed and needs stays where it is, and no rank receives a row it does not keep.

Volume (rows of H values): ``sum_r |need[r] - have[r]|``. For a split sequence the clip fills, A / 2
rows move in all at cp 2 and 3A / 4 at cp 4, where an all-gather of the slices would move A (cp - 1);
`Handover.volume` gives the exact count of any case (docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Handover", "Interval", "chunk_ranges", "clip_needs", "intersect"]

Interval = tuple[int, int]  # [lo, hi) rows of the clip


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The rows in both ``a`` and ``b`` (each a list of disjoint sorted intervals), sorted."""
    out = []
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo < hi:
                out.append((lo, hi))
    return sorted(out)


def chunk_ranges(padded_len: int, cp: int, rank: int) -> list[Interval]:
    """The rows ``[lo, hi)`` of a split sequence of ``padded_len`` rows (a multiple of 2 cp) that CP rank
    ``rank`` keeps: chunks ``rank`` and ``2 cp - 1 - rank``, in that order (`parallel.cp_shard`)."""
    if cp < 1 or not 0 <= rank < cp or padded_len < 0 or padded_len % (2 * cp):
        raise ValueError(
            f"padded_len={padded_len} must be a multiple of 2*cp and rank={rank} in [0, cp={cp})"
        )
    c = padded_len // (2 * cp)
    return [(rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def clip_needs(
    frames: int, offset: int, cp: int, *, split: bool, padded_len: int = 0, owner: int = 0
) -> list[list[Interval]]:
    """Per CP rank, the rows of a clip of ``frames`` rows its local stream holds (module docstring): the
    clip starts at row ``offset`` of its sequence; ``split``: the sequence is split over the CP group
    (``padded_len`` rows), else it lives whole on ``owner``."""
    if frames < 0 or offset < 0:
        raise ValueError(f"frames={frames} and offset={offset} must be >= 0")
    if not split:
        if not 0 <= owner < cp:
            raise ValueError(f"owner={owner} is outside 0..{cp - 1}")
        return [[(0, frames)] if r == owner and frames else [] for r in range(cp)]
    if offset + frames > padded_len:
        raise ValueError(
            f"the clip's rows [{offset}, {offset + frames}) overrun its sequence of {padded_len}"
        )
    clip = [(offset, offset + frames)]
    return [
        [(lo - offset, hi - offset) for lo, hi in intersect(chunk_ranges(padded_len, cp, r), clip)]
        for r in range(cp)
    ]


@dataclass(frozen=True)
class Handover:
    """Which rows of one clip go from which rank to which (module docstring). ``have[r]``: the rows rank r
    projected (contiguous); ``need[r]``: the rows rank r's stream holds."""

    frames: int
    have: tuple[Interval, ...]
    need: tuple[tuple[Interval, ...], ...]

    @staticmethod
    def build(frames: int, have: Sequence[Interval], need: Sequence[Sequence[Interval]]) -> Handover:
        if len(have) != len(need):
            raise ValueError(f"have has {len(have)} ranks, need {len(need)}")
        covered = sorted(have)
        if (
            covered
            and (covered[0][0] != 0 or covered[-1][1] != frames)
            or any(a[1] != b[0] for a, b in zip(covered, covered[1:]))
        ):
            raise ValueError(f"the slices {list(have)} do not tile the clip's {frames} rows")
        return Handover(frames, tuple(have), tuple(tuple(n) for n in need))

    @property
    def cp(self) -> int:
        return len(self.have)

    def moves(self, src: int, dst: int) -> list[Interval]:
        """The rows ``src`` sends to ``dst`` (none to itself): what ``dst`` needs of ``src``'s slice."""
        if src == dst:
            return []
        return intersect([self.have[src]], self.need[dst])

    def kept(self, rank: int) -> list[Interval]:
        """The rows ``rank`` needs and computed itself."""
        return intersect([self.have[rank]], self.need[rank])

    def volume(self) -> int:
        """Rows moved in all (each of H values)."""
        return sum(hi - lo for s in range(self.cp) for d in range(self.cp) for lo, hi in self.moves(s, d))
