"""Decoding audio to float32 mono at the training sample rate (soundfile + soxr; no torchaudio).

`decode_audio` takes a path or the bytes of a tar member (`io.BytesIO`), optionally a segment
(`start`, `duration` in seconds), averages the channels, refuses NaN/inf samples and resamples with
soxr HQ. `what` names the clip in errors (a path, or ``TAR:MEMBER``).
"""

from __future__ import annotations

import io
import os

import numpy as np
import soundfile as sf
import soxr


class AudioDecodeError(RuntimeError):
    """An audio file exists but cannot be decoded into finite samples."""


class SegmentOutOfRangeError(AudioDecodeError):
    """A segment (a cut) starts at or beyond the end of its recording: the file is fine, the cut is not."""


def _reason(e: BaseException, source: object, what: str) -> str:
    """libsndfile's reason, with the object it was given (a BytesIO repr for a tar member) named as `what`."""
    reason = getattr(e, "error_string", None) or str(e)
    return str(reason).replace(repr(source), what).replace(str(source), what)


def decode_audio(
    source: str | io.BytesIO, what: str, target_sr: int, *, start: float = 0.0, duration: float | None = None
) -> np.ndarray:
    """Decode to float32 mono at `target_sr`; `start`/`duration` (seconds) cut a segment of the file.

    Raises `AudioDecodeError` for undecodable (unknown format, truncated stream) or non-finite audio.
    """
    # a str path goes to libsndfile as the file system's bytes (os.fsencode), so a file name that is not
    # UTF-8 (kept by Python as surrogate escapes) opens like any other
    opened = os.fsencode(source) if isinstance(source, str) else source
    try:
        with sf.SoundFile(opened) as f:
            sr = f.samplerate
            first = round(start * sr)
            if first and first >= f.frames:
                raise SegmentOutOfRangeError(
                    f"the segment of {what} starts at {start:.2f} s but the recording is "
                    f"{f.frames / sr:.2f} s long: the file is fine; fix the cut's start (offset) in the manifest"
                )
            if first:
                f.seek(first)
            frames = -1 if duration is None else round(duration * sr)
            x_NC = f.read(frames, dtype="float32", always_2d=True)
    except SegmentOutOfRangeError:
        raise
    except (sf.SoundFileError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise AudioDecodeError(f"cannot decode {what}: {_reason(e, source, what)}") from e
    x_N = x_NC.mean(axis=1, dtype=np.float32) if x_NC.shape[1] > 1 else x_NC[:, 0]
    if x_N.size and not np.isfinite(x_N).all():
        raise AudioDecodeError(f"{what} contains NaN or infinite samples: re-encode or drop the file")
    if sr != target_sr and x_N.size:
        x_N = soxr.resample(x_N, sr, target_sr, quality="HQ")
    return np.ascontiguousarray(x_N, dtype=np.float32)
