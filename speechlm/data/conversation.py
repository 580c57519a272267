"""A training sample as a conversation: turns of text and audio clips, a task and a language.

Every sample the trainer sees is a `Conversation`, whatever format it was read from (manifest row,
NeMo multimodal-conversation JSONL, ShareGPT JSON, Lhotse cut). Shapes of the parts:

    Conversation
      turns   (Turn(role, parts), ...)   role: "system" | "user" | "assistant"
                                         parts: text (str) or an audio reference (AudioRef(k): clip k)
      clips   (Clip(path, offset, duration, tar locator, transcript), ...)   in order of first reference
      task    "asr" (default), "ast", "qa", ... : selects the metric and the share in plans
      lang    the language of the audio (the row's language; the sampler balances on it)

The single-transcript row of today is the special case `Conversation.transcription`:
``user: [clip 0] + instruction, assistant: "<|lang|> transcript"``.

Answer and transcript are different things. The assistant turns are the LLM's targets
(`speechlm.packing.prompt.render_conversation`; ``data.loss_turns`` chooses all of them or only the last one).
A clip's CTC target is its own transcript (`Clip.transcript`), given per clip by the data; the one
declared exception is `ctc_transcripts`' rule: a one-clip sample of task ``asr`` whose clip has no
transcript of its own uses its answer, cleaned and tagged, since that answer *is* the clip's
transcript. A QA, AST or any other answer is never a CTC target: such a clip without a transcript gets
no CTC term (and is not counted in the CTC normaliser).

Turn order (`check`): a conversation opens with system turns and then a user turn (an answer cannot
come before what it answers), and every clip is heard before the last answer.

JSON form (`to_json` / `from_json`, the manifest's ``conversation`` column)::

    {"task": "ast", "lang": "hi", "id": "utt-1",
     "clips": [{"path": "a.flac", "offset": 0.0, "duration": 2.5, "transcript": "<|hi|> ..."}],
     "turns": [{"role": "user", "parts": [{"audio": 0}, {"text": "Translate to English."}]},
               {"role": "assistant", "parts": [{"text": "water house"}]}]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from speechlm.data.text import as_transcript, split_lang_tag

__all__ = ["ROLES", "AudioRef", "Clip", "Conversation", "ConversationError", "Turn"]

ROLES = ("system", "user", "assistant")


class ConversationError(ValueError):
    """A conversation that cannot be trained on (the message says which part and what to do)."""


@dataclass(frozen=True)
class AudioRef:
    """A part of a turn that is audio clip ``clip`` of the conversation."""

    clip: int


@dataclass(frozen=True)
class Clip:
    """One audio clip: a file (``path``), a cut of one (``offset``/``duration``, seconds), or a tar member
    (``tar`` the shard path, ``path`` the member name; byte locators filled by the loader when known).
    ``transcript``: the clip's ASR transcript when known (language tag first), the CTC target."""

    path: str
    offset: float | None = None
    duration: float | None = None
    tar: str | None = None
    member_offset: int | None = None  # byte offset of the member's data in ``tar``
    member_nbytes: int | None = None
    header_bytes: int | None = None
    transcript: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple[str | AudioRef, ...]

    @property
    def text(self) -> str:
        """The turn's text parts joined (audio left out)."""
        return "".join(p for p in self.parts if isinstance(p, str))


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    clips: tuple[Clip, ...] = ()
    task: str = "asr"
    lang: str = ""
    id: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise `ConversationError` for: an unknown role, no assistant turn, no user turn, an assistant
        turn before the first user turn (an answer before what it answers), an audio reference to a clip
        that does not exist, a clip no turn refers to, or a clip heard only after the last answer."""
        where = f"conversation {self.id!r}" if self.id else "conversation"
        used: dict[int, int] = {}  # clip -> the turn it is first heard in
        for t, turn in enumerate(self.turns):
            if turn.role not in ROLES:
                raise ConversationError(f"{where}, turn {t}: role {turn.role!r} is not one of {ROLES}")
            for p in turn.parts:
                if isinstance(p, AudioRef):
                    if not 0 <= p.clip < len(self.clips):
                        raise ConversationError(
                            f"{where}, turn {t}: refers to audio clip {p.clip} but it has {len(self.clips)} clip(s)"
                        )
                    if turn.role == "assistant":
                        raise ConversationError(
                            f"{where}, turn {t}: an assistant turn holds audio; only user/system turns may"
                        )
                    used.setdefault(p.clip, t)
        roles = [t.role for t in self.turns]
        if "assistant" not in roles:
            raise ConversationError(f"{where} has no assistant turn: nothing to train on")
        if "user" not in roles:
            raise ConversationError(
                f"{where} has no user turn: an answer needs a question (put the audio and the instruction "
                "in a user turn before the assistant's)"
            )
        first = next(t for t, r in enumerate(roles) if r != "system")
        if roles[first] == "assistant":
            raise ConversationError(
                f"{where}, turn {first}: the assistant answers before any user turn; a conversation opens "
                "with the user's turn (and the audio) and the answer follows it: reorder the turns"
            )
        unused = sorted(set(range(len(self.clips))) - set(used))
        if unused:
            raise ConversationError(f"{where}: clip(s) {unused} are never referred to by a turn")
        last_answer = max(t for t, r in enumerate(roles) if r == "assistant")
        late = sorted(c for c, t in used.items() if t > last_answer)
        if late:
            raise ConversationError(
                f"{where}: clip(s) {late} are heard only after the last assistant turn, so no answer uses "
                "them: end the conversation with the assistant's answer to them"
            )

    def ctc_transcripts(self) -> tuple[str | None, ...]:
        """Each clip's CTC target (clip order), None for a clip that gets no CTC term: the clip's own
        transcript (tagged with the sample's language when written untagged); else, for a one-clip
        sample of task ``asr`` only, its answer (cleaned and tagged with the sample's language,
        `data.text.as_transcript`). Never a QA/AST/other answer."""
        own = tuple(as_transcript(c.transcript, self.lang) if c.transcript else None for c in self.clips)
        if len(self.clips) == 1 and own[0] is None and self.task == "asr":
            words = split_lang_tag(self.answer)[1].strip()
            return (as_transcript(words, self.lang),) if words else (None,)
        return own

    # ------------------------------------------------------------------------------------------

    @classmethod
    def transcription(
        cls, clip: Clip, transcript: str, *, lang: str, instruction: str = "", task: str = "asr", id: str = ""
    ) -> Conversation:
        """Today's row: ``user: [clip] + instruction, assistant: transcript`` (the clip keeps its own
        transcript, or none: `ctc_transcripts` says what its CTC target is)."""
        user: tuple[str | AudioRef, ...] = (AudioRef(0), instruction) if instruction else (AudioRef(0),)
        return cls((Turn("user", user), Turn("assistant", (transcript,))), (clip,), task, lang, id)

    @property
    def answer(self) -> str:
        """The last assistant turn's text (what evaluation compares a hypothesis with)."""
        return next(t.text for t in reversed(self.turns) if t.role == "assistant")

    @property
    def audio_order(self) -> list[int]:
        """Clip indices in the order their placeholders appear in the rendered prompt."""
        return [p.clip for t in self.turns for p in t.parts if isinstance(p, AudioRef)]

    @property
    def duration(self) -> float | None:
        """Seconds of audio over all clips (None when a clip's duration is unknown)."""
        ds = [c.duration for c in self.clips]
        return None if any(d is None for d in ds) else float(sum(d for d in ds if d is not None))

    def to_json(self) -> str:
        turns = [
            {
                "role": t.role,
                "parts": [{"audio": p.clip} if isinstance(p, AudioRef) else {"text": p} for p in t.parts],
            }
            for t in self.turns
        ]
        doc = {
            "task": self.task,
            "lang": self.lang,
            "id": self.id,
            "clips": [c.to_dict() for c in self.clips],
        }
        return json.dumps({**doc, "turns": turns}, ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str = "conversation") -> Conversation:
        try:
            doc = json.loads(text)
            clips = tuple(Clip(**c) for c in doc.get("clips", []))
            turns = tuple(
                Turn(
                    t["role"],
                    tuple(AudioRef(int(p["audio"])) if "audio" in p else str(p["text"]) for p in t["parts"]),
                )
                for t in doc["turns"]
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConversationError(
                f"{where}: not a conversation in speechlm's JSON form ({type(e).__name__}: {e}); rebuild the "
                "manifest with `speechlm manifest build`"
            ) from e
        return cls(
            turns, clips, str(doc.get("task", "asr")), str(doc.get("lang", "")), str(doc.get("id", ""))
        )
