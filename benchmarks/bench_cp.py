"""Context-parallel step time, CPU/gloo or CUDA/NCCL: cp = 1, 2, 4 on the same global batch.

Each layout runs the real training step (`run_optimizer_step`: distributed audio encoding, packing
with CP rounding, load-balanced sharding, ring or all-gather attention, FSDP2 over the CP ranks) on
one long-sequence micro-batch, a warm-up step then `--steps` timed steps; rank 0 reports the median.
On 2 CPU cores, cp = 4 oversubscribes the cores: the figures show overheads, not speed-ups.
`--mix` uses one micro-batch of speech-like clips (one long among short ones) and
`--split-threshold auto,0` compares dynamic CP with splitting every utterance on the same batch.
Usage: `speechlm bench cp [--steps N] [--clips B] [--seconds S] [--kind ring|allgather] [--mix]
[--split-threshold auto,0] [--device cpu|cuda]`. With `--device cuda` each CP rank is one GPU (NCCL),
steps are timed between `torch.cuda.synchronize` calls, and a machine without enough GPUs is refused
with the count it has.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

VOCAB = 256


SPEECH_MIX = (16.0, 6.0, 5.0, 4.0, 3.5, 3.0, 2.5, 2.0)  # seconds: one long utterance among short ones


def make_batch(n_clips: int, seconds: float, seed: int = 0, mix: bool = False):
    import torch

    from speechlm.data.dataset import Batch

    g = torch.Generator().manual_seed(seed)
    secs = list(SPEECH_MIX) if mix else [seconds] * n_clips
    n_clips = len(secs)
    n = int(max(secs) * 16000)
    audio = 0.3 * torch.randn(n_clips, n, generator=g)
    lens = torch.tensor([int(x * 16000) for x in secs])
    tokens = torch.randint(5, VOCAB, (n_clips, 48), generator=g)
    return Batch(
        audio=audio,
        audio_lens=lens,
        tokens=tokens,
        token_lens=torch.full((n_clips,), 48),
        langs=["xx"] * n_clips,
        indices=list(range(n_clips)),
        durations=lens.float() / 16000,
        dropped={},
    )


def rank_body(
    rank: int,
    world: int,
    cp: int,
    kind: str,
    steps: int,
    clips: int,
    seconds: float,
    threshold: str = "auto",
    mix: bool = False,
    device_type: str = "cpu",
) -> dict:
    import torch

    from parallel.mesh import ParallelDims
    from speechlm.config import load_config
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.train.distributed import build_distributed_context
    from speechlm.train.schedule import build_optimizer
    from speechlm.train.step import StepContext, run_optimizer_step

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(max(1, 2 // world))
    cfg = load_config(
        None,
        [
            f"parallel.cp_size={cp}",
            f"parallel.cp_attention={kind}",
            f"parallel.cp_split_threshold={threshold}",
            "trainer.precision=32",
            "model.dropout=0",
            "optim.grad_clip=0",
        ],
    )
    torch.manual_seed(0)
    model = SpeechLLM(cfg.model, vocab_size=VOCAB, pad_id=0, bos_id=2, eos_id=3, audio_id=4).to(device)
    ctx = StepContext()
    if world > 1:
        dims = ParallelDims(world, 1, -1, cp, 1)
        dims.build_mesh(device_type)
        ctx = build_distributed_context(model, dims, cfg, device)
    opt, sched = build_optimizer(model, cfg)
    batch = make_batch(clips, seconds, mix=mix).to(device)
    times = []
    for i in range(steps + 1):
        if device_type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run_optimizer_step(model, [batch], ctx, opt, sched, cfg, step=i)
        if device_type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times)}


def check_device(device: str, max_cp: int) -> str | None:
    """Why the run cannot happen on `device` (None when it can): CUDA missing, or too few GPUs."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return "--device cuda, but this torch build or machine has no CUDA device; run on a GPU machine or use --device cpu"
    if torch.cuda.device_count() < max_cp:
        return (
            f"--cp up to {max_cp} needs {max_cp} GPUs (one per CP rank), this machine has {torch.cuda.device_count()}; "
            f"pass --cp 1,{torch.cuda.device_count()} or fewer"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench cp", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--clips", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds of audio per clip")
    ap.add_argument("--kind", default="ring", choices=("ring", "allgather"))
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument(
        "--mix",
        action="store_true",
        help=f"one micro-batch of {len(SPEECH_MIX)} clips of {SPEECH_MIX} s instead",
    )
    ap.add_argument(
        "--split-threshold",
        default="auto",
        help="parallel.cp_split_threshold values to compare, comma-separated (e.g. auto,0)",
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo, one process per CP rank (default); cuda: NCCL, one GPU per CP rank",
    )
    args = ap.parse_args(argv)
    cps = [int(x) for x in args.cp.split(",")]
    problem = check_device(args.device, max(cps))
    if problem:
        print(f"speechlm bench cp: {problem}", file=sys.stderr)
        return 2

    from parallel.testing import run_distributed

    rows = []
    thresholds = args.split_threshold.split(",")
    backend = "nccl" if args.device == "cuda" else "gloo"
    for cp in cps:
        for th in thresholds if cp > 1 else thresholds[:1]:
            body_args = (cp, args.kind, args.steps, args.clips, args.seconds, th, args.mix, args.device)
            if cp == 1:
                res = rank_body(0, 1, *body_args)
            else:
                res = run_distributed(rank_body, cp, backend, *body_args, timeout_s=1200)[0]
            rows.append((cp, th if cp > 1 else "-", res["median_s"]))
            print(f"cp={cp} threshold={rows[-1][1]}: {res['median_s'] * 1000:.0f} ms/step", flush=True)
    base = rows[0][2]
    batch = f"clips of {SPEECH_MIX} s" if args.mix else f"{args.clips} clips x {args.seconds:g} s"
    print(
        f"\ndemo-size model, {batch} per global batch, {args.kind} attention, "
        f"median of {args.steps} steps after one warm-up"
    )
    print(f"{'cp':>3} {'threshold':>10} {'ms/step':>9} {'vs cp=1':>8}")
    for cp, th, t in rows:
        print(f"{cp:>3} {th:>10} {t * 1000:>9.0f} {t / base:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
