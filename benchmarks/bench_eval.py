"""Greedy decoding with a KV cache versus prefix recompute, on the demo splits, side by side in one run.

Decodes the demo validation and training splits (the evaluation batches `speechlm train` uses) twice
with the same weights: the batched KV-cache decoder (`speechlm.model.generation.greedy_with_cache`,
the default) and the prefix-recompute decoder (the oracle). Reports the time of each (features,
encoder, projector and the greedy loop), the speedup, the same with the audio side (timed alone,
identical in both) subtracted, and whether every hypothesis is identical.

Weights: ``--run DIR`` loads the latest checkpoint of a run (e.g. ``runs/demo`` after `speechlm
demo`), so hypotheses have realistic lengths; without it the demo model is freshly initialised and
its eos id is set to an id it never emits, so every utterance decodes exactly ``--max-new-tokens``
tokens (the decoders are timed on a known number of steps).
Usage: ``speechlm bench eval [--run runs/demo] [--max-new-tokens 96] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def load_run_weights(model: Any, run_dir: Path) -> Path:
    """Load the model weights of the latest checkpoint of ``run_dir`` (DCP format) into ``model``."""
    import torch.distributed.checkpoint as dcp

    from speechlm.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise SystemExit(
            f"error: {run_dir}/checkpoints holds no checkpoint; run `speechlm demo` first or drop --run"
        )
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    prefix = next(
        (
            p
            for p in ("state_dict.model.", "model.model.", "state_dict.", "model.")
            if any(k.startswith(p + "llm.") for k in meta.state_dict_metadata)
        ),
        None,
    )
    if prefix is None:
        raise SystemExit(f"error: {ckpt}: no model weights found (keys like '...llm.*')")
    state = {prefix + k: v for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(ckpt))
    model.load_state_dict({k[len(prefix) :]: v for k, v in state.items()})
    return ckpt


def main(argv: list[str] | None = None) -> int:
    from bench_packing import DEFAULT_DATA

    ap = argparse.ArgumentParser(prog="speechlm bench eval", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data", default=DEFAULT_DATA, help="demo manifest/tokenizer directory (one per checkout)"
    )
    ap.add_argument("--config", default=str(REPO / "configs/demo.yaml"))
    ap.add_argument("--run", default=None, help="run directory whose latest checkpoint is decoded")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--batch-duration",
        type=float,
        default=None,
        help="seconds of audio per decoding batch (default: trainer.eval_batch_duration, as validation)",
    )
    ap.add_argument("--splits", default="val,train", help="comma-separated: val, train")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)

    import torch
    from bench_packing import prepare_demo

    from parallel.collectives import Collectives
    from speechlm.config import eval_batch_duration, load_config
    from speechlm.data.dataset import SpeechDataset, build_dataloader
    from speechlm.data.sources.detect import load_source
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.use.evaluator import build_eval_batches, decode_shard

    data = Path(args.data)
    prepare_demo(data)
    cfg = load_config(args.config, [])
    tok = Tokenizer(data / "tokenizer.model")
    torch.manual_seed(0)
    model = SpeechLLM(
        cfg.model,
        vocab_size=len(tok),
        pad_id=tok.pad_id,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        audio_id=tok.audio_id,
    )
    if args.run:
        print(f"weights: {load_run_weights(model, Path(args.run))}")
    else:
        model.eos_id = len(tok)  # never emitted: every utterance decodes --max-new-tokens tokens
        print(f"weights: fresh initialisation; every utterance decodes {args.max_new_tokens} tokens")
    model.eval()
    batches = []
    for split in args.splits.split(","):
        table = load_source(data / f"{split}.parquet")
        ds = SpeechDataset(table, tok, max_tokens=cfg.data.max_tokens)
        budget = args.batch_duration or eval_batch_duration(cfg)
        plan = build_eval_batches(table, max_batch_duration=budget)
        batches += list(build_dataloader(ds, plan, num_workers=0))
    n_utts = sum(len(b) for b in batches)

    results: dict[str, Any] = {}
    hyps: dict[str, list[str]] = {}
    for name, use_cache in (("kv_cache", True), ("recompute", False)):
        t0 = time.perf_counter()
        rows = decode_shard(
            model,
            batches,
            tok,
            device=torch.device("cpu"),
            comm=Collectives(),
            max_new_tokens=args.max_new_tokens,
            use_cache=use_cache,
        )
        seconds = time.perf_counter() - t0
        hyps[name] = [r["hyp"] for r in rows]
        results[name] = {"seconds": seconds, "utterances": len(rows)}
        print(f"{name}: {seconds:.1f} s for {len(rows)} utterances", flush=True)
    t0 = time.perf_counter()  # the audio side, identical in both runs: timed alone to isolate the decoders
    with torch.no_grad():
        for b in batches:
            if len(b):
                model.encode_audio(b.audio, b.audio_lens)
    encode_seconds = time.perf_counter() - t0
    for r in results.values():
        r["seconds_without_encoder"] = r["seconds"] - encode_seconds
    speedup = results["recompute"]["seconds"] / results["kv_cache"]["seconds"]
    kv_loop = results["kv_cache"]["seconds_without_encoder"]
    # None when the machine's noise exceeds the KV loop's own time (the subtraction is meaningless)
    speedup_decoder = results["recompute"]["seconds_without_encoder"] / kv_loop if kv_loop > 0.05 else None
    tokens = sum(len(h.split()) for h in hyps["kv_cache"])
    same = hyps["kv_cache"] == hyps["recompute"]
    differing = sum(a != b for a, b in zip(hyps["kv_cache"], hyps["recompute"]))
    print(
        f"\n{n_utts} utterances ({args.splits}), {len(batches)} batches, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"KV cache {results['kv_cache']['seconds']:.1f} s, recompute {results['recompute']['seconds']:.1f} s: "
        f"speedup {speedup:.2f}x; same hypotheses: {same} ({differing} differ)"
    )
    print(
        f"audio side alone {encode_seconds:.1f} s (the same in both runs); greedy loops alone: speedup "
        f"{'n/a' if speedup_decoder is None else f'{speedup_decoder:.2f}x'}; {tokens / max(n_utts, 1):.1f} words per hypothesis"
    )
    if args.json:
        payload = {
            "speedup": speedup,
            "speedup_decoder_only": speedup_decoder,
            "encode_seconds": encode_seconds,
            "words_per_hypothesis": tokens / max(n_utts, 1),
            "same_hypotheses": same,
            "differing": differing,
            "utterances": n_utts,
            "splits": args.splits,
            "run": args.run,
            "max_new_tokens": args.max_new_tokens,
            "batch_duration": args.batch_duration or eval_batch_duration(cfg),
            "threads": torch.get_num_threads(),
            **results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
