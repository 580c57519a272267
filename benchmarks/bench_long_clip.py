"""One long clip through a FastConformer the size of Parakeet's (random weights): features, encoder
forward and backward under bf16 autocast, wall time and peak CUDA memory, with full and with limited
self-attention context (`model.encoder.att_context_size`). Each clip length in its own process for a
clean peak: ``speechlm bench long-clip 10`` then ``... 60 --contexts limited`` (``--json FILE`` writes the records).
``--tiny`` uses a 2-layer 64-wide encoder (what the test runs on a CPU). docs/benchmarks.md has the
H100 figures (2026-11-27)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from speechlm.config import EncoderConfig
from speechlm.model.encoders import build_encoder
from speechlm.model.features import LogMelFeatures

PARAKEET = dict(
    hidden_size=1024, num_layers=24, num_heads=8, intermediate_size=4096, subsampling_conv_channels=256
)
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, subsampling_conv_channels=8)
CONTEXTS = {"full": None, "limited": [128, 128]}


def measure(minutes: float, context: str, *, tiny: bool, device: str) -> dict[str, Any]:
    """One clip's features, encoder forward and backward: its record (``error`` when out of memory)."""
    n = int(minutes * 60 * 16000)
    audio = torch.randn(1, n, device=device) * 0.1
    lens = torch.tensor([n], device=device)
    torch.manual_seed(0)
    cfg = EncoderConfig(kind="parakeet", att_context_size=CONTEXTS[context], **(TINY if tiny else PARAKEET))
    enc = build_encoder(cfg, dropout=0.0).to(device)
    feats_mod = LogMelFeatures(enc.feature_settings).to(device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    record: dict[str, Any] = {"minutes": minutes, "context": context, "device": device}
    t0 = time.time()
    try:
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=cuda):
            feats, flens = feats_mod.packed(audio, lens)
            out, olens = enc(feats, flens, packed=True)
            out.float().pow(2).mean().backward()
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        return {**record, "error": f"out of memory ({str(e).splitlines()[0][:100]})"}
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {**record, "frames": int(olens[0]), "seconds": time.time() - t0, "peak_gib": peak}


def describe(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['minutes']:g} min clip, context {r['context']}: {r['error']}"
    peak = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "n/a on CPU"
    return (
        f"{r['minutes']:g} min clip, {r['frames']} encoder frames, context {r['context']}: "
        f"fwd+bwd {r['seconds']:.2f} s, peak {peak}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="speechlm bench long-clip",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("minutes", type=float)
    p.add_argument("--contexts", nargs="+", choices=sorted(CONTEXTS), default=["full", "limited"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--json", default=None, metavar="FILE", help="also write the records (one per context) here"
    )
    args = p.parse_args(argv)
    records = []
    for context in args.contexts:
        records.append(measure(args.minutes, context, tiny=args.tiny, device=args.device))
        print(describe(records[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
