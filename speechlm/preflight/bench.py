"""`speechlm bench NAME [ARGS...]`: run one of the benchmarks in the source tree's `benchmarks/`.

Each benchmark is a script with `main(argv) -> int` (or a `main()` that reads `sys.argv`); this registry maps its name to the file, which
is loaded by path (the `benchmarks/` folder is not an installed package, so this works from an
editable install or a checkout). Everything after NAME goes to the benchmark's own parser, so
`speechlm bench sampler --help` shows that benchmark's options. To add one, add a line below.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

# name -> file, relative to the repository root
BENCHMARKS: dict[str, str] = {
    "sampler": "benchmarks/bench_sampler.py",  # epoch plan: vectorised vs per-row Python
    "manifest-memory": "benchmarks/bench_manifest_memory.py",  # 10M-row manifest resident memory
    "index-memory": "benchmarks/bench_index_memory.py",  # a rank's index: in RAM vs memory-mapped
    "plan-memory": "benchmarks/bench_plan_memory.py",  # speechlm plan on 10M rows: peak RSS
    "read-throughput": "benchmarks/bench_read_throughput.py",  # extracted files vs tar indexed/streaming
    "packing": "benchmarks/bench_packing.py",  # BSHD / THD + padded encoder / THD end to end
    "eval": "benchmarks/bench_eval.py",  # greedy decoding: KV cache vs prefix recompute
    "decode": "benchmarks/bench_decode.py",  # joint CTC decoding at 49k ids: LLM alone / every token / top-K
    "decode-local": "benchmarks/bench_decode_local.py",  # audio decoded per CP rank: every clip vs its own
    "cp": "benchmarks/bench_cp.py",  # CP step time on gloo/CPU, cp=1/2/4 on the same global batch
    "cp-placement": "benchmarks/bench_cp_placement.py",  # dynamic CP: padding, balance, ring traffic
    "attention": "benchmarks/bench_attention.py",  # one decoder layer per attention backend (CUDA)
    "attention-calls": "benchmarks/bench_attention_calls.py",  # varlen kernel calls per layer (CPU/gloo)
    "pretrained-lora": "benchmarks/bench_pretrained_lora.py",  # SmolLM2 LoRA recipe: tokens/s, peak memory
    "long-audio": "benchmarks/bench_long_audio.py",  # one long clip over cp 1/2/4: memory per rank (gloo/CPU)
    "long-clip": "benchmarks/bench_long_clip.py",  # one long clip through a Parakeet-sized encoder (CUDA)
    "mfu": "benchmarks/bench_mfu.py",  # ~1B speech LLM step: MFU THD vs BSHD, estimate vs peak memory
    "compression": "benchmarks/bench_compression.py",  # CTC-compressed audio rows: rows/s of speech, step time
    "whisper-reference": "benchmarks/bench_whisper_reference.py",  # faster-whisper zero-shot WER on a manifest
    "whisper-window": "benchmarks/bench_whisper_window.py",  # Whisper encoder: 30 s window vs the clip, ms per clip
    "encoder-share": "benchmarks/bench_encoder_share.py",  # a frozen Whisper's share of a speech-LLM step (cache?)
    "gpu": "benchmarks/bench_gpu.py",  # the GPU acceptance run: kit, attention, mfu, recipe, long clip (one GPU)
}

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(name: str) -> ModuleType:
    """Import benchmark `name` from its file; raise a clear error when it is unknown or absent."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHMARKS))}")
    path = REPO_ROOT / BENCHMARKS[name]
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark {name!r} expects {path}, which is missing; benchmarks run from a source checkout "
            "(pip install -e .)"
        )
    # imported by its own name from benchmarks/ on sys.path, so that processes a benchmark spawns
    # (multiprocessing pickles functions by module name) can import it too
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(path.stem)


def run_benchmark(args: argparse.Namespace) -> int:
    try:
        module = load_benchmark(args.benchmark)
    except (KeyError, FileNotFoundError) as e:
        print(f"speechlm bench: {e.args[0]}", file=sys.stderr)
        return 1
    argv = list(args.benchmark_args)
    # a benchmark's parser names itself after sys.argv[0] unless it sets prog: `speechlm bench NAME`
    saved = sys.argv
    sys.argv = [f"speechlm bench {args.benchmark}", *argv]
    try:
        if inspect.signature(module.main).parameters:
            return int(module.main(argv) or 0)
        return int(module.main() or 0)  # a script-style main() that reads sys.argv
    finally:
        sys.argv = saved


def add_parser(subparsers: Any) -> None:  # Any: argparse's subparsers action (a private class)
    parser = subparsers.add_parser(
        "bench", help="run a benchmark (sampler, ...)", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "benchmark",
        metavar="NAME",
        choices=sorted(BENCHMARKS),
        help=f"one of: {', '.join(sorted(BENCHMARKS))}; NAME --help shows its options",
    )
    parser.add_argument(
        "benchmark_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the benchmark"
    )
    parser.set_defaults(func=run_benchmark)
