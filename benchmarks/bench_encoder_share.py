"""What a frozen Whisper encoder costs in a speech-LLM step, side by side in one process: its forward on one
micro-batch in the ``full`` (30 s) and the ``clip`` window, against the LLM's forward and backward with LoRA on
that micro-batch's tokens (what caching the frozen encoder's output could save; docs/pretrained.md).

Usage:
    speechlm bench encoder-share --encoder models/whisper-tiny.en --llm models/smollm2-135m-instruct
        [--clips 2.3 1.8 2.6 2.0] [--prompt-tokens 48] [--text-tokens 8] [--stack 4] [--repeats 3]

Timings are the median of ``--repeats`` after one warm-up; set OMP_NUM_THREADS for the thread count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from speechlm.model.encoders import load_whisper_encoder

    frames = [round(s * 100) for s in args.clips]  # 10 ms feature frames
    feats = torch.randn(len(frames), max(frames), 80) * 0.3
    lens = torch.tensor(frames)
    out: dict[str, float] = {}
    for window in ("full", "clip"):
        enc = load_whisper_encoder(args.encoder, dropout=0.0, window=window).eval()
        feats_w = feats[..., : enc.feature_settings.n_mels]
        with torch.no_grad():
            out[window] = _median_s(lambda enc=enc, f=feats_w: enc(f, lens), args.repeats)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, dtype=torch.float32)
    llm = get_peft_model(
        llm, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    audio_rows = [((f - 1) // 2 + 1 + args.stack - 1) // args.stack for f in frames]
    tokens = sum(args.prompt_tokens + rows + args.text_tokens for rows in audio_rows)
    ids = torch.randint(0, llm.config.vocab_size, (1, tokens))
    out["llm"] = _median_s(lambda: llm(input_ids=ids, labels=ids).loss.backward(), args.repeats)
    out["tokens"] = float(tokens)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--encoder", required=True, help="a Whisper directory (speechlm encoder import)")
    parser.add_argument("--llm", required=True, help="a causal-LM directory (speechlm llm import-gguf)")
    parser.add_argument(
        "--clips", type=float, nargs="+", default=[2.3, 1.8, 2.6, 2.0], help="seconds per clip"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=48, help="chat template + instruction per sample"
    )
    parser.add_argument("--text-tokens", type=int, default=8, help="transcript tokens per sample")
    parser.add_argument("--stack", type=int, default=4, help="projector frame stack")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    r = measure(args)
    full, clip, llm = r["full"], r["clip"], r["llm"]
    print(f"micro-batch of {len(args.clips)} clips ({sum(args.clips):.1f} s), {int(r['tokens'])} LLM tokens")
    print(
        f"encoder forward: full window {full:.2f} s, clip window {clip:.2f} s; LLM fwd+bwd (LoRA) {llm:.2f} s"
    )
    print(f"encoder share of encoder + LLM: full {full / (full + llm):.0%}, clip {clip / (clip + llm):.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
