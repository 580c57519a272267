"""The context-parallel layout of a model, as one typed object: place, encode, shard, attention context.

Letters: B clips of a micro-batch, N audio samples, T packed tokens, H hidden.

Clips and sequences. A plan is per sequence (`place` sees sequence lengths); with one clip per sample
clip i is sequence i. Samples with several clips (conversations) see the plan through
`plan_for_clips(plan, clip_sample)`: each clip is encoded by its sequence's clip owner and gathered to
every rank of its sequence's (sub-)group when its sequence is split, so a whole sequence's clips all stay
on the rank that decodes it.

A speech LLM's micro-batch goes through four CP decisions, in this order (`SpeechLLM.forward`):

    plan = layout.place(seq_lens)                          which sequences are split over the CP
                                                           group, which live whole here, padded how
    enc = layout.encode(encode_fn, audio_BN, lens_B, plan) each clip encoded on one rank; the split
                                                           sequences' clips all-gathered
    ...   pack_thd(plan.indices, plan.padded_lengths)     (the model packs its local sequences)
    parts, cu, max_len = layout.shard(tensors, cu, max_len, plan)
                                                           this rank's chunks of the split sequences
                                                           + its whole ones
    ctx = layout.attention_context(meta, n_split)          what the attention backends receive

Audio whose LLM lengths are known only after the encoder (CTC compression) is encoded with
`plan_for_clips(..., gather_all=True)`: every clip gathered to every rank, then `place` runs again on
the encoded lengths (`speechlm.model.cp_audio.place_encoded`).

`CPLayout` is the protocol; three implementations:
- `NullCPLayout` (one CP rank, the default of every model): every sequence whole here, encoding in
  one call, no sharding, no CP attention context (None). ``round_cp``/``tp``/``pad_to_multiple`` say
  how the packed lengths are rounded (`parallel.rounding.round_lengths`): a one-process reference can
  round like a cp > 1 run without sharding anything.
- `DynamicCPLayout` (cp > 1): dynamic CP (`parallel.cp_placement`), placed encoding
  (`parallel.dist_encode`), sharding (`parallel.cp_shard.shard_placed_thd`) and ring/all-gather
  attention (`parallel.cp_attention`), over a CP process group that stays opaque to the model.
- `parallel.hybrid_layout.HybridCPLayout` (cp > 1, ``parallel.cp_degrees=hybrid``): a split sequence spans
  an aligned sub-group of 2, 4, ..., cp ranks (`parallel.cp_placement.place_hybrid`); the plan's
  ``local_degrees`` tell `attention_context` each local sequence's degree.

The model never touches ``torch.distributed`` and never tests which layout it holds: the training
layer builds the layout from the mesh and the config (`speechlm.train.distributed`) and hands it to
the model once (`SpeechLLM.set_cp_layout`). Model-specific pieces come in as arguments: the encoder
as a callable ``encode_fn(audio_bN, lens_b) -> (embeds, extra)``, the packed stream as a mapping of
``[T, ...]`` tensors with its ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from torch import Tensor

from parallel import sharded_clip
from parallel.clip_handover import Handover
from parallel.clip_placement import ClipGroup, ClipSharding, place_clips
from parallel.cp_attention import CPAttention, CPAttentionContext
from parallel.cp_placement import LocalPlacement, place_sequences
from parallel.cp_shard import shard_placed_thd
from parallel.dist_encode import EncodeFn, PlacedEncoding, encode_placed
from parallel.dist_encode import dummy_clip as dummy_clip  # re-exported: the model's no-clip dummy
from parallel.halo import Exchange, HaloExchange
from parallel.rounding import round_lengths
from parallel.varlen_meta import VarlenMeta

__all__ = [
    "CPLayout",
    "CPPlan",
    "ClipPlan",
    "DynamicCPLayout",
    "NullCPLayout",
    "WholePlan",
    "plan_for_clips",
]

E = TypeVar("E")


class CPPlan(Protocol):
    """Where one micro-batch's sequences live on this rank (`CPLayout.place`)."""

    @property
    def indices(self) -> list[int]:
        """The sequences of this rank's local stream before sharding, in stream order."""
        ...

    @property
    def padded_lengths(self) -> list[int]:
        """Their lengths in the local stream before sharding (rounded, padded)."""
        ...

    @property
    def n_split(self) -> int:
        """How many of them (the first ones) are split over the CP group (or a sub-group of it)."""
        ...

    @property
    def local_degrees(self) -> list[int]:
        """Per sequence of `indices`: the CP ranks it is split over (1: whole on this rank)."""
        ...

    @property
    def clip_owners(self) -> list[int]:
        """Per clip of the micro-batch: the CP rank that encodes it."""
        ...

    @property
    def degrees(self) -> list[int]:
        """Per clip of the micro-batch: the CP ranks its sequence is split over (1: whole)."""
        ...

    @property
    def gathered(self) -> list[bool]:
        """Per clip of the micro-batch: whether its embeddings go to other CP ranks (a split sequence)."""
        ...

    @property
    def gather_groups(self) -> list[ClipGroup]:
        """Per clip of the micro-batch: ``(first, d)``, the aligned CP ranks ``[first, first + d)`` that
        receive its embeddings (its sequence's group; d = 1: it stays on its owner)."""
        ...


class CPLayout(Protocol):
    """The CP decisions of one rank (module docstring)."""

    @property
    def cp_size(self) -> int: ...

    @property
    def cp_rank(self) -> int: ...

    @property
    def tp(self) -> int:
        """The TP size the packed lengths are rounded for."""
        ...

    def place(self, seq_lens: Sequence[int]) -> CPPlan: ...

    def for_planning(self) -> CPLayout:
        """A copy that places and shards clips but holds no process group (the data pipeline's)."""
        ...

    def encode(
        self,
        encode_fn: EncodeFn[E],
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        plan: CPPlan,
        skip: Sequence[bool] = (),
    ) -> PlacedEncoding[E]:
        """Encode the clips (``skip[i]``: clip i is sharded over the group, its slices encoded with the
        whole clips by `encode_fn`; its entry is left None)."""
        ...

    def clip_sharding(
        self,
        frames: Sequence[int],
        *,
        min_frames: int,
        min_slice: int,
        groups: Sequence[ClipGroup] = (),
    ) -> ClipSharding:
        """Which clips the encoder shards (`parallel.clip_placement.place_clips`); ``groups``: per clip the
        aligned CP ranks it would be sharded over (its sequence's sub-group under hybrid degrees; empty:
        the whole CP group)."""
        ...

    def halo(self, group: ClipGroup) -> Exchange:
        """The halo exchange of the slices of a clip sharded over ``group`` (`parallel.halo`)."""
        ...

    def hand_over(self, x_PH: Tensor, handover: Handover, group: ClipGroup) -> Tensor:
        """A sharded clip's projected rows to the ranks of ``group`` whose streams hold them
        (`parallel.sharded_clip`; ``handover`` is over the group's ranks, in order)."""
        ...

    def gather_slices(self, x_UE: Tensor, counts: Sequence[int], group: ClipGroup) -> Tensor:
        """A sharded clip's encoder frames, the slice of every rank of ``group``, on each of them
        (`parallel.sharded_clip`)."""
        ...

    def tie(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The audio side's outputs through one autograd node (`parallel.sharded_clip.tie`)."""
        ...

    def reduce_sum(self, x: Tensor, group: ClipGroup) -> Tensor:
        """``x`` summed over the ranks of ``group`` (no gradient): a sharded clip's feature statistics."""
        ...

    def shard(
        self, tensors: Mapping[str, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: CPPlan
    ) -> tuple[dict[str, Tensor], Tensor, int]: ...

    def attention_context(
        self, meta: VarlenMeta, n_split: int, degrees: Sequence[int] = ()
    ) -> CPAttentionContext | None:
        """What the attention backends receive; ``degrees``: `CPPlan.local_degrees` (hybrid degrees)."""
        ...


@dataclass(frozen=True)
class WholePlan:
    """`NullCPLayout`'s plan: every sequence whole on this rank, in micro-batch order."""

    padded_lengths: list[int]

    @property
    def indices(self) -> list[int]:
        return list(range(len(self.padded_lengths)))

    @property
    def n_split(self) -> int:
        return 0

    @property
    def local_degrees(self) -> list[int]:
        return [1] * len(self.padded_lengths)

    @property
    def degrees(self) -> list[int]:
        return [1] * len(self.padded_lengths)

    @property
    def clip_owners(self) -> list[int]:
        return [0] * len(self.padded_lengths)

    @property
    def gathered(self) -> list[bool]:
        return [False] * len(self.padded_lengths)

    @property
    def gather_groups(self) -> list[ClipGroup]:
        return [(0, 1)] * len(self.padded_lengths)


@dataclass(frozen=True)
class ClipPlan:
    """A plan whose samples hold any number of clips (conversations): the sequences are ``plan``'s, the
    clips those of ``clip_sample`` (the sequence of each clip, non-decreasing). A clip lives where its
    sequence lives: a whole sequence's clips are encoded by its owner and stay there; a split
    sequence's clips are gathered to every rank of its sequence's group (the whole CP group, or its
    sub-group under hybrid degrees). With ``clip_lens`` (frames per clip) the gathered clips are dealt one
    by one, longest first, to the rank of that group with the least encoding work so far (ties: lower
    clip, lower rank), so that the clips of one long conversation do not all land on one encoder;
    without, each goes to its sequence's clip owner. ``gather_all``: every clip's group is the whole CP
    group. A function of the plan, ``clip_sample`` and ``clip_lens`` only, so identical on every CP rank."""

    plan: CPPlan
    clip_sample: tuple[int, ...]
    clip_lens: tuple[int, ...] = ()
    cp_size: int = 1
    gather_all: bool = False  # every clip gathered, whatever its sequence (`plan_for_clips`)

    @property
    def indices(self) -> list[int]:
        return self.plan.indices

    @property
    def padded_lengths(self) -> list[int]:
        return self.plan.padded_lengths

    @property
    def n_split(self) -> int:
        return self.plan.n_split

    @property
    def local_degrees(self) -> list[int]:
        return self.plan.local_degrees

    @property
    def degrees(self) -> list[int]:
        per_seq = self.plan.degrees
        return [per_seq[s] for s in self.clip_sample]

    @property
    def clip_owners(self) -> list[int]:
        per_seq = self.plan.clip_owners
        owners = [per_seq[s] for s in self.clip_sample]
        if not self.clip_lens or self.cp_size <= 1:
            return owners
        groups = self.gather_groups
        work = [0] * self.cp_size
        for c, o in enumerate(owners):
            if groups[c][1] == 1:
                work[o] += self.clip_lens[c]
        for c in sorted((c for c, g in enumerate(groups) if g[1] > 1), key=lambda c: (-self.clip_lens[c], c)):
            first, d = groups[c]
            r = min(range(first, first + d), key=lambda r: (work[r], r))
            owners[c] = r
            work[r] += self.clip_lens[c]
        return owners

    @property
    def gathered(self) -> list[bool]:
        return [d > 1 for _, d in self.gather_groups]

    @property
    def gather_groups(self) -> list[ClipGroup]:
        if self.gather_all and self.cp_size > 1:
            return [(0, self.cp_size)] * len(self.clip_sample)
        per_seq = self.plan.gather_groups
        return [per_seq[s] for s in self.clip_sample]


def plan_for_clips(
    plan: CPPlan,
    clip_sample: Sequence[int],
    clip_lens: Sequence[int] = (),
    cp_size: int = 1,
    *,
    gather_all: bool = False,
) -> ClipPlan:
    """``plan`` (per sequence) seen per clip: ``clip_sample[c]`` is the sequence of clip ``c``;
    ``clip_lens`` (its frames) and ``cp_size`` spread the split sequences' clips (`ClipPlan`).
    ``gather_all``: every clip is gathered to every CP rank, and so dealt over the encoders longest first:
    the encoding plan of audio whose LLM lengths are known only after the encoder (CTC compression), whose
    sequences are placed again from the encoded lengths (`speechlm.model.cp_audio.place_encoded`); only
    ``gathered`` and ``clip_owners`` differ from ``plan``'s."""
    n = len(plan.clip_owners)
    bad = [c for c, s in enumerate(clip_sample) if not 0 <= int(s) < n]
    if bad:
        raise ValueError(
            f"clip {bad[0]} belongs to sequence {clip_sample[bad[0]]}, but the plan has {n} sequences"
        )
    if clip_lens and len(clip_lens) != len(clip_sample):
        raise ValueError(f"got {len(clip_lens)} clip lengths for {len(clip_sample)} clips")
    clips, lens = tuple(int(s) for s in clip_sample), tuple(int(a) for a in clip_lens)
    return ClipPlan(plan, clips, lens, int(cp_size), gather_all)


@dataclass(frozen=True)
class NullCPLayout:
    """One CP rank: nothing is split, gathered or sharded (module docstring)."""

    round_cp: int = 1  # round lengths as for this CP size (a one-process reference of a CP run)
    tp: int = 1
    pad_to_multiple: int | None = None
    cp_size: int = field(default=1, init=False)
    cp_rank: int = field(default=0, init=False)

    def place(self, seq_lens: Sequence[int]) -> WholePlan:
        return WholePlan(round_lengths(seq_lens, self.round_cp, self.tp, self.pad_to_multiple))

    def encode(
        self,
        encode_fn: EncodeFn[E],
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        plan: CPPlan,
        skip: Sequence[bool] = (),
    ) -> PlacedEncoding[E]:
        if any(skip):
            raise ValueError("one CP rank shards no clip: skip must be all False")
        if audio_BN.shape[0] == 0:  # samples without audio only: a dummy keeps the encoder in the graph
            embeds, extra = encode_fn(*dummy_clip(audio_BN, audio_lens_B))
            return PlacedEncoding([], [], extra, 0.0, unused=list(embeds))
        embeds, extra = encode_fn(audio_BN, audio_lens_B)
        return PlacedEncoding(list(embeds), list(range(len(embeds))), extra)

    def for_planning(self) -> NullCPLayout:
        return self

    def clip_sharding(
        self,
        frames: Sequence[int],
        *,
        min_frames: int,
        min_slice: int,
        groups: Sequence[ClipGroup] = (),
    ) -> ClipSharding:
        return place_clips(frames, 1, min_frames=min_frames)  # nothing is sharded on one rank

    def halo(self, group: ClipGroup) -> Exchange:
        raise RuntimeError("one CP rank shards no clip: there is no halo to exchange")

    def hand_over(self, x_PH: Tensor, handover: Handover, group: ClipGroup) -> Tensor:
        raise RuntimeError("one CP rank shards no clip: there is nothing to hand over")

    def gather_slices(self, x_UE: Tensor, counts: Sequence[int], group: ClipGroup) -> Tensor:
        raise RuntimeError("one CP rank shards no clip: there are no slices to gather")

    def tie(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return list(tensors)  # one rank: no collective to keep in order

    def reduce_sum(self, x: Tensor, group: ClipGroup) -> Tensor:
        return x

    def shard(
        self, tensors: Mapping[str, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: CPPlan
    ) -> tuple[dict[str, Tensor], Tensor, int]:
        return dict(tensors), cu_seqlens, max_seqlen

    def attention_context(self, meta: VarlenMeta, n_split: int, degrees: Sequence[int] = ()) -> None:
        return None


@dataclass(frozen=True)
class DynamicCPLayout:
    """cp > 1: dynamic context parallelism over ``group`` (module docstring).

    ``threshold``: ``parallel.cp_split_threshold`` ("auto", or tokens; 0 splits every sequence);
    ``pair_cost``: the modelled cost of one attention pair in tokens (about ``1 / (6 * hidden)``);
    ``kind``: ``parallel.cp_attention`` ("ring" or "allgather")."""

    group: Any
    cp_size: int
    cp_rank: int
    kind: str
    tp: int = 1
    threshold: int | str = "auto"
    pair_cost: float = 0.0
    pad_to_multiple: int | None = None
    cp_attention: CPAttention = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        attention = CPAttention(self.group, self.cp_size, self.cp_rank, self.kind)
        object.__setattr__(self, "cp_attention", attention)

    def for_planning(self) -> DynamicCPLayout:
        """This layout without its process group: `place` and `clip_sharding` only (pure functions of
        lengths), for the data pipeline, which decodes the clips this rank encodes (picklable)."""
        return replace(self, group=None)

    def place(self, seq_lens: Sequence[int]) -> LocalPlacement:
        placement = place_sequences(
            seq_lens,
            self.cp_size,
            threshold=self.threshold,
            tp=self.tp,
            pair_cost=self.pair_cost,
            pad_to_multiple=self.pad_to_multiple,
        )
        return placement.local(self.cp_rank)

    def process_groups(self) -> dict[int, Any]:
        """This rank's process group of each size a clip can be gathered or sharded over: the CP group."""
        return {self.cp_size: self.group}

    def process_group(self, group: ClipGroup) -> tuple[Any, int]:
        """``(process group, this rank's place in it)`` of the aligned ranks ``group = (first, d)``, which
        must hold this rank (`process_groups` has one per size d)."""
        first, d = group
        mine = self.process_groups()
        if d not in mine or not first <= self.cp_rank < first + d or first % d:
            raise ValueError(
                f"CP rank {self.cp_rank} has no process group for the ranks [{first}, {first + d}) "
                f"(sizes {sorted(mine)}): a clip is sharded or gathered only over a group that holds it"
            )
        return mine[d], self.cp_rank - first

    def encode(
        self,
        encode_fn: EncodeFn[E],
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        plan: CPPlan,
        skip: Sequence[bool] = (),
    ) -> PlacedEncoding[E]:
        return encode_placed(
            encode_fn,
            audio_BN,
            audio_lens_B,
            owners=plan.clip_owners,
            gathered=plan.gathered,
            group=self.group,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
            skip=skip,
            gather_groups=plan.gather_groups,
            subgroups=self.process_groups(),
        )

    def clip_sharding(
        self,
        frames: Sequence[int],
        *,
        min_frames: int,
        min_slice: int,
        groups: Sequence[ClipGroup] = (),
    ) -> ClipSharding:
        return place_clips(frames, self.cp_size, min_frames=min_frames, min_slice=min_slice, groups=groups)

    def halo(self, group: ClipGroup) -> Exchange:
        return HaloExchange(self.process_group(group)[0])

    def hand_over(self, x_PH: Tensor, handover: Handover, group: ClipGroup) -> Tensor:
        pg, rank = self.process_group(group)
        return sharded_clip.hand_over(x_PH, handover, rank, pg)

    def gather_slices(self, x_UE: Tensor, counts: Sequence[int], group: ClipGroup) -> Tensor:
        pg, rank = self.process_group(group)
        return sharded_clip.gather_slices(x_UE, counts, rank, pg)

    def tie(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return sharded_clip.tie(tensors)

    def reduce_sum(self, x: Tensor, group: ClipGroup) -> Tensor:
        return sharded_clip.reduce_sum(x, self.process_group(group)[0])

    def shard(
        self, tensors: Mapping[str, Tensor], cu_seqlens: Tensor, max_seqlen: int, plan: CPPlan
    ) -> tuple[dict[str, Tensor], Tensor, int]:
        parts, cu_local, max_local = shard_placed_thd(
            tensors, cu_seqlens, plan.n_split, self.cp_size, self.cp_rank
        )
        return parts, cu_local, int(max_local)

    def attention_context(
        self, meta: VarlenMeta, n_split: int, degrees: Sequence[int] = ()
    ) -> CPAttentionContext:
        return self.cp_attention.for_split_prefix(n_split, meta)
