"""Distributed audio encoding across the CP group: each rank encodes 1/cp of the clips, all get all.

Letters: B clips in the micro-batch, b clips one rank encodes, N audio samples, U embedding frames
(per clip), H embedding width, P padded frames per rank.

CP peers receive the same micro-batch. Without this module every CP rank would run the encoder on
all B clips (cp-fold duplicated work). Instead:

1. Shares. Pad the clip count to ``B' = cp * b`` with ``b = max(1, ceil(B / cp))``; rank r owns the
   contiguous slots ``[r*b, (r+1)*b)``. Slots ``>= B`` are dummies: zero audio of ``dummy_len``
   samples. Every rank encodes exactly b clips in one ``encode_fn`` call, so FSDP2's all-gathers
   and reduce-scatters of the encoder run the same number of times on every rank. Example B=3,
   cp=2: b=2, rank 0 owns clips [0, 1], rank 1 owns clip [2] plus one dummy; B=1, cp=2: rank 1
   encodes only a dummy.
2. Gather. Frame counts U_i differ per clip, so each rank first all-gathers its b frame counts (a
   fixed-size int tensor; dummies count 0), concatenates its real clips' embeddings to ``[U_r, H]``,
   pads to ``P = max_r U_r`` and runs a DIFFERENTIABLE all-gather
   (``parallel.collectives.gather_dim0``: all-gather forward, reduce-scatter backward); the result is trimmed and split back into B
   per-clip tensors, in order, identical on every rank.
3. Backward. The all-gather's backward sums, over all CP ranks, the gradient each rank's loss sends
   to a slot, and delivers the sum to the slot's owner. So the owner's encoder receives the gradient
   of the whole CP group's loss for its clips, and the sum of the encoder gradients over the CP ranks
   (which FSDP2's reduction over dp_shard_cp performs) is the gradient of the total loss. A
   non-differentiable gather here would leave the encoder and projector with only the owner's own
   share of the loss gradient.
4. Dummies. Their embeddings are added with weight zero into the rank's gather input, so the encoder
   is in every rank's autograd graph (its backward hooks fire everywhere) while contributing nothing.
5. Extras. ``encode_fn`` may return extra outputs (e.g. encoder hidden states for an auxiliary CTC
   loss). ``local_extra`` holds them for this rank's real clips only; computing the CTC from it on
   each rank counts every clip exactly once across the CP group. ``dummy_extra`` holds the dummies'
   part, for callers that must keep a head used only there in the graph with weight zero.

``encode_fn`` must be padding-invariant (a clip's output does not depend on the other clips or on
padding past its length), as the batching already assumes: a rank's audio is cut to its own longest
clip. Dummies pass through batch statistics if the encoder has BatchNorm in training mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.collectives import gather_dim0

__all__ = ["DistEncodeResult", "cp_clip_ranges", "encode_distributed", "slice_extra"]

EncodeFn = Callable[[Tensor, Tensor], tuple[list[Tensor], Any]]


@dataclass
class DistEncodeResult:
    embeds: list[Tensor]  # B tensors [U_i, H], all real clips in order, on every CP rank
    local_range: range  # this rank's real clips (indices into embeds); may be empty
    local_extra: Any  # encode_fn's extra for the real clips of local_range (sliced, see slice_extra)
    dummy_extra: Any  # encode_fn's extra for this rank's dummies, None if it has none


def cp_clip_ranges(num_clips: int, cp: int) -> list[range]:
    """Contiguous clip shares of the cp ranks; every rank owns ``max(1, ceil(B/cp))`` slots, the
    returned ranges are the real clips among them (trailing ranks may get fewer or none)."""
    if cp < 1 or num_clips < 0:
        raise ValueError(f"need cp >= 1 and num_clips >= 0, got cp={cp}, num_clips={num_clips}")
    per = max(1, math.ceil(num_clips / cp))
    return [range(min(r * per, num_clips), min((r + 1) * per, num_clips)) for r in range(cp)]


def slice_extra(extra: Any, sl: slice) -> Any:
    """Slice encode_fn's extra along the clip axis: tensors on dim 0, lists as per-clip lists,
    objects with a ``slice_clips(slice)`` method (packed frames of several clips) through it, tuples
    and mappings element-wise (recursively); None and other values pass through."""
    if hasattr(extra, "slice_clips"):
        return extra.slice_clips(sl)
    if isinstance(extra, Tensor):
        return extra[sl]
    if isinstance(extra, list):
        return extra[sl]
    if isinstance(extra, tuple):
        items = [slice_extra(e, sl) for e in extra]
        return type(extra)(*items) if hasattr(extra, "_fields") else tuple(items)
    if isinstance(extra, Mapping):
        return {k: slice_extra(v, sl) for k, v in extra.items()}
    return extra


def _build_local_audio(
    audio_BN: Tensor, audio_lens_B: Tensor, share: range, num_slots: int, dummy_len: int
) -> tuple[Tensor, Tensor]:
    """This rank's clips followed by zero dummies, cut to the longest of them: ([b, N_loc], [b])."""
    n_dummy = num_slots - len(share)
    lens = [int(x) for x in audio_lens_B[share.start : share.stop].tolist()] + [dummy_len] * n_dummy
    n_loc = max(lens)
    audio_bN = audio_BN.new_zeros((num_slots, n_loc))
    if len(share):
        width = min(n_loc, audio_BN.shape[1])
        audio_bN[: len(share), :width] = audio_BN[share.start : share.stop, :width]
    return audio_bN, torch.tensor(lens, dtype=audio_lens_B.dtype, device=audio_lens_B.device)


def _gather_frame_counts(
    counts: list[int], group: Any, cp_size: int, device: torch.device
) -> list[list[int]]:
    """All-gather each rank's per-slot frame counts (fixed size b): [cp][b]."""
    local = torch.tensor(counts, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(gathered, local, group=group)
    return [[int(x) for x in t.tolist()] for t in gathered]


def encode_distributed(
    encode_fn: EncodeFn,
    audio_BN: Tensor,
    audio_lens_B: Tensor,
    *,
    group: Any,
    cp_rank: int,
    cp_size: int,
    dummy_len: int = 1600,
) -> DistEncodeResult:
    """Encode this rank's share of the clips and all-gather every clip's embeddings (module docstring).

    ``encode_fn(audio_bN, audio_lens_b) -> (embeds: list of b tensors [U_i, H], extra)``; ``group`` is
    the CP process group (unused when ``cp_size == 1``). Every CP rank must call this with the same
    batch.
    """
    num_clips = audio_BN.shape[0]
    if audio_lens_B.shape != (num_clips,):
        raise ValueError(f"audio_lens_B has shape {tuple(audio_lens_B.shape)}, expected ({num_clips},)")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside cp_size={cp_size}")
    if dummy_len < 1:
        raise ValueError(f"dummy_len must be >= 1 audio samples, got {dummy_len}")
    shares = cp_clip_ranges(num_clips, cp_size)
    share = shares[cp_rank]
    num_slots = max(1, math.ceil(num_clips / cp_size))
    n_real = len(share)

    audio_bN, lens_b = _build_local_audio(audio_BN, audio_lens_B, share, num_slots, dummy_len)
    local_embeds, extra = encode_fn(audio_bN, lens_b)
    if len(local_embeds) != num_slots:
        raise ValueError(f"encode_fn returned {len(local_embeds)} embeddings for {num_slots} clips")
    local_extra = slice_extra(extra, slice(0, n_real))
    dummy_extra = slice_extra(extra, slice(n_real, num_slots)) if n_real < num_slots else None

    real, dummies = local_embeds[:n_real], local_embeds[n_real:]
    if cp_size == 1:
        return DistEncodeResult(list(real), share, local_extra, dummy_extra)

    if dist.get_rank(group) != cp_rank or dist.get_world_size(group) != cp_size:
        raise ValueError(
            f"cp_rank={cp_rank}/cp_size={cp_size} do not match the group's rank {dist.get_rank(group)} "
            f"of {dist.get_world_size(group)}; pass the CP group and this rank's place in it"
        )
    counts = [int(e.shape[0]) for e in real] + [0] * len(dummies)
    all_counts = _gather_frame_counts(counts, group, cp_size, audio_lens_B.device)
    pad_to = max(sum(c) for c in all_counts)
    ref = local_embeds[0]
    flat_UH = torch.cat(real, dim=0) if real else ref.new_zeros((0, ref.shape[-1]))
    flat_PH = torch.nn.functional.pad(flat_UH, (0, 0, 0, pad_to - flat_UH.shape[0]))
    if dummies:  # weight zero: keeps the encoder in this rank's backward without changing any value
        flat_PH = flat_PH + 0.0 * sum(d.sum() for d in dummies)

    gathered = gather_dim0(flat_PH, group).split(pad_to, dim=0)
    embeds: list[Tensor] = []
    for rank_counts, rank_PH, rank_share in zip(all_counts, gathered, shares):
        real_counts = rank_counts[: len(rank_share)]
        embeds.extend(torch.split(rank_PH[: sum(real_counts)], real_counts, dim=0))
    return DistEncodeResult(embeds, share, local_extra, dummy_extra)


@dataclass
class PlacedEncodeResult:
    embeds: list[Tensor | None]  # per clip: gathered clips everywhere, whole ones on their owner, else None
    local_clips: list[int]  # the clips this rank encoded, in the order of local_extra (gathered ones first)
    local_extra: Any  # encode_fn's extra for local_clips
    dummy_extra: Any  # encode_fn's extra for the dummy clip of a rank that owns no clip, else None


def encode_placed(
    encode_fn: EncodeFn,
    audio_BN: Tensor,
    audio_lens_B: Tensor,
    *,
    owners: list[int],
    gathered: list[bool],
    group: Any,
    cp_rank: int,
    cp_size: int,
    dummy_len: int = 1600,
) -> PlacedEncodeResult:
    """Dynamic CP: encode the clips this rank owns, in one ``encode_fn`` call, and all-gather only the
    ``gathered`` ones (the clips of split sequences); a whole sequence's clip stays on its owner.

    ``owners[i]`` is the rank that encodes clip i; ``owners`` and ``gathered`` must be identical on
    every CP rank (they come from `parallel.cp_placement`, a pure function of the micro-batch). Every
    rank calls ``encode_fn`` exactly once (a rank that owns no clip encodes a dummy; the placement
    only leaves a rank without a clip when some clip is gathered), so FSDP2's collectives of the
    encoder stay in lockstep. When some clip is gathered, all of this rank's outputs (its gathered
    clips, its whole clips, its dummy) pass through one autograd node (`gather_head_dim0`), so the
    backward reaches the encoder at the same point on every rank; the dummy's rows are unused there
    and receive a zero gradient, which keeps the encoder in that rank's backward. The gather is
    differentiable, as in `encode_distributed`.
    """
    from parallel.collectives import gather_head_dim0

    num_clips = audio_BN.shape[0]
    if len(owners) != num_clips or len(gathered) != num_clips:
        raise ValueError(f"owners/gathered have {len(owners)}/{len(gathered)} entries for {num_clips} clips")
    if any(not 0 <= o < cp_size for o in owners):
        raise ValueError(f"owners must be CP ranks in [0, {cp_size}), got {owners}")
    any_gathered = cp_size > 1 and any(gathered)
    sent = [[i for i, o in enumerate(owners) if o == r and gathered[i]] for r in range(cp_size)]
    kept = [i for i, o in enumerate(owners) if o == cp_rank and not gathered[i]]
    mine = sent[cp_rank] + kept  # gathered ones first: the head of the exchange below
    if not mine and not any_gathered:
        raise ValueError(
            f"CP rank {cp_rank} owns no clip and none is gathered: it would have nothing in step with "
            "the other ranks' encoder backward (the placement must give every rank work)"
        )
    if mine:
        idx = torch.tensor(mine, dtype=torch.long, device=audio_BN.device)
        lens_b = audio_lens_B.index_select(0, idx)
        audio_bN = audio_BN.index_select(0, idx)[:, : int(lens_b.max())]
    else:
        audio_bN = audio_BN.new_zeros((1, dummy_len))
        lens_b = torch.tensor([dummy_len], dtype=audio_lens_B.dtype, device=audio_lens_B.device)
    local_embeds, extra = encode_fn(audio_bN, lens_b)
    embeds: list[Tensor | None] = [None] * num_clips
    result = PlacedEncodeResult(embeds, mine, extra if mine else None, None if mine else extra)
    if not any_gathered:
        for i, e in zip(mine, local_embeds):
            embeds[i] = e
        return result
    counts = [int(e.shape[0]) for e in local_embeds]
    n_head = sum(counts[: len(sent[cp_rank])])
    width = max(len(x) for x in sent)
    head_counts = counts[: len(sent[cp_rank])] + [0] * (width - len(sent[cp_rank]))
    all_counts = _gather_frame_counts(head_counts, group, cp_size, audio_lens_B.device)
    pad_to = max(1, max(sum(c) for c in all_counts))
    flat = torch.cat(list(local_embeds), dim=0)
    gathered_PH, tail = gather_head_dim0(flat, n_head, pad_to, group)
    for r, (rank_counts, rank_PH) in enumerate(zip(all_counts, gathered_PH.split(pad_to, dim=0))):
        real = rank_counts[: len(sent[r])]
        for i, e in zip(sent[r], torch.split(rank_PH[: sum(real)], real, dim=0)):
            embeds[i] = e
    for i, e in zip(kept, torch.split(tail, counts[len(sent[cp_rank]) :], dim=0)):
        embeds[i] = e
    return result
