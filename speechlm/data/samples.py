"""What the dataset returns for one manifest row: a decoded `Sample`, or a `DroppedSample` saying why not.

Kept apart from `speechlm.data.dataset` so that `speechlm.data.conversation_samples`, which builds
conversation samples for it, does not import the dataset back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DroppedSample", "PendingClip", "Sample"]


@dataclass(frozen=True)
class PendingClip:
    """A clip whose length is known (its header) and whose samples are not decoded yet
    (`SpeechDataset(defer_audio=True)`; `speechlm.data.local_decode` decodes it where it is encoded)."""

    load: Callable[..., Any]  # load(read=decode_audio) -> float32 samples
    where: str  # the manifest, row and clip, for messages
    samples: int  # what the header says decoding will return


@dataclass(frozen=True)
class Sample:
    """One decoded utterance. `duration` is that of the decoded audio, in seconds (all clips).

    With a renderer (`SpeechDataset(renderer=...)`) it is a conversation: ``clips`` every decoded clip
    in the order of its placeholders (``audio`` is the first), ``prompt_ids``/``prompt_mask`` the
    rendered conversation, ``ctc_tokens`` each clip's transcript ids (empty: none), ``tokens`` the
    last answer's ids."""

    index: int
    audio: torch.Tensor  # [N] float32, mono, at the dataset's sample rate
    tokens: torch.Tensor  # [L] int64, no bos/eos, at most max_tokens
    duration: float
    lang: str
    clips: tuple[torch.Tensor, ...] = ()
    prompt_ids: torch.Tensor | None = None  # [P] int64, one audio_id per clip
    prompt_mask: torch.Tensor | None = None  # [P] bool, True on the supervised tokens
    ctc_tokens: tuple[torch.Tensor, ...] = ()  # per clip, [K] int64
    task: str = "asr"
    pending: tuple[PendingClip, ...] = ()  # defer_audio: per clip, in ``clips``' order; ``clips`` are empty


@dataclass(frozen=True)
class DroppedSample:
    """A row whose audio could not be used; `reason` is one of DROP_REASONS."""

    index: int
    reason: str
    detail: str = ""
    path: str = ""
