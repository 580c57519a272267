"""Decoding audio to float32 mono at the training sample rate (soundfile + soxr; no torchaudio).

`decode_audio` takes a path or the bytes of a tar member (`io.BytesIO`), optionally a segment
(`start`, `duration` in seconds), averages the channels, refuses NaN/inf samples and resamples with
soxr HQ. `what` names the clip in errors (a path, or ``TAR:MEMBER``).

`probe_length` answers, from the file's header alone, how many samples `decode_audio` will return with
the same arguments (the segment's frames, resampled: soxr's one-shot length, ``round(n * target / sr)``
with halves up). The data pipeline places clips over CP ranks with it before decoding any
(`speechlm.data.local_decode`), and checks it against the decoded length.
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


def resampled_length(n: int, sr: int, target_sr: int) -> int:
    """Samples that soxr's one-shot resampling of `n` samples from `sr` to `target_sr` returns."""
    if sr == target_sr or n == 0:
        return int(n)
    return (2 * int(n) * int(target_sr) + int(sr)) // (2 * int(sr))


def _open(source: str | io.BytesIO) -> sf.SoundFile:
    # a str path goes to libsndfile as the file system's bytes (os.fsencode), so a file name that is not
    # UTF-8 (kept by Python as surrogate escapes) opens like any other
    return sf.SoundFile(os.fsencode(source) if isinstance(source, str) else source)


def _first_frame(f: sf.SoundFile, what: str, start: float) -> int:
    """The segment's first frame; SegmentOutOfRangeError when it starts at or past the recording's end."""
    sr = f.samplerate
    first = round(start * sr)
    if first and first >= f.frames:
        raise SegmentOutOfRangeError(
            f"the segment of {what} starts at {start:.2f} s but the recording is "
            f"{f.frames / sr:.2f} s long: the file is fine; fix the cut's start (offset) in the manifest"
        )
    return first


def probe_length(
    source: str | io.BytesIO, what: str, target_sr: int, *, start: float = 0.0, duration: float | None = None
) -> int:
    """The samples `decode_audio(source, what, target_sr, start=..., duration=...)` returns, read from the
    header (no sample is decoded). Raises as `decode_audio` does when the header cannot be read; a stream
    that fails further in is found only by decoding it."""
    try:
        with _open(source) as f:
            first = _first_frame(f, what, start)
            n = f.frames - first
            if duration is not None:
                n = min(n, round(duration * f.samplerate))
            return resampled_length(max(n, 0), f.samplerate, target_sr)
    except SegmentOutOfRangeError:
        raise
    except (sf.SoundFileError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise AudioDecodeError(f"cannot decode {what}: {_reason(e, source, what)}") from e


def decode_audio(
    source: str | io.BytesIO, what: str, target_sr: int, *, start: float = 0.0, duration: float | None = None
) -> np.ndarray:
    """Decode to float32 mono at `target_sr`; `start`/`duration` (seconds) cut a segment of the file.

    Raises `AudioDecodeError` for undecodable (unknown format, truncated stream) or non-finite audio.
    """
    try:
        with _open(source) as f:
            sr = f.samplerate
            first = _first_frame(f, what, start)
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
