"""Audio encoding under dynamic context parallelism: each clip is encoded on one CP rank; only the
clips of split sequences are all-gathered, a whole sequence's clip stays on the rank that decodes it.

Letters: B clips in the micro-batch, b clips one rank encodes, N audio samples, U embedding frames
(per clip), H embedding width, P padded frames per rank.

CP peers receive the same micro-batch; `parallel.cp_placement` (a pure function of its lengths, so
identical on every CP rank) says which sequences are split over the group and which rank owns each
clip (`CPPlacement.clip_owners`). Then `encode_placed`:

1. Own clips. Rank r encodes the clips it owns in one ``encode_fn`` call: first those it must send
   (clips of split sequences), then those it keeps. A rank that owns no clip encodes a dummy (zero
   audio of ``dummy_len`` samples), so FSDP2's all-gathers and reduce-scatters of the encoder run the
   same number of times on every rank. With one clip per sample the placement only leaves a rank
   without a clip when some clip is gathered; with samples that hold no audio (conversations) a rank
   may own only those: its dummy reaches no exchange and comes back in `PlacedEncoding.unused`, for
   the caller to keep in its loss with weight 0. A rank whose clips all hold 0 samples encodes the
   dummy too, and gives each of them 0 rows cut from the dummy's output (an encoder run on no frame
   leaves it out of that rank's backward: FSDP's collectives fall out of step).
2. Gather. A gathered clip goes to the ranks of its sequence's group (the whole CP group, or under
   hybrid CP degrees its aligned sub-group: ``gather_groups``), one gather per group size, largest first,
   each over the rank's own group of that size (skipped where that group gathers nothing). Frame counts
   U_i differ per clip, so at each size every rank first all-gathers the frame counts of the clips it
   sends (a fixed-size int tensor), pads its sent rows to ``P = max_r`` and runs one DIFFERENTIABLE
   exchange (``parallel.collectives.gather_head_dim0``: all-gather forward, reduce-scatter backward)
   whose input is all of this rank's rows not gathered yet: the sent head goes out, the rest (the later
   sizes' heads, the kept clips, the dummy) passes through the same autograd node to the next size's
   exchange. With one chain of nodes through every exchange, the backward reaches the encoder at the same
   point on every rank.
3. Backward. The all-gather's backward sums, over the group's ranks, the gradient each rank's loss sends
   to a gathered clip, and delivers the sum to its owner. So the owner's encoder receives the
   gradient of the whole CP group's loss for its clips, and the sum of the encoder gradients over the
   CP ranks (which FSDP2's reduction over dp_shard_cp performs) is the gradient of the total loss. A
   non-differentiable gather would leave the encoder and projector with only the owner's own share.
4. Extras. ``encode_fn`` may return an extra output (the encoder hidden states for the auxiliary CTC
   loss). `PlacedEncoding.extra` holds it for the clips this rank encoded (`PlacedEncoding.clips`,
   in that order), so computing the CTC from it on each rank counts every clip exactly once across
   the CP group; for a dummy-only rank it holds the dummy's, with ``weight`` 0, so that a head used
   only there stays in the graph and contributes nothing.

``encode_fn`` must be padding-invariant (a clip's output does not depend on the other clips or on
padding past its length), as the batching already assumes: a rank's audio is cut to its own longest
clip. Dummies pass through batch statistics if the encoder has BatchNorm in training mode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.collectives import gather_head_dim0
from parallel.frames import DUMMY_CLIP_SAMPLES

__all__ = ["EncodeFn", "PlacedEncoding", "dummy_clip", "encode_placed"]

E = TypeVar("E")
EncodeFn = Callable[[Tensor, Tensor], tuple[list[Tensor], E]]


@dataclass
class PlacedEncoding(Generic[E]):
    """One rank's result of encoding a micro-batch under a CP layout."""

    embeds: list[Tensor | None]  # per clip: gathered clips everywhere, whole ones on their owner, else None
    clips: list[int]  # the clips this rank encoded, in the order of `extra`; empty: only a dummy
    extra: E  # encode_fn's extra for `clips` (or for the dummy clip)
    weight: float = 1.0  # 0.0 when `extra` is the dummy's: keep it in the graph, count nothing
    # a dummy's embeddings that no exchange carries (this rank owns no clip and none is gathered:
    # samples without audio): the caller keeps them in its loss with weight 0
    unused: list[Tensor] = field(default_factory=list)


def dummy_clip(
    audio_BN: Tensor, audio_lens_B: Tensor, dummy_len: int = DUMMY_CLIP_SAMPLES
) -> tuple[Tensor, Tensor]:
    """``(audio [1, dummy_len], lens [1])`` of silence: what a rank with no clip of its own encodes, so
    that the encoder's collectives (FSDP) run the same number of times on every rank."""
    audio = audio_BN.new_zeros((1, dummy_len))
    return audio, torch.tensor([dummy_len], dtype=audio_lens_B.dtype, device=audio_lens_B.device)


def _gather_frame_counts(
    counts: list[int], group: Any, cp_size: int, device: torch.device
) -> list[list[int]]:
    """All-gather each rank's per-slot frame counts (fixed size b): [cp][b]."""
    local = torch.tensor(counts, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(gathered, local, group=group)
    return [[int(x) for x in t.tolist()] for t in gathered]


def encode_placed(
    encode_fn: EncodeFn[E],
    audio_BN: Tensor,
    audio_lens_B: Tensor,
    *,
    owners: list[int],
    gathered: list[bool],
    group: Any,
    cp_rank: int,
    cp_size: int,
    dummy_len: int = DUMMY_CLIP_SAMPLES,
    skip: Sequence[bool] = (),
    gather_groups: Sequence[tuple[int, int]] = (),
    subgroups: Mapping[int, Any] | None = None,
) -> PlacedEncoding[E]:
    """Encode the clips this rank owns, in one ``encode_fn`` call, and all-gather only the ``gathered``
    ones (the clips of split sequences); a whole sequence's clip stays on its owner (module docstring).

    ``owners[i]`` is the rank that encodes clip i; ``owners`` and ``gathered`` must be identical on
    every CP rank (they come from `parallel.cp_placement`, a pure function of the micro-batch);
    ``skip[i]``: clip i is sharded over the group and encoded by the caller (`parallel.clip_placement`),
    so it is neither encoded nor gathered here and its entry stays None. ``gather_groups[i] = (first, d)``:
    the aligned ranks a gathered clip goes to (hybrid CP degrees: its sequence's sub-group; empty: the
    whole group), its owner among them; ``subgroups[d]``: this rank's process group of size d (default:
    ``{cp_size: group}``). Every rank calls ``encode_fn`` exactly once (a rank that owns no clip encodes a
    dummy; the placement only leaves a rank without a clip when some clip is gathered), so FSDP2's
    collectives of the encoder stay in lockstep. Gathers run one group size at a time, largest first, each
    over this rank's group of that size (`_gather_levels`); all of this rank's outputs (its gathered clips,
    its whole clips, its dummy) pass through them in one chain of autograd nodes (`gather_head_dim0`), so
    the backward reaches the encoder at the same point on every rank; the dummy's rows are unused there and
    receive a zero gradient, which keeps the encoder in that rank's backward.
    """
    num_clips = audio_BN.shape[0]
    if len(owners) != num_clips or len(gathered) != num_clips:
        raise ValueError(f"owners/gathered have {len(owners)}/{len(gathered)} entries for {num_clips} clips")
    if any(not 0 <= o < cp_size for o in owners):
        raise ValueError(f"owners must be CP ranks in [0, {cp_size}), got {owners}")
    if skip and len(skip) != num_clips:
        raise ValueError(f"skip has {len(skip)} entries for {num_clips} clips")
    elsewhere = [bool(x) for x in skip] or [False] * num_clips  # sharded clips: encoded by the caller
    gathered = [g and not e for g, e in zip(gathered, elsewhere)]
    groups = _gather_groups(gather_groups, gathered, owners, cp_size)
    # per group size d that this rank's aligned group of d ranks gathers over, largest first: the clips
    # each rank of that group sends (the members of a group see the same plan, so they agree on its levels)
    sent = {
        d: _sent_by_rank(d, groups, gathered, owners, cp_rank)
        for d in _gather_levels(groups, gathered, cp_size)
    }
    sent = {d: by_rank for d, by_rank in sent.items() if any(by_rank)}
    levels = list(sent)
    any_gathered = bool(levels)
    kept = [i for i, o in enumerate(owners) if o == cp_rank and not gathered[i] and not elsewhere[i]]
    mine = [i for d in levels for i in sent[d][cp_rank % d]] + kept  # gathered ones first, by level
    heard = False  # some clip of mine has audio
    if mine:
        idx = torch.tensor(mine, dtype=torch.long, device=audio_BN.device)
        lens_b = audio_lens_B.index_select(0, idx)
        heard = int(lens_b.max()) > 0
    if heard:
        audio_bN = audio_BN.index_select(0, idx)[:, : int(lens_b.max())]
    else:  # no clip, or clips of 0 samples only: their empty graph would leave the encoder's backward out
        audio_bN, lens_b = dummy_clip(audio_BN, audio_lens_B, dummy_len)
    local_embeds, extra = encode_fn(audio_bN, lens_b)
    if mine and not heard:  # 0 rows each, cut from the dummy's (its rows follow, which nobody reads)
        local_embeds = [local_embeds[0][:0] for _ in mine] + list(local_embeds)
    embeds: list[Tensor | None] = [None] * num_clips
    result = PlacedEncoding(embeds, mine if heard else [], extra, 1.0 if heard else 0.0)
    if not heard and not any_gathered:  # no clip with audio here: the dummy reaches no exchange
        result.unused = list(local_embeds[len(mine) :])
        for i in mine:
            embeds[i] = local_embeds[0][:0]
        return result
    if not any_gathered:
        for i, e in zip(mine, local_embeds):
            embeds[i] = e
        return result
    pgs = dict(subgroups) if subgroups is not None else {cp_size: group}
    counts = [int(e.shape[0]) for e in local_embeds]
    rest = torch.cat(list(local_embeds), dim=0)  # this rank's rows not gathered yet, in `mine` order
    done = 0  # clips of `mine` gathered so far
    for d in levels:
        if d not in pgs:
            raise ValueError(f"a clip is gathered over {d} CP ranks, but rank {cp_rank} has no such group")
        by_rank = sent[d]
        n_mine = len(by_rank[cp_rank % d])
        head_counts = counts[done : done + n_mine]
        width = max(1, *(len(x) for x in by_rank))
        all_counts = _gather_frame_counts(
            head_counts + [0] * (width - n_mine), pgs[d], d, audio_lens_B.device
        )
        pad_to = max(1, max(sum(c) for c in all_counts))
        gathered_PH, rest = gather_head_dim0(rest, sum(head_counts), pad_to, pgs[d])
        for clips, rank_counts, rank_PH in zip(by_rank, all_counts, gathered_PH.split(pad_to, dim=0)):
            real = rank_counts[: len(clips)]
            for i, e in zip(clips, torch.split(rank_PH[: sum(real)], real, dim=0)):
                embeds[i] = e
        done += n_mine
    for i, e in zip(kept, torch.split(rest, counts[done:], dim=0)):
        embeds[i] = e
    return result


def _gather_groups(
    gather_groups: Sequence[tuple[int, int]], gathered: Sequence[bool], owners: Sequence[int], cp_size: int
) -> list[tuple[int, int]]:
    """Per clip, the aligned ranks ``(first, d)`` it is gathered to (``gather_groups``, or the whole group for
    every gathered clip), checked: its owner among them."""
    if not gather_groups:
        return [(0, cp_size) if g else (o, 1) for g, o in zip(gathered, owners)]
    if len(gather_groups) != len(owners):
        raise ValueError(f"gather_groups has {len(gather_groups)} entries for {len(owners)} clips")
    out = [(int(f), int(d)) for f, d in gather_groups]
    for i, ((f, d), o, g) in enumerate(zip(out, owners, gathered)):
        if g and (d < 2 or f % d or not f <= o < f + d or f + d > cp_size):
            raise ValueError(
                f"clip {i} is gathered to the ranks [{f}, {f + d}), which must be an aligned group of 2 or "
                f"more of the {cp_size} CP ranks holding its owner {o}"
            )
    return out


def _gather_levels(groups: Sequence[tuple[int, int]], gathered: Sequence[bool], cp_size: int) -> list[int]:
    """The group sizes some clip of the micro-batch is gathered over, largest first: a rank runs one gather
    per size where its own aligned group of that size gathers a clip, in this order, so the collectives of
    every group run in the same order on all its members. A group that gathers nothing at a size skips it
    on every member (a gather whose output no member uses would run its backward on some members only)."""
    if cp_size <= 1:
        return []
    return sorted({d for (_, d), g in zip(groups, gathered) if g}, reverse=True)


def _sent_by_rank(
    d: int, groups: Sequence[tuple[int, int]], gathered: Sequence[bool], owners: Sequence[int], cp_rank: int
) -> list[list[int]]:
    """Per rank of ``cp_rank``'s aligned group of size d (in group order): the clips it sends at this level,
    in clip order."""
    first = cp_rank // d * d
    out: list[list[int]] = [[] for _ in range(d)]
    for i, ((f, size), g) in enumerate(zip(groups, gathered)):
        if g and size == d and f == first:
            out[owners[i] - first].append(i)
    return out
