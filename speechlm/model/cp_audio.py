"""A micro-batch's audio side through the CP layout: place, encode, hand over, tie, pack, shard.

Letters: B clips, N audio samples, U encoder frames, E encoder width, H LLM hidden, P projected rows.

Functions of (model, layout): ``model`` is the `SpeechLLM` (its features, encoder, projector and CTC head),
``layout`` its `parallel.cp_layout.CPLayout` (``NullCPLayout`` with one CP rank). `SpeechLLM.forward` calls
them in this order, once per micro-batch:

    plan_audio(model, layout, batch, ...)          the lengths, the sequences' plan, the encoding plan and
                                                   the clip sharding, from lengths alone (the data pipeline
                                                   runs it too: `speechlm.model.clip_planner`)
    check_clips_present(batch, audio_plan, layout) every clip this rank's encoder reads was decoded here
    encoding_plan(layout, plan, ...)               which rank encodes each clip, which clips are gathered
    clip_sharding(model, layout, frames, groups)   which clips the encoder shards, each over which ranks
    prepare_slices(model, layout, audio, sharding)  this rank's slice of each (features of its span)
    encode_for_layout(model, layout, ..., plan)    this rank's clips (split sequences' gathered) and slices,
                                                   one encoder call and one projector call
    finish_sharded(model, layout, enc, ...)        the slices' projected rows handed to the ranks whose
                                                   stream holds them, their frames gathered for CTC, and
                                                   every output tied in one autograd node (`tie_audio_side`)
    place_encoded(layout, enc, ...)                CTC-compressed audio: the sequences placed again from
                                                   the rows each clip got (every clip is on every rank)
    pack_for_layout(model, layout, prompts, enc, plan)  pack_thd to the plan's rounded lengths, then this
                                                   rank's share (`CPLayout.shard`)

A sharded clip (`parallel.clip_placement`): a long clip of a padding-free encoder with limited context is
cut into contiguous slices of encoder frames (cut on the projector's stack), one per rank of its group
(`ClipSharding.group`: the CP group, or under hybrid CP degrees its sequence's sub-group of d ranks); the
group's k-th rank encodes slice k from the feature frames its subsampling reads
(`sharded_encoder.feature_span`), with the clip's normalisation statistics summed over the group, its
halos exchanged within the group and its rows handed over within the group. A rank outside the group holds
nothing of the clip.

Greedy decoding (`encode_for_decoding`): every CP peer decodes the same batch, so each needs every clip's
rows. A clip the layout would shard is still encoded slice by slice over the group (a long clip does not fit
one rank any better in evaluation than in training), then its projected rows and encoder frames are
gathered to every rank; the other clips are encoded whole on each rank.

CTC-compressed audio (``model.audio_compression: ctc``): a clip's LLM rows are known only after the encoder,
so under CP every clip's rows are gathered to every rank (`encoding_plan`) and the sequences are placed
from them (`place_encoded`); a sharded clip is gathered and compressed whole on every rank
(`speechlm.model.compression`), so `finish_sharded` hands nothing over (docs/parallelism.md, "CTC-compressed
audio under CP").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from parallel.clip_handover import Handover, clip_needs
from parallel.clip_placement import ClipGroup, ClipSharding, clip_readers, short_clip_frames
from parallel.cp_layout import CPLayout, CPPlan, dummy_clip, plan_for_clips
from speechlm.model.conversation_inputs import (
    batch_field,
    clips_per_sample,
    conversation_prompts,
    conversation_seq_lens,
    optional_field,
)
from speechlm.model.ctc import CTCModel
from speechlm.model.encoder_output import EncoderOutput
from speechlm.model.encoders.base import AudioEncoder
from speechlm.model.features import FeatureSettings, LogMelFeatures, compute_feature_lengths
from speechlm.model.packed_encoder import PackedFrames
from speechlm.model.projector import FrameStackProjector, compute_stacked_lengths
from speechlm.model.sharded_encoder import ClipSlice, feature_span
from speechlm.packing.thd import PackedBatch, pack_thd


class EncoderLengths(Protocol):
    """What the placement reads of an encoder: its frame arithmetic (`AudioEncoder` has it)."""

    @property
    def feature_settings(self) -> FeatureSettings: ...
    @property
    def subsampling(self) -> int: ...
    @property
    def slice_halo(self) -> int | None: ...
    def output_lengths(self, feat_lens_B: Tensor) -> Tensor: ...


class ProjectorStack(Protocol):
    @property
    def stack(self) -> int: ...


class AudioShape(Protocol):
    """What the placement reads of the model (`plan_audio`): lengths only (a `SpeechLLM`, or the data
    pipeline's `speechlm.model.clip_planner.ModelShape`)."""

    @property
    def encoder(self) -> EncoderLengths: ...
    @property
    def projector(self) -> ProjectorStack: ...
    @property
    def encoder_packed(self) -> bool: ...


class AudioModel(CTCModel, Protocol):
    """What the audio side reads of the model (`SpeechLLM` has it)."""

    @property
    def encoder(self) -> AudioEncoder: ...
    @property
    def projector(self) -> FrameStackProjector: ...
    @property
    def features(self) -> LogMelFeatures: ...
    @property
    def encoder_packed(self) -> bool: ...
    def encode_audio(
        self,
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        *,
        freeze_encoder: bool = False,
        slices: Sequence[ClipSlice] = (),
    ) -> EncoderOutput: ...


@dataclass(frozen=True)
class AudioLengths:
    """A micro-batch's clip lengths as host integers, read once per micro-batch (`audio_lengths`)."""

    samples: list[int]  # audio samples per clip
    features: list[int]  # feature frames (`features.compute_feature_lengths`)
    encoder: list[int]  # encoder frames (`AudioEncoder.output_lengths`)
    embeds: list[int]  # projected rows, what each clip takes in the LLM's stream


def audio_lengths(model: AudioShape, audio_lens_B: Tensor) -> AudioLengths:
    """Every length of the audio side from the sample counts alone (one copy to the host): what the
    encoder and projector will return, known before they run (dynamic CP places sequences with it)."""
    samples_B = audio_lens_B.cpu()
    feat_B = compute_feature_lengths(samples_B, model.encoder.feature_settings.hop_length)
    enc_B = model.encoder.output_lengths(feat_B)
    rows_B = compute_stacked_lengths(enc_B, model.projector.stack)
    return AudioLengths(*([int(n) for n in t.tolist()] for t in (samples_B, feat_B, enc_B, rows_B)))


@dataclass(frozen=True)
class AudioPlan:
    """Where a micro-batch's audio goes under the layout, known before any clip is decoded (`plan_audio`)."""

    lens: AudioLengths
    prompts: list[tuple[Tensor, Tensor]]  # each row's rendered prompt and target mask
    clip_sample: list[int]  # the row of each clip
    clip_counts: list[int]  # clips per row
    seq_lens: list[int]  # packed length per row (compressed audio: an upper bound)
    plan: CPPlan  # per sequence (`CPLayout.place`)
    enc_plan: CPPlan  # per clip (`encoding_plan`)
    sharding: ClipSharding | None  # the clips sharded (each over its group), or None

    def readers(self, cp_size: int) -> list[tuple[int, ...]]:
        """Per clip, the CP ranks whose encoder reads its audio (`parallel.clip_placement.clip_readers`)."""
        return clip_readers(self.enc_plan.clip_owners, self.sharding, cp_size)


def plan_audio(
    model: AudioShape, layout: CPLayout, batch: Any, *, audio_id: int, compressed: bool
) -> AudioPlan:
    """A conversation batch's `AudioPlan`: a pure function of its clip lengths (``audio_lens``) and rendered
    prompts, so the same on every CP rank, in the model and where the batch is built."""
    lens = audio_lengths(model, batch_field(batch, "audio_lens"))
    prompts, clip_sample = conversation_prompts(batch, audio_id)
    clip_counts = clips_per_sample(clip_sample, len(prompts))
    seq_lens = conversation_seq_lens(prompts, clip_counts, lens.embeds)
    plan = layout.place(seq_lens)
    enc_plan = encoding_plan(layout, plan, clip_sample, lens.embeds, compressed=compressed)
    sharding = clip_sharding(model, layout, lens.encoder, sharding_groups(enc_plan, layout.cp_size))
    return AudioPlan(lens, prompts, clip_sample, clip_counts, seq_lens, plan, enc_plan, sharding)


def check_clips_present(batch: Any, audio_plan: AudioPlan, layout: CPLayout) -> None:
    """Refuse to encode a clip that was not decoded on this rank (``batch.audio_present`` False: the data
    pipeline decoded only the clips its placement gave this rank, `speechlm.data.local_decode`); its row of
    ``audio`` holds no samples and must never be encoded as silence. No ``audio_present``: every clip is."""
    present = optional_field(batch, "audio_present")
    if present is None:
        return
    have = [bool(x) for x in present.tolist()]
    rank = layout.cp_rank
    missing = [
        c for c, ranks in enumerate(audio_plan.readers(layout.cp_size)) if rank in ranks and not have[c]
    ]
    if missing:
        c = missing[0]
        rows = optional_field(batch, "indices") or []
        row = rows[audio_plan.clip_sample[c]] if rows else audio_plan.clip_sample[c]
        raise RuntimeError(
            f"clip {c} (manifest row {row}) is encoded on CP rank {rank}, but the data pipeline did not decode "
            f"it there ({len(missing)} such clip(s)): its placement and the model's disagree. Build the loader's "
            "planner from this model and layout (speechlm.model.clip_planner), or set data.decode_local=false"
        )


def encoding_plan(
    layout: CPLayout, plan: CPPlan, clip_sample: Sequence[int], clip_lens: Sequence[int], *, compressed: bool
) -> CPPlan:
    """The plan the encoder follows: ``plan`` (per sequence) seen per clip (`plan_for_clips`). Compressed
    audio under CP (`place_encoded`) gathers every clip to every rank (``gather_all``): the sequences'
    LLM lengths, hence where each is decoded, are known only after the encoder."""
    gather_all = compressed and layout.cp_size > 1
    return plan_for_clips(plan, clip_sample, clip_lens, layout.cp_size, gather_all=gather_all)


def place_encoded(
    layout: CPLayout,
    enc: EncoderOutput,
    prompts: list[tuple[Tensor, Tensor]],
    clip_counts: Sequence[int],
) -> tuple[list[int], CPPlan]:
    """``(seq_lens, plan)`` of compressed audio: the sequences' lengths from the rows each clip got, placed
    again (`CPLayout.place`, a pure function of them: the same on every CP rank, which holds every clip:
    `encoding_plan`). The clips no sequence of this rank holds join ``enc.unused`` in `pack_for_layout`."""
    rows = [int(e.shape[0]) for e in enc.embeds_of(range(len(enc.embeds)))]
    seq_lens = conversation_seq_lens(prompts, clip_counts, rows)
    return seq_lens, layout.place(seq_lens)


def encode_for_layout(
    model: AudioModel,
    layout: CPLayout,
    audio_BN: Tensor,
    audio_lens_B: Tensor,
    plan: CPPlan,
    *,
    freeze_encoder: bool = False,
    skip: Sequence[bool] = (),
    slices: Sequence[ClipSlice] = (),
) -> EncoderOutput:
    """`SpeechLLM.encode_audio` through the CP layout: this rank's clips, the split sequences' clips
    gathered; ``skip``: the clips sharded over the CP group, left None here; ``slices``: this rank's slices
    of them (`prepare_slices`), encoded and projected in the same encoder and projector calls as its whole
    clips (one call each per micro-batch on every rank, whatever the micro-batch holds, so FSDP's
    collectives of those units stay in step across data-parallel ranks); their outputs come back in
    ``EncoderOutput.slices`` for `finish_sharded`."""

    def encode_fn(a: Tensor, lens: Tensor) -> tuple[list[Tensor], Any]:
        out = model.encode_audio(a, lens, freeze_encoder=freeze_encoder, slices=slices)
        return out.embeds_of(out.ctc_rows), (out.enc_hidden, out.enc_lens_B, out.slices, out.slices_whole)

    res = layout.encode(encode_fn, audio_BN, audio_lens_B, plan, skip)
    enc_hidden, enc_lens_B, slice_outs, slices_whole = res.extra
    enc = EncoderOutput(res.embeds, enc_hidden, enc_lens_B, res.clips, res.weight, res.unused)
    enc.slices, enc.slices_whole = list(slice_outs), slices_whole
    return enc


def sharding_groups(enc_plan: CPPlan, cp_size: int) -> list[ClipGroup]:
    """Per clip, the aligned CP ranks a long clip would be sharded over: its sequence's group when the
    sequence is split (the whole CP group under dynamic CP, its sub-group under hybrid degrees; every clip's
    is the whole group with CTC-compressed audio, `encoding_plan`), the whole CP group for a whole
    sequence (the hand-over then brings every row to its rank)."""
    return [g if g[1] > 1 else (0, cp_size) for g in enc_plan.gather_groups]


def clip_sharding(
    model: AudioShape, layout: CPLayout, enc_frames: Sequence[int], groups: Sequence[ClipGroup] = ()
) -> ClipSharding | None:
    """Which clips of a micro-batch (``enc_frames``: encoder frames per clip; ``groups``: the ranks each
    would be sharded over, `sharding_groups`; empty: the whole CP group) the encoder shards
    (`parallel.clip_placement.place_clips`, through the layout), or None when none is: one CP rank, an
    encoder that cannot shard a clip (full context, not padding-free), or no clip long enough."""
    halo = model.encoder.slice_halo
    if layout.cp_size == 1 or halo is None or not model.encoder_packed:
        return None
    sharding = layout.clip_sharding(
        list(enc_frames),
        min_frames=short_clip_frames(model.encoder.subsampling),
        min_slice=halo + model.projector.stack,  # a slice's halo, after the cut's stack alignment
        groups=groups,
    )
    return sharding if sharding.sharded_indices else None


def prepare_slices(
    model: AudioModel,
    layout: CPLayout,
    audio_BN: Tensor,
    lens: AudioLengths,
    sharding: ClipSharding,
) -> list[ClipSlice]:
    """This rank's slice of every clip ``sharding`` shards over a group that holds this rank, ready for the
    encoder (in clip order, `ClipSharding.local_indices`): its contiguous encoder frames
    (`ClipSharding.bounds`, cut on the projector's stack) and the feature frames its subsampling reads
    (`LogMelFeatures.frames_of_clip`, the clip's normalisation statistics summed over the group; no
    gradient: features have no parameters)."""
    stack, sub = model.projector.stack, model.encoder.subsampling
    out = []
    for c in sharding.local_indices(layout.cp_rank):
        group = sharding.group(c)
        n, total = lens.samples[c], lens.features[c]  # the clip's samples and feature frames
        bounds = sharding.bounds(c, align=stack)
        lo, hi = bounds[layout.cp_rank - group[0]]
        span = feature_span(lo, hi, (sub - 1).bit_length(), total)  # sub = 2 ** n_convs
        own = (min(lo * sub, total), min(hi * sub, total))  # the ranks' own frames partition the clip's

        def reduce_sum(x: Tensor, group: ClipGroup = group) -> Tensor:
            return layout.reduce_sum(x, group)

        with torch.no_grad():
            feats = model.features.frames_of_clip(audio_BN[c], n, span, own, reduce_sum)
        counts = tuple(b - a for a, b in bounds)
        out.append(ClipSlice(feats, (lo, hi), layout.halo(group), span[0], total, counts, group))
    return out


def finish_sharded(
    model: AudioModel,
    layout: CPLayout,
    enc: EncoderOutput,
    sharding: ClipSharding,
    plan: CPPlan,
    *,
    seq_of_clip: Sequence[int],
    offsets: Sequence[int],
) -> None:
    """The sharded clips' side of ``enc`` once the encoder and projector ran on this rank's slices (in the
    same calls as its whole clips: `encode_for_layout`, ``enc.slices``, the clips of
    `ClipSharding.local_indices`): the layout hands each clip's projected rows to the ranks of its group
    whose LLM stream holds them (`parallel.clip_handover`) and, with a CTC head, gathers the slices'
    encoder frames for the rank that scores the clip's CTC (its owner in ``plan``, one of the group).
    ``seq_of_clip[c]``: the sequence of clip c; ``offsets[c]``: the row of that sequence where the clip's
    first frame sits. Finally every output of the audio side passes through one autograd node
    (`tie_audio_side`), which keeps the CP collectives of the backward in one order on every rank
    (docs/parallelism.md)."""
    stack, rank = model.projector.stack, layout.cp_rank
    padded = dict(zip(plan.indices, plan.padded_lengths))
    gathered, owners = plan.gathered, plan.clip_owners
    local = sharding.local_indices(rank)
    for c, (hidden_UE, proj_PH) in zip(local, enc.slices, strict=True):
        group = sharding.group(c)
        first, d = group
        bounds = sharding.bounds(c, align=stack)
        if enc.slices_whole:  # compressed: every rank holds the whole clip's frames and rows already
            enc.embeds[c] = proj_PH
        else:
            rows = int(compute_stacked_lengths(torch.tensor([sharding.frames[c]]), stack)[0])
            have = [(a // stack, -(-b // stack)) for a, b in bounds]
            # a split sequence spans exactly the clip's group (`sharding_groups`); a whole one sits on its
            # owner, somewhere in the group
            need = clip_needs(
                rows,
                int(offsets[c]),
                d,
                split=bool(gathered[c]),
                padded_len=padded[seq_of_clip[c]] if gathered[c] else 0,
                owner=int(owners[c]) - first,
            )
            enc.embeds[c] = layout.hand_over(proj_PH, Handover.build(rows, have, need), group)
        if model.ctc_head is not None:
            full_UE = (
                hidden_UE
                if enc.slices_whole
                else layout.gather_slices(hidden_UE, [b - a for a, b in bounds], group)
            )
            if owners[c] == rank:
                enc.ctc_extra.append((c, full_UE))
            else:
                enc.unused.append(full_UE)
        lo, hi = bounds[rank - first]
        enc.slice_feature_frames.append((hi - lo) * model.encoder.subsampling)
    enc.slices = []
    tie_audio_side(layout, enc)


def tie_audio_side(layout: CPLayout, enc: EncoderOutput) -> None:
    """Pass every tensor of ``enc`` that reaches the loss through `CPLayout.tie` (one autograd node), and
    keep one of them in the loss with weight 0 so that the node runs on every rank."""
    hidden = enc.enc_hidden
    data = hidden.data_UE if isinstance(hidden, PackedFrames) else hidden
    present = [(i, e) for i, e in enumerate(enc.embeds) if e is not None]
    slots = [i for i, _ in present]
    tensors = [data, *(e for _, e in present), *(h for _, h in enc.ctc_extra), *enc.unused]
    tied = iter(layout.tie(tensors))
    data = next(tied)
    enc.enc_hidden = PackedFrames(data, hidden.lens_B) if isinstance(hidden, PackedFrames) else data
    for i in slots:
        enc.embeds[i] = next(tied)
    enc.ctc_extra = [(c, next(tied)) for c, _ in enc.ctc_extra]
    enc.unused = [next(tied) for _ in enc.unused] + [data]


def pack_for_layout(
    layout: CPLayout,
    prompts: list[tuple[Tensor, Tensor]],
    enc: EncoderOutput,
    plan: CPPlan,
    embed_tokens: Callable[[Tensor], Tensor],
    *,
    audio_id: int,
    clip_counts: Sequence[int],
    device: torch.device,
    align_skip: int | None = None,
) -> PackedBatch:
    """This rank's THD stream: its sequences of ``plan`` packed to their padded lengths, then its share of
    them (`CPLayout.shard`). ``clip_counts``: clips per sequence; ``align_skip``: the audio rows' positions
    aligned with their answers (`speechlm.packing.positions`)."""
    local = plan.indices
    starts = [0]
    for k in clip_counts:
        starts.append(starts[-1] + k)
    clips = [c for i in local for c in range(starts[i], starts[i + 1])]
    # clips this rank received but does not decode (compressed audio: every clip is gathered to every rank)
    # join ``enc.unused`` (weight 0 in the loss), so that the gather's backward runs on every rank whatever
    # its stream holds
    decoded = set(clips)
    enc.unused.extend(e for c, e in enumerate(enc.embeds) if e is not None and c not in decoded)
    packed = pack_thd(
        [prompts[i] for i in local],
        enc.embeds_of(clips),
        embed_tokens,
        audio_id=audio_id,
        padded_lengths=plan.padded_lengths,
        clip_counts=[clip_counts[i] for i in local],
        device=device,
        align_skip=align_skip,
    )
    parts, cu, max_len = layout.shard(
        {"x": packed.inputs_embeds, "labels": packed.labels, "pos": packed.position_ids},
        packed.cu_seqlens,
        packed.max_seqlen,
        plan,
    )
    return PackedBatch(
        parts["x"],
        parts["labels"],
        parts["pos"],
        cu,
        max_len,
        packed.seq_lens,
        cp_split_seqs=plan.n_split,
        cp_degrees=tuple(plan.local_degrees),
    )


def encode_for_decoding(
    model: AudioModel, layout: CPLayout, audio_BN: Tensor, audio_lens_B: Tensor
) -> EncoderOutput:
    """Every clip's projected rows and encoder frames on this rank, for greedy decoding under ``layout``
    (module docstring): the clips it shards (`clip_sharding`) encoded slice by slice over the CP group in the
    same encoder call as the other clips (whole on this rank), their rows and frames gathered (`gather_slices`;
    compressed audio gathers them in `encode_audio` already). One CP rank or no clip long enough:
    `encode_audio` of the whole batch. The result reads as one process's: ``ctc_rows`` every clip, in order."""
    lens = audio_lengths(model, audio_lens_B)
    # decoding places no sequence: every clip is sharded over the whole group (hybrid degrees too)
    sharding = clip_sharding(model, layout, lens.encoder)
    if sharding is None:
        return model.encode_audio(audio_BN, audio_lens_B)
    slices = prepare_slices(model, layout, audio_BN, lens, sharding)
    sharded = set(sharding.sharded_indices)
    whole = [c for c in range(len(lens.samples)) if c not in sharded]
    if whole:
        index = torch.tensor(whole, device=audio_BN.device)
        audio, audio_lens = audio_BN[index], audio_lens_B[index]
    else:  # only sharded clips: a dummy clip keeps the encoder call (and FSDP's collectives) as usual
        audio, audio_lens = dummy_clip(audio_BN, audio_lens_B)
    out = model.encode_audio(audio, audio_lens, slices=slices)
    hidden = out.enc_hidden
    if not isinstance(hidden, PackedFrames):  # clip_sharding shards for the padding-free encoder only
        raise TypeError("a sharded clip needs the padding-free encoder (PackedFrames)")
    embeds: list[Tensor | None] = [None] * len(lens.samples)
    frames: list[Tensor | None] = [None] * len(lens.samples)
    for c, e, f in zip(whole, out.embeds, hidden.split(), strict=False):
        embeds[c], frames[c] = e, f
    stack = model.projector.stack
    for c, (hidden_UE, proj_PH) in zip(sharding.sharded_indices, out.slices, strict=True):
        if out.slices_whole:  # compressed audio: the whole clip's frames and rows already
            embeds[c], frames[c] = proj_PH, hidden_UE
            continue
        bounds, group = sharding.bounds(c, align=stack), sharding.group(c)
        rows = [-(-b // stack) - a // stack for a, b in bounds]
        embeds[c] = layout.gather_slices(proj_PH, rows, group)
        frames[c] = layout.gather_slices(hidden_UE, [b - a for a, b in bounds], group)
    present = [f for f in frames if f is not None]
    lens_B = torch.tensor([f.shape[0] for f in present], dtype=torch.long, device=hidden.lens_B.device)
    return EncoderOutput(embeds, PackedFrames(torch.cat(present), lens_B), lens_B, list(range(len(present))))
