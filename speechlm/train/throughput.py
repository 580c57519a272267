"""The throughput, MFU, memory and timing figures of each optimizer step (docs/training.md, "Step metrics").

Every figure is a plain number in the step's record of metrics.jsonl, in the CSV/TensorBoard logs and
(tokens/s and MFU) on the console line; a figure that does not apply is None (null), never a made-up 0.
The keys (`STEP_METRIC_KEYS`) are shared with the progress display.

Time: ``step_s`` = ``data_wait_s`` (the loader producing this step's micro-batches while training
waited, `speechlm.train.data.StepLoader`) + the time inside the training step (forwards, backwards,
clipping, optimizer, the step's collectives). Callbacks between steps (validation, checkpoints) are not
in it. ``optim_s``: gradient clipping, the optimizer step and zeroing the gradients (device-synchronised).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from speechlm.model.flops import device_kind_of, implausible_peak, peak_tflops
from speechlm.train.step import StepWork

STEP_METRIC_KEYS = (
    "tokens_per_s",
    "tokens_per_s_rank",
    "audio_s_per_s",
    "audio_s_per_s_rank",
    "real_token_share",
    "tflops_per_s",
    "mfu",
    "mem_cuda_alloc_gib",
    "mem_cuda_reserved_gib",
    "rss_gib",
    "data_wait_s",
    "optim_s",
    "step_s",
)
GIB = 2.0**30


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Peak TFLOP/s of one device of the run (`speechlm.model.flops.PEAK_TFLOPS`; a CPU: per core times the
    process's torch threads); `override` (trainer.peak_tflops) wins; None for a GPU not in the table."""
    if device.type == "cuda":
        return peak_tflops(device_kind_of(torch.cuda.get_device_name(device)), override=override)
    if device.type == "cpu":
        return peak_tflops("cpu", override=override, cpu_cores=torch.get_num_threads())
    return peak_tflops(None, override=override)


def warn_implausible_peak(peak: float | None) -> bool:
    """At fit start: a warning on stderr when trainer.peak_tflops cannot be a device's peak
    (`speechlm.model.flops.implausible_peak`); the steps' MFU is then shown as n/a (`progress.step_fields`)."""
    why = implausible_peak(peak)
    if why is not None:
        print(f"warning: {why}", file=sys.stderr, flush=True)
    return why is not None


def peak_rss_gib() -> float:
    """The process's peak resident memory so far (getrusage: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB


def memory_figures(device: torch.device) -> dict[str, float | None]:
    """Peak memory since the process started: CUDA allocated/reserved (torch's peak counters, read and
    never reset: whoever else reads them, e.g. `speechlm bench pretrained-lora`, still gets the run's
    peak) and the process's RSS."""
    out: dict[str, float | None] = {"mem_cuda_alloc_gib": None, "mem_cuda_reserved_gib": None}
    if device.type == "cuda":
        out["mem_cuda_alloc_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["mem_cuda_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    out["rss_gib"] = peak_rss_gib()
    return out


def _per_s(x: float, seconds: float) -> float | None:
    return x / seconds if seconds > 0 else None


def step_metrics(
    work: StepWork,
    *,
    step_s: float,
    data_wait_s: float,
    audio_s_rank: float,
    audio_s_total: float,
    world_size: int,
    peak: float | None,
) -> dict[str, Any]:
    """The step's figures (module docstring) from what it computed (`StepWork`) and its times.

    tokens: real tokens (audio embeddings + prompt tokens) of the whole step (summed over dp x cp) and of
    this rank's share; ``real_token_share`` = real / computed tokens of the LLM stream (padding and CP
    rounding count as computed); ``tflops_per_s``: model FLOPs per second per device (the step's FLOPs
    over all ranks / step_s / world size); ``mfu`` = that / the device's `peak` (None without one)."""
    tflops = _per_s(work.flops_total, step_s)
    tflops = tflops / world_size / 1e12 if tflops is not None else None
    return {
        "tokens_per_s": _per_s(work.real_tokens_total, step_s),
        "tokens_per_s_rank": _per_s(work.real_tokens, step_s),
        "audio_s_per_s": _per_s(audio_s_total, step_s),
        "audio_s_per_s_rank": _per_s(audio_s_rank, step_s),
        "real_token_share": (
            work.real_tokens_total / work.computed_tokens_total if work.computed_tokens_total > 0 else None
        ),
        "tflops_per_s": tflops,
        "mfu": tflops / peak if tflops is not None and peak else None,
        "data_wait_s": data_wait_s,
        "optim_s": work.optim_s,
        "step_s": step_s,
        # what the rates are made of: the step's real and computed tokens and TFLOPs over all ranks
        "real_tokens": work.real_tokens_total,
        "computed_tokens": work.computed_tokens_total,
        "step_tflop": work.flops_total / 1e12,
    }
