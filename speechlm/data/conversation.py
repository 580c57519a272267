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
``user: [clip 0] + instruction, assistant: "<|lang|> transcript"``, the clip's transcript set so CTC can use it.

Loss: the assistant turns are the targets (`speechlm.prompt.render_conversation`); ``data.loss_turns``
chooses all of them or only the last one.

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
        """Raise `ConversationError` for: an unknown role, no assistant turn, an audio reference to a clip
        that does not exist, or a clip no turn refers to."""
        where = f"conversation {self.id!r}" if self.id else "conversation"
        used: set[int] = set()
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
                    used.add(p.clip)
        if not any(t.role == "assistant" for t in self.turns):
            raise ConversationError(f"{where} has no assistant turn: nothing to train on")
        unused = sorted(set(range(len(self.clips))) - used)
        if unused:
            raise ConversationError(f"{where}: clip(s) {unused} are never referred to by a turn")

    # ------------------------------------------------------------------------------------------

    @classmethod
    def transcription(
        cls, clip: Clip, transcript: str, *, lang: str, instruction: str = "", task: str = "asr", id: str = ""
    ) -> Conversation:
        """Today's row: ``user: [clip] + instruction, assistant: transcript`` (the clip's transcript set)."""
        if clip.transcript is None:
            clip = Clip(**{**clip.__dict__, "transcript": transcript})
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
