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

Degrees between 1 and cp (splitting over CP sub-groups) are not implemented: a sequence is either on
one rank or on all of them.

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
    "LocalPlacement",
    "AUTO_TOLERANCE",
    "place_auto",
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

    def local(self, rank: int) -> LocalPlacement:
        return LocalPlacement(self, rank)


@dataclass(frozen=True)
class LocalPlacement:
    """One rank's view of a `CPPlacement`: what it packs, in which order, to which lengths."""

    placement: CPPlacement
    rank: int

    @property
    def indices(self) -> list[int]:
        return self.placement.local_indices(self.rank)

    @property
    def padded_lengths(self) -> list[int]:
        return [self.placement.padded[i] for i in self.indices]

    @property
    def n_split(self) -> int:
        return len(self.placement.split_indices)

    @property
    def clip_owners(self) -> list[int]:
        return self.placement.clip_owners()

    @property
    def gathered(self) -> list[bool]:
        """Per clip: its sequence is split, so its embeddings go to every rank."""
        return list(self.placement.split)


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
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1, got cp={cp}, tp={tp}")
    lens = [int(n) for n in lengths]
    for i, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every packed sequence needs at least one token")
    unit = rounding_unit(cp, tp)
    if pad_to_multiple is not None and (pad_to_multiple < 1 or pad_to_multiple % unit):
        raise ValueError(f"pad_to_multiple={pad_to_multiple} is not a multiple of {unit} (cp={cp}, tp={tp})")
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
