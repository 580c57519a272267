"""MFU of a whole speech LLM training step, THD against BSHD, and `speechlm estimate` against the measured peak.

One process, cp 1, random weights. ``--size 1b``: a Parakeet-sized FastConformer (24 layers x 1024, 8 heads,
FFN 4096, 8x subsampling with 256 channels, about 0.6B parameters with its CTC head) under a 0.5B
Qwen2-like LLM (hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864, a 32k vocabulary), about 1.1B in
all; ``--size tiny`` is the same pipeline a few hundred times smaller (a CPU smoke in seconds).
Trailing ``KEY.PATH=VALUE`` overrides change the preset (e.g. ``model.attention_backend=torch_varlen``).

Micro-batches: `bench_packing.lognormal_batches` (log-normal durations 0.5-20 s, the trainer's
duration-bucketed sampler, ``--budget`` seconds of audio each), the same ``--batches`` for both layouts.
Per layout, one optimizer step per micro-batch as training runs it (`speechlm.train.step.run_optimizer_step`:
forward, backward, gradient clipping, AdamW, the schedule): ``--warmup`` steps, then ``--steps`` timed
ones (device-synchronised), cycling through the batches. On CUDA bf16 autocast as one-process training
decides it (`speechlm.train.precision`); on a CPU fp32. Layouts (`bench_packing.LAYOUTS`):
``thd`` = packed decoder and padding-free encoder, ``bshd`` = padded decoder and padded encoder.

Figures per layout (the definitions of `speechlm.train.throughput.step_metrics`, over all timed steps):
step time, real tokens/s, audio s/s, model TFLOP/s (the analytic count of `speechlm.model.flops` on the real
work; padding is not model work) and MFU against `speechlm.model.flops.peak_tflops` (H100/H200 989; a CPU
0.096 per thread), the real share of the computed decoder tokens, peak memory (CUDA:
``torch.cuda.max_memory_allocated`` since the layout's optimizer was built; CPU: the process's peak RSS,
which never goes down, so the second layout's is the larger of both), and `speechlm.preflight.estimate`'s
prediction for the heaviest micro-batch the layout computed (BSHD: every clip padded to the batch's
longest, every transcript to its longest) with its error in percent (CUDA: against the estimate without
the CUDA context, which the allocator does not count); beside them `estimate`'s figure for the config
alone (no manifest: its worst case). Across layouts: THD's speedup over BSHD, the compute bound (BSHD's
computed encoder frames, decoder tokens and analytic FLOPs of the padded work, the LM head on every
position, over THD's, as ``speechlm bench packing`` reports it) and the share of the bound reached. A
layout that runs out of device memory is reported as such and the other one still runs.

``--profile FILE`` runs one more THD step (untimed) under `torch.profiler` and writes its operator table,
the most expensive first (self device time on CUDA): where the time goes when MFU falls short of the goal.

``--dry-run`` prints the parameter counts, the batches and the predicted device time of the run at
``--assume-mfu`` (from the FLOP count) and exits without building the model.
Usage: ``speechlm bench mfu --size 1b --device cuda --json mfu.json`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from pathlib import Path
from typing import Any

from bench_packing import LAYOUTS, count_frames, lognormal_batches

from speechlm.cli import positive_float, positive_int
from speechlm.model.devices import device_name_argument

ENCODER_1B = [
    "model.encoder.kind=parakeet",
    "model.encoder.hidden_size=1024",
    "model.encoder.num_layers=24",
    "model.encoder.num_heads=8",
    "model.encoder.intermediate_size=4096",
    "model.encoder.subsampling_conv_channels=256",
    "model.encoder.subsampling_factor=8",
]
LLM_05B = [
    "model.llm.family=qwen2",
    "model.llm.hidden_size=896",
    "model.llm.num_layers=24",
    "model.llm.num_heads=14",
    "model.llm.num_kv_heads=2",
    "model.llm.intermediate_size=4864",
]
TINY = [
    "model.encoder.hidden_size=64",
    "model.encoder.num_layers=2",
    "model.encoder.num_heads=2",
    "model.encoder.intermediate_size=128",
    "model.encoder.subsampling_conv_channels=8",
    "model.llm.family=qwen2",
    "model.llm.hidden_size=64",
    "model.llm.num_layers=2",
    "model.llm.num_heads=4",
    "model.llm.num_kv_heads=2",
    "model.llm.intermediate_size=128",
    "model.projector_hidden=128",
]
# size -> (config overrides, vocabulary, seconds of audio per micro-batch, batches, warm-up steps)
PRESETS: dict[str, tuple[list[str], int, float, int, int]] = {
    "1b": ([*ENCODER_1B, *LLM_05B, "model.projector_hidden=2048"], 32000, 300.0, 8, 3),
    "tiny": (TINY, 1024, 20.0, 2, 1),
}
COMMON = [
    "model.ctc_weight=0.3",
    "model.dropout=0.0",
    "model.attention_backend=reference",
    "data.max_tokens=64",
]
ORDER = ("thd", "bshd")  # THD first: on a CPU the peak RSS only grows


def build_config(size: str, device_type: str, budget: float, overrides: list[str]) -> Any:
    from speechlm.config import load_config

    precision = "bf16" if device_type == "cuda" else "32"
    return load_config(
        None,
        [
            *COMMON,
            *PRESETS[size][0],
            f"sampler.max_batch_duration={budget}",
            f"trainer.precision={precision}",
            *overrides,
        ],
    )


def workload_of(batch: Any, *, padded: bool) -> Any:
    """`speechlm.preflight.estimate.Workload` of a micro-batch: feature frames and transcript tokens (the language
    tag apart) of each clip; `padded`: every clip as long as the longest, every transcript too (BSHD)."""
    from parallel.frames import HOP_SAMPLES
    from speechlm.preflight.estimate import Workload

    frames = [int(n) // HOP_SAMPLES + 1 for n in batch.audio_lens.tolist()]
    text = [int(n) - 1 for n in batch.token_lens.tolist()]
    if padded:
        frames, text = [max(frames)] * len(frames), [max(text)] * len(text)
    return Workload(frames, text)


def analytic_flops(dims: Any, cfg: Any, w: Any, *, logits_everywhere: bool = False) -> float:
    """Training FLOPs (`speechlm.model.flops.micro_flops`) of one micro-batch's workload, all of it trained;
    `logits_everywhere`: the LM head runs on every position (BSHD's forward), not the labelled ones only."""
    from speechlm.model.flops import Trainable, micro_flops, record_work
    from speechlm.preflight.estimate import llm_seq_lens

    seqs = llm_seq_lens(dims, w)
    work = record_work(
        seqs,
        seqs if logits_everywhere else [k + 1 for k in w.text_tokens],
        range(len(seqs)),
        0,
        1,
        clip_frames=w.clip_frames,
        computed_tokens=sum(seqs),
    )
    return micro_flops(dims, work, Trainable(encoder=True, llm=cfg.model.llm.train == "full"))


def heaviest_estimate(
    cfg: Any, counts: Any, dims: Any, batches: list[Any], *, padded: bool, device: str
) -> Any:
    """The estimate (`speechlm.preflight.estimate.estimate`, one rank) of the batch whose estimate is largest."""
    from speechlm.preflight.estimate import Layout, estimate

    ests = []
    for b in batches:
        w = workload_of(b, padded=padded)
        ests.append(estimate(cfg, counts, dims, w, w, Layout(1), device=device))
    return max(ests, key=lambda e: e.total)


def run_layout(
    model: Any, cfg: Any, name: str, batches: list[Any], args: argparse.Namespace, device: Any
) -> dict[str, Any]:
    """Warm-up and timed optimizer steps of one layout; the step figures and the peak memory."""
    import torch

    from speechlm.model.flops import Trainable, dims_of_model, step_flops
    from speechlm.train.precision import precision_policy
    from speechlm.train.schedule import build_optimizer
    from speechlm.train.step import StepContext, StepWork, run_optimizer_step
    from speechlm.train.throughput import device_peak_tflops, memory_figures, step_metrics

    packed_decoder, packed_encoder = LAYOUTS[name]
    cfg.model.packed_sequences = packed_decoder
    model.encoder_packed = packed_encoder
    ctx = StepContext(precision=precision_policy(cfg, None, device))
    dims = dims_of_model(model)

    def flop_count(works: list[Any], frozen: bool) -> float:
        return step_flops(dims, works, Trainable(encoder=not frozen, llm=cfg.model.llm.train == "full"))

    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    opt, sched = build_optimizer(model, cfg)
    seconds = cpu_seconds = audio = optim_s = 0.0
    real = computed = flops = 0.0
    for k in range(args.warmup + args.steps):
        b = batches[k % len(batches)]
        if cuda:
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        res = run_optimizer_step(model, [b], ctx, opt, sched, cfg, step=k, flop_count=flop_count)
        if cuda:
            torch.cuda.synchronize(device)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if k >= args.warmup:
            w = res["work"]
            seconds, cpu_seconds = seconds + dt, cpu_seconds + dc
            real, computed, flops = real + w.real_tokens, computed + w.computed_tokens, flops + w.flops
            optim_s += w.optim_s
            audio += float(b.durations.sum())
        print(
            f"{name} step {k + 1}/{args.warmup + args.steps}: {1000 * dt:.0f} ms, loss {res['loss']:.3f}"
            + (" (warm-up)" if k < args.warmup else ""),
            flush=True,
        )
    if args.profile and name == "thd":  # one more step, untimed, under the profiler
        k = args.warmup + args.steps
        write_profile(
            functools.partial(
                run_optimizer_step, model, [batches[0]], ctx, opt, sched, cfg, step=k, flop_count=flop_count
            ),
            device,
            args.profile,
        )
    # all timed steps as one: the rates of step_metrics over their summed work and time
    total = StepWork(real, computed, flops, optim_s, real, computed, flops)
    peak = device_peak_tflops(device)
    figures = step_metrics(
        total,
        step_s=seconds,
        data_wait_s=0.0,
        audio_s_rank=audio,
        audio_s_total=audio,
        world_size=1,
        peak=peak,
    )
    for key in ("tokens_per_s_rank", "audio_s_per_s_rank", "data_wait_s"):  # one process, no loader
        del figures[key]
    figures["real_tokens_timed"] = figures.pop("real_tokens")
    figures["computed_tokens_timed"] = figures.pop("computed_tokens")
    figures["tflop_timed"] = figures.pop("step_tflop")
    mem = memory_figures(device)
    frames = [
        count_frames(model, b, None, packed_decoder=packed_decoder, packed_encoder=packed_encoder)
        for b in batches
    ]
    del opt, sched
    return {
        **figures,
        "step_s": seconds / args.steps,
        "optim_s": optim_s / args.steps,
        "audio_s_timed": audio,
        "cpu_s_per_step": cpu_seconds / args.steps,
        "steps": args.steps,
        "peak_tflops": peak,
        "measured_gib": mem["mem_cuda_alloc_gib"] if cuda else mem["rss_gib"],
        "mem_cuda_reserved_gib": mem["mem_cuda_reserved_gib"],
        "encoder_frames_computed": sum(f["enc"] for f in frames),
        "decoder_tokens_computed": sum(f["dec"] for f in frames),
    }


def write_profile(step: Any, device: Any, path: str) -> None:
    """Run ``step`` once under `torch.profiler` and write its operators, the most expensive first (self time
    on the device on CUDA, on the host on a CPU): where a step's time goes when MFU falls short."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    Path(path).write_text(f"one THD optimizer step on {device}, sorted by {sort}\n{table}\n")
    print(f"wrote the profile of one THD step to {path}")


def estimate_figures(est: Any, measured_gib: float | None, *, cuda: bool) -> dict[str, float | None]:
    """The estimate beside the measurement (None: not measured): on CUDA without the runtime (the CUDA
    context is not allocated memory)."""
    from speechlm.preflight.estimate import GIB

    predicted = (est.total - (est.memory["runtime"] if cuda else 0.0)) / GIB
    error = 100.0 * (predicted - measured_gib) / measured_gib if measured_gib else None
    return {
        "estimate_gib": predicted,
        "estimate_activations_gib": est.memory["activations"] / GIB,
        "estimate_error_pct": error,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="speechlm bench mfu", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="config overrides of the preset")
    ap.add_argument("--size", choices=sorted(PRESETS), default="tiny", help="model preset (module docstring)")
    ap.add_argument("--device", type=device_name_argument, default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument(
        "--budget", type=positive_float, default=None, help="seconds of audio per micro-batch (preset's)"
    )
    ap.add_argument("--batches", type=positive_int, default=None, help="distinct micro-batches (preset's)")
    ap.add_argument(
        "--steps", type=positive_int, default=None, help="timed steps per layout (default: 2 x --batches)"
    )
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per layout first (preset's)")
    ap.add_argument("--assume-mfu", type=float, default=0.35, help="MFU of the predicted run time")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and predicted time; build nothing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results to this file")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="also profile one more THD step; its operator table here",
    )
    args = ap.parse_intermixed_args(argv)
    _, _, budget, n_batches, warmup = PRESETS[args.size]
    args.budget = budget if args.budget is None else args.budget
    args.batches = n_batches if args.batches is None else args.batches
    args.steps = 2 * args.batches if args.steps is None else args.steps  # two passes over the batches
    args.warmup = warmup if args.warmup is None else args.warmup
    if min(args.batches, args.steps) < 1 or args.warmup < 0 or not 0 < args.assume_mfu <= 1:
        ap.error("--batches and --steps must be >= 1, --warmup >= 0, --assume-mfu in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from speechlm.errors import UsageError
    from speechlm.model.flops import device_kind_of
    from speechlm.preflight.estimate import GIB, count_parameters

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    present = cuda and torch.cuda.is_available()
    if cuda and not present and not args.dry_run:
        raise UsageError(
            f"--device {args.device}: torch {torch.__version__} sees no CUDA device here; run on a GPU machine, "
            "or use --device cpu (fp32, a smoke run) or --dry-run (the plan only)"
        )
    cfg = build_config(args.size, device.type, args.budget, args.overrides)
    gpu = torch.cuda.get_device_name(device) if present else device.type
    # the estimate's device row: the GPU's kind (its memory and peak), h100 for a GPU not in its table
    est_device = (device_kind_of(gpu) or "h100") if cuda else "cpu"
    vocab = PRESETS[args.size][1]
    counts, dims = count_parameters(cfg, vocab)
    n_params = counts.encoder + counts.projector + counts.llm
    print(
        f"--size {args.size}: encoder {counts.encoder / 1e6:.1f}M, projector+CTC {counts.projector / 1e6:.1f}M, "
        f"LLM {counts.llm / 1e6:.1f}M, {n_params / 1e6:.1f}M parameters in all; vocabulary {vocab}"
    )
    t_build = time.perf_counter()
    batches, info = lognormal_batches(args.batches, args.budget, "bucketed", args.seed)
    payload: dict[str, Any] = {
        "size": args.size,
        "device": gpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "precision": cfg.trainer.precision,
        "attention_backend": cfg.model.attention_backend,
        "parameters": {
            "encoder": counts.encoder,
            "projector_ctc": counts.projector,
            "llm": counts.llm,
            "total": n_params,
        },
        "vocab": vocab,
        "budget_s": args.budget,
        "batches": len(batches),
        "warmup": args.warmup,
        "steps": args.steps,
        "profile": args.profile,
        **plan_figures(cfg, dims, batches, args),
    }
    if args.dry_run:
        for name in ORDER:
            est = heaviest_estimate(cfg, counts, dims, batches, padded=name == "bshd", device=est_device)
            payload[f"estimate_gib_{name}"] = est.total / GIB
            print(
                f"{name}: speechlm estimate {est.total / GIB:.2f} GiB (activations "
                f"{est.memory['activations'] / GIB:.2f}) of the heaviest micro-batch on {est_device}"
            )
        cli = config_estimate(cfg, counts, dims, est_device)
        payload["estimate_config_worst_case_gib"] = cli.total / GIB
        print(f"speechlm estimate of the config (no manifest, a worst case): {cli.total / GIB:.2f} GiB")
        return write_json(args.json, payload)

    torch.manual_seed(args.seed)
    from speechlm.model.speech_llm import SpeechLLM

    model = SpeechLLM(
        cfg.model,
        vocab_size=vocab,
        pad_id=info.pad_id,
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        audio_id=info.audio_id,
    ).to(device)
    model.train()
    batches = [b.to(device) for b in batches]
    payload["build_s"] = time.perf_counter() - t_build
    results = {name: run_layout_or_oom(model, cfg, name, batches, args, device) for name in ORDER}
    for name in ORDER:
        est = heaviest_estimate(cfg, counts, dims, batches, padded=name == "bshd", device=est_device)
        results[name].update(estimate_figures(est, results[name].get("measured_gib"), cuda=cuda))
    bound = bound_figures(results, payload["computed_tflop_per_step"])
    cli = config_estimate(cfg, counts, dims, est_device)
    cli_gib = (cli.total - (cli.memory["runtime"] if cuda else 0.0)) / GIB
    print(format_table(results, bound, args, gpu, payload["build_s"], torch.__version__))
    print(
        f"speechlm estimate of the config (no manifest: {args.budget:g} s of 20 s clips with data.max_tokens "
        f"tokens each, a worst case): {cli_gib:.3f} GiB"
    )
    payload["estimate_config_worst_case_gib"] = cli_gib
    return write_json(args.json, {**payload, "layouts": results, "thd_vs_bshd": bound})


def run_layout_or_oom(
    model: Any, cfg: Any, name: str, batches: list[Any], args: argparse.Namespace, device: Any
) -> dict[str, Any]:
    """`run_layout`, or {"error": ...} when the device runs out of memory (the other layout still runs)."""
    import torch

    try:
        return run_layout(model, cfg, name, batches, args, device)
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0][:200]}"
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"{name}: {error}", flush=True)
    return {"error": error}


def bound_figures(
    results: dict[str, dict[str, Any]], tflop_per_step: dict[str, float]
) -> dict[str, float] | None:
    """THD's speedup over BSHD, the compute bound (BSHD's computed work over THD's) and the share of it
    reached; None when a layout did not run."""
    thd, bshd = results["thd"], results["bshd"]
    if "error" in thd or "error" in bshd:
        return None
    speedup = bshd["step_s"] / thd["step_s"]
    bound = tflop_per_step["bshd"] / tflop_per_step["thd"]
    return {
        "encoder_frames_ratio": bshd["encoder_frames_computed"] / thd["encoder_frames_computed"],
        "decoder_tokens_ratio": bshd["decoder_tokens_computed"] / thd["decoder_tokens_computed"],
        "compute_bound": bound,
        "speedup": speedup,
        "share_of_bound": speedup / bound,
    }


def config_estimate(cfg: Any, counts: Any, dims: Any, device: str) -> Any:
    """What `speechlm estimate` says of the config without a manifest (its worst-case micro-batch)."""
    from speechlm.preflight.estimate import Layout, config_workloads, estimate

    heavy, mean = config_workloads(cfg)
    return estimate(cfg, counts, dims, heavy, mean, Layout(1), device=device)


def plan_figures(cfg: Any, dims: Any, batches: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """The run before it runs: computed TFLOP per step of each layout (the analytic count of its work,
    padding included) and the seconds all steps take on one H100 at ``--assume-mfu``."""
    per_step = {
        name: sum(
            analytic_flops(dims, cfg, workload_of(b, padded=name == "bshd"), logits_everywhere=name == "bshd")
            for b in batches
        )
        / len(batches)
        for name in ORDER
    }
    predicted_s = sum(per_step.values()) * (args.warmup + args.steps) / (989e12 * args.assume_mfu)
    audio_s = sum(float(b.durations.sum()) for b in batches) / len(batches)
    clips = sum(len(b) for b in batches) / len(batches)
    print(
        f"{len(batches)} micro-batches of <= {args.budget:g} s ({audio_s:.0f} s of audio, {clips:.1f} clips each "
        f"on average); {args.warmup} + {args.steps} steps per layout; computed TFLOP per step THD "
        f"{per_step['thd'] / 1e12:.3g}, BSHD {per_step['bshd'] / 1e12:.3g}: {predicted_s:.1f} s of steps on one "
        f"H100 at MFU {args.assume_mfu:g} (model build, imports and first-step set-up apart)"
    )
    return {
        "computed_tflop_per_step": {n: v / 1e12 for n, v in per_step.items()},
        "predicted_steps_s_h100": predicted_s,
        "assume_mfu": args.assume_mfu,
        "audio_s_per_batch": audio_s,
    }


def write_json(path: str | None, payload: dict[str, Any]) -> int:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")
    return 0


def format_table(
    results: dict[str, dict[str, Any]],
    bound: dict[str, float] | None,
    args: argparse.Namespace,
    device: str,
    build_s: float,
    torch_version: str,
) -> str:
    lines = [
        f"\n{args.size} on {device}, torch {torch_version}, {args.steps} timed steps per layout after "
        f"{args.warmup} warm-up, budget {args.budget:g} s; model build and batches {build_s:.0f} s",
        f"{'layout':<6} {'step ms':>8} {'cpu ms':>8} {'tokens/s':>10} {'audio s/s':>10} {'TFLOP/s':>9} "
        f"{'MFU':>7} {'real tok':>9} {'peak GiB':>9} {'estimate':>9} {'error':>7}",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:<6} {r['error']} (estimate {r['estimate_gib']:.3f} GiB)")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(
            f"{name:<6} {1000 * r['step_s']:>8.1f} {1000 * r['cpu_s_per_step']:>8.1f} {r['tokens_per_s']:>10,.0f} "
            f"{r['audio_s_per_s']:>10,.1f} {r['tflops_per_s']:>9.4g} {mfu:>7} {r['real_token_share']:>9.1%} "
            f"{r['measured_gib']:>9.3f} {r['estimate_gib']:>9.3f} {r['estimate_error_pct']:>+6.1f}%"
        )
    if bound is not None:
        lines.append(
            f"THD over BSHD: speedup {bound['speedup']:.3f}x; compute bound {bound['compute_bound']:.3f}x "
            f"(encoder frames {bound['encoder_frames_ratio']:.3f}x, decoder tokens "
            f"{bound['decoder_tokens_ratio']:.3f}x); {bound['share_of_bound']:.1%} of the bound"
        )
    what = "torch.cuda.max_memory_allocated" if device != "cpu" else "peak RSS of the process"
    lines.append(f"peak: {what}; estimate: speechlm estimate of the heaviest micro-batch")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
