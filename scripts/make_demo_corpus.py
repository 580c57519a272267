#!/usr/bin/env python3
"""Generate the bundled multilingual demo corpus (raw shards) with espeak-ng.

The output is the *raw shard* layout that `speechlm manifest build` reads:

    <out>/<shard_id>/metadata.parquet     segment_id, transcription_native, duration_s,
                                          tx_quality_score, segment_language
    <out>/<shard_id>/audio_index.parquet  segment_id, tar_member_name
    <out>/<shard_id>/<tar_member_name>    16 kHz mono 16-bit FLAC

The shard language is the prefix of the shard directory name (``hi_000`` -> ``hi``); rows whose
``segment_language`` is null fall back to it.

Five languages (en, hi, bn, ta, te) with deliberately skewed counts. Sentences are random
combinations of a small native-script vocabulary so that a tiny model can learn them quickly.
Besides the valid rows, every shard set contains rows that the manifest build must drop
(too short, too long, low quality, empty / blank / null text, missing audio index entry,
duplicated segment id) and two rows whose audio cannot be decoded (dropped and counted later
by the dataset). See data/demo/README.md.

Texts, speeds, scores and the bad-row layout depend only on ``--seed``; the audio bytes depend
on the installed espeak-ng version.

Usage:  python scripts/make_demo_corpus.py --out data/demo/shards [--seed 1234]
Needs:  espeak-ng on PATH (``apt-get install espeak-ng``), numpy, soundfile, soxr, pyarrow.
"""

from __future__ import annotations

import argparse
import io
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

# the vocabularies, the sentence generator and the bad rows are the synthesized corpus' too
from speechlm.demo.vocabulary import BAD_ROWS, VOCAB, BadRow, make_sentence
from speechlm.demo.writing import write_shard_tables

__all__ = ["BAD_ROWS", "VOCAB", "build", "make_sentence"]

TARGET_SR = 16000
MIN_UTT_S = 1.0  # valid utterances are kept inside [MIN_UTT_S, MAX_UTT_S]
MAX_UTT_S = 8.0
KEEP_EDGE_S = 0.05  # silence kept at each end after trimming
SILENCE_THRESHOLD = 0.01  # absolute amplitude (full scale = 1.0) regarded as silence

# Valid utterances per shard: en 110, hi 55, bn 35, ta 20, te 11 (231 in all; en ~10x te).
SHARDS: dict[str, int] = {
    "en_000": 55,
    "en_001": 55,
    "hi_000": 30,
    "hi_001": 25,
    "bn_000": 35,
    "ta_000": 20,
    "te_000": 11,
}


# --------------------------------------------------------------------------------------------
# Audio synthesis
# --------------------------------------------------------------------------------------------
def synth(text: str, lang: str, speed: int, pitch: int, tmpdir: Path) -> np.ndarray:
    """Speak `text` with espeak-ng; return float32 mono samples at TARGET_SR."""
    wav = tmpdir / "tts.wav"
    cmd = [
        "espeak-ng",
        "-v",
        lang,
        "-s",
        str(speed),
        "-p",
        str(pitch),
        "-w",
        str(wav),
        "--",
        text,
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    audio, sr = sf.read(str(wav), dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if sr != TARGET_SR:
        import soxr

        audio = soxr.resample(audio, sr, TARGET_SR).astype(np.float32)
    return audio


def trim_silence(audio: np.ndarray, sr: int = TARGET_SR) -> np.ndarray:
    """Cut leading/trailing samples below SILENCE_THRESHOLD, keeping KEEP_EDGE_S of margin."""
    loud = np.flatnonzero(np.abs(audio) > SILENCE_THRESHOLD)
    if loud.size == 0:
        return audio
    keep = int(KEEP_EDGE_S * sr)
    start = max(0, int(loud[0]) - keep)
    stop = min(audio.size, int(loud[-1]) + 1 + keep)
    return audio[start:stop]


def flac_bytes(audio: np.ndarray, sr: int = TARGET_SR) -> bytes:
    buf = io.BytesIO()
    audio = np.clip(audio, -1.0, 1.0)
    try:
        sf.write(buf, audio, sr, format="FLAC", subtype="PCM_16", compression_level=1.0)
    except TypeError:  # soundfile < 0.12 has no compression_level
        buf = io.BytesIO()
        sf.write(buf, audio, sr, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def make_utterance(
    rng: random.Random, lang: str, spoken: str, tmpdir: Path, lo: float = MIN_UTT_S, hi: float = MAX_UTT_S
) -> np.ndarray:
    """Synthesise, trim and fit the duration into [lo, hi] (faster speech / silence padding)."""
    speed = rng.randint(150, 170)
    pitch = rng.randint(40, 60)
    for _ in range(6):
        audio = trim_silence(synth(spoken, lang, speed, pitch, tmpdir))
        if audio.size / TARGET_SR <= hi:
            break
        speed = int(speed * 1.2)
    else:
        audio = audio[: int(hi * TARGET_SR)]
    min_len = int(lo * TARGET_SR) + int(0.05 * TARGET_SR)
    if audio.size < min_len:  # pad a very short sentence with trailing silence
        audio = np.concatenate([audio, np.zeros(min_len - audio.size, dtype=np.float32)])
    return audio


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------
def build(out: Path, seed: int) -> dict[str, dict[str, int]]:
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng not found: apt-get install espeak-ng")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    summary: dict[str, dict[str, int]] = {}
    bad_by_shard: dict[str, list[BadRow]] = {}
    for b in BAD_ROWS:
        bad_by_shard.setdefault(b.shard, []).append(b)

    with tempfile.TemporaryDirectory() as td:
        tmpdir = Path(td)
        for shard, n_valid in SHARDS.items():
            lang = shard.split("_")[0]
            sdir = out / shard
            (sdir / "audio").mkdir(parents=True)
            meta: list[dict] = []
            index: list[dict] = []
            rng = random.Random(f"{seed}/{shard}")  # str seeds are hashed deterministically
            n_null_lang = 0

            # valid rows
            for i in range(n_valid):
                seg = f"{shard}_{i:05d}"
                text, spoken = make_sentence(rng, lang)
                audio = make_utterance(rng, lang, spoken, tmpdir)
                member = f"audio/{seg}.flac"
                (sdir / member).write_bytes(flac_bytes(audio))
                # leave the language null on a few rows (reader falls back to the shard language)
                null_lang = i % 17 == 5
                n_null_lang += null_lang
                meta.append(
                    {
                        "segment_id": seg,
                        "transcription_native": text,
                        "duration_s": audio.size / TARGET_SR,
                        "tx_quality_score": round(rng.uniform(0.6, 1.0), 3),
                        "segment_language": None if null_lang else lang,
                    }
                )
                index.append({"segment_id": seg, "tar_member_name": member})

            # bad rows, numbered after the valid ones
            for j, b in enumerate(bad_by_shard.get(shard, [])):
                seg = f"{shard}_{n_valid + j:05d}"
                member = f"audio/{seg}.flac"
                text, spoken = make_sentence(rng, lang)
                q = round(rng.uniform(0.6, 1.0), 3)
                row_audio: bytes | None
                if b.kind == "duplicate":
                    meta.append(dict(meta[0]))  # exact copy of the shard's first row
                    continue
                if b.kind == "short":
                    audio = make_utterance(rng, lang, spoken, tmpdir)
                    audio = audio[: int(b.params["dur"] * TARGET_SR)]
                    row_audio, dur = flac_bytes(audio), audio.size / TARGET_SR
                elif b.kind == "long":
                    parts, total = [], 0
                    gap = np.zeros(int(0.4 * TARGET_SR), dtype=np.float32)
                    while total < b.params["dur"] * TARGET_SR:
                        t, s = make_sentence(rng, lang)
                        a = make_utterance(rng, lang, s, tmpdir)
                        parts += [a, gap]
                        total += a.size + gap.size
                        text += " " + t
                    audio = np.concatenate(parts)[: int(b.params["dur"] * TARGET_SR)]
                    row_audio, dur = flac_bytes(audio), audio.size / TARGET_SR
                elif b.kind == "random_bytes":
                    row_audio = rng.randbytes(6000)
                    if row_audio[:4] == b"fLaC":
                        row_audio = b"\0" + row_audio[1:]
                    dur = 2.5
                elif b.kind == "truncated_flac":
                    audio = make_utterance(rng, lang, spoken, tmpdir)
                    row_audio, dur = flac_bytes(audio)[:100], audio.size / TARGET_SR
                else:
                    audio = make_utterance(rng, lang, spoken, tmpdir)
                    row_audio, dur = flac_bytes(audio), audio.size / TARGET_SR
                if "q" in b.params:
                    q = b.params["q"]
                if "text" in b.params:
                    text = b.params["text"]
                meta.append(
                    {
                        "segment_id": seg,
                        "transcription_native": text,
                        "duration_s": float(dur),
                        "tx_quality_score": q,
                        "segment_language": lang,
                    }
                )
                if b.kind == "no_audio_index":
                    continue  # neither an index entry nor a file
                (sdir / member).write_bytes(row_audio)
                index.append({"segment_id": seg, "tar_member_name": member})

            write_shard_tables(sdir, meta, index, split_column=False)
            summary[shard] = {
                "valid": n_valid,
                "bad": len(bad_by_shard.get(shard, [])),
                "metadata_rows": len(meta),
                "null_language": n_null_lang,
            }
            print(
                f"{shard}: {n_valid} valid, {summary[shard]['bad']} bad, {len(meta)} metadata rows",
                flush=True,
            )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/demo/shards"), help="output shard root (replaced)")
    ap.add_argument("--seed", type=int, default=1234, help="seed for texts, speeds, scores")
    args = ap.parse_args(argv)
    summary = build(args.out, args.seed)
    per_lang: dict[str, int] = {}
    for shard, s in summary.items():
        lang = shard.split("_")[0]
        per_lang[lang] = per_lang.get(lang, 0) + s["valid"]
    print("valid utterances per language:", per_lang, "total", sum(per_lang.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
