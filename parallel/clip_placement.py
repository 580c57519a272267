"""Which audio clips the encoder shards over the CP group, and which stay whole on one rank (issue 25).
Standard library only; a pure function of the clips' encoder frames, computed alike on every rank.

Letters: N clips of one micro-batch, L_i the encoder frames of clip i (after subsampling), cp the CP
size, r a CP rank.

Today every clip is encoded whole on one CP rank (`parallel.cp_placement.CPPlacement.clip_owners`):
right for speech clips of seconds, wrong for one clip of 60 minutes (~45,000 FastConformer frames),
whose activations do not fit one rank and which leaves the other ranks' encoders idle. The rule:

- with cp > 1, clip i is **sharded** when ``L_i > min_frames`` and ``L_i > sum(L) / cp``: longer than
  a short clip (``min_frames``, by default the frames of `SHORT_CLIP_SECONDS` = 30 s: such clips keep
  today's placement, and Whisper's fixed window holds them) and longer than one rank's fair share of
  the micro-batch's encoder work (dealing whole clips cannot balance a clip bigger than that);
- every other clip stays **whole** on one rank, placed as today.

A sharded clip is cut into contiguous slices of its frames over its **group**: the whole CP group, or under
hybrid CP degrees (`parallel.hybrid_layout`) the aligned sub-group ``[first, first + d)`` of d ranks that
computes its sequence (``groups``: per clip ``(first, d)``; a clip of a whole sequence, or of one split over
every rank, uses the whole group). The group's k-th rank holds ``[k*L//d, (k+1)*L//d)``
(`shard_bounds`; lengths that do not divide by d give slices that differ by one frame; with `align`,
the cuts fall on multiples of the projector's stack). Contiguous
slices (not the LLM's load-balanced chunk pairs) because the encoder is bidirectional and local:
convolutions and limited-context attention need only the edge frames of the neighbours (a halo).

Who uses it: `speechlm.model.cp_audio.clip_sharding` in training (through the CP layout, where the encoder
can shard a clip: limited context), which then encodes each sharded clip with `speechlm.model.sharded_encoder` and
hands its rows to the LLM (`parallel.clip_handover`); `speechlm plan`'s report; the validator's rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parallel.frames import FEATURE_FRAMES_PER_SECOND, planned_encoder_frames

__all__ = [
    "FEATURE_FRAMES_PER_SECOND",
    "SHORT_CLIP_SECONDS",
    "ClipGroup",
    "ClipSharding",
    "clip_readers",
    "place_clips",
    "shard_bounds",
    "short_clip_frames",
    "slice_halo",
]

SHORT_CLIP_SECONDS = (
    30.0  # clips up to this long are never sharded (Whisper's window; seconds of activations)
)


def slice_halo(window: tuple[int, int], conv_kernel: int) -> int:
    """The fewest encoder frames a slice of a sharded clip may hold: the widest halo it sends, the
    limited-context attention window's sides or the depthwise convolution's half-width (`conv_kernel`).
    `place_clips`' ``min_slice`` is this plus the projector's stack (the cut's alignment); the model
    (`ParakeetAudioEncoder.slice_halo`) and the config (`EncoderConfig.shard_min_slice`, kernel 9 of an
    encoder built from sizes) compute it alike."""
    return max(*window, (conv_kernel - 1) // 2)


def short_clip_frames(subsampling: int) -> int:
    """`min_frames` of the rule for an encoder of `subsampling`: the frames of a 30 s clip."""
    return int(planned_encoder_frames(SHORT_CLIP_SECONDS, subsampling))


def shard_bounds(length: int, cp: int, align: int = 1) -> list[tuple[int, int]]:
    """The contiguous slice ``[lo, hi)`` of a sharded clip of `length` frames on each of `cp` ranks: the cut
    before rank r at ``r * length // cp``, rounded down to a multiple of `align` (the projector's frame
    stacking, so that every rank stacks whole groups of its own frames)."""
    if cp < 1 or length < 0 or align < 1:
        raise ValueError(f"length={length}, cp={cp} and align={align} must be >= 0, >= 1 and >= 1")
    cuts = [0, *((r * length // cp) // align * align for r in range(1, cp)), length]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


ClipGroup = tuple[
    int, int
]  # (first CP rank, ranks): the aligned ranks [first, first + size) a clip is sharded over


def _checked_groups(groups: Sequence[ClipGroup], n: int, cp: int) -> tuple[ClipGroup, ...]:
    """``groups`` as a tuple, one aligned group of the CP ranks per clip (empty: the whole group each)."""
    if not groups:
        return ((0, cp),) * n
    if len(groups) != n:
        raise ValueError(f"got {len(groups)} clip groups for {n} clips")
    out = tuple((int(f), int(d)) for f, d in groups)
    for c, (f, d) in enumerate(out):
        if d < 1 or f < 0 or f + d > cp or f % d:
            raise ValueError(
                f"clip {c}'s group ({f}, {d}) is not an aligned group of ranks [first, first + d) inside 0..{cp - 1}"
            )
    return out


@dataclass(frozen=True)
class ClipSharding:
    """The rule's decision for the clips of one micro-batch on a CP group of `cp` ranks: which are sharded,
    each over which ranks (``groups``: per clip, `ClipGroup`; the whole group unless `place_clips` was
    given sub-groups)."""

    cp: int
    frames: tuple[int, ...]  # encoder frames per clip
    sharded: tuple[bool, ...]  # True: cut into contiguous slices, one per rank of its group
    min_frames: int
    groups: tuple[ClipGroup, ...] = ()  # per clip; empty: (0, cp) for every clip

    def group(self, c: int) -> ClipGroup:
        """``(first, d)``: clip c is sharded over CP ranks ``[first, first + d)``."""
        return self.groups[c] if self.groups else (0, self.cp)

    def ranks(self, c: int) -> range:
        first, d = self.group(c)
        return range(first, first + d)

    @property
    def sharded_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.sharded) if s]

    @property
    def whole_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.sharded) if not s]

    def local_indices(self, rank: int) -> list[int]:
        """The sharded clips whose group holds `rank` (it encodes a slice of each), in clip order."""
        return [c for c in self.sharded_indices if rank in self.ranks(c)]

    def bounds(self, c: int, align: int = 1) -> list[tuple[int, int]]:
        """`shard_bounds` of clip c over its group, one slice per rank of the group in rank order."""
        return shard_bounds(self.frames[c], self.group(c)[1], align)

    def slices(self, rank: int) -> list[tuple[int, int, int]]:
        """(clip, lo, hi) of every sharded clip's slice on `rank`, in clip order (the clips whose group
        holds it)."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank={rank} is outside 0..{self.cp - 1}")
        return [(c, *self.bounds(c)[rank - self.group(c)[0]]) for c in self.local_indices(rank)]

    def sharded_frames(self) -> int:
        return sum(self.frames[i] for i in self.sharded_indices)


def place_clips(
    frames: Sequence[int],
    cp: int,
    *,
    min_frames: int,
    min_slice: int = 0,
    groups: Sequence[ClipGroup] = (),
) -> ClipSharding:
    """Decide which clips of a micro-batch are sharded (module docstring): clip i when cp > 1,
    ``frames[i] > min_frames``, ``frames[i] > sum(frames) / cp`` (longer than one rank's fair share of the
    micro-batch's encoder work) and every rank of its group gets a slice of at least ``min_slice`` frames
    (the halo a slice sends its neighbours: the attention window's and the convolution's widths).
    ``groups``: per clip, the aligned ranks ``(first, d)`` it would be sharded over (hybrid CP degrees: its
    sequence's sub-group); empty: the whole group, d = cp, for every clip. A group of one rank shards
    nothing. Deterministic: the same arguments give the same decision on every rank; the rank is not an
    argument."""
    if cp < 1 or min_frames < 0 or min_slice < 0:
        raise ValueError(f"cp={cp} must be >= 1, min_frames={min_frames} and min_slice={min_slice} >= 0")
    lens = tuple(int(n) for n in frames)
    if any(n < 0 for n in lens):
        raise ValueError(f"encoder frames must be >= 0, got {list(lens)[:8]}")
    total = sum(lens)
    grp = _checked_groups(groups, len(lens), cp)
    sharded = tuple(
        d > 1 and n > min_frames and n * cp > total and n // d >= min_slice for n, (_, d) in zip(lens, grp)
    )
    return ClipSharding(cp, lens, sharded, int(min_frames), grp if groups else ())


def clip_readers(owners: Sequence[int], sharding: ClipSharding | None, cp: int) -> list[tuple[int, ...]]:
    """Per clip of a micro-batch, the CP ranks whose encoder reads its audio: its owner (``owners[c]``, the
    rank that encodes it whole, `CPPlan.clip_owners`), or every rank of its group when ``sharding`` shards
    it (each encodes its slice; None: nothing is sharded). The one answer to "which ranks need clip c" that
    the data pipeline decodes by (`speechlm.data.local_decode`) and the model checks against."""
    if sharding is not None and len(sharding.sharded) != len(owners):
        raise ValueError(f"got {len(sharding.sharded)} sharding flags for {len(owners)} clips")
    out = []
    for c, o in enumerate(owners):
        if not 0 <= int(o) < cp:
            raise ValueError(f"clip {c} is owned by rank {o}, outside the CP group of {cp}")
        sharded = sharding is not None and sharding.sharded[c]
        out.append(tuple(sharding.ranks(c)) if sharding is not None and sharded else (int(o),))
    return out
