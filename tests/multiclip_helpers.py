"""Conversation batches for the multi-clip tests, built without the dataset (another part's scope):
conversations rendered by the real `ConversationRenderer` over a word tokenizer, collated into the
`Batch` conversation fields as interface B describes them (rows in order, each row's clips in the
order of their placeholders; ``tokens`` the last answer's ids).

The tokenizer's words are ``w<N>``, whose id is N, so a transcript's ids are written out directly
(``"w5 w17 w30"`` is ``[5, 17, 30]``); ids 0-4 are pad, (unused), bos, eos and the audio placeholder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from speechlm.data.conversation import AudioRef, Clip, Conversation, Turn
from speechlm.data.dataset import Batch
from speechlm.packing.prompt import ConversationRenderer

PAD, BOS, EOS, AUDIO = 0, 2, 3, 4


class WordTokenizer:
    """``encode("w7 w12") == [7, 12]``; the plain form's special ids (no chat template)."""

    pad_id, bos_id, eos_id, audio_id = PAD, BOS, EOS, AUDIO
    langs = ("xx",)

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]


def words(ids: Sequence[int]) -> str:
    return " ".join(f"w{int(i)}" for i in ids)


def renderer(loss_turns: str = "all") -> ConversationRenderer:
    return ConversationRenderer(WordTokenizer(), chat_template="none", loss_turns=loss_turns)


def random_conversation(g: torch.Generator, n_clips: int, vocab: int, *, two_turns: bool) -> Conversation:
    """A user turn with the first clips and a short instruction, an assistant answer (a tag first);
    with ``two_turns`` a second user turn (text, then the remaining clips) and a second answer. Clip
    transcripts (the CTC targets) are set on every other clip only."""

    def rand(n: int) -> list[int]:
        return torch.randint(8, vocab, (n,), generator=g).tolist()

    first = n_clips if not two_turns else max(1, n_clips - 1)
    user1: list[str | AudioRef] = [AudioRef(c) for c in range(first)] + [words(rand(1))]
    answer1 = words(
        [5 + int(torch.randint(0, 3, (1,), generator=g)), *rand(int(torch.randint(1, 4, (1,), generator=g)))]
    )
    turns = [Turn("user", tuple(user1)), Turn("assistant", (answer1,))]
    if two_turns:
        user2: list[str | AudioRef] = [words(rand(2))] + [AudioRef(c) for c in range(first, n_clips)]
        turns += [Turn("user", tuple(user2)), Turn("assistant", (words(rand(2)),))]
    clips = tuple(
        Clip(f"clip{c}.wav", transcript=words([5, *rand(3)]) if c % 2 == 0 else None) for c in range(n_clips)
    )
    return Conversation(tuple(turns), clips, task="qa", lang="xx")


def random_audio(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.randint(2400, 8000, (n,), generator=g)
    audio = torch.zeros(n, int(lens.max()) if n else 0)
    for i, m in enumerate(lens.tolist()):
        audio[i, :m] = 0.3 * torch.randn(m, generator=g)
    return audio, lens


def collate(
    convs: Sequence[Conversation], audio_CN: torch.Tensor, audio_lens_C: torch.Tensor, r: ConversationRenderer
) -> Batch:
    """The conversation `Batch` of ``convs`` whose clips (in audio_order, row after row) are ``audio_CN``."""
    tok = r.tokenizer
    rendered = [r.render(c) for c in convs]
    P = max(int(ids.shape[0]) for ids, _ in rendered)
    B = len(convs)
    prompt_ids = torch.full((B, P), PAD, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    for b, (ids, mask) in enumerate(rendered):
        prompt_ids[b, : ids.shape[0]] = ids
        prompt_mask[b, : ids.shape[0]] = mask
    clip_sample = [b for b, c in enumerate(convs) for _ in c.audio_order]
    ctc = [tok.encode(ctc_target(c, k)) for c in convs for k in c.audio_order]
    answers = [tok.encode(c.answer) for c in convs]

    def pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full((len(rows), max([len(x) for x in rows] + [1])), PAD, dtype=torch.long)
        for i, x in enumerate(rows):
            out[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        return out, torch.tensor([len(x) for x in rows], dtype=torch.long)

    tokens, token_lens = pad(answers)
    ctc_tokens, ctc_lens = pad(ctc)
    assert audio_CN.shape[0] == len(clip_sample), "one audio row per clip reference"
    durations = torch.zeros(B)
    durations.index_add_(0, torch.tensor(clip_sample, dtype=torch.long), audio_lens_C.float() / 16000)
    return Batch(
        audio=audio_CN,
        audio_lens=audio_lens_C,
        tokens=tokens,
        token_lens=token_lens,
        langs=[c.lang for c in convs],
        indices=list(range(B)),
        durations=durations,
        dropped={},
        clip_sample=torch.tensor(clip_sample, dtype=torch.long),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        prompt_lens=torch.tensor([int(ids.shape[0]) for ids, _ in rendered], dtype=torch.long),
        ctc_tokens=ctc_tokens,
        ctc_token_lens=ctc_lens,
        tasks=[c.task for c in convs],
    )


def text_conversation(g: torch.Generator, vocab: int) -> Conversation:
    """A conversation without audio: a user question and an answer."""
    q, a = (
        torch.randint(8, vocab, (3,), generator=g).tolist(),
        torch.randint(8, vocab, (2,), generator=g).tolist(),
    )
    return Conversation((Turn("user", (words(q),)), Turn("assistant", (words(a),))), (), task="chat")


def make_conv_batch(
    seed: int, n_rows: int, vocab: int, *, text_rows: int = 0, transcripts: bool = True
) -> Batch:
    """``n_rows`` conversations of 1-3 clips, one or two answers each (loss on all answers); the first
    ``text_rows`` of them hold no audio. ``transcripts=False``: no clip has a transcript (QA data,
    multi-clip ShareGPT): the batch has no CTC target at all."""
    g = torch.Generator().manual_seed(seed)
    convs = [text_conversation(g, vocab) for _ in range(text_rows)]
    for i in range(text_rows, n_rows):
        n_clips = 1 + (seed + i) % 3
        conv = random_conversation(g, n_clips, vocab, two_turns=(seed + i) % 2 == 1)
        if not transcripts:
            conv = dataclasses.replace(
                conv, clips=tuple(dataclasses.replace(c, transcript=None) for c in conv.clips)
            )
        convs.append(conv)
    n = sum(len(c.audio_order) for c in convs)
    audio, lens = random_audio(g, n)
    return collate(convs, audio, lens, renderer())


def ctc_target(conv: Conversation, k: int) -> str:
    """Clip k's CTC target by `Conversation.ctc_transcripts`' rule, in the word tokenizer's terms (its
    texts carry no ``<|xx|>`` tag to add): the clip's own transcript, or the answer of a one-clip asr
    sample, else none."""
    own = conv.clips[k].transcript
    if own:
        return own
    return conv.answer if len(conv.clips) == 1 and conv.task == "asr" else ""


def transcription_pair(legacy: Batch) -> Batch:
    """The conversation batch of a one-clip batch: each row the transcription shape of its transcript
    (no instruction), its answer the clip's CTC target (the one-clip asr rule)."""
    n = legacy.audio.shape[0]
    convs = []
    for b in range(n):
        text = words(legacy.tokens[b, : int(legacy.token_lens[b])].tolist())
        convs.append(Conversation.transcription(Clip(f"c{b}.wav"), text, lang=legacy.langs[b]))
    return collate(convs, legacy.audio, legacy.audio_lens, renderer())
