"""Joint CTC/attention greedy decoding at a large vocabulary: the LLM alone vs joint (every token) vs joint
(the LLM's K best tokens), side by side in one run.

A freshly initialised speech LLM of the demo's size (`configs/demo.yaml`: Parakeet-style encoder, 4-layer
LLM 256 wide; ``--llm smollm2-135m``: an LLM of SmolLM2-135M's shape) with a ``--vocab`` rows vocabulary (default 49,152: SmolLM2's) decodes the same random clips
three times with the batched KV-cache decoder: plain greedy (``model.decode_ctc_weight=0``), joint with
CTC prefix scores for every token (``model.decode_ctc_candidates=0``, the only form before 2026-11-28)
and joint with the default candidates (``model.decode_ctc_candidates``, 32). The stop id is set to
one the model never emits, so every clip decodes exactly ``--max-new-tokens`` tokens in all three and
the times compare the same number of steps. Each time is the whole ``generate_greedy`` call (features,
encoder, projector, the greedy loop), the best of ``--repeats``; "greedy loop" subtracts the audio side,
timed alone (the same in all three). Joint decoding also runs the CTC head over the whole vocabulary once
per batch (every form of it does, ESPnet's too): that time is printed beside.

The weights are random, so the CTC head's posteriors are flat and the LLM's ranking says little about
them: the count of hypotheses that equal the every-token decode's is printed, but it is not the
exactness test (that is `tests/model/test_ctc_prefix.py`, on posteriors that spell a transcript).
Usage: ``speechlm bench decode [--llm demo] [--vocab 49152] [--utterances 20] [--max-new-tokens 16] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


# LLM sizes: the demo's (configs/demo.yaml), or SmolLM2-135M's shape (random weights)
LLM_SIZES: dict[str, list[str]] = {
    "demo": [],
    "smollm2-135m": [
        "model.llm.hidden_size=576",
        "model.llm.num_layers=30",
        "model.llm.num_heads=9",
        "model.llm.num_kv_heads=3",
        "model.llm.intermediate_size=1536",
    ],
}


def build_model(vocab: int, ctc_weight: float, llm: str = "demo") -> Any:
    import torch

    from speechlm.config import load_config
    from speechlm.model.speech_llm import SpeechLLM

    cfg = load_config(str(REPO / "configs/demo.yaml"), LLM_SIZES[llm])
    torch.manual_seed(0)
    model = SpeechLLM(cfg.model, vocab_size=vocab, pad_id=0, bos_id=1, eos_id=2, audio_id=3)
    model.prompt = replace(model.prompt, stop=(vocab,))  # never emitted: every clip decodes the same steps
    model.decode_ctc_weight = ctc_weight
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench decode", description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary rows (LLM and CTC head)")
    ap.add_argument("--utterances", type=int, default=20)
    ap.add_argument("--seconds", type=float, nargs=2, default=(1.0, 4.0), help="clip lengths: min max")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--ctc-weight", type=float, default=0.7, help="joint decoding's CTC weight (the demo's)")
    ap.add_argument("--candidates", type=int, default=None, help="K (default: model.decode_ctc_candidates)")
    ap.add_argument("--repeats", type=int, default=3, help="times each decode runs; the best is kept")
    ap.add_argument("--llm", choices=sorted(LLM_SIZES), default="demo", help="the LLM's shape")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)

    import torch

    from speechlm.config import ModelConfig
    from speechlm.model.ctc import ctc_log_prob_rows

    k = ModelConfig().decode_ctc_candidates if args.candidates is None else args.candidates
    model = build_model(args.vocab, args.ctc_weight, args.llm)
    g = torch.Generator().manual_seed(0)
    lo, hi = args.seconds
    lens = (16000 * (lo + (hi - lo) * torch.rand(args.utterances, generator=g))).long()
    audio = torch.randn(args.utterances, int(lens.max()), generator=g) * 0.1
    audio[torch.arange(audio.shape[1])[None, :] >= lens[:, None]] = 0

    modes = {
        "llm alone": (0.0, k),
        "joint, every token": (args.ctc_weight, 0),
        f"joint, K={k}": (args.ctc_weight, k),
    }
    hyps: dict[str, list[list[int]]] = {}
    seconds: dict[str, list[float]] = {name: [] for name in [*modes, "audio side", "ctc head"]}
    with torch.no_grad():
        model.generate_greedy(audio[:2], lens[:2], max_new_tokens=2)  # warm-up: first-call allocations
        for _ in range(args.repeats):  # the modes interleaved, so a change in the machine's load hits all
            for name, (weight, cands) in modes.items():
                model.decode_ctc_weight, model.decode_ctc_candidates = weight, cands
                t0 = time.perf_counter()
                hyps[name] = model.generate_greedy(audio, lens, max_new_tokens=args.max_new_tokens)
                seconds[name].append(time.perf_counter() - t0)
                print(f"{name}: {seconds[name][-1]:.2f} s", flush=True)
            t0 = time.perf_counter()  # the audio side, the same in all three: timed alone
            enc = model.encode_audio(audio, lens)
            seconds["audio side"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()  # joint decoding's fixed cost: the CTC head's posteriors, once
            ctc_log_prob_rows(model, enc.enc_hidden)
            seconds["ctc head"].append(time.perf_counter() - t0)
    results = {name: {"seconds": min(seconds[name])} for name in modes}
    encode = min(seconds["audio side"])
    base = results["llm alone"]["seconds"]
    for r in results.values():
        r["ratio_to_llm_alone"] = r["seconds"] / base
        r["loop_seconds"] = r["seconds"] - encode
        r["loop_ratio_to_llm_alone"] = r["loop_seconds"] / (base - encode)
    full, top = hyps["joint, every token"], hyps[f"joint, K={k}"]
    same = sum(a == b for a, b in zip(full, top))
    print(
        f"\nvocab {args.vocab}, {args.utterances} clips of {lo:g}-{hi:g} s, {args.max_new_tokens} tokens each, "
        f"CTC weight {args.ctc_weight}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    ctc_head = min(seconds["ctc head"])
    print(
        f"audio side (features, encoder, projector) alone: {encode:.2f} s; the CTC head's posteriors over "
        f"the vocabulary (joint decoding, once per batch): {ctc_head:.2f} s"
    )
    print(
        "| decoding | seconds | x LLM alone | greedy loop s | x LLM alone |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for name, r in results.items():
        print(
            f"| {name} | {r['seconds']:.2f} | {r['ratio_to_llm_alone']:.2f}x | {r['loop_seconds']:.2f} "
            f"| {r['loop_ratio_to_llm_alone']:.2f}x |"
        )
    print(f"joint K={k} hypotheses equal to every-token joint: {same} of {len(full)} (random weights)")
    if args.json:
        out = {
            "args": vars(args),
            "candidates": k,
            "results": results,
            "audio_side_seconds": encode,
            "ctc_head_seconds": ctc_head,
            "same_hypotheses": same,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
