"""One long clip through a FastConformer the size of Parakeet's (random weights): features, encoder
forward and backward under bf16 autocast, wall time and peak CUDA memory, with full and with limited
self-attention context (`model.encoder.att_context_size`). Each clip length in its own process for a
clean peak: ``python benchmarks/bench_long_clip.py 10`` then ``... 60 --contexts limited``.
``--tiny`` uses a 2-layer 64-wide encoder (what the test runs on a CPU). docs/benchmarks.md has the
H100 figures (2026-11-27)."""

from __future__ import annotations

import argparse
import time

import torch

from speechlm.config import EncoderConfig
from speechlm.model.encoders import build_encoder
from speechlm.model.features import LogMelFeatures

PARAKEET = dict(
    hidden_size=1024, num_layers=24, num_heads=8, intermediate_size=4096, subsampling_conv_channels=256
)
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, subsampling_conv_channels=8)
CONTEXTS = {"full": None, "limited": [128, 128]}


def measure(minutes: float, context: str, *, tiny: bool, device: str) -> str:
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
    t0 = time.time()
    try:
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=cuda):
            feats, flens = feats_mod.packed(audio, lens)
            out, olens = enc(feats, flens, packed=True)
            out.float().pow(2).mean().backward()
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        return f"{minutes:g} min clip, context {context}: out of memory ({str(e).splitlines()[0][:100]})"
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else "n/a on CPU"
    return (
        f"{minutes:g} min clip, {int(olens[0])} encoder frames, context {context}: "
        f"fwd+bwd {time.time() - t0:.2f} s, peak {peak}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("minutes", type=float)
    p.add_argument("--contexts", nargs="+", choices=sorted(CONTEXTS), default=["full", "limited"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for context in args.contexts:
        print(measure(args.minutes, context, tiny=args.tiny, device=args.device), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
