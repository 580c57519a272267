"""The demo corpus' voices (`speechlm.demo.corpus`): libespeak-ng through ctypes, one utterance at a time.

The library and its voice data come inside the ``espeakng-loader`` wheel (espeak-ng 1.52; GPL-3.0-or-later,
loaded at run time, never linked into speechlm), so nothing is installed with apt. Every utterance gets its
own voice variant (`VARIANTS`: the language's voice with one of espeak's male and female variants),
speaking rate, pitch and pitch range, a random gain and light white noise (SNR 20-40 dB), at 16 kHz mono.
espeak-ng keeps state from one utterance to the next inside a process: `speechlm.demo.writing` synthesizes
each shard in a fresh one.
"""

from __future__ import annotations

import ctypes
import io
import random
import subprocess
import sys
from typing import Any

import numpy as np
import soundfile as sf
import soxr

from speechlm.errors import UsageError

ESPEAKNG_LOADER_VERSION = "0.2.4"  # pinned in pyproject.toml: it fixes the espeak-ng build, hence the audio
TARGET_SR = 16000
MIN_UTT_S = 1.0
MAX_UTT_S = 8.0
KEEP_EDGE_S = 0.05  # silence kept at each end after trimming
SILENCE_THRESHOLD = 0.01
# espeak's own variants of every voice (espeak-ng-data/voices/!v): "" is the language's default voice
VARIANTS = ("", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4")


class Espeak:
    """libespeak-ng in this process, synchronous mode: `speak` returns float32 mono samples at 16 kHz."""

    AUDIO_OUTPUT_SYNCHRONOUS = 2
    INITIALIZE_DONT_EXIT = 0x8000
    CHARS_UTF8 = 1
    RATE, PITCH, RANGE = 1, 3, 4

    def __init__(self) -> None:
        try:
            import espeakng_loader  # lazy: an optional dependency (UsageError without it)
        except ImportError:
            raise UsageError(
                "the demo corpus is synthesized with libespeak-ng from the espeakng-loader package, which is "
                f"not installed: pip install espeakng-loader=={ESPEAKNG_LOADER_VERSION} (or pass --shards "
                "data/demo/shards to use the small bundled corpus)"
            ) from None
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.lib.espeak_Info.restype = ctypes.c_char_p
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self.sample_rate = self.lib.espeak_Initialize(
            self.AUDIO_OUTPUT_SYNCHRONOUS,
            0,
            espeakng_loader.get_data_path().encode(),
            self.INITIALIZE_DONT_EXIT,
        )
        if self.sample_rate <= 0:
            raise RuntimeError(f"libespeak-ng failed to initialise (status {self.sample_rate})")
        self._chunks: list[Any] = []
        callback_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
        )
        self._callback = callback_type(self._collect)  # kept alive on self
        self.lib.espeak_SetSynthCallback(self._callback)
        self.version = self.lib.espeak_Info(None).decode()

    def _collect(self, wav: Any, n: int, _events: Any) -> int:
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def speak(self, text: str, voice: str, rate: int, pitch: int, pitch_range: int, seed: int) -> Any:
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"libespeak-ng has no voice {voice!r}")
        self.lib.espeak_ng_SetRandSeed(seed)
        self.lib.espeak_SetParameter(self.RATE, rate, 0)
        self.lib.espeak_SetParameter(self.PITCH, pitch, 0)
        self.lib.espeak_SetParameter(self.RANGE, pitch_range, 0)
        self._chunks.clear()
        data = text.encode()
        status = self.lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, self.CHARS_UTF8, None, None)
        self.lib.espeak_Synchronize()
        if status != 0 or not self._chunks:
            raise RuntimeError(
                f"libespeak-ng could not speak {text!r} with voice {voice!r} (status {status})"
            )
        audio = np.concatenate(self._chunks).astype(np.float32) / 32768.0
        return soxr.resample(audio, self.sample_rate, TARGET_SR).astype(np.float32)


def espeak_version() -> str:
    """The libespeak-ng version the loader ships, read in a throwaway process (this one stays clean)."""
    code = "from speechlm.demo.synthesis import Espeak; print(Espeak().version)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "espeak failed")
    return out.stdout.strip()


def trim_silence(audio: Any) -> Any:
    loud = np.flatnonzero(np.abs(audio) > SILENCE_THRESHOLD)
    if loud.size == 0:
        return audio
    keep = int(KEEP_EDGE_S * TARGET_SR)
    return audio[max(0, int(loud[0]) - keep) : min(audio.size, int(loud[-1]) + 1 + keep)]


def flac_bytes(audio: Any) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.clip(audio, -1.0, 1.0), TARGET_SR, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def utterance(tts: Espeak, rng: random.Random, lang: str, spoken: str) -> Any:
    """Speak `spoken` with a random variant, rate, pitch and range; trim, fit into [MIN_UTT_S, MAX_UTT_S],
    then a random gain and white noise at 20-40 dB SNR."""
    variant = rng.choice(VARIANTS)
    voice = lang + (f"+{variant}" if variant else "")
    rate, pitch, pitch_range = rng.randint(135, 195), rng.randint(25, 75), rng.randint(30, 80)
    seed = rng.randrange(2**31)
    for _ in range(6):
        audio = trim_silence(tts.speak(spoken, voice, rate, pitch, pitch_range, seed))
        if audio.size <= MAX_UTT_S * TARGET_SR:
            break
        rate = int(rate * 1.2)
    audio = audio[: int(MAX_UTT_S * TARGET_SR)]
    min_len = int((MIN_UTT_S + 0.05) * TARGET_SR)
    if audio.size < min_len:
        audio = np.concatenate([audio, np.zeros(min_len - audio.size, dtype=np.float32)])
    peak = float(np.abs(audio).max()) or 1.0
    audio = audio * (rng.uniform(0.3, 0.9) / peak)
    power = float(np.mean(audio**2)) or 1e-8
    snr_db = rng.uniform(20.0, 40.0)
    noise = np.random.default_rng(rng.randrange(2**32)).standard_normal(audio.size).astype(np.float32)
    return (audio + noise * np.sqrt(power / 10 ** (snr_db / 10))).astype(np.float32)
