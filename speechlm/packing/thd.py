"""Pack speech-LLM prompts into one THD stream (with ``cu_seqlens``) or a padded BSHD batch.

Letters: N utterances, L one prompt's length (before audio expansion), A one clip's audio frames,
T packed tokens (all utterances, padding included), B batch rows, S padded row length, H hidden,
M supervised positions.

A prompt is ``ids_L`` plus ``target_mask_L`` (see ``speechlm.packing.prompt``) and holds one ``audio_id``
placeholder per audio clip: exactly one (a transcription prompt, the default), or ``clip_counts[i]``
for a conversation (`speechlm.packing.prompt.ConversationRenderer`: several clips, several turns). Packing
replaces each placeholder by its clip's ``A_c`` audio slots, in place, so an utterance with ``k``
clips has ``seq_len = L - k + sum_c A_c`` positions. Audio lengths and embeddings are per clip,
flattened in prompt order: prompt 0's clips in the order of its placeholders, then prompt 1's, ...
``cu_seqlens`` stay per utterance (a sequence is a sample, whatever its number of clips).

Labels. ``shift_labels_within`` is the one place where labels are shifted:
``labels[t] = ids[t + 1]`` when position ``t + 1`` is a target *of the same sequence*, else
``IGNORE_INDEX``. Audio slots, the prompt and padding are never targets, so the last audio slot
predicts the first target token (the language tag), and the last real position of an utterance
(its EOS) and every padding slot carry ``IGNORE_INDEX``: no label crosses an utterance boundary.

THD layout. Utterance ``i`` occupies ``[cu_seqlens[i], cu_seqlens[i + 1])`` of the stream; its
first ``seq_lens[i]`` positions are real, the rest is rounding padding (zero embeddings, ignored
labels, position ids continuing ``seq_lens[i], seq_lens[i] + 1, ...``). Position ids restart at 0
at every ``cu_seqlens[i]``, i.e. ``position_ids_T[t] = t - cu_seqlens[i]``.

Rounding (``round_lengths``), for a CP degree ``cp`` and TP/sequence-parallel degree ``tp``:
- ``cp == 1``: lengths are kept; only the last one grows so that the total divides by ``tp``.
- ``cp > 1``: every length is rounded up to a multiple of ``2 * cp`` (load-balanced CP cuts each
  sequence into ``2 * cp`` equal chunks, rank ``r`` keeps chunks ``r`` and ``2cp - 1 - r``), then
  the last one grows until the total is a multiple of ``lcm(2 * cp, cp * tp)``. Each CP rank then
  holds ``total / cp`` tokens, and that share divides by ``tp`` for sequence parallelism. Making
  only the total divisible by ``tp`` is not enough (cp=2, tp=8, lengths [4, 4]: 4 tokens per rank).

BSHD layout. The same expanded utterances, right-padded to ``S = max(seq_lens)`` (rounded up to
``pad_to_multiple``), with ``attention_mask`` 1 on real positions and labels from the same shift.
For every rounding, the (input embedding, target id) pairs that reach the loss are identical
between the two layouts; ``supervised_pairs_thd`` / ``supervised_pairs_bshd`` expose them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from parallel.rounding import round_lengths
from parallel.rounding import rounding_unit as rounding_unit  # re-exported: the rule packing follows
from parallel.rounding import sequence_multiple as sequence_multiple
from speechlm.packing.positions import align_audio_positions

IGNORE_INDEX = -100

Prompt = tuple[Tensor, Tensor]  # (ids_L int64, target_mask_L bool)


# --------------------------------------------------------------------------------------------
# Labels and rounding
# --------------------------------------------------------------------------------------------


def shift_labels_within(ids_L: Tensor, target_mask_L: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """Return ``labels_L`` with ``labels_L[t] = ids_L[t + 1]`` where ``t + 1`` is a target, else ignore.

    With ``cu_seqlens`` (``[N + 1]``, ``cu_seqlens[-1] == L``) the input is a concatenation of
    sequences and no label is taken across a boundary: the last position of each sequence is
    ``IGNORE_INDEX`` even when the next sequence starts with a target.
    """
    if ids_L.dim() != 1 or ids_L.shape != target_mask_L.shape:
        raise ValueError(
            f"ids and target_mask must be 1-D of the same length, got {tuple(ids_L.shape)} and "
            f"{tuple(target_mask_L.shape)}"
        )
    L = ids_L.shape[0]
    labels_L = torch.full_like(ids_L, IGNORE_INDEX)
    if L < 2:
        return labels_L
    next_is_target = target_mask_L[1:].clone()
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=ids_L.device, dtype=torch.long)
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != L:
            raise ValueError(f"cu_seqlens must start at 0 and end at {L}, got {cu_seqlens.tolist()}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
        starts = cu[(cu > 0) & (cu < L)]
        next_is_target[starts - 1] = False  # position start-1 is the last one of the previous sequence
    labels_L[:-1] = torch.where(next_is_target, ids_L[1:], labels_L[:-1])
    return labels_L


# --------------------------------------------------------------------------------------------
# THD index plan
# --------------------------------------------------------------------------------------------


@dataclass
class PackLayout:
    """Index math of a THD pack (no embeddings); all tensors are ``[T]`` except ``cu_seqlens``."""

    input_ids_T: Tensor  # int64 text token ids; audio and padding slots hold 0
    audio_mask_T: Tensor  # bool, where audio embeddings go (utterance order)
    pad_mask_T: Tensor  # bool, rounding padding
    labels_T: Tensor  # int64, shifted within each utterance; IGNORE_INDEX elsewhere
    position_ids_T: Tensor  # int64, restart at 0 per utterance; padding continues the count
    cu_seqlens: Tensor  # int32 [N + 1], cumulative padded lengths
    max_seqlen: int  # max padded length
    seq_lens: list[int]  # unpadded lengths (audio expanded)
    audio_lens: list[int]  # audio slots per clip, in prompt order (checked by splice_embeddings)
    clip_counts: list[int] | None = None  # clips per utterance; None: one each

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])


def _as_prompt(i: int, prompt: Prompt) -> Prompt:
    ids, mask = prompt
    ids_L = torch.as_tensor(ids, dtype=torch.long).cpu()
    mask_L = torch.as_tensor(mask, dtype=torch.bool).cpu()
    if ids_L.dim() != 1 or ids_L.shape != mask_L.shape:
        raise ValueError(
            f"utterance {i}: ids and target_mask must be 1-D of the same length, got "
            f"{tuple(ids_L.shape)} and {tuple(mask_L.shape)}"
        )
    return ids_L, mask_L


def _check_audio_lens(
    audio_lens: Sequence[int], n: int, clip_counts: Sequence[int] | None = None
) -> list[int]:
    lens = [int(a) for a in audio_lens]
    if clip_counts is None:
        if len(lens) != n:
            raise ValueError(f"got {n} prompts but {len(lens)} audio lengths; pass one clip per prompt")
    elif len(clip_counts) != n or sum(int(k) for k in clip_counts) != len(lens):
        raise ValueError(
            f"got {n} prompts with clip_counts {list(clip_counts)} (one count per prompt) but {len(lens)} "
            "audio lengths; pass one length per clip, prompt 0's clips first"
        )
    for i, a in enumerate(lens):
        if a < 0:
            raise ValueError(
                f"{'utterance' if clip_counts is None else 'clip'} {i}: audio length {a} is negative"
            )
    return lens


def _raise_placeholder_error(i: int, count: int, audio_id: int, expected: int = 1) -> None:
    if expected == 1:
        raise ValueError(
            f"utterance {i}: prompt holds {count} audio placeholders (audio_id={audio_id}), expected exactly "
            "one; build prompts with speechlm.packing.prompt.build_prompt and keep audio_id out of the text vocabulary"
        )
    raise ValueError(
        f"utterance {i}: prompt holds {count} audio placeholders (audio_id={audio_id}) but the sample has "
        f"{expected} clip(s); render it with speechlm.packing.prompt.ConversationRenderer (one placeholder per clip "
        "reference) and keep audio_id out of the text vocabulary"
    )


def plan_thd(
    prompts: Sequence[Prompt],
    audio_lens: Sequence[int],
    *,
    audio_id: int,
    cp: int = 1,
    tp: int = 1,
    pad_to_multiple: int | None = None,
    padded_lengths: Sequence[int] | None = None,
    clip_counts: Sequence[int] | None = None,
    align_skip: int | None = None,
) -> PackLayout:
    """Lay out the prompts as one THD stream: expand audio, shift labels, round, build cu_seqlens.

    ``audio_lens``: per clip, in prompt order; ``clip_counts``: the clips of each prompt (None: one
    each). ``padded_lengths`` (dynamic CP: `parallel.cp_placement`) gives every sequence's padded length
    instead of the `round_lengths` rule; each must be at least the sequence's length.

    Vectorised: the prompts are concatenated, and one end-of-utterance marker per utterance is
    appended to carry its padding. ``repeat_interleave`` then expands each entry by its repeat
    count (1 for a text token, ``A_c`` for clip c's placeholder, the padding amount for the marker).
    """
    n = len(prompts)
    lens_audio = _check_audio_lens(audio_lens, n, clip_counts)
    pairs = [_as_prompt(i, p) for i, p in enumerate(prompts)]
    if n == 0:
        empty_l = torch.zeros(0, dtype=torch.long)
        empty_b = torch.zeros(0, dtype=torch.bool)
        return PackLayout(
            empty_l, empty_b, empty_b, empty_l, empty_l, torch.zeros(1, dtype=torch.int32), 0, [], []
        )
    prompt_lens = torch.tensor([p[0].shape[0] for p in pairs], dtype=torch.long)
    ids_cat = torch.cat([p[0] for p in pairs])
    mask_cat = torch.cat([p[1] for p in pairs])
    utt_of_token = torch.repeat_interleave(torch.arange(n), prompt_lens)

    is_audio = ids_cat == audio_id
    counts = torch.bincount(utt_of_token[is_audio], minlength=n)
    expected = torch.ones(n, dtype=torch.long) if clip_counts is None else torch.tensor(clip_counts).long()
    bad = torch.nonzero(counts != expected).flatten()
    if bad.numel():
        i = int(bad[0])
        _raise_placeholder_error(i, int(counts[i]), audio_id, 1 if clip_counts is None else int(expected[i]))
    supervised_audio = torch.nonzero(is_audio & mask_cat).flatten()
    if supervised_audio.numel():
        i = int(utt_of_token[supervised_audio[0]])
        raise ValueError(f"utterance {i}: the audio placeholder is marked as a target; it must not be")

    # placeholders in stream order are the clips in prompt order: clip c belongs to utt_of_token there
    audio_of_utt = torch.zeros(n, dtype=torch.long).index_add_(
        0, utt_of_token[is_audio], torch.tensor(lens_audio, dtype=torch.long)
    )
    seq_lens_t = prompt_lens - counts + audio_of_utt
    seq_lens = seq_lens_t.tolist()
    if padded_lengths is None:
        padded = round_lengths(seq_lens, cp=cp, tp=tp, total_multiple=pad_to_multiple)
    else:
        padded = [int(x) for x in padded_lengths]
        short = [i for i, (p, n) in enumerate(zip(padded, seq_lens)) if p < n]
        if len(padded) != n or short:
            raise ValueError(
                f"padded_lengths {padded} do not cover the sequence lengths {seq_lens} (a placement "
                "computed from other audio lengths than the encoder produced?)"
            )
    pad_amounts = torch.tensor(padded, dtype=torch.long) - seq_lens_t

    # Extended entries: utterance i's prompt tokens followed by its padding marker, so that entry
    # j of utterance i sits at prompt_offset_i + i + j and the marker at prompt_end_i + i.
    cu_prompt = torch.zeros(n + 1, dtype=torch.long)
    cu_prompt[1:] = torch.cumsum(prompt_lens, 0)
    n_ext = int(cu_prompt[-1]) + n
    marker_pos = cu_prompt[1:] + torch.arange(n)
    is_marker = torch.zeros(n_ext, dtype=torch.bool)
    is_marker[marker_pos] = True
    ext_ids = torch.zeros(n_ext, dtype=torch.long)
    ext_mask = torch.zeros(n_ext, dtype=torch.bool)
    ext_audio = torch.zeros(n_ext, dtype=torch.bool)
    ext_ids[~is_marker] = torch.where(is_audio, 0, ids_cat)
    ext_mask[~is_marker] = mask_cat
    ext_audio[~is_marker] = is_audio
    repeats = torch.ones(n_ext, dtype=torch.long)
    repeats[ext_audio] = torch.tensor(lens_audio, dtype=torch.long)
    repeats[is_marker] = pad_amounts

    input_ids_T = torch.repeat_interleave(ext_ids, repeats)
    target_mask_T = torch.repeat_interleave(ext_mask, repeats)
    audio_mask_T = torch.repeat_interleave(ext_audio, repeats)
    pad_mask_T = torch.repeat_interleave(is_marker, repeats)

    padded_t = torch.tensor(padded, dtype=torch.long)
    cu_seqlens = torch.zeros(n + 1, dtype=torch.long)
    cu_seqlens[1:] = torch.cumsum(padded_t, 0)
    labels_T = shift_labels_within(input_ids_T, target_mask_T, cu_seqlens)
    starts_T = torch.repeat_interleave(cu_seqlens[:-1], padded_t)
    position_ids_T = torch.arange(int(cu_seqlens[-1]), dtype=torch.long) - starts_T
    if align_skip is not None:
        seq_of_T = torch.repeat_interleave(torch.arange(n), padded_t)
        position_ids_T = align_audio_positions(
            position_ids_T, audio_mask_T, target_mask_T, seq_of_T, lens_audio, seq_lens, skip=align_skip
        )
    return PackLayout(
        input_ids_T=input_ids_T,
        audio_mask_T=audio_mask_T,
        pad_mask_T=pad_mask_T,
        labels_T=labels_T,
        position_ids_T=position_ids_T,
        cu_seqlens=cu_seqlens.to(torch.int32),
        max_seqlen=max(padded),
        seq_lens=seq_lens,
        audio_lens=lens_audio,
        clip_counts=None if clip_counts is None else [int(k) for k in clip_counts],
    )


def clip_offsets(
    prompts: Sequence[Prompt], seq_of_clip: Sequence[int], audio_lens: Sequence[int], audio_id: int
) -> list[int]:
    """Per clip, the row of its (expanded) sequence where its first audio frame sits, as `plan_thd` lays it
    out: clip c is the next placeholder of prompt ``seq_of_clip[c]`` (clips in prompt order), and each
    earlier clip of that prompt adds its ``audio_lens`` frames less the one placeholder row."""
    where = {}
    out = []
    for c, s in enumerate(seq_of_clip):
        if s not in where:
            ids = _as_prompt(s, prompts[s])[0]
            where[s] = (torch.nonzero(ids == audio_id).flatten().tolist(), [0])
        places, shift = where[s]
        j = len(shift) - 1
        if j >= len(places):
            _raise_placeholder_error(s, len(places), audio_id, j + 1)
        out.append(places[j] + shift[-1])
        shift.append(shift[-1] + int(audio_lens[c]) - 1)
    return out


def _check_audio_embeds(
    audio_embeds: Sequence[Tensor], audio_lens: Sequence[int], hidden: int, one_clip: bool = True
) -> None:
    what = "utterance" if one_clip else "clip"
    if len(audio_embeds) != len(audio_lens):
        raise ValueError(f"got {len(audio_embeds)} audio embeddings for {len(audio_lens)} {what}s")
    for i, (emb, a) in enumerate(zip(audio_embeds, audio_lens)):
        if emb.dim() != 2 or emb.shape[0] != a or emb.shape[1] != hidden:
            raise ValueError(
                f"{what} {i}: audio embeddings have shape {tuple(emb.shape)}, expected ({a}, {hidden}) "
                "(audio length used to plan the pack, text hidden size)"
            )


def splice_embeddings(layout: PackLayout, text_embeds_TH: Tensor, audio_embeds: Sequence[Tensor]) -> Tensor:
    """Return ``[T, H]``: text embeddings, audio slots replaced by the clips, padding zeroed.

    ``text_embeds_TH = embed_tokens(layout.input_ids_T)``. Differentiable w.r.t. both inputs; the
    audio is cast to the text dtype.
    """
    if text_embeds_TH.dim() != 2 or text_embeds_TH.shape[0] != layout.num_tokens:
        raise ValueError(
            f"text embeddings have shape {tuple(text_embeds_TH.shape)}, expected ({layout.num_tokens}, H)"
        )
    H = text_embeds_TH.shape[1]
    _check_audio_embeds(audio_embeds, layout.audio_lens, H, layout.clip_counts is None)
    device = text_embeds_TH.device
    audio_mask_T = layout.audio_mask_T.to(device)
    drop_T1 = (audio_mask_T | layout.pad_mask_T.to(device)).unsqueeze(1)
    out_TH = text_embeds_TH.masked_fill(drop_T1, 0.0)
    if not audio_embeds:
        return out_TH
    audio_AH = torch.cat(list(audio_embeds)).to(device=device, dtype=text_embeds_TH.dtype)
    audio_pos = torch.nonzero(audio_mask_T).flatten()
    return out_TH.index_put((audio_pos,), audio_AH)


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """THD batch for a varlen decoder: one stream of ``T`` tokens, sequences given by ``cu_seqlens``."""

    inputs_embeds: Tensor  # [T, H]
    labels: Tensor  # [T] int64
    position_ids: Tensor  # [T] int64
    cu_seqlens: Tensor  # [N + 1] int32
    max_seqlen: int
    seq_lens: list[int]
    # dynamic CP (after sharding): the first cp_split_seqs sequences are CP-split, the rest whole on
    # this rank; None: every sequence is split (or there is no CP)
    cp_split_seqs: int | None = None
    # each sequence's CP degree, in stream order (hybrid CP degrees: `CPPlan.local_degrees`); empty: unknown
    cp_degrees: tuple[int, ...] = ()

    def num_labelled(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def _default_device(audio_embeds: Sequence[Tensor]) -> torch.device:
    return audio_embeds[0].device if audio_embeds else torch.device("cpu")


def pack_thd(
    prompts: Sequence[Prompt],
    audio_embeds: Sequence[Tensor],
    embed_tokens: Callable[[Tensor], Tensor],
    *,
    audio_id: int,
    cp: int = 1,
    tp: int = 1,
    pad_to_multiple: int | None = None,
    padded_lengths: Sequence[int] | None = None,
    clip_counts: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    align_skip: int | None = None,
) -> PackedBatch:
    """Plan, embed and splice in one call; tensors land on ``device`` (default: the audio's).
    ``audio_embeds``: per clip, in prompt order; ``clip_counts``: clips per prompt (None: one each);
    ``align_skip``: as in `plan_thd`."""
    layout = plan_thd(
        prompts,
        [int(e.shape[0]) for e in audio_embeds],
        audio_id=audio_id,
        cp=cp,
        tp=tp,
        pad_to_multiple=pad_to_multiple,
        padded_lengths=padded_lengths,
        clip_counts=clip_counts,
        align_skip=align_skip,
    )
    dev = torch.device(device) if device is not None else _default_device(audio_embeds)
    inputs_embeds = splice_embeddings(layout, embed_tokens(layout.input_ids_T.to(dev)), audio_embeds)
    return PackedBatch(
        inputs_embeds=inputs_embeds,
        labels=layout.labels_T.to(dev),
        position_ids=layout.position_ids_T.to(dev),
        cu_seqlens=layout.cu_seqlens.to(dev),
        max_seqlen=layout.max_seqlen,
        seq_lens=layout.seq_lens,
    )


@dataclass
class PaddedBatch:
    """BSHD batch: one right-padded row per utterance."""

    inputs_embeds: Tensor  # [B, S, H]
    labels: Tensor  # [B, S] int64, shifted within the row, IGNORE_INDEX on padding
    attention_mask: Tensor  # [B, S] int64, 1 real / 0 pad
    position_ids: Tensor  # [B, S] int64, 0.. per row (padding continues the count)

    def num_labelled(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def expand_prompt(
    i: int, prompt: Prompt, audio_lens: Sequence[int], audio_id: int, one_clip: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(ids, target_mask, audio_mask)`` of one utterance with each placeholder expanded to its
    clip's length (``audio_lens``, in placeholder order)."""
    ids_L, mask_L = _as_prompt(i, prompt)
    where = torch.nonzero(ids_L == audio_id).flatten()
    if where.numel() != len(audio_lens):
        _raise_placeholder_error(i, where.numel(), audio_id, 1 if one_clip else len(audio_lens))
    if bool(mask_L[where].any()):
        raise ValueError(f"utterance {i}: the audio placeholder is marked as a target; it must not be")
    repeats = torch.ones(ids_L.shape[0], dtype=torch.long)
    repeats[where] = torch.tensor([int(a) for a in audio_lens], dtype=torch.long)
    is_audio = ids_L == audio_id
    ids = torch.repeat_interleave(torch.where(is_audio, 0, ids_L), repeats)
    mask = torch.repeat_interleave(mask_L, repeats)
    audio = torch.repeat_interleave(is_audio, repeats)
    return ids, mask, audio


def pack_bshd(
    prompts: Sequence[Prompt],
    audio_embeds: Sequence[Tensor],
    embed_tokens: Callable[[Tensor], Tensor],
    *,
    audio_id: int,
    pad_to_multiple: int = 1,
    clip_counts: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    align_skip: int | None = None,
) -> PaddedBatch:
    """Right-pad each expanded utterance to ``S = round_up(max seq_len, pad_to_multiple)``.
    ``audio_embeds``: per clip, in prompt order; ``clip_counts``: clips per prompt (None: one each);
    ``align_skip``: as in `plan_thd`."""
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    B = len(prompts)
    lens_audio = _check_audio_lens([int(e.shape[0]) for e in audio_embeds], B, clip_counts)
    counts = [1] * B if clip_counts is None else [int(k) for k in clip_counts]
    starts = [sum(counts[:i]) for i in range(B)]
    rows = [
        expand_prompt(i, p, lens_audio[starts[i] : starts[i] + counts[i]], audio_id, clip_counts is None)
        for i, p in enumerate(prompts)
    ]
    seq_lens = [r[0].shape[0] for r in rows]
    S = -(-max(seq_lens, default=0) // pad_to_multiple) * pad_to_multiple
    ids_BS = torch.zeros(B, S, dtype=torch.long)
    labels_BS = torch.full((B, S), IGNORE_INDEX, dtype=torch.long)
    audio_BS = torch.zeros(B, S, dtype=torch.bool)
    attn_BS = torch.zeros(B, S, dtype=torch.long)
    target_BS = torch.zeros(B, S, dtype=torch.bool)
    for b, (ids, mask, audio) in enumerate(rows):
        n = ids.shape[0]
        ids_BS[b, :n] = ids
        labels_BS[b, :n] = shift_labels_within(ids, mask)
        audio_BS[b, :n] = audio
        target_BS[b, :n] = mask
        attn_BS[b, :n] = 1
    position_ids_BS = torch.arange(S, dtype=torch.long).expand(B, S).contiguous()
    if align_skip is not None:
        seq_of = torch.arange(B).repeat_interleave(S)
        position_ids_BS = align_audio_positions(
            position_ids_BS.flatten(),
            audio_BS.flatten(),
            target_BS.flatten(),
            seq_of,
            lens_audio,
            seq_lens,
            skip=align_skip,
        ).view(B, S)

    dev = torch.device(device) if device is not None else _default_device(audio_embeds)
    text_BSH = embed_tokens(ids_BS.to(dev))
    H = text_BSH.shape[-1]
    _check_audio_embeds(audio_embeds, lens_audio, H, clip_counts is None)
    audio_flat = audio_BS.flatten().to(dev)
    drop = (audio_flat | (attn_BS.flatten().to(dev) == 0)).unsqueeze(1)
    out_TH = text_BSH.reshape(B * S, H).masked_fill(drop, 0.0)
    if audio_embeds:
        audio_AH = torch.cat(list(audio_embeds)).to(device=dev, dtype=text_BSH.dtype)
        out_TH = out_TH.index_put((torch.nonzero(audio_flat).flatten(),), audio_AH)
    return PaddedBatch(
        inputs_embeds=out_TH.reshape(B, S, H),
        labels=labels_BS.to(dev),
        attention_mask=attn_BS.to(dev),
        position_ids=position_ids_BS.to(dev),
    )


def supervised_pairs_thd(batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """Return ``(embeds_MH, targets_M)``: the input embedding and target of every labelled position."""
    keep_T = batch.labels != IGNORE_INDEX
    return batch.inputs_embeds[keep_T], batch.labels[keep_T]


def supervised_pairs_bshd(batch: PaddedBatch) -> tuple[Tensor, Tensor]:
    """Same as ``supervised_pairs_thd`` for a padded batch (row-major, i.e. utterance order)."""
    keep_BS = batch.labels != IGNORE_INDEX
    return batch.inputs_embeds[keep_BS], batch.labels[keep_BS]
