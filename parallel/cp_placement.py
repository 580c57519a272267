"""Dynamic context parallelism: which utterances of a micro-batch are split over the CP group, and on
which rank each of the others lives whole. Standard library only; a pure function of the lengths.

Letters: N sequences of the micro-batch, L_i the packed length of sequence i (audio frames + text),
cp the CP size, r a CP rank.

Splitting every sequence into 2·cp chunks (`parallel.cp_shard`) pads each one to a multiple of 2·cp
and sends every sequence's K/V around the ring. Speech utterances are short: at cp=8 a 50-token
utterance becomes 16 chunks of about 3 tokens plus padding. So:

- a sequence longer than ``threshold`` tokens is **split**: padded to a multiple of 2·cp and cut into
  the load-balanced chunk pairs of `parallel.cp_shard` (rank r keeps chunks r and 2cp-1-r); its
  attention runs over the CP group (ring or all-gather), and only its K/V travels;
- every other sequence is **whole**: it lives, unpadded, on one rank, attends locally with no
  communication, and its audio clip is encoded on that rank and never gathered.

Hybrid degrees (`place_hybrid`, `HybridPlacement`): a sequence whole on one rank or split over an aligned
sub-group of degree 2, 4, ..., cp (ranks ``[k·d, k·d + d)``), whichever the balance needs, padded to a
multiple of 2·d only. A fixed micro-batch of speech holds only one or two utterances per rank at cp = 8,
where splitting over all eight pads every split one to a multiple of 16: whole-or-all computes ~3% padding
there, hybrid degrees under 1% (`speechlm plan` prints both). Training runs it with
``parallel.cp_degrees=hybrid`` (`parallel.hybrid_layout.HybridCPLayout`); `place_sequences` is what
`DynamicCPLayout` runs.

Whole sequences are dealt to ranks by longest-processing-time first: in order of decreasing
modelled cost (ties: lower index first), each goes to the rank with the least load so far (ties:
lower rank). The modelled cost of a sequence is ``L + L·(L+1)/2 · pair_cost``: one unit per token
for the linear layers plus the causal attention pairs, each ``pair_cost`` of a token (about
``1 / (6·hidden)`` for a decoder). A split sequence adds ``cost / cp`` to every rank (its chunk pairs
give every rank the same attention work). The result is deterministic and identical on every rank.

Local stream of rank r (what the decoder sees): the split sequences first, in micro-batch order,
each padded to a multiple of 2·cp, the last one padded further so that their total divides by
``rounding_unit(cp, tp)`` (or ``pad_to_multiple``); then rank r's whole sequences, in micro-batch
order, unpadded except the last, which is padded so that their total divides by ``tp``. Padding
at the end of a causal sequence never changes its real tokens. After sharding the split part, each
rank holds ``split_total / cp`` + its whole tokens.

No rank is left without a token: when nothing is split and there are fewer sequences than ranks,
the longest sequence is split. (With something split every rank holds its chunks of it; with at
least cp whole sequences the greedy deal gives every rank one.) A rank with no token of its own
would run the layers on nothing, and its backward would fall out of step with the others'.

``threshold = 0`` splits every sequence: the layout before dynamic CP, kept for comparison.
``threshold = "auto"`` (the default of ``parallel.cp_split_threshold``) decides per micro-batch: the
fewest sequences are split, longest first, such that the busiest rank's modelled cost is within 5%
of the mean (`place_auto`). A fixed token threshold cannot do this for every micro-batch: whether a
120-token utterance must be split depends on how much else the micro-batch holds.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from parallel.rounding import rounding_unit, sequence_multiple

__all__ = [
    "CPPlacement",
    "HybridPlacement",
    "LocalPlacement",
    "AUTO_TOLERANCE",
    "cp_degrees",
    "place_auto",
    "place_hybrid",
    "place_sequences",
    "sequence_cost",
]


AUTO_TOLERANCE = 1.05  # threshold="auto": the busiest rank's modelled cost may exceed the mean by 5%


def sequence_cost(length: int, pair_cost: float) -> float:
    """Modelled cost of one causal sequence of ``length`` tokens (see the module docstring)."""
    return length + length * (length + 1) / 2 * pair_cost


@dataclass(frozen=True)
class CPPlacement:
    """Where the sequences of one micro-batch live on a CP group of ``cp`` ranks."""

    cp: int
    tp: int
    lengths: tuple[int, ...]  # unpadded packed lengths
    split: tuple[bool, ...]  # True: cut into 2·cp chunks over all ranks
    owner: tuple[int, ...]  # the rank of a whole sequence; -1 for a split one
    padded: tuple[int, ...]  # per sequence: the length it has in its rank's local stream before sharding
    loads: tuple[float, ...]  # modelled cost per rank

    @property
    def split_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.split) if s]

    def whole_indices(self, rank: int) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o == rank]

    def local_indices(self, rank: int) -> list[int]:
        """Sequences of rank ``rank``'s local stream before sharding: all split ones, then its own."""
        return self.split_indices + self.whole_indices(rank)

    @property
    def split_total(self) -> int:
        return sum(self.padded[i] for i in self.split_indices)

    def local_tokens(self, rank: int) -> int:
        """Tokens rank ``rank`` computes (its chunks of the split sequences + its whole ones)."""
        return self.split_total // self.cp + sum(self.padded[i] for i in self.whole_indices(rank))

    def computed_tokens(self) -> int:
        return sum(self.local_tokens(r) for r in range(self.cp))

    def real_tokens(self) -> int:
        return sum(self.lengths)

    def max_over_mean(self) -> float:
        """The busiest rank's modelled cost over the mean (1.0 = perfectly balanced)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0

    def ring_tokens(self) -> int:
        """Tokens whose K/V travel between CP ranks (those of the split sequences)."""
        return self.split_total

    def clip_owners(self) -> list[int]:
        """The rank that encodes each sequence's audio clip: a whole sequence's owner; the split
        sequences' clips, longest first, each to the rank with the least encoding work so far (the
        lengths of the sequences whose clips it encodes; ties to the lower rank), so that the long
        clips do not pile up on one rank's encoder."""
        owners = list(self.owner)
        work = [0] * self.cp
        for i, o in enumerate(self.owner):
            if o >= 0:
                work[o] += self.lengths[i]
        for i in sorted(self.split_indices, key=lambda i: (-self.lengths[i], i)):
            r = min(range(self.cp), key=lambda r: (work[r], r))
            owners[i] = r
            work[r] += self.lengths[i]
        return owners

    @property
    def degree(self) -> tuple[int, ...]:
        """Per sequence: the ranks it is split over (cp, or 1: whole), as `HybridPlacement.degree`."""
        return tuple(self.cp if s else 1 for s in self.split)

    def sequence_ranks(self, i: int) -> range:
        """The CP ranks that compute sequence i: all of them when it is split, else its owner."""
        return range(self.cp) if self.split[i] else range(self.owner[i], self.owner[i] + 1)

    def clip_readers(self, i: int, *, sharded: bool = False) -> range:
        """The CP ranks that need sequence i's audio: its clip owner alone, or with ``sharded`` (the encoder
        shards a long clip over the CP group) every rank (`HybridPlacement.clip_readers` likewise)."""
        return _readers(self, i, sharded)

    def local(self, rank: int) -> LocalPlacement:
        return LocalPlacement(self, rank)


def _readers(placement: CPPlacement | HybridPlacement, i: int, sharded: bool) -> range:
    if sharded:
        return placement.sequence_ranks(i)
    owner = placement.clip_owners()[i]
    return range(owner, owner + 1)


@dataclass(frozen=True)
class LocalPlacement:
    """One rank's view of a `CPPlacement` or `HybridPlacement` (the `parallel.cp_layout.CPPlan` of dynamic CP
    and of hybrid degrees): what it packs, in which order, to which lengths."""

    placement: CPPlacement | HybridPlacement
    rank: int

    @property
    def indices(self) -> list[int]:
        return self.placement.local_indices(self.rank)

    @property
    def padded_lengths(self) -> list[int]:
        return [self.placement.padded[i] for i in self.indices]

    @property
    def local_degrees(self) -> list[int]:
        return [self.placement.degree[i] for i in self.indices]

    @property
    def n_split(self) -> int:
        return sum(d > 1 for d in self.local_degrees)

    @property
    def degrees(self) -> list[int]:
        return list(self.placement.degree)

    @property
    def clip_owners(self) -> list[int]:
        return self.placement.clip_owners()

    @property
    def gathered(self) -> list[bool]:
        """Per clip: its sequence is split, so its embeddings go to every rank of its (sub-)group."""
        return [d > 1 for d in self.placement.degree]

    @property
    def gather_groups(self) -> list[tuple[int, int]]:
        """Per clip: ``(first, d)``, the CP ranks ``[first, first + d)`` that compute its sequence (d = 1:
        whole on ``first``), which receive its embeddings."""
        seqs = (self.placement.sequence_ranks(i) for i in range(len(self.placement.degree)))
        return [(r.start, len(r)) for r in seqs]


def place_sequences(
    lengths: Sequence[int],
    cp: int,
    *,
    threshold: int | str,
    tp: int = 1,
    pair_cost: float = 0.0,
    pad_to_multiple: int | None = None,
    tolerance: float = AUTO_TOLERANCE,
) -> CPPlacement:
    """Place one micro-batch's sequences on ``cp`` ranks (module docstring).

    ``threshold``: sequences longer than this many tokens are split (0: every sequence); ``"auto"``:
    the fewest sequences are split, longest first, such that the busiest rank's modelled cost is within
    ``tolerance`` of the mean (`place_auto`)."""
    lens = _checked_lengths(lengths, cp, tp, pad_to_multiple)
    if threshold == "auto":
        return place_auto(
            lens, cp, tp=tp, pair_cost=pair_cost, pad_to_multiple=pad_to_multiple, tolerance=tolerance
        )
    if not isinstance(threshold, int) or threshold < 0:
        raise ValueError(
            f"threshold must be 'auto' or >= 0 tokens (0: split every sequence), got {threshold!r}"
        )
    split = [cp > 1 and (threshold == 0 or n > threshold) for n in lens]
    return _place(lens, split, cp, tp, pair_cost, pad_to_multiple)


def _checked_lengths(lengths: Sequence[int], cp: int, tp: int, pad_to_multiple: int | None) -> list[int]:
    """The lengths as ints, after refusing a bad cp, tp, length or ``pad_to_multiple`` with what to use."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1, got cp={cp}, tp={tp}")
    lens = [int(n) for n in lengths]
    for i, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every packed sequence needs at least one token")
    unit = rounding_unit(cp, tp)
    if pad_to_multiple is not None and (pad_to_multiple < 1 or pad_to_multiple % unit):
        raise ValueError(f"pad_to_multiple={pad_to_multiple} is not a multiple of {unit} (cp={cp}, tp={tp})")
    return lens


def place_auto(
    lengths: Sequence[int],
    cp: int,
    *,
    tp: int = 1,
    pair_cost: float = 0.0,
    pad_to_multiple: int | None = None,
    tolerance: float = AUTO_TOLERANCE,
) -> CPPlacement:
    """``threshold="auto"``: split the k longest sequences for the smallest k whose placement keeps the
    busiest rank within ``tolerance`` of the mean modelled cost (k = 0, 1, 2, ... in turn: the balance
    is not monotone in k, since splitting a short sequence takes away a piece the greedy deal could
    have used). Splitting every sequence balances exactly, so a k always exists; fewer splits mean
    less padding and less ring traffic. Ties in length are broken by index, so every rank finds the
    same k."""
    lens = [int(n) for n in lengths]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))

    def with_k(k: int) -> CPPlacement:
        chosen = set(order[:k])
        return _place(
            lens, [cp > 1 and i in chosen for i in range(len(lens))], cp, tp, pair_cost, pad_to_multiple
        )

    for k in range(len(lens)):
        placement = with_k(k)
        if placement.max_over_mean() <= tolerance:
            return placement
    return with_k(len(lens))


def _place(
    lens: list[int], split: list[bool], cp: int, tp: int, pair_cost: float, pad_to_multiple: int | None
) -> CPPlacement:
    split = list(split)
    unit = rounding_unit(cp, tp)
    while cp > 1 and not any(split) and 0 < len(lens) < cp:
        # fewer whole sequences than ranks and nothing split would leave a rank with no token: split the
        # longest (every rank then computes its chunks; see the module docstring)
        split[max(range(len(lens)), key=lambda i: (lens[i], -i))] = True
    padded = list(lens)
    chunk = sequence_multiple(cp)
    split_idx = [i for i, s in enumerate(split) if s]
    for i in split_idx:
        padded[i] = -(-lens[i] // chunk) * chunk
    if split_idx:
        total = sum(padded[i] for i in split_idx)
        padded[split_idx[-1]] += -total % (pad_to_multiple or unit)

    split_cost = sum(sequence_cost(padded[i], pair_cost) for i in split_idx)
    loads = [split_cost / cp] * cp
    owner = [-1] * len(lens)
    whole = [i for i, s in enumerate(split) if not s]
    heap = [(loads[r], r) for r in range(cp)]  # least loaded first, ties by rank
    for i in sorted(whole, key=lambda i: (-sequence_cost(lens[i], pair_cost), i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        loads[r] = load + sequence_cost(lens[i], pair_cost)
        heapq.heappush(heap, (loads[r], r))
    if tp > 1:  # each rank's whole part ends on a multiple of tp: pad its last whole sequence
        for r in range(cp):
            mine = [i for i in whole if owner[i] == r]
            if mine:
                padded[mine[-1]] += -sum(padded[i] for i in mine) % tp
    return CPPlacement(cp, tp, tuple(lens), tuple(split), tuple(owner), tuple(padded), tuple(loads))


# ---- hybrid CP degrees -------------------------------------------------------------------------------


def cp_degrees(cp: int) -> list[int]:
    """The degrees a sequence may be split over on ``cp`` ranks, smallest first: 1 (whole), then every
    power of two that divides cp, then cp itself. Each divides the next, so the aligned sub-groups of
    one degree nest inside those of the next (rank r's degree-d group is ``[r // d * d, r // d * d + d)``)."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    degrees = [1]
    while cp % (degrees[-1] * 2) == 0:
        degrees.append(degrees[-1] * 2)
    return degrees if degrees[-1] == cp else [*degrees, cp]


@dataclass(frozen=True)
class HybridPlacement:
    """Where one micro-batch's sequences live on ``cp`` ranks with hybrid degrees (`place_hybrid`).

    Sequence i is computed by the aligned ranks ``[first[i], first[i] + degree[i])``: degree 1 is a whole
    sequence on rank ``first[i]``, degree d > 1 a sequence padded to a multiple of 2·d and cut into the 2·d
    load-balanced chunks of `parallel.cp_shard` over that sub-group."""

    cp: int
    tp: int
    lengths: tuple[int, ...]  # unpadded packed lengths
    degree: tuple[int, ...]  # ranks the sequence is split over (1: whole)
    first: tuple[int, ...]  # the first rank of its sub-group (its rank when whole)
    padded: tuple[int, ...]  # per sequence: its length in the local streams before sharding
    loads: tuple[float, ...]  # modelled cost per rank

    def sequence_ranks(self, i: int) -> range:
        """The CP ranks that compute sequence i (its sub-group), and so need its clip's embeddings."""
        return range(self.first[i], self.first[i] + self.degree[i])

    def segments(self, rank: int) -> list[tuple[int, list[int]]]:
        """Rank ``rank``'s local stream before sharding, as (degree, sequences) segments: one per degree of
        `cp_degrees`, largest first (the order every rank runs its sub-groups' attention in), each with the
        sequences of rank's aligned sub-group of that degree in micro-batch order; degree 1 last."""
        out = []
        for d in reversed(cp_degrees(self.cp)):
            lo = rank // d * d
            out.append(
                (d, [i for i in range(len(self.lengths)) if self.degree[i] == d and self.first[i] == lo])
            )
        return out

    def local_indices(self, rank: int) -> list[int]:
        return [i for _, seqs in self.segments(rank) for i in seqs]

    def local_tokens(self, rank: int) -> int:
        """Tokens rank ``rank`` computes: its 1/d share of each degree-d segment."""
        return sum(sum(self.padded[i] for i in seqs) // d for d, seqs in self.segments(rank))

    def computed_tokens(self) -> int:
        return sum(self.padded)  # each split sequence's padded tokens are shared out exactly

    def real_tokens(self) -> int:
        return sum(self.lengths)

    def max_over_mean(self) -> float:
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0

    def ring_tokens(self) -> int:
        """Tokens whose K/V travel between CP ranks (those of the sequences split over d > 1)."""
        return sum(p for p, d in zip(self.padded, self.degree) if d > 1)

    def clip_owners(self) -> list[int]:
        """The rank that encodes each sequence's audio clip: a whole sequence's rank; a split sequence's
        clip, longest first, goes to the rank of its sub-group with the least encoding work so far (the
        lengths of the sequences whose clips it encodes; ties to the lower rank). A clip's audio is read
        only there (`clip_readers`)."""
        owners = list(self.first)
        work = [0] * self.cp
        for i, d in enumerate(self.degree):
            if d == 1:
                work[self.first[i]] += self.lengths[i]
        for i in sorted((i for i, d in enumerate(self.degree) if d > 1), key=lambda i: (-self.lengths[i], i)):
            r = min(self.sequence_ranks(i), key=lambda r: (work[r], r))
            owners[i] = r
            work[r] += self.lengths[i]
        return owners

    def clip_readers(self, i: int, *, sharded: bool = False) -> range:
        """The CP ranks that need sequence i's audio: its clip owner alone, or with ``sharded`` (the
        encoder shards a long clip over the sequence's sub-group) every rank of the sub-group."""
        return _readers(self, i, sharded)

    def local(self, rank: int) -> LocalPlacement:
        return LocalPlacement(self, rank)


def place_hybrid(
    lengths: Sequence[int],
    cp: int,
    *,
    tp: int = 1,
    pair_cost: float = 0.0,
    pad_to_multiple: int | None = None,
    tolerance: float = AUTO_TOLERANCE,
) -> HybridPlacement:
    """Hybrid CP degrees: each sequence whole on one rank or split over an aligned sub-group of degree d
    in `cp_degrees`, the busiest rank within ``tolerance`` of the mean modelled cost, no rank without a
    token, and as few computed tokens (padding) as that allows.

    Every sequence has a least degree: the smallest d with ``cost / d`` under the mean cost per rank (the
    rank budget). Candidate degree assignments, each packed by `_pack_hybrid`, in this order:

    1. every sequence at its least degree;
    2. for k = 1 .. cp-1: k sequences (the k longest, then the k shortest) split as a mixed-radix fraction
       of a rank (`_spread_degrees`: with cp = 8 and k = 5, four over the four pairs of ranks and one over
       all eight, so that each rank gets 1/2 + 1/8 of a sequence), the rest at their least degree; this is
       what a micro-batch of similar lengths (one duration bucket) needs when it holds q·cp + k sequences;
    3. for each degree L = 2, 4, ..., cp: the k longest sequences at degree L (or their least degree if
       higher), for the smallest k that balances (k = 0, 1, ... in turn).

    The balanced candidate with the fewest computed tokens wins (ties: fewer tokens whose K/V travel, then
    the earlier candidate; a candidate whose own padding already exceeds the best is not packed); if none balances, every sequence is split over all cp ranks (balanced exactly).
    A pure function of the lengths: every rank, and a resumed run, finds the same plan."""
    lens = _checked_lengths(lengths, cp, tp, pad_to_multiple)
    degrees = cp_degrees(cp)
    costs = [sequence_cost(n, pair_cost) for n in lens]
    mean = sum(costs) / cp
    least = [next((d for d in degrees if c / d <= mean), cp) for c in costs]
    longest = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    best: HybridPlacement | None = None

    tried: dict[tuple[int, ...], bool] = {}

    def settled(degree: list[int]) -> bool:
        """Pack ``degree`` and keep it if it balances with fewer tokens than the best so far. True when it
        balances, or when its sequences' own padding alone already exceeds the best plan's tokens (so no
        plan that splits more at this level can win either, and it is not packed)."""
        nonlocal best
        key = tuple(degree)
        if key not in tried:
            floor = sum(-(-n // sequence_multiple(d)) * sequence_multiple(d) for n, d in zip(lens, degree))
            if best is not None and floor > sum(best.padded):
                tried[key] = True
                return True
            p = _pack_hybrid(lens, degree, cp, tp, pair_cost, pad_to_multiple)
            # a rank's load is 0 only when it holds no token (every sequence costs at least 1)
            tried[key] = p.max_over_mean() <= tolerance and min(p.loads) > 0
            if tried[key] and (best is None or _fewer_tokens(p, best)):
                best = p
        return tried[key]

    settled(least)
    for k in range(1, min(cp, len(lens) + 1)):
        spread = _spread_degrees(k, degrees)
        for picked in (longest[:k], longest[::-1][:k], _least_padded(lens, spread, longest)):
            degree = list(least)
            for i, d in zip(picked, spread):
                degree[i] = max(d, least[i])
            settled(degree)
    for level in degrees[1:]:
        for k in range(len(lens) + 1):
            chosen = set(longest[:k])
            if settled([max(level, least[i]) if i in chosen else least[i] for i in range(len(lens))]):
                break
    return best or _pack_hybrid(lens, [cp] * len(lens), cp, tp, pair_cost, pad_to_multiple)


def _fewer_tokens(p: HybridPlacement, q: HybridPlacement) -> bool:
    return (sum(p.padded), p.ring_tokens()) < (sum(q.padded), q.ring_tokens())


def _least_padded(lens: list[int], spread: list[int], longest: list[int]) -> list[int]:
    """For each degree of ``spread`` in turn, the sequence not yet picked that a split at that degree pads
    least (ties: the longer, then the lower index): in a micro-batch of similar lengths, which ones are
    split hardly moves the balance but decides the padding."""
    picked: list[int] = []
    for d in spread:
        m = sequence_multiple(d)
        picked.append(min((i for i in longest if i not in picked), key=lambda i: -lens[i] % m))
    return picked


def _spread_degrees(k: int, degrees: list[int]) -> list[int]:
    """Degrees for k < cp sequences that give every rank the same share: for each degree d = 2, 4, ..., cp
    in turn, cp/d sequences at degree d (one per sub-group) while at least cp/d are left; largest first.
    With cp a power of two these are the binary digits of k/cp (k = 5 of 8: 4 at degree 2, 1 at 8)."""
    cp, out = degrees[-1], []
    for d in degrees[1:]:
        while k >= cp // d:
            out += [d] * (cp // d)
            k -= cp // d
    return sorted(out, reverse=True)


def _pack_hybrid(
    lens: list[int], degree: list[int], cp: int, tp: int, pair_cost: float, pad_to_multiple: int | None
) -> HybridPlacement:
    """Pack sequences of the given degrees: split ones first, the widest and then the costliest first
    (ties: lower index), each onto the aligned sub-group of its degree whose busiest rank is least loaded
    (ties: lower first rank), adding cost / d to each of its ranks; then the whole ones longest-processing-
    time first onto the least loaded rank (ties: lower rank). Rounding: a degree-d sequence pads to a
    multiple of 2·d, the last of each sub-group's degree-d segment further so that the segment divides by
    `rounding_unit(d, tp)` (or ``pad_to_multiple``), and each rank's whole part by tp."""
    padded = [-(-n // sequence_multiple(d)) * sequence_multiple(d) for n, d in zip(lens, degree)]
    loads = [0.0] * cp
    first = [0] * len(lens)
    split = sorted((i for i, d in enumerate(degree) if d > 1), key=lambda i: (-degree[i], -padded[i], i))
    for i in split:
        d, share = degree[i], sequence_cost(padded[i], pair_cost) / degree[i]
        lo = min(range(0, cp, d), key=lambda lo: (max(loads[lo : lo + d]), lo))
        first[i] = lo
        for r in range(lo, lo + d):
            loads[r] += share
    heap = [(loads[r], r) for r in range(cp)]
    heapq.heapify(heap)
    whole = [i for i, d in enumerate(degree) if d == 1]
    for i in sorted(whole, key=lambda i: (-lens[i], i)):
        load, r = heapq.heappop(heap)
        first[i] = r
        loads[r] = load + sequence_cost(lens[i], pair_cost)
        heapq.heappush(heap, (loads[r], r))
    segments: dict[tuple[int, int], list[int]] = {}
    for i in range(len(lens)):  # micro-batch order within each (degree, sub-group) segment
        segments.setdefault((degree[i], first[i]), []).append(i)
    for (d, lo), seqs in segments.items():
        multiple = tp if d == 1 else (pad_to_multiple or rounding_unit(d, tp))
        extra = -sum(padded[i] for i in seqs) % multiple
        if extra:
            last = seqs[-1]
            share = (
                sequence_cost(padded[last] + extra, pair_cost) - sequence_cost(padded[last], pair_cost)
            ) / d
            padded[last] += extra
            for r in range(lo, lo + d):
                loads[r] += share
    return HybridPlacement(cp, tp, tuple(lens), tuple(degree), tuple(first), tuple(padded), tuple(loads))
