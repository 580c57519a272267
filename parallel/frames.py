"""Audio frame arithmetic, one owner for every layer (standard library only: the data layer's planner, the
model, the FLOP count, `speechlm estimate` and the CP clip placement all call these).

Letters: N audio samples, T feature frames, U encoder frames.

- Audio is mono 16 kHz (`SAMPLE_RATE`); every encoder kind's front end reads 10 ms feature frames
  (`HOP_SAMPLES` = 160 samples, `FEATURE_FRAMES_PER_SECOND` = 100), ``T = N // hop`` (the centred STFT's
  extra last frame is dropped: `feature_frames`).
- The encoder subsamples by a power of two (`ENCODER_SUBSAMPLING` per kind; a Parakeet built from sizes
  may set its own factor, a pretrained one keeps its own) with stride-2 convolutions of kernel 3 and
  padding 1: each maps L frames to ``(L - 1) // 2 + 1 = ceil(L / 2)``, so n of them give
  ``ceil(T / 2**n)`` (`encoder_frames`; ceil(ceil(x / a) / b) = ceil(x / ab)).
- The planner works from durations in seconds, not samples: `planned_encoder_frames` counts
  ``ceil(ceil(seconds * 100) / subsampling)``, which may be one feature frame more than the model's
  ``N // hop`` (a duration that is not a whole number of 10 ms): an estimate on the safe side, kept as
  it is because the sampler's costs, plans and fingerprints are built from it.
- Per encoder kind: its subsampling (`ENCODER_SUBSAMPLING`) and whether it has a padding-free path
  (`PADDING_FREE_KINDS`; the model's encoders declare the same through ``supports_packed``).
- The dummy clip (`DUMMY_CLIP_SAMPLES`, 0.1 s of silence) is what a rank with no clip of its own encodes,
  so that every rank runs the same collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "DUMMY_CLIP_SAMPLES",
    "ENCODER_SUBSAMPLING",
    "FEATURE_FRAMES_PER_SECOND",
    "HOP_SAMPLES",
    "PADDING_FREE_KINDS",
    "SAMPLE_RATE",
    "encoder_frames",
    "feature_frames",
    "feature_frames_of_seconds",
    "planned_encoder_frames",
]

SAMPLE_RATE = 16000  # audio samples per second (every clip is resampled to it)
HOP_SAMPLES = 160  # the 10 ms hop of every encoder kind's front end
FEATURE_FRAMES_PER_SECOND = SAMPLE_RATE // HOP_SAMPLES  # 100
# feature frames per encoder frame, per encoder kind: Whisper's one stride-2 conv (50 frames/s),
# FastConformer's three (Parakeet, NeMo: 12.5 frames/s)
ENCODER_SUBSAMPLING = {"whisper": 2, "parakeet": 8, "nemo": 8}
# the encoder kinds with a padding-free path (features, subsampling, layers on real frames only)
PADDING_FREE_KINDS = frozenset({"parakeet"})
DUMMY_CLIP_SAMPLES = SAMPLE_RATE // 10  # 0.1 s of silence


def feature_frames(samples: int, hop: int = HOP_SAMPLES) -> int:
    """T: feature frames of a clip of `samples` audio samples (`speechlm.model.features`)."""
    return int(samples) // hop


def feature_frames_of_seconds(seconds: float) -> int:
    """T of a clip of `seconds`, as the model computes it from the clip's samples."""
    return feature_frames(int(seconds * SAMPLE_RATE))


def encoder_frames(feat_frames: int, subsampling: int) -> int:
    """U: encoder frames of a clip of `feat_frames` feature frames (log2(subsampling) stride-2 convs)."""
    return -(-int(feat_frames) // subsampling)


def planned_encoder_frames(
    seconds: Any,
    subsampling: int,
    *,
    ceil: Callable[[Any], Any] = math.ceil,
    frames_per_second: float = FEATURE_FRAMES_PER_SECOND,
) -> Any:
    """U as the planner estimates it from a duration: ceil(ceil(seconds * 100) / subsampling) (module
    docstring: one feature frame more than the model's count where the duration is not whole 10 ms).
    ``ceil=numpy.ceil`` takes an array of durations (the sampler's costs, the plan's figures)."""
    return ceil(ceil(seconds * frames_per_second) / subsampling)
