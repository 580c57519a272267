"""A manifest row as a rendered conversation (`SpeechDataset(renderer=...)`) and the Batch fields of many.

Letters: B rows, C clips (all rows' clips, rows in order, each row's in `Conversation.audio_order`),
N audio samples, P prompt tokens, K transcript tokens of a clip.

    conversation_sample(ds, i)   row i -> Conversation (`SpeechDataset.conversation`) -> checks of its
                                 texts -> every clip decoded (any failing drops the whole sample, the
                                 message naming the clip; ``ds.defer_audio``: its length read from the
                                 header instead, the clip left to `speechlm.data.local_decode`) ->
                                 rendered (`ConversationRenderer.render`) -> Sample with clips,
                                 prompt_ids/prompt_mask, ctc_tokens, task
    conversation_fields(kept)    the Batch's clip_sample, audio [C, N], prompt_ids/mask/lens,
                                 ctc_tokens/ctc_token_lens, tasks

The texts: a row of the transcription shape whose answer is its transcript goes through the checks of
today (`SpeechDataset._tokens`: not UTF-8, empty, untagged, mistagged, more than ``max_tokens``), so an
old manifest drops exactly the rows it dropped before and its ``tokens`` are the same ids. Otherwise the
answer must hold words (else ``empty_text``), a clip's CTC target (`Conversation.ctc_transcripts`: its
own transcript, or the answer of a one-clip ``asr`` sample; none for other answers) must pass
`check_transcript` for the row's language, and ``max_tokens`` bounds the answer of a one-clip row, or
the rendered prompt without its audio placeholders for any other conversation (``too_many_tokens``). A tag the tokenizer does not
know drops the row as ``tag_mismatch``, as today.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from speechlm.data.audio import decode_audio, probe_length
from speechlm.data.conversation import Conversation
from speechlm.data.samples import DroppedSample, PendingClip, Sample
from speechlm.data.special_tokens import format_lang_tag
from speechlm.data.text import check_transcript

# `ds` below is the `speechlm.data.dataset.SpeechDataset` that calls in (typed Any: the dataset imports
# this module, and importing it back would make a cycle)
SpeechDataset = Any


def _encode(ds: SpeechDataset, i: int, text: str, what: str) -> list[int] | DroppedSample:
    try:  # an answer or a clip's transcript: a target, under the run's data.text_normalize rule
        return list(ds.renderer.encode_target(text))
    except ValueError as e:  # a tag the tokenizer lacks
        return ds._drop(i, "tag_mismatch", f"{what}: {e}")


def _texts(
    ds: SpeechDataset, i: int, conv: Conversation, plain: bool
) -> tuple[list[int], list[list[int]]] | DroppedSample:
    """(answer ids, per-clip transcript ids) of row `i` (``plain``: it has no ``conversation``), or why it
    is dropped."""
    if plain and ds.optional("answer", i) is None:
        ids = ds._tokens(i)  # today's row: today's checks and drops, the same ids
        return (ids, [ids]) if isinstance(ids, list) else ids
    answer = conv.answer
    if not answer.strip():
        return ds._drop(i, "empty_text", "its last assistant turn holds no words: fix the answer of the row")
    ctc: list[list[int]] = []
    for k, (clip, transcript) in enumerate(zip(conv.clips, conv.ctc_transcripts())):
        if not transcript:  # no transcript of its own (and no asr answer stands in): no CTC term
            ctc.append([])
            continue
        reason = check_transcript(transcript, conv.lang)
        if reason is not None:
            return ds._drop(
                i,
                reason,
                f"clip {k} ({clip.path}): transcript {transcript[:60]!r} fails the check {reason} for "
                f"language {conv.lang!r}; fix the clip's transcript (tag {format_lang_tag(conv.lang)} first)",
            )
        got = _encode(ds, i, transcript, f"clip {k} ({clip.path})'s transcript")
        if not isinstance(got, list):
            return got
        ctc.append(got)
    ids = _encode(ds, i, answer, "the answer")
    if not isinstance(ids, list):
        return ids
    if plain and len(ids) > ds.max_tokens:
        return ds._drop(
            i,
            "too_many_tokens",
            f"its answer has {len(ids)} tokens, more than data.max_tokens={ds.max_tokens}: raise "
            "data.max_tokens or shorten the answer",
        )
    return ids, ctc


def conversation_sample(ds: SpeechDataset, i: int) -> Sample | DroppedSample:
    """Row `i` of `ds` rendered by ``ds.renderer`` (see the module docstring)."""
    assert ds.renderer is not None
    plain = ds.optional("conversation", i) is None  # the transcription shape of the row's columns
    if plain:
        try:
            ds._texts[i].as_py()
        except UnicodeDecodeError as e:
            return ds._drop(i, "invalid_text", f"column 'text' is not valid UTF-8 ({e}): fix the text")
    conv = ds.conversation(i)
    texts = _texts(ds, i, conv, plain)
    if not isinstance(texts, tuple):
        return texts
    ids, ctc = texts
    try:
        prompt_ids, prompt_mask = ds.renderer.render(conv, answer_ids=ids)  # the answer encoded once
    except ValueError as e:  # a tag the tokenizer lacks in a turn's text, a placeholder written as text
        return ds._drop(i, "tag_mismatch", f"its conversation cannot be rendered: {e}")
    if not plain:
        n_text = int((prompt_ids != ds.tokenizer.audio_id).sum())  # type: ignore[attr-defined]
        if n_text > ds.max_tokens:
            return ds._drop(
                i,
                "too_many_tokens",
                f"its rendered conversation has {n_text} text tokens, more than data.max_tokens="
                f"{ds.max_tokens}: raise data.max_tokens or shorten the conversation",
            )
    decoded, pending = [], []
    read = probe_length if ds.defer_audio else decode_audio  # defer: the header's length, decoded later
    for k, clip in enumerate(conv.clips):
        if plain:  # the row's one clip, read as today (the row's locators)
            name, start = str(ds.resolve_path(i)), ds._locators.start_of(i)
            load = functools.partial(ds._load, i)
            what = ""
        else:
            name, start = (f"{clip.tar}:{clip.path}" if clip.tar else clip.path), clip.offset
            load = functools.partial(ds.load_clip, clip)
            what = f"clip {k} of {len(conv.clips)}: "
        audio = ds._decoded(i, functools.partial(load, read=read), name, start, clip.duration, what=what)
        if isinstance(audio, DroppedSample):
            return audio
        decoded.append(audio)
        seg = ds._describe(i)
        row = f"row {i}" if seg == f"row {i}" else f"row {i} ({seg})"
        where = f"manifest {ds._source_of(i)}, {row}, {what or 'clip '}{name}"
        pending.append(PendingClip(load, where, audio) if ds.defer_audio else None)
    order = conv.audio_order
    if ds.defer_audio:  # lengths only (`speechlm.data.local_decode.LocalCollator` decodes)
        lens = [int(decoded[k]) for k in order]
        clips = tuple(torch.zeros(0) for _ in order)
        n_samples = sum(lens)
    else:
        clips = tuple(torch.from_numpy(decoded[k]) for k in order)
        n_samples = sum(a.size for a in decoded)
    return Sample(
        index=i,
        audio=clips[0],
        tokens=torch.tensor(ids, dtype=torch.int64),
        duration=float(n_samples) / ds.sample_rate,
        lang=conv.lang,
        clips=clips,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        ctc_tokens=tuple(torch.tensor(ctc[k], dtype=torch.int64) for k in order),
        task=conv.task,
        pending=tuple(pending[k] for k in order) if ds.defer_audio else (),
    )


def conversation_fields(kept: list[Sample], pad_id: int) -> dict[str, Any]:
    """The Batch fields of conversation samples (module docstring): audio/audio_lens per clip too."""
    clips = [c for s in kept for c in s.clips]
    if kept[0].pending:  # lengths from the headers, no sample yet (`speechlm.data.local_decode`)
        audio_lens_C = torch.tensor([p.samples for s in kept for p in s.pending], dtype=torch.int64)
        audio_CN = torch.zeros(len(clips), 0, dtype=torch.float32)
    else:
        audio_lens_C = torch.tensor([c.numel() for c in clips], dtype=torch.int64)
        audio_CN = torch.zeros(len(clips), int(audio_lens_C.max()), dtype=torch.float32)
    for c, clip in enumerate(clips):
        audio_CN[c, : clip.numel()] = clip
    prompts = [s.prompt_ids for s in kept]
    masks = [s.prompt_mask for s in kept]
    prompt_lens_B = torch.tensor([p.numel() for p in prompts if p is not None], dtype=torch.int64)
    prompt_ids_BP = torch.full((len(kept), int(prompt_lens_B.max())), pad_id, dtype=torch.int64)
    prompt_mask_BP = torch.zeros(len(kept), int(prompt_lens_B.max()), dtype=torch.bool)
    for b, (p, m) in enumerate(zip(prompts, masks)):
        assert p is not None and m is not None
        prompt_ids_BP[b, : p.numel()] = p
        prompt_mask_BP[b, : m.numel()] = m
    ctc = [t for s in kept for t in s.ctc_tokens]
    ctc_lens_C = torch.tensor([t.numel() for t in ctc], dtype=torch.int64)
    ctc_CK = torch.full((len(ctc), int(ctc_lens_C.max()) if ctc else 0), pad_id, dtype=torch.int64)
    for c, t in enumerate(ctc):
        ctc_CK[c, : t.numel()] = t
    clip_sample_C = torch.tensor([b for b, s in enumerate(kept) for _ in s.clips], dtype=torch.int64)
    return {
        "audio": audio_CN,
        "audio_lens": audio_lens_C,
        "clip_sample": clip_sample_C,
        "prompt_ids": prompt_ids_BP,
        "prompt_mask": prompt_mask_BP,
        "prompt_lens": prompt_lens_B,
        "ctc_tokens": ctc_CK,
        "ctc_token_lens": ctc_lens_C,
        "tasks": [s.task for s in kept],
    }
