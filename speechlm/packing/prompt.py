"""Build the token prompt of one utterance from a `PromptFormat`: its fixed ids around the audio
placeholder and the transcript, computed once per run from the tokenizer.

Letters: B batch rows, L prompt length (here: one utterance, audio still a single placeholder).

    ids_L          *prefix  <audio>  *middle  *target  *stop  *trailing
    target_mask_L     0        0        0        1       1        0

``ids_L`` holds one ``audio_id`` placeholder that packing (``speechlm.packing.thd``) replaces by the
clip's audio embeddings. ``target_mask_L`` is True on the transcript tokens (which begin with the
language tag when there is one, so the language is supervised) and on the stop tokens; everything
else is context only.

The plain form (SentencePiece tokenizer, or an LLM tokenizer without a chat template) is today's
``[bos, <audio>, *instruction, *target, eos]``: prefix ``[bos]`` (empty without a BOS token), middle
the instruction, stop ``[eos]``, no trailing ids. Example, instruction of 2 tokens, target
``[<en>, w1, w2]``::

    ids_L          bos  <audio>  i1  i2  <en>  w1  w2  eos
    target_mask_L   0      0      0   0    1    1   1    1

The chat form (`build_prompt_format` with a template): the template is rendered once with a system
turn (``data.system_prompt``, if set), a user turn ``<|audio|>`` + newline + instruction and an
assistant turn whose content is a sentinel; the text is split at the placeholder and the sentinel
and each piece encoded with its special tokens. Prefix is everything before the placeholder, middle
the rest of the user turn and the assistant header, stop the text after the sentinel up to and
including its first special token (the template's end-of-turn token, e.g. ChatML's ``<|im_end|>``;
``stop_id``, where greedy decoding stops), trailing what the template writes after it (unlabelled).
A template that writes no special token after the content gets ``eos`` appended to stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from speechlm.packing.thd import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "PromptFormat", "build_prompt", "build_prompt_format", "build_prompts"]

SENTINEL = "SPEECHLMTRANSCRIPTSENTINEL"  # the assistant content the template is rendered with


@dataclass(frozen=True)
class PromptFormat:
    """The fixed ids of every utterance's prompt (see the module docstring); ``stop_id`` ends decoding."""

    audio_id: int
    eos_id: int
    prefix: tuple[int, ...] = ()
    middle: tuple[int, ...] = ()
    stop: tuple[int, ...] = ()
    trailing: tuple[int, ...] = ()
    bos_id: int | None = None
    templated: bool = False

    def __post_init__(self) -> None:
        if not self.stop:
            raise ValueError("PromptFormat.stop is empty: the transcript needs an end token (eos)")
        for name in ("prefix", "middle", "stop", "trailing"):
            if self.audio_id in getattr(self, name):
                raise ValueError(
                    f"PromptFormat.{name} contains the audio placeholder id {self.audio_id}; the placeholder "
                    "must appear only once, between the prefix and the middle"
                )

    @classmethod
    def plain(
        cls, *, bos_id: int | None, eos_id: int, audio_id: int, instruction_ids: Sequence[int] = ()
    ) -> PromptFormat:
        """``[bos, <audio>, *instruction, *target, eos]`` (no bos where ``bos_id`` is None)."""
        instruction = tuple(int(t) for t in instruction_ids)
        if audio_id in instruction:
            raise ValueError(
                f"instruction_ids contains the audio placeholder id {audio_id}; the placeholder must appear "
                "only once, between BOS and the instruction (use a dedicated special token for audio_id)"
            )
        prefix = () if bos_id is None else (int(bos_id),)
        return cls(int(audio_id), int(eos_id), prefix, instruction, (int(eos_id),), (), bos_id)

    @property
    def stop_id(self) -> int:
        """The token whose generation ends a transcript (the last stop token)."""
        return self.stop[-1]

    @property
    def generation_prompt(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids before the audio, ids after it): what greedy decoding feeds before the first new token."""
        return self.prefix, self.middle

    def build(self, target_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        """``(ids_L, target_mask_L)`` (int64, bool) for one utterance."""
        target = [int(t) for t in target_ids]
        if self.audio_id in target:
            raise ValueError(
                f"target_ids contains the audio placeholder id {self.audio_id}; the placeholder must appear "
                "only once, between BOS and the instruction (use a dedicated special token for audio_id)"
            )
        head = [*self.prefix, self.audio_id, *self.middle]
        ids = [*head, *target, *self.stop, *self.trailing]
        target_mask_L = torch.zeros(len(ids), dtype=torch.bool)
        target_mask_L[len(head) : len(head) + len(target) + len(self.stop)] = True
        return torch.tensor(ids, dtype=torch.long), target_mask_L


def _split_once(text: str, marker: str, what: str) -> tuple[str, str]:
    if text.count(marker) != 1:
        raise ValueError(
            f"the chat template renders {what} {text.count(marker)} times, expected once: {text[:300]!r}; "
            "use a template that writes each message's content once (or data.chat_template=none)"
        )
    before, after = text.split(marker)
    return before, after


def build_prompt_format(
    tokenizer: Any,
    *,
    instruction: str = "",
    system_prompt: str | None = None,
    chat_template: str = "auto",
    audio_token: str = "<|audio|>",
) -> PromptFormat:
    """The run's `PromptFormat` from its tokenizer, built once (never per sample).

    ``chat_template``: ``auto`` (the tokenizer's template if it has one, else the plain form),
    ``none`` (the plain form), or the template text itself (the caller reads a file). A tokenizer
    without ``render_chat``/``encode_template`` (SentencePiece) only has the plain form. A system
    prompt needs a template (ValueError otherwise, as for any template that cannot be split)."""
    template: str | None = None
    if chat_template == "auto":
        template = getattr(tokenizer, "chat_template", None)
    elif chat_template != "none":
        template = chat_template
    if template is not None and not hasattr(tokenizer, "render_chat"):
        raise ValueError(
            "a chat template needs the LLM's (Hugging Face) tokenizer; this tokenizer has no chat "
            "support (a SentencePiece model): set data.chat_template=none"
        )
    if template is None:
        if system_prompt:
            raise ValueError(
                "data.system_prompt is set but the prompt has no chat template (plain form "
                "[bos, audio, instruction, transcript, eos]) to put it in: unset data.system_prompt, or "
                "use a tokenizer with a chat template (data.chat_template)"
            )
        instruction_ids = tokenizer.encode(instruction) if instruction else ()
        return PromptFormat.plain(
            bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, audio_id=tokenizer.audio_id,
            instruction_ids=instruction_ids,
        )  # fmt: skip
    user = audio_token + (f"\n{instruction}" if instruction else "")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": SENTINEL}]
    text = tokenizer.render_chat(messages, template)
    head, tail = _split_once(text, SENTINEL, "the assistant content")
    before, after = _split_once(head, audio_token, f"the audio placeholder {audio_token}")
    encode, special = tokenizer.encode_template, tokenizer.special_ids
    tail_ids = encode(tail)
    k = next((j for j, t in enumerate(tail_ids) if t in special), None)
    stop = (*tail_ids, tokenizer.eos_id) if k is None else tail_ids[: k + 1]
    trailing = () if k is None else tail_ids[k + 1 :]
    return PromptFormat(
        audio_id=tokenizer.audio_id,
        eos_id=tokenizer.eos_id,
        prefix=tuple(encode(before)),
        middle=tuple(encode(after)),
        stop=tuple(stop),
        trailing=tuple(trailing),
        bos_id=tokenizer.bos_id,
        templated=True,
    )


def build_prompt(
    target_ids: Sequence[int],
    *,
    bos_id: int | None,
    eos_id: int,
    audio_id: int,
    instruction_ids: Sequence[int] = (),
) -> tuple[Tensor, Tensor]:
    """Return ``(ids_L, target_mask_L)`` (int64, bool) of the plain form for one utterance."""
    fmt = PromptFormat.plain(bos_id=bos_id, eos_id=eos_id, audio_id=audio_id, instruction_ids=instruction_ids)
    return fmt.build(target_ids)


def build_prompts(
    tokens_BL: Tensor,
    token_lens_B: Tensor | Sequence[int],
    *,
    prompt: PromptFormat | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    audio_id: int | None = None,
    instruction_ids: Sequence[int] = (),
) -> list[tuple[Tensor, Tensor]]:
    """Build one prompt per row of a collated batch; row ``b`` uses ``tokens_BL[b, :token_lens_B[b]]``.

    ``prompt`` is the format; without it, the plain form of ``bos_id``/``eos_id``/``audio_id``."""
    if prompt is None:
        if eos_id is None or audio_id is None:
            raise ValueError("build_prompts needs prompt=PromptFormat or eos_id and audio_id")
        prompt = PromptFormat.plain(
            bos_id=bos_id, eos_id=eos_id, audio_id=audio_id, instruction_ids=instruction_ids
        )
    lens = [int(n) for n in (token_lens_B.tolist() if isinstance(token_lens_B, Tensor) else token_lens_B)]
    if tokens_BL.dim() != 2 or len(lens) != tokens_BL.shape[0]:
        raise ValueError(
            f"tokens must be [B, L] with one length per row, got shape {tuple(tokens_BL.shape)} and "
            f"{len(lens)} lengths"
        )
    rows = tokens_BL.detach().cpu().tolist()
    out = []
    for b, (row, n) in enumerate(zip(rows, lens)):
        if not 0 <= n <= len(row):
            raise ValueError(f"row {b}: token length {n} is outside [0, {len(row)}]")
        out.append(prompt.build(row[:n]))
    return out


# --------------------------------------------------------------------------------------------
# Conversations: any number of turns and audio clips, a prompt per sample
# --------------------------------------------------------------------------------------------

LOSS_TURNS = ("all", "last")


class ConversationRenderer:
    """Render a `speechlm.data.conversation.Conversation` to ``(ids_L, target_mask_L)``: one ``audio_id``
    placeholder per audio part (in `Conversation.audio_order`), the assistant turns' text and stop tokens
    as targets (every assistant turn with ``loss_turns="all"``, only the last with ``"last"``; the
    others stay as context).

    Plain form (no chat template): ``[bos]``, then per turn: system and user text encoded as they are
    (audio parts as placeholders), assistant text followed by ``eos`` (labelled). The chat form renders
    the template once per sample over the messages (audio parts written as ``audio_token``, parts of a
    turn joined by a newline, each assistant content a sentinel), splits the text at the placeholders
    and sentinels, and labels each assistant content plus the template's end-of-turn token after it (as
    `build_prompt_format` does for one turn). ``system_prompt`` is added as a system turn to
    conversations that have none.

    A conversation of the transcription shape (one user turn ``[audio] + instruction``, one assistant
    turn, no system turn of its own) is rendered through a `PromptFormat` cached per instruction: the
    same ids as `build_prompt_format(...).build(...)`, at the cost of a tuple concatenation.

    Assistant text is a training target: `encode_target` applies ``normalize`` (the run's
    ``data.text_normalize`` rule) before encoding it; user and system text are encoded as written."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        system_prompt: str | None = None,
        chat_template: str = "auto",
        loss_turns: str = "all",
        audio_token: str = "<|audio|>",
        normalize: Callable[[str], str] | None = None,
    ) -> None:
        if loss_turns not in LOSS_TURNS:
            raise ValueError(f"loss_turns={loss_turns!r}: choose one of {LOSS_TURNS}")
        self.tokenizer = tokenizer
        self.normalize = normalize
        self.system_prompt = system_prompt or None
        self.chat_template = chat_template
        self.loss_turns = loss_turns
        self.audio_token = audio_token
        template: str | None = None
        if chat_template == "auto":
            template = getattr(tokenizer, "chat_template", None)
        elif chat_template != "none":
            template = chat_template
        self.template = template
        self._formats: dict[str, PromptFormat] = {}

    def format_for(self, instruction: str) -> PromptFormat:
        """The `PromptFormat` of a one-turn transcription prompt with ``instruction`` (cached)."""
        fmt = self._formats.get(instruction)
        if fmt is None:
            fmt = build_prompt_format(
                self.tokenizer,
                instruction=instruction,
                system_prompt=self.system_prompt,
                chat_template=self.chat_template,
                audio_token=self.audio_token,
            )
            self._formats[instruction] = fmt
        return fmt

    def render(self, conv: Any, *, answer_ids: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        """``(ids_L int64, target_mask_L bool)`` of one conversation. A part that is not a ``str`` is an
        audio reference (`speechlm.data.conversation.AudioRef`; not imported: this module needs torch only).
        ``answer_ids``: the last assistant turn's ids when the caller has encoded them already (the dataset
        has, for `Batch.tokens`); None: encoded here."""
        turns = conv.turns
        answers = self.answers_of(turns, answer_ids)
        if (
            len(turns) == 2
            and turns[0].role == "user"
            and turns[1].role == "assistant"
            and turns[0].parts
            and not isinstance(turns[0].parts[0], str)
            and all(isinstance(p, str) for p in turns[0].parts[1:])
            and all(isinstance(p, str) for p in turns[1].parts)
        ):
            return self.format_for("\n".join(str(p) for p in turns[0].parts[1:])).build(answers[0])
        if self.template is None:
            return self._render_plain(turns, answers)
        return self._render_chat(turns, answers)

    def answers_of(self, turns: Sequence[Any], answer_ids: Sequence[int] | None = None) -> list[list[int]]:
        """The ids of each assistant turn's text, the last one ``answer_ids`` when given."""
        said = [t.text for t in turns if t.role == "assistant"]
        answers = [self.encode_target(text) for text in said[:-1]]
        last = self.encode_target(said[-1]) if answer_ids is None else answer_ids
        return [*answers, [int(t) for t in last]]

    def encode_target(self, text: str) -> list[int]:
        """The ids of an answer or transcript: ``normalize`` applied (the run's data.text_normalize rule,
        `speechlm.data.text.normalize_target`), then encoded. Every target of training goes through here
        (the dataset's answers and per-clip transcripts too)."""
        return list(self.tokenizer.encode(text if self.normalize is None else self.normalize(text)))

    def _labelled(self, turns: Sequence[Any]) -> list[bool]:
        last = max(i for i, t in enumerate(turns) if t.role == "assistant")
        return [
            t.role == "assistant" and (self.loss_turns == "all" or i == last) for i, t in enumerate(turns)
        ]

    def _render_plain(self, turns: Sequence[Any], answers: Sequence[list[int]]) -> tuple[Tensor, Tensor]:
        tok = self.tokenizer
        if self.system_prompt and not any(t.role == "system" for t in turns):
            raise ValueError(
                "data.system_prompt is set but the prompt has no chat template to put it in: unset "
                "data.system_prompt, or use a tokenizer with a chat template (data.chat_template)"
            )
        ids: list[int] = [] if tok.bos_id is None else [int(tok.bos_id)]
        mask: list[bool] = [False] * len(ids)
        answer = iter(answers)
        for turn, labelled in zip(turns, self._labelled(turns)):
            if turn.role == "assistant":
                piece = [*next(answer), int(tok.eos_id)]
                if tok.audio_id in piece[:-1]:
                    raise ValueError(
                        f"an assistant turn's text {turn.text[:60]!r} holds the audio placeholder"
                    )
                ids += piece
                mask += [labelled] * len(piece)
                continue
            for p in turn.parts:
                piece = list(tok.encode(p)) if isinstance(p, str) else [int(tok.audio_id)]
                ids += piece
                mask += [False] * len(piece)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)

    def _render_chat(self, turns: Sequence[Any], answers: Sequence[list[int]]) -> tuple[Tensor, Tensor]:
        tok = self.tokenizer
        messages: list[dict[str, str]] = []
        if self.system_prompt and not any(t.role == "system" for t in turns):
            messages.append({"role": "system", "content": self.system_prompt})
        sentinels: list[str] = []
        for t in turns:
            if t.role == "assistant":
                sentinels.append(f"{SENTINEL}{len(sentinels)}X")
                messages.append({"role": "assistant", "content": sentinels[-1]})
            else:
                parts = [p if isinstance(p, str) else self.audio_token for p in t.parts]
                messages.append({"role": t.role, "content": "\n".join(parts)})
        text = tok.render_chat(messages, self.template)
        labelled = [flag for t, flag in zip(turns, self._labelled(turns)) if t.role == "assistant"]
        texts = [t.text for t in turns if t.role == "assistant"]
        ids: list[int] = []
        mask: list[bool] = []
        encode = tok.encode_template

        def context(piece: str) -> None:
            for k, chunk in enumerate(piece.split(self.audio_token)):
                if k:
                    ids.append(int(tok.audio_id))
                    mask.append(False)
                got = encode(chunk)
                if tok.audio_id in got:
                    raise ValueError(f"the chat template writes the audio placeholder itself: {chunk[:80]!r}")
                ids.extend(got)
                mask.extend([False] * len(got))

        rest = text
        for k, sentinel in enumerate(sentinels):
            before, rest = _split_once(rest, sentinel, f"assistant turn {k}'s content")
            if k:  # the previous answer's stop tokens lead this piece
                before = self._stop_then(before, labelled[k - 1], ids, mask)
            context(before)
            target = [int(t) for t in answers[k]]
            if tok.audio_id in target:
                raise ValueError(f"assistant turn {k}'s text {texts[k][:60]!r} holds the audio placeholder")
            ids.extend(target)
            mask.extend([labelled[k]] * len(target))
        rest = self._stop_then(rest, labelled[-1], ids, mask)
        context(rest)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)

    def _stop_then(self, piece: str, labelled: bool, ids: list[int], mask: list[bool]) -> str:
        """Append the end-of-turn tokens at the head of ``piece`` (up to and including its first special
        token; ``eos`` when it has none), labelled as the answer is; return the rest of ``piece`` as text."""
        tok = self.tokenizer
        got = tok.encode_template(piece)
        k = next((j for j, t in enumerate(got) if t in tok.special_ids), None)
        if k is None:
            ids.append(int(tok.eos_id))
            mask.append(labelled)
            return piece
        ids.extend(got[: k + 1])
        mask.extend([labelled] * (k + 1))
        token_text = tok.id_to_piece(got[k])
        if token_text not in piece:
            raise ValueError(
                f"cannot find the end-of-turn token {token_text!r} in the rendered text {piece[:80]!r}"
            )
        return piece.split(token_text, 1)[1]  # the text after it: encoded by the caller as context
