"""`speechlm estimate CONFIG --world-size N`: per-rank memory and step time of a layout before a run.

Memory per rank (bytes; docs/training.md, "Estimating a layout"; the calibration in docs/benchmarks.md):
- parameters: fp32, the LLM's split over tp, all of them sharded by FSDP2 over dp_shard x cp
  (`dp_shard_cp`); gradients (fp32) and AdamW's two moments (2 x fp32) of the *trainable* ones likewise.
  Sharded runs add the gathered copy of the two largest FSDP units (the current one and the prefetched
  next; bf16 under mixed precision).
- activations of the heaviest micro-batch (`Workload`): what autograd keeps for the backward, counted
  in elements per token / frame (`LLM_ACT_PER_TOKEN`, `ENCODER_ACT_PER_FRAME`, ...) at 4 bytes (fp32)
  or 2 (bf16), the logits of the labelled tokens and the CTC head in fp32, and the quadratic terms of
  the attention where the backend materialises the scores. CP divides the LLM stream and the clips over
  cp ranks, TP the wide LLM activations over tp. With activation checkpointing only each LLM layer's
  input is kept, plus the larger of one LLM layer's and the whole encoder's activations (recomputed in
  the backward, one at a time).
- runtime: what the process holds before any model (`RUNTIME_GIB`: Python, torch, transformers and
  Lightning on a CPU; the CUDA context on a GPU).
Step time: the step's training FLOPs on one rank (`speechlm.model.flops`) / (device peak x `--mfu`).

The heaviest micro-batch is the config's budget (sampler.max_batch_duration seconds) filled with the
longest utterances of the manifest (`--manifest`, or data.train_manifest when it exists), each with its
transcript's tokens; without a manifest, with clips of the longest bucket (or 20 s) and data.max_tokens
tokens each. The mean step (for the time) is the budget filled with the manifest's mean utterance.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from parallel.frames import HOP_SAMPLES, SAMPLE_RATE, feature_frames_of_seconds
from speechlm.config import ExperimentConfig, load_config
from speechlm.data.sampler.cost import CHARS_PER_TOKEN  # no tokenizer at hand: the sampler's estimate
from speechlm.data.tokenizer import load_text_tokenizer
from speechlm.errors import DataError, UsageError, UserError
from speechlm.model.flops import (
    PEAK_TFLOPS,
    ModelDims,
    Trainable,
    dims_of_model,
    encoder_frames,
    record_work,
    step_flops,
)

GIB = 2.0**30
DEVICE_GIB = {"h100": 79.1, "h200": 139.8, "a100": 79.1}  # what torch reports usable; cpu: this machine's RAM
RUNTIME_GIB = {"cpu": 0.60, "cuda": 0.50}  # before any model: CPU process RSS; CUDA context (not allocated)
DEFAULT_MFU = {"h100": 0.40, "h200": 0.40, "a100": 0.45, "cpu": 0.25}
FIT_MARGIN = 0.90  # a layout fits when its estimate is at most this share of the device (fragmentation)
QUADRATIC_BACKENDS = ("reference", "sdpa")  # materialise the attention scores (flash, te, flex do not)


class LayoutDoesNotFitError(UserError):
    """The estimated memory of a rank exceeds the device's (exit code of a layout that cannot be used)."""


@dataclass(frozen=True)
class Layout:
    world: int
    cp: int = 1
    tp: int = 1
    dp_replicate: int = 1

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP2 shards a parameter over (`dp_shard_cp`)."""
        return self.world // (self.tp * self.dp_replicate)

    @property
    def dp(self) -> int:
        return self.world // (self.cp * self.tp)


@dataclass(frozen=True)
class Workload:
    """One micro-batch: feature frames and transcript tokens of each clip."""

    clip_frames: list[int]
    text_tokens: list[int]

    @property
    def audio_seconds(self) -> float:
        return sum(self.clip_frames) * HOP_SAMPLES / SAMPLE_RATE


@dataclass(frozen=True)
class ParamCounts:
    encoder: int
    projector: int  # with the CTC head
    llm: int
    largest_unit: int  # the largest FSDP unit (a decoder layer, the encoder, the embeddings, ...)

    def trainable(self, t: Trainable) -> int:
        return (self.encoder if t.encoder else 0) + self.projector + (self.llm if t.llm else 0)


def count_parameters(cfg: ExperimentConfig, vocab_size: int) -> tuple[ParamCounts, ModelDims]:
    """Parameter counts per part and the FLOP dims of the config's model, built on the meta device (no
    memory, no weights read)."""
    import torch  # lazy: torch (CLI start-up)
    from torch import nn  # lazy: torch (CLI start-up)

    from speechlm.model.encoders import build_encoder  # lazy: torch (CLI start-up)
    from speechlm.model.llm import build_llm  # lazy: torch, transformers (CLI start-up)
    from speechlm.model.projector import FrameStackProjector  # lazy: torch (CLI start-up)

    m = cfg.model
    with torch.device("meta"):  # the parts with parameters (the features' filterbank needs real numbers)
        encoder = build_encoder(m.encoder, dropout=0.0)
        llm = build_llm(
            m.llm,
            vocab_size=vocab_size,
            pad_id=0,
            bos_id=1,
            eos_id=2,
            dropout=0.0,
            attn_implementation="sdpa",
        )
        projector = FrameStackProjector(
            encoder.output_dim, int(llm.config.hidden_size), m.projector_stack, m.projector_hidden
        )
        ctc_head = nn.Linear(encoder.output_dim, vocab_size) if m.ctc_weight > 0 else None
    model: Any = SimpleNamespace(encoder=encoder, llm=llm, projector=projector, ctc_head=ctc_head)

    def n(module: nn.Module) -> int:
        return sum(int(p.numel()) for p in module.parameters())

    layers = [n(layer) for layer in model.llm.model.layers]
    head = n(model.ctc_head) if model.ctc_head is not None else 0
    emb = n(model.llm.get_input_embeddings())
    counts = ParamCounts(
        encoder=n(model.encoder),
        projector=n(model.projector) + head,
        llm=n(model.llm),
        largest_unit=max([*layers, emb, n(model.llm) - sum(layers) - emb, n(model.encoder)]),
    )
    return counts, dims_of_model(model)


def llm_seq_lens(dims: ModelDims, w: Workload) -> list[int]:
    """Sequence lengths in the LLM: the clip's audio embeddings and its prompt (tag, transcript, eos)."""
    return [
        -(-encoder_frames(dims.encoder, t) // dims.stack) + k + 2
        for t, k in zip(w.clip_frames, w.text_tokens)
    ]


def encoder_clip_elements(dims: ModelDims, t: int) -> float:
    """Activation elements the encoder, projector and CTC head keep for one clip of `t` feature frames."""
    e = dims.encoder
    u = encoder_frames(e, t)
    n = int(math.log2(e.subsampling))
    c, ts, fs = e.conv_channels, (t - 1) // 2 + 1, (e.n_mels - 1) // 2 + 1
    sub = t * e.n_mels + 2 * c * ts * fs  # features; first conv and its ReLU
    for _ in range(n - 1):
        ts, fs = (ts - 1) // 2 + 1, (fs - 1) // 2 + 1
        sub += 3 * c * ts * fs  # depthwise, pointwise, ReLU
    sub += u * (c * (e.n_mels // 2**n) + e.hidden)
    # per layer: the linear terms (32E + 4I per frame: two FFNs, norm in/out, linear1 out, activation: 2E + 2I
    # each; attention: norms, q, k, v, q + biases, output, o_proj input: 10E; conv module: norm, pointwise
    # 2E, GLU, depthwise, channel norm in/out, activation, pointwise 2 input: 10E; output norm, residuals:
    # 4E), the relative-position keys, and the score tensors (position scores,
    # their shifted copy, content scores, mask, softmax: about 8 per head and frame pair)
    layer = u * (32 * e.hidden + 4 * e.ffn) + (2 * u - 1) * e.hidden + 8 * e.heads * u * u
    proj = -(-u // dims.stack) * (dims.stack * e.hidden + 2 * dims.proj_hidden + dims.llm.hidden)
    return sub + e.layers * layer + proj


def activation_bytes(
    cfg: ExperimentConfig, dims: ModelDims, w: Workload, layout: Layout, *, checkpointing: bool
) -> dict[str, float]:
    """Activation bytes of micro-batch `w` on one rank: {"encoder", "llm", "total"} (module docstring)."""
    act = 2 if cfg.trainer.precision == "bf16" else 4
    d = dims.llm
    g = d.hidden // d.heads * d.kv_heads
    seqs = llm_seq_lens(dims, w)
    tokens, labelled = sum(seqs) / layout.cp, sum(k + 1 for k in w.text_tokens) / layout.cp
    # one LLM layer on this rank's share of the stream (1/cp), 7H + 3G + 4J elements per token: x, norm
    # output, q, k, v, rotated q and k, attention output, x after attention, its norm; the MLP's gate, up,
    # activation and product. The wide ones split over tp.
    layer = tokens * (4 * d.hidden + (3 * d.hidden + 3 * g + 4 * d.ffn) / layout.tp) * act
    if cfg.model.attention_backend in QUADRATIC_BACKENDS:  # scores and probabilities, fp32
        layer += sum(2 * d.heads / layout.tp * n * n for n in seqs) / layout.cp * 4
    logits = 3 * labelled * d.vocab * 4  # fp32 logits, log-softmax and their gradient
    ctc = sum(3 * encoder_frames(dims.encoder, t) * dims.ctc_vocab * 4 for t in w.clip_frames)
    enc = (sum(encoder_clip_elements(dims, t) for t in w.clip_frames) * act + ctc) / layout.cp
    embeds = tokens * 3 * d.hidden * act  # text embeddings, spliced stream, its packed copy
    if not checkpointing:
        llm = d.layers * layer + logits + embeds
        return {"encoder": enc, "llm": llm, "total": enc + llm}
    saved = d.layers * tokens * d.hidden * act + embeds  # each layer's input is all that is kept
    return {"encoder": enc, "llm": saved + layer + logits, "total": saved + logits + max(layer, enc)}


@dataclass(frozen=True)
class Estimate:
    """Per-rank memory in bytes (``memory``: part -> bytes), the step time, and whether it fits."""

    memory: dict[str, float]
    total: float
    total_checkpointed: float
    capacity: float
    step_s: float
    step_tflop: float
    mfu: float
    peak_tflops: float
    fits: bool
    llm_tokens: int  # tokens of the heaviest micro-batch in the LLM (audio embeddings + prompts), all ranks


def weights_bytes(cfg: ExperimentConfig, p: ParamCounts, layout: Layout) -> dict[str, float]:
    """Parameters, gradients, AdamW state and FSDP's gathered units of one rank (module docstring)."""
    t = Trainable(encoder=cfg.model.encoder.train == "full", llm=cfg.model.llm.train == "full")
    shard = layout.fsdp_shard
    params = (p.encoder + p.projector + p.llm / layout.tp) / shard
    trainable = p.trainable(t)
    trainable_local = (trainable - (p.llm if t.llm else 0) * (1 - 1 / layout.tp)) / shard
    gathered = 0.0
    if shard > 1:
        bytes_gathered = 2 if cfg.trainer.precision in ("bf16", "auto") else 4
        gathered = 2 * p.largest_unit * bytes_gathered
    return {
        "parameters": 4 * params,
        "gradients": 4 * trainable_local,
        "optimizer": 8 * trainable_local,
        "fsdp_gathered": gathered,
    }


def estimate(
    cfg: ExperimentConfig,
    p: ParamCounts,
    dims: ModelDims,
    heavy: Workload,
    mean: Workload,
    layout: Layout,
    *,
    device: str,
    mfu: float | None = None,
) -> Estimate:
    """The estimate of one layout (module docstring); `heavy` sizes the activations, `mean` the time."""
    ac = cfg.parallel.activation_checkpointing
    weights = weights_bytes(cfg, p, layout)
    act_plain = activation_bytes(cfg, dims, heavy, layout, checkpointing=False)
    act_ckpt = activation_bytes(cfg, dims, heavy, layout, checkpointing=True)
    act = act_ckpt if ac else act_plain
    runtime = RUNTIME_GIB["cpu" if device == "cpu" else "cuda"] * GIB
    memory = {
        **weights,
        "activations": act["total"],
        "activations_encoder": act["encoder"],
        "activations_no_ckpt": act_plain["total"],
        "activations_ckpt": act_ckpt["total"],
        "runtime": runtime,
    }
    base = sum(weights.values()) + runtime
    capacity = DEVICE_GIB[device] * GIB if device in DEVICE_GIB else _cpu_capacity(layout.world)
    seqs = llm_seq_lens(dims, mean)
    work = record_work(seqs, [k + 1 for k in mean.text_tokens], range(len(seqs)), 0, 1,
                       clip_frames=mean.clip_frames, computed_tokens=sum(seqs))  # fmt: skip
    trainable = Trainable(encoder=cfg.model.encoder.train == "full", llm=cfg.model.llm.train == "full")
    flops = cfg.trainer.grad_accum * step_flops(dims, [work], trainable) / (layout.cp * layout.tp)
    peak = PEAK_TFLOPS[device] * (cpu_threads(layout.world) if device == "cpu" else 1)
    use_mfu = mfu if mfu is not None else DEFAULT_MFU[device]
    total = base + act["total"]
    return Estimate(
        memory=memory,
        total=total,
        total_checkpointed=base + act_ckpt["total"],
        capacity=capacity,
        step_s=flops / (peak * 1e12 * use_mfu),
        step_tflop=flops / 1e12,
        mfu=use_mfu,
        peak_tflops=peak,
        fits=total <= FIT_MARGIN * capacity,
        llm_tokens=sum(llm_seq_lens(dims, heavy)),
    )


def _cpu_capacity(world: int) -> float:
    """This machine's RAM shared by the ranks running on it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(world, 1)


def cpu_threads(world: int) -> int:
    """Cores one rank computes on: OMP_NUM_THREADS, else this machine's cores shared by the ranks."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else max(1, (os.cpu_count() or 1) // max(world, 1))


def config_workloads(cfg: ExperimentConfig) -> tuple[Workload, Workload]:
    """(heaviest, mean) micro-batch without a manifest: the budget filled with clips of the longest bucket
    (or 20 s), each with data.max_tokens tokens (a worst case; the mean is the same)."""
    budget = _budget_seconds(cfg)
    bounds = cfg.sampler.bucket_boundaries
    clip = min(budget, max(bounds) if bounds else 20.0)
    n = max(1, int(budget // clip))
    w = Workload([feature_frames_of_seconds(clip)] * n, [cfg.data.max_tokens] * n)
    return w, w


def _budget_seconds(cfg: ExperimentConfig) -> float:
    if cfg.sampler.max_batch_tokens is not None or cfg.sampler.max_batch_duration is None:
        raise UsageError(
            "speechlm estimate sizes micro-batches by sampler.max_batch_duration (seconds of audio); this config "
            "sets a token budget (sampler.max_batch_tokens): give sampler.max_batch_duration=SECONDS instead"
        )
    return float(cfg.sampler.max_batch_duration)


def manifest_workloads(
    cfg: ExperimentConfig, manifest: Path, tokens_per_char: float
) -> tuple[Workload, Workload]:
    """(heaviest, mean) micro-batch from a manifest's durations and transcript lengths (module docstring)."""
    import pyarrow.compute as pc  # lazy: pyarrow (CLI start-up)
    import pyarrow.parquet as pq  # lazy: pyarrow (CLI start-up)

    try:
        table = pq.read_table(manifest, columns=["duration", "text"])
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which and what to do
        raise DataError(
            f"--manifest {manifest}: cannot read its duration and text columns ({e}); give a training manifest "
            "(parquet) of `speechlm manifest build`"
        ) from None
    if table.num_rows == 0:
        raise DataError(f"--manifest {manifest} has no rows; give the manifest the run trains on")
    budget = _budget_seconds(cfg)
    dur = table.column("duration").to_numpy().astype(np.float64)
    chars = pc.utf8_length(table.column("text")).to_numpy(zero_copy_only=False).astype(np.float64)
    toks = np.minimum(np.ceil(chars * tokens_per_char), cfg.data.max_tokens)
    order = np.argsort(-dur, kind="stable")
    picked: list[int] = []
    total = 0.0
    for i in order:  # the longest utterances that fit the budget (at least one)
        if dur[i] > budget and picked:
            continue
        if total + dur[i] > budget and picked:
            break
        picked.append(int(i))
        total += dur[i]
    heavy = Workload([feature_frames_of_seconds(dur[i]) for i in picked], [int(toks[i]) for i in picked])
    mean_d, mean_t = float(dur.mean()), float(toks.mean())
    n = max(1, int(budget // mean_d))
    return heavy, Workload([feature_frames_of_seconds(mean_d)] * n, [int(round(mean_t))] * n)


def tokenizer_facts(cfg: ExperimentConfig, texts: list[str]) -> tuple[int, float, str]:
    """(vocabulary size, tokens per transcript character, where they came from): the config's tokenizer
    when it exists, else the LLM's size and `CHARS_PER_TOKEN`."""
    path = cfg.data.tokenizer
    if path and Path(path).exists():
        tok = load_text_tokenizer(path)
        chars = sum(len(t) for t in texts)
        per_char = sum(len(tok.encode(t)) for t in texts) / chars if chars else 1 / CHARS_PER_TOKEN
        return int(tok.vocab_size), per_char, f"tokenizer {path}"
    return (
        32000 if cfg.model.llm.pretrained else 1024,
        1 / CHARS_PER_TOKEN,
        "no tokenizer: 1024 ids, 3 chars/token",
    )


def _sample_texts(manifest: Path | None, n: int = 500) -> list[str]:
    if manifest is None:
        return []
    import pyarrow.parquet as pq  # lazy: pyarrow (CLI start-up)

    try:
        f = pq.ParquetFile(manifest)
        return [str(t) for t in f.read_row_group(0, columns=["text"]).column("text").to_pylist()[:n]]
    except Exception:  # noqa: BLE001 - manifest_workloads reports an unreadable manifest
        return []


def estimate_layout(
    cfg: ExperimentConfig, layout: Layout, device: str, manifest: Path | None, *, mfu: float | None = None
) -> tuple[Estimate, ParamCounts, Workload, Path | None, str]:
    """The estimate of `layout` for `cfg` (its manifest: `manifest`, else data.train_manifest when it
    exists), with the parameter counts, the heaviest micro-batch, the manifest used and the tokenizer note."""
    if cfg.model.llm.pretrained or cfg.model.encoder.pretrained:
        raise UsageError(
            "speechlm estimate counts models built from sizes; this config loads a pretrained "
            f"{'LLM' if cfg.model.llm.pretrained else 'encoder'}: give its sizes as model.llm.* / model.encoder.* "
            "overrides with pretrained=null to estimate it"
        )
    if manifest is None and cfg.data.train_manifest and Path(cfg.data.train_manifest).is_file():
        manifest = Path(cfg.data.train_manifest)
    vocab, per_char, tok_note = tokenizer_facts(cfg, _sample_texts(manifest))
    counts, dims = count_parameters(cfg, vocab)
    heavy, mean = manifest_workloads(cfg, manifest, per_char) if manifest else config_workloads(cfg)
    est = estimate(cfg, counts, dims, heavy, mean, layout, device=device, mfu=mfu)
    return est, counts, heavy, manifest, tok_note


def run_estimate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides or [])
    if args.world_size < 1:
        raise UsageError(f"--world-size {args.world_size}: give the number of processes (>= 1)")
    cp = args.cp_size if args.cp_size is not None else cfg.parallel.cp_size
    tp = args.tp_size if args.tp_size is not None else cfg.parallel.tp_size
    if cp < 1 or tp < 1:
        raise UsageError(f"--cp-size {cp} --tp-size {tp}: each size must be >= 1")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UsageError(
            f"--mfu {args.mfu}: give the model FLOPs utilisation as a fraction in (0, 1], e.g. 0.4"
        )
    dp_rep = cfg.parallel.dp_replicate
    if args.world_size % (cp * tp * dp_rep):
        raise UsageError(
            f"--world-size {args.world_size} is not a multiple of cp x tp x dp_replicate = {cp} x {tp} x {dp_rep}: "
            "choose sizes whose product divides the world size"
        )
    layout = Layout(args.world_size, cp=cp, tp=tp, dp_replicate=dp_rep)
    manifest = Path(args.manifest) if args.manifest else None
    est, counts, heavy, manifest, tok_note = estimate_layout(cfg, layout, args.device, manifest, mfu=args.mfu)
    print(format_estimate(cfg, est, counts, layout, heavy, args.device, manifest, tok_note))
    if not est.fits:
        ckpt = est.total_checkpointed <= FIT_MARGIN * est.capacity
        raise LayoutDoesNotFitError(
            f"the layout does not fit: {est.total / GIB:.2f} GiB per rank estimated against "
            f"{FIT_MARGIN:.0%} of {est.capacity / GIB:.1f} GiB on {args.device}. "
            + (
                "parallel.activation_checkpointing=true fits (" + f"{est.total_checkpointed / GIB:.2f} GiB); "
                if ckpt and not cfg.parallel.activation_checkpointing
                else ""
            )
            + "or shard wider (more ranks: --world-size), split the sequences (--cp-size), the LLM (--tp-size), or "
            "lower sampler.max_batch_duration"
        )
    return 0


def format_estimate(
    cfg: ExperimentConfig,
    est: Estimate,
    counts: ParamCounts,
    layout: Layout,
    heavy: Workload,
    device: str,
    manifest: Path | None,
    tok_note: str,
) -> str:
    m = est.memory
    gib = {k: v / GIB for k, v in m.items()}
    ac = "on" if cfg.parallel.activation_checkpointing else "off"
    lines = [
        f"layout: world {layout.world} = dp {layout.dp} x cp {layout.cp} x tp {layout.tp}; FSDP shards over "
        f"{layout.fsdp_shard}; device {device}",
        f"model: encoder {counts.encoder / 1e6:.2f}M, projector+CTC {counts.projector / 1e6:.2f}M, "
        f"LLM {counts.llm / 1e6:.2f}M parameters",
        f"heaviest micro-batch: {len(heavy.clip_frames)} clips, {heavy.audio_seconds:.1f} s of audio, "
        f"{sum(heavy.text_tokens)} transcript tokens ({'manifest ' + str(manifest) if manifest else 'no manifest: longest bucket, data.max_tokens'}; {tok_note})",
        "memory per rank (GiB):",
        f"  parameters      {gib['parameters']:8.3f}",
        f"  gradients       {gib['gradients']:8.3f}",
        f"  optimizer       {gib['optimizer']:8.3f}   (AdamW, 2 x fp32 per trainable parameter)",
        f"  fsdp gathered   {gib['fsdp_gathered']:8.3f}",
        f"  activations     {gib['activations']:8.3f}   (checkpointing {ac}; off {gib['activations_no_ckpt']:.3f}, "
        f"on {gib['activations_ckpt']:.3f}; encoder {gib['activations_encoder']:.3f}; "
        f"{est.memory['activations'] / max(est.llm_tokens, 1) / 1024:.1f} KiB per LLM token)",
        f"  runtime         {gib['runtime']:8.3f}",
        f"  total           {est.total / GIB:8.3f}   of {est.capacity / GIB:.1f} GiB: "
        + ("fits" if est.fits else "DOES NOT FIT"),
        f"step time: {est.step_s:.3f} s for {est.step_tflop:.3f} TFLOP per rank ({cfg.trainer.grad_accum} "
        f"micro-batches of the mean utterance) at MFU {est.mfu:.2f} of {est.peak_tflops:g} TFLOP/s",
    ]
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:  # Any: argparse's subparsers action (private)
    """Add `estimate` to the `speechlm` subcommands (sets `func`)."""
    p = subparsers.add_parser(
        "estimate",
        help="per-rank memory and step time of a layout before a run; exit 1 when it does not fit",
        description=(
            "Estimate per-rank memory (parameters, gradients, optimizer state by FSDP sharding, activations with "
            "and without activation checkpointing, the encoder's share) and the step time from the FLOP count at "
            "a stated MFU, for the config's batch budget and the manifest's lengths. Exit code 1 when the layout "
            "does not fit the device (docs/training.md, 'Estimating a layout')."
        ),
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="dotted config overrides")
    p.add_argument("--world-size", type=int, required=True, help="processes in the job")
    p.add_argument(
        "--cp-size", type=int, default=None, help="context-parallel size (default: parallel.cp_size)"
    )
    p.add_argument(
        "--tp-size", type=int, default=None, help="tensor-parallel size (default: parallel.tp_size)"
    )
    p.add_argument("--device", choices=sorted(PEAK_TFLOPS), default="h100", help="device of each rank")
    p.add_argument(
        "--manifest", default=None, help="training manifest (default: data.train_manifest if it exists)"
    )
    p.add_argument("--mfu", type=float, default=None, help="MFU the step time assumes (default: per device)")
    p.set_defaults(func=run_estimate)
    return p
