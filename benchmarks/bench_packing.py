"""THD (packed) versus BSHD (padded) on the same demo micro-batches, side by side in one run.

For each micro-batch of the demo epoch plan: tokens the decoder computes (THD: the packed total;
BSHD: batch x longest utterance), attention score entries (THD: sum of L_i^2; BSHD: B x S^2), and the
wall time of one forward + backward of the whole demo model. Prints per-layout totals and THD/BSHD
ratios. Usage: `speechlm bench packing [--batches N] [--repeats R]` (builds the demo manifest and
tokenizer under /tmp if they are missing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def prepare_demo(out: Path) -> None:
    from speechlm.cli import main

    if not (out / "train.parquet").exists():
        main(["manifest", "build", str(REPO / "data/demo/shards"), "--out", str(out)])
    if not (out / "tokenizer.model").exists():
        main(["tokenizer", "train", "--manifest", str(out / "train.parquet"), "--out", str(out / "tokenizer")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench packing", description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/speechlm_bench_demo", help="demo manifest/tokenizer directory")
    ap.add_argument("--batches", type=int, default=12, help="micro-batches timed per layout")
    ap.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes per batch")
    ap.add_argument("--max-batch-duration", type=float, default=32.0)
    args = ap.parse_args(argv)

    import torch

    from speechlm.config import load_config
    from speechlm.data.dataset import Collator, SpeechDataset
    from speechlm.data.manifest import load_manifest, manifest_arrays
    from speechlm.data.sampler import DurationBucketBatchSampler
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.train.module import TokenizerInfo
    from speechlm.train.step import StepContext, compute_micro_losses

    out = Path(args.data)
    prepare_demo(out)
    cfg = load_config(REPO / "configs/demo.yaml", [f"data.train_manifest={out / 'train.parquet'}"])
    tok = Tokenizer(out / "tokenizer.model")
    table = load_manifest(out / "train.parquet")
    arr = manifest_arrays(table)
    sampler = DurationBucketBatchSampler(arr.durations, arr.lang_codes, arr.lang_names,
                                         max_batch_duration=args.max_batch_duration, seed=0)
    ds = SpeechDataset(table, tok, max_tokens=cfg.data.max_tokens)
    collate = Collator(tok.pad_id)
    batches = [collate([ds[i] for i in idx]) for idx in list(sampler)[: args.batches]]
    info = TokenizerInfo(len(tok), tok.pad_id, tok.bos_id, tok.eos_id, tok.audio_id)
    torch.manual_seed(0)
    model = SpeechLLM(cfg.model, vocab_size=info.vocab_size, pad_id=info.pad_id, bos_id=info.bos_id,
                      eos_id=info.eos_id, audio_id=info.audio_id)
    model.train()

    def token_counts(batch, packed: bool) -> tuple[int, int]:
        with torch.no_grad():
            enc = model.encode_audio(batch.audio, batch.audio_lens)
        ctx = StepContext.single(cfg, info)
        lens = [int(p[0].shape[0]) - 1 + int(e.shape[0]) for p, e in zip(ctx.prompts(batch), enc.embeds)]
        if packed:
            return sum(lens), sum(n * n for n in lens)
        return len(lens) * max(lens), len(lens) * max(lens) ** 2

    results: dict[str, dict[str, float]] = {}
    for name, packed in (("THD (packed)", True), ("BSHD (padded)", False)):
        cfg.model.packed_sequences = packed
        ctx = StepContext.single(cfg, info)
        times, toks, scores, real = [], 0, 0, 0
        for b in batches:
            t, s = token_counts(b, packed)
            toks += t
            scores += s
            real += token_counts(b, True)[0]
            out0 = compute_micro_losses(model, b, ctx)  # warm-up
            out0.ce_sum.backward()
            model.zero_grad(set_to_none=True)
            per = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = compute_micro_losses(model, b, ctx)
                (out.ce_sum + (out.ctc_sum if out.ctc_sum is not None else 0)).backward()
                per.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            times.append(statistics.median(per))
        results[name] = {"tokens": toks, "scores": scores, "real": real, "seconds": sum(times)}

    thd, bshd = results["THD (packed)"], results["BSHD (padded)"]
    print(f"{len(batches)} demo micro-batches (budget {args.max_batch_duration:g} s of audio), "
          f"forward+backward of the demo model, median of {args.repeats}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'layout':<15} {'decoder tokens':>14} {'real/computed':>13} {'attn scores':>12} {'step time':>10}")
    for name, r in results.items():
        print(f"{name:<15} {r['tokens']:>14,} {r['real'] / r['tokens']:>13.1%} {r['scores']:>12,} "
              f"{r['seconds'] / len(batches) * 1000:>8.0f}ms")
    print(f"ratio THD/BSHD: tokens {thd['tokens'] / bshd['tokens']:.2f}, attention scores "
          f"{thd['scores'] / bshd['scores']:.2f}, step time {thd['seconds'] / bshd['seconds']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
