"""What Whisper's 30-second window costs on short clips, and what cutting it changes.

Timing (random weights; the cost does not depend on them): one clip of 1..5 s of speech-like noise per
encoder call, the encoder the size of Whisper tiny (4 layers x 384) and of base (6 x 512), with
``model.encoder.whisper_window`` ``full`` (3000 frames, as trained) and ``clip`` (the clip's own frames,
whisper.cpp's audio_ctx): encoder forward without autograd (a frozen encoder) and forward + backward
(a trained one), CPU and wall milliseconds per clip, median of ``--repeats``. The front end is not timed. Run it on one
thread (``OMP_NUM_THREADS=1``) for the figures in docs/benchmarks.md.

Difference (``--pretrained DIR``, a transformers Whisper directory such as ``speechlm encoder import``
writes): each English clip of the bundled demo corpus (real speech) through both windows; per clip the
relative error ``||clip - full|| / ||full||`` over the clip's encoder frames and the mean cosine of its
frames. ``--tiny`` shrinks the timing to a 2-layer 64-wide encoder (the test).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speechlm.config import EncoderConfig
from speechlm.model.encoders import build_whisper_encoder, load_whisper_encoder
from speechlm.model.encoders.whisper import WhisperAudioEncoder
from speechlm.model.features import LogMelFeatures

REPO = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": dict(hidden_size=384, num_layers=4, num_heads=6, intermediate_size=1536),
    "base": dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=2048),
    "test": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
}


def build(size: str, window: str) -> WhisperAudioEncoder:
    torch.manual_seed(0)
    cfg = EncoderConfig(kind="whisper", **SIZES[size])
    cfg.whisper_window = window
    return build_whisper_encoder(cfg, dropout=0.0)


def time_call(
    enc: WhisperAudioEncoder, feats: tuple[torch.Tensor, torch.Tensor], backward: bool
) -> tuple[float, float]:
    """(wall ms, CPU ms of this process) of one encoder call; on one thread the CPU time is the work,
    whatever else the machine runs."""
    t0, c0 = time.perf_counter(), time.process_time()
    if backward:
        enc.zero_grad(set_to_none=True)
        h_BUE, _ = enc(*feats)
        h_BUE.square().mean().backward()
    else:
        with torch.no_grad():
            enc(*feats)
    return (time.perf_counter() - t0) * 1000.0, (time.process_time() - c0) * 1000.0


def timing_lines(sizes: list[str], seconds: list[float], repeats: int) -> list[str]:
    lines = []
    for size in sizes:
        encs = {w: build(size, w) for w in ("full", "clip")}
        encs["clip"].load_state_dict(encs["full"].state_dict())
        front = LogMelFeatures(encs["full"].feature_settings)
        for sec in seconds:
            n = int(sec * 16000)
            audio = 0.1 * torch.randn(1, n, generator=torch.Generator().manual_seed(1))
            feats = front(audio, torch.tensor([n]))
            cells = {}
            for backward in (False, True):
                for window in ("full", "clip"):
                    time_call(encs[window], feats, backward)  # warm-up
                    runs = [time_call(encs[window], feats, backward) for _ in range(repeats)]
                    cells[backward, window] = [statistics.median(r[i] for r in runs) for i in (0, 1)]
            parts = []
            for backward, what in ((False, "forward"), (True, "forward+backward")):
                (fw, fc), (cw, cc) = cells[backward, "full"], cells[backward, "clip"]
                parts.append(
                    f"{what} full {fc:.0f} ms, clip {cc:.0f} ms ({fc / cc:.1f}x) [wall {fw:.0f} / {cw:.0f} ms]"
                )
            lines.append(
                f"{size} ({SIZES[size]['num_layers']}x{SIZES[size]['hidden_size']}), {sec:g} s clip, CPU ms "
                f"per clip: {'; '.join(parts)}"
            )
            print(lines[-1], flush=True)
    return lines


def english_files(limit: int) -> list[Path]:
    return sorted((REPO / "data/demo/shards").glob("en_*/audio/*.flac"))[:limit]


def english_clips(limit: int) -> list[np.ndarray]:
    import soundfile as sf  # lazy: only the difference measurement reads audio

    return [sf.read(f, dtype="float32")[0] for f in english_files(limit)]


def difference_line(pretrained: Path, limit: int) -> str:
    full = load_whisper_encoder(pretrained, dropout=0.0, window="full").eval()
    clip = load_whisper_encoder(pretrained, dropout=0.0, window="clip").eval()
    front = LogMelFeatures(full.feature_settings)
    rels, coss, secs = [], [], []
    for audio in english_clips(limit):
        feats = front(torch.from_numpy(audio)[None], torch.tensor([len(audio)]))
        with torch.no_grad():
            f_UE, c_UE = full(*feats)[0][0], clip(*feats)[0][0]
        rels.append(float((c_UE - f_UE).norm() / f_UE.norm()))
        coss.append(float(torch.nn.functional.cosine_similarity(c_UE, f_UE, dim=-1).mean()))
        secs.append(len(audio) / 16000)
    return (
        f"{pretrained.name}: clip vs full window on {len(rels)} English demo clips "
        f"({min(secs):.1f}-{max(secs):.1f} s): relative error median {statistics.median(rels):.3f}, "
        f"mean {statistics.mean(rels):.3f}, max {max(rels):.3f}; mean frame cosine median "
        f"{statistics.median(coss):.3f}, min {min(coss):.3f}"
    )


def decode_line(pretrained: Path, limit: int) -> str:
    """WER of the directory's own Whisper decoder (greedy) on the English demo clips, reading the encoder's
    30 s output (Whisper as used), the full window's output cut to the clip (what speechlm's projector
    reads), and the clip window's output (whisper.cpp's audio_ctx)."""
    import jiwer  # lazy: only --decode scores
    import pyarrow.parquet as pq
    from transformers import PreTrainedTokenizerFast, WhisperForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutput

    from speechlm.data.text import clean_text

    model: Any = WhisperForConditionalGeneration.from_pretrained(pretrained).float().eval()
    model.generation_config.max_length = 48
    tok = PreTrainedTokenizerFast(tokenizer_file=str(pretrained / "tokenizer.json"))
    full = load_whisper_encoder(pretrained, dropout=0.0, window="full").eval()
    clip = load_whisper_encoder(pretrained, dropout=0.0, window="clip").eval()
    front = LogMelFeatures(full.feature_settings)
    texts = {}
    for meta in sorted((REPO / "data/demo/shards").glob("en_*/metadata.parquet")):
        texts.update({r["segment_id"]: r["transcription_native"] for r in pq.read_table(meta).to_pylist()})
    refs: list[str] = []
    hyps: dict[str, list[str]] = {"30 s window": [], "full cut to the clip": [], "clip window": []}
    for f, audio in zip(english_files(limit), english_clips(limit)):
        if not texts.get(f.stem):
            continue
        feats = front(torch.from_numpy(audio)[None], torch.tensor([len(audio)]))
        with torch.no_grad():
            outs = [model.model.encoder(input_features=full.window_input(*feats)).last_hidden_state]
            outs += [full(*feats)[0], clip(*feats)[0]]
            for name, h_1UE in zip(hyps, outs):
                ids = model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=h_1UE))
                hyps[name].append(clean_text(tok.decode(ids[0], skip_special_tokens=True)).lower())
        refs.append(clean_text(texts[f.stem]).lower())
    wers = ", ".join(f"{name} {100 * jiwer.wer(refs, h):.1f}%" for name, h in hyps.items())
    return (
        f"{pretrained.name}: its own greedy decoder on {len(refs)} English demo clips, WER reading the {wers}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=["tiny", "base"], default=["tiny", "base"])
    p.add_argument("--seconds", nargs="+", type=float, default=[1, 2, 3, 4, 5])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide encoder instead of --sizes (tests)")
    p.add_argument("--pretrained", type=Path, help="also measure clip vs full with these weights")
    p.add_argument("--clips", type=int, default=40, help="English demo clips for --pretrained")
    p.add_argument("--no-timing", action="store_true", help="only the --pretrained difference")
    p.add_argument(
        "--decode", action="store_true", help="with --pretrained: its own decoder's WER per window"
    )
    args = p.parse_args(argv)
    if not args.no_timing:
        timing_lines(["test"] if args.tiny else args.sizes, args.seconds, args.repeats)
    if args.pretrained is not None:
        print(difference_line(args.pretrained, args.clips), flush=True)
        if args.decode:
            print(decode_line(args.pretrained, args.clips), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
