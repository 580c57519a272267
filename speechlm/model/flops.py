"""Analytic FLOP count of the speech LLM, and the peak FLOP/s of a device: what MFU is measured against.

Pure arithmetic on sizes (`ModelDims`) and lengths; no torch. One multiply-add is 2 FLOPs; norms,
activations, softmax, rotary embeddings and the loss are left out (a few percent at most). The count is
of the *model's* work on the real data: padding (BSHD rows, CP rounding) is not counted, so MFU drops
when padding grows (`real_token_share` tells how much of the computed stream was real).

Letters: T feature frames of a clip, F mel bins, C subsampling channels, U encoder frames, E encoder width,
I encoder FFN width, K depthwise kernel, V projected frames = ceil(U / stack), P projector hidden,
L sequence length (audio embeddings + prompt tokens), H LLM width, G KV width (kv_heads * head_dim),
J LLM FFN width, W vocabulary.

Encoder (Parakeet/FastConformer, per clip; ``encoder_flops``):
- subsampling, n = log2(subsampling) stride-2 stages: 2*9*C*t1*f1 (the first conv, 1 -> C channels), then
  per later stage 2*9*C*t*f (depthwise) + 2*C*C*t*f (pointwise), t and f the stage's output sizes;
  then the linear 2*U*(C*F/2^n)*E;
- per conformer layer: FFNs 2 * 4*U*E*I; q, k, v, o 8*U*E^2; relative-position keys 2*(2U-1)*E^2;
  the quadratic attention terms (content QK^T and AV 4*U^2*E, position 2*U*(2U-1)*E); conv module
  pointwise 4*U*E^2 + 2*U*E^2, depthwise 2*U*E*K; with limited context (a window of W = l + 1 + r
  frames) the attention terms are linear in U: keys 2*W*E^2, content 4*U*min(W, U)*E, position 2*U*W*E,
  so a clip sharded over the CP group counts, summed over its slices, what it counts whole;
- the CTC head 2*U*E*W_ctc (when there is one).
Other encoder kinds (whisper, nemo) are counted as 2 * parameters per encoder frame (no quadratic term).

Projector: 2*V*(stack*E*P + P*H) per clip.

LLM, per token: 2 * layers * (2*H*H + 2*H*G + 3*H*J) (attention projections, SwiGLU MLP); the LM head
2*H*W per *labelled* token only (the training forward computes logits where there is a label);
attention's quadratic term per sequence, causal: 2 * layers * L^2 * H (QK^T and AV, 2*L^2*H each,
half of them masked).

Training: forward + backward = 3x forward for a part whose weights train; a frozen part that gradients
still flow through (a frozen or LoRA LLM above a training projector) 2x (activation gradients, no weight
gradients); a frozen encoder 1x (nothing below it needs a gradient; it runs without autograd).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from parallel import frames
from parallel.frames import ENCODER_SUBSAMPLING, HOP_SAMPLES

# Peak dense FLOP/s per device in TFLOP/s, the figure MFU is measured against (`peak_tflops`):
# GPUs: the vendor's dense bf16 tensor-core figure (SXM parts; no 2:4 sparsity). CPU: a nominal,
# measure-free figure per core used by the process: 3.0 GHz x 32 fp32 FLOPs per cycle (two 8-wide FMA
# units, AVX2) = 0.096 TFLOP/s per core. Override with `trainer.peak_tflops`.
PEAK_TFLOPS: dict[str, float] = {"h100": 989.0, "h200": 989.0, "a100": 312.0, "cpu": 0.096}
DEVICE_KINDS = tuple(PEAK_TFLOPS)


@dataclass(frozen=True)
class EncoderDims:
    kind: str = "parakeet"
    hidden: int = 176  # E
    layers: int = 3
    heads: int = 4
    ffn: int = 704  # I
    conv_channels: int = 64  # C
    n_mels: int = 80  # F
    subsampling: int = ENCODER_SUBSAMPLING["parakeet"]
    conv_kernel: int = 9  # K
    params: int = 0  # kinds other than parakeet: 2 * params FLOPs per encoder frame
    window: int = 0  # limited-context attention: left + 1 + right frames per query (0: full context)


@dataclass(frozen=True)
class LLMDims:
    hidden: int = 256  # H
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 704  # J
    vocab: int = 1000  # W


@dataclass(frozen=True)
class ModelDims:
    encoder: EncoderDims
    llm: LLMDims
    stack: int = 2
    proj_hidden: int = 512  # P
    ctc_vocab: int = 0  # 0: no CTC head
    hop: int = HOP_SAMPLES  # audio samples per feature frame


@dataclass(frozen=True)
class Trainable:
    """Which parts' weights train in a step (the forward+backward multiplier of each part)."""

    encoder: bool = True
    llm: bool = True


def _halve(n: int) -> int:
    return (n - 1) // 2 + 1  # a kernel-3, stride-2, padding-1 convolution


def encoder_frames(dims: EncoderDims, feat_frames: int) -> int:
    """U: encoder frames of a clip of `feat_frames` feature frames (`parallel.frames.encoder_frames`); at
    least one for a kind counted by its parameters (its cost per frame)."""
    u = frames.encoder_frames(feat_frames, dims.subsampling)
    return u if dims.kind == "parakeet" else max(1, u)


def subsampling_flops(d: EncoderDims, feat_frames: int) -> float:
    """Forward FLOPs of the stride-2 conv stack and its output linear, one clip."""
    c, t, f = d.conv_channels, _halve(feat_frames), _halve(d.n_mels)
    total = 2.0 * 9 * c * t * f
    n = int(math.log2(d.subsampling))
    for _ in range(n - 1):
        t, f = _halve(t), _halve(f)
        total += 2.0 * 9 * c * t * f + 2.0 * c * c * t * f
    return total + 2.0 * t * (c * (d.n_mels // 2**n)) * d.hidden


def conformer_layer_flops(d: EncoderDims, u: int) -> float:
    """Forward FLOPs of one conformer layer on a clip of `u` encoder frames."""
    e = d.hidden
    ffn = 2 * 4.0 * u * e * d.ffn
    # relative positions: 2U - 1 distances with full context, the window's W with limited context
    distances = d.window if d.window else 2 * u - 1
    keys = min(d.window, u) if d.window else u  # keys per query
    proj = 8.0 * u * e * e + 2.0 * distances * e * e
    quadratic = 4.0 * u * keys * e + 2.0 * u * distances * e
    conv = 6.0 * u * e * e + 2.0 * u * e * d.conv_kernel
    return ffn + proj + quadratic + conv


def encoder_flops(dims: ModelDims, feat_frames: int) -> float:
    """Forward FLOPs of the encoder (and the CTC head) on one clip of `feat_frames` feature frames."""
    d = dims.encoder
    u = encoder_frames(d, feat_frames)
    if d.kind != "parakeet":
        body = 2.0 * d.params * u
    else:
        body = subsampling_flops(d, feat_frames) + d.layers * conformer_layer_flops(d, u)
    return body + 2.0 * u * d.hidden * dims.ctc_vocab


def projector_flops(dims: ModelDims, feat_frames: int) -> float:
    """Forward FLOPs of the frame-stack projector on one clip."""
    v = -(-encoder_frames(dims.encoder, feat_frames) // dims.stack)
    return (
        2.0 * v * (dims.stack * dims.encoder.hidden * dims.proj_hidden + dims.proj_hidden * dims.llm.hidden)
    )


def llm_token_flops(d: LLMDims) -> float:
    """Forward FLOPs per token of the LLM's linear layers (the LM head apart)."""
    g = d.hidden // d.heads * d.kv_heads
    return 2.0 * d.layers * (2 * d.hidden * d.hidden + 2 * d.hidden * g + 3 * d.hidden * d.ffn)


def llm_flops(
    d: LLMDims, seq_lens: Iterable[float], labelled: float, shares: Iterable[float] | None = None
) -> float:
    """Forward FLOPs of the LLM on sequences of `seq_lens` tokens with `labelled` labelled tokens in all;
    `shares`: the fraction of each sequence this rank computes (CP splits a sequence; default 1)."""
    lens = list(seq_lens)
    w = list(shares) if shares is not None else [1.0] * len(lens)
    tokens = sum(n * s for n, s in zip(lens, w))
    quadratic = sum(2.0 * d.layers * n * n * d.hidden * s for n, s in zip(lens, w))
    return tokens * llm_token_flops(d) + quadratic + 2.0 * d.hidden * d.vocab * labelled


@dataclass
class MicroWork:
    """What one micro-batch put through the model on this rank (its share under CP): host integers,
    from what the model's forward placed (`work_of`)."""

    clip_frames: list[int]  # feature frames of each clip this rank encoded
    seq_lens: list[int]  # real length of each sequence in this rank's stream (audio + prompt tokens)
    seq_shares: list[float]  # the fraction of each this rank computes (1/cp for a CP-split sequence)
    labelled: float  # labelled tokens this rank computes the loss of
    computed_tokens: int  # rows of the stream the LLM ran (THD after rounding and CP sharding; BSHD B*S)

    @property
    def real_tokens(self) -> float:
        return sum(n * s for n, s in zip(self.seq_lens, self.seq_shares))


def record_work(
    seq_lens: Sequence[int],
    labelled: Sequence[int],
    local: Sequence[int],
    n_split: int,
    cp: int,
    *,
    clip_frames: list[int],
    computed_tokens: int,
    degrees: Sequence[int] = (),
) -> MicroWork:
    """The `MicroWork` of a micro-batch: of its sequences (`seq_lens`, `labelled` tokens each), this rank
    runs `local` (in stream order), the first `n_split` of them split over the `cp` ranks; ``degrees``
    (hybrid CP degrees): per local sequence, the ranks it is split over instead (1: whole)."""
    if degrees:
        shares = [1.0 / d for d in degrees]
    else:
        shares = [1.0 / cp if k < n_split else 1.0 for k in range(len(local))]
    return MicroWork(
        clip_frames=clip_frames,
        seq_lens=[int(seq_lens[i]) for i in local],
        seq_shares=shares,
        labelled=sum(labelled[i] * s for i, s in zip(local, shares)),
        computed_tokens=computed_tokens,
    )


@dataclass(frozen=True)
class Placement:
    """What the model's forward placed on this rank for one micro-batch (`SpeechLLM.forward` returns it in
    `MicroLosses.placed`): the inputs of `record_work`, from which the training layer counts the FLOPs."""

    seq_lens: list[int]  # real length of every sequence of the micro-batch (audio + prompt tokens)
    labelled: list[int]  # labelled tokens of every sequence
    local: list[int]  # the sequences this rank runs, in stream order
    degrees: list[int]  # per local sequence: the CP ranks it is split over (1: whole here)
    cp: int
    clip_frames: list[int]  # feature frames of each clip (or sharded clip's slice) this rank encoded
    computed_tokens: int  # rows of the stream the LLM ran (THD after rounding and CP sharding; BSHD B*S)


def work_of(placed: Placement) -> MicroWork:
    """The `MicroWork` of a micro-batch from what its forward placed on this rank (`record_work`)."""
    return record_work(
        placed.seq_lens,
        placed.labelled,
        placed.local,
        0,  # the degrees say which are split
        placed.cp,
        clip_frames=list(placed.clip_frames),
        computed_tokens=placed.computed_tokens,
        degrees=placed.degrees,
    )


def micro_flops(dims: ModelDims, work: MicroWork, trainable: Trainable) -> float:
    """Training FLOPs (forward + backward) of one micro-batch on this rank (module docstring)."""
    enc = sum(encoder_flops(dims, t) for t in work.clip_frames)
    proj = sum(projector_flops(dims, t) for t in work.clip_frames)
    llm = llm_flops(dims.llm, work.seq_lens, work.labelled, work.seq_shares)
    return (3.0 if trainable.encoder else 1.0) * enc + 3.0 * proj + (3.0 if trainable.llm else 2.0) * llm


def step_flops(dims: ModelDims, works: Sequence[MicroWork], trainable: Trainable) -> float:
    """Training FLOPs of an optimizer step's micro-batches on this rank."""
    return sum(micro_flops(dims, w, trainable) for w in works)


def peak_tflops(
    device_kind: str | None, *, override: float | None = None, cpu_cores: int = 1
) -> float | None:
    """Peak TFLOP/s of one device (`PEAK_TFLOPS`; a CPU: per core times `cpu_cores`); `override` wins;
    None for a device not in the table (MFU is then not reported: set trainer.peak_tflops)."""
    if override is not None:
        return float(override)
    if device_kind is None or device_kind not in PEAK_TFLOPS:
        return None
    return PEAK_TFLOPS[device_kind] * (cpu_cores if device_kind == "cpu" else 1)


# a per-device peak outside this range (TFLOP/s) is no device's: one CPU core is about 0.1, the largest GPUs
# a few thousand. A value outside it was most likely given in another unit (FLOP/s, GFLOP/s, PFLOP/s)
PLAUSIBLE_PEAK_TFLOPS = (0.01, 10_000.0)
MFU_FLAG = "n/a: above 100%, check trainer.peak_tflops"  # what an MFU above 1 is shown as


def implausible_peak(peak: float | None) -> str | None:
    """Why `peak` (trainer.peak_tflops, TFLOP/s of one device) cannot be a device's peak, or None."""
    lo, hi = PLAUSIBLE_PEAK_TFLOPS
    if peak is None or lo <= peak <= hi:
        return None
    return (
        f"trainer.peak_tflops={peak:g} TFLOP/s per device is outside {lo:g}-{hi:g} (a CPU core is about "
        f"{PEAK_TFLOPS['cpu']:g}, an H100 {PEAK_TFLOPS['h100']:g}): was it given in another unit (FLOP/s, "
        "GFLOP/s)? MFU is measured against it and will be wrong; give the device's dense peak in TFLOP/s, "
        "or leave the key unset for the table's"
    )


def device_kind_of(name: str) -> str | None:
    """'h100', 'h200', 'a100' from a CUDA device name ('NVIDIA H100 80GB HBM3'), None otherwise."""
    low = name.lower()
    return next((k for k in ("h200", "h100", "a100") if k in low), None)


def dims_of_model(model: object) -> ModelDims:
    """The `ModelDims` of a built `SpeechLLM` (read from its modules, so a pretrained encoder or LLM
    brings its own sizes): a Parakeet encoder's transformers config, any other encoder's parameter count;
    the LLM's transformers config (Llama, Qwen2); the projector's and CTC head's shapes."""
    m: Any = model
    enc = m.encoder
    inner = getattr(getattr(enc, "model", None), "config", None)
    if enc.kind == "parakeet" and inner is not None:
        edims = EncoderDims(
            kind="parakeet",
            hidden=int(inner.hidden_size),
            layers=int(inner.num_hidden_layers),
            heads=int(inner.num_attention_heads),
            ffn=int(inner.intermediate_size),
            conv_channels=int(inner.subsampling_conv_channels),
            n_mels=int(inner.num_mel_bins),
            subsampling=int(inner.subsampling_factor),
            conv_kernel=int(inner.conv_kernel_size),
            window=sum(enc.att_context) + 1 if enc.att_context is not None else 0,
        )
    else:
        edims = EncoderDims(
            kind=str(enc.kind),
            hidden=int(enc.output_dim),
            subsampling=int(enc.subsampling),
            params=sum(int(p.numel()) for p in enc.parameters()),
        )
    c = m.llm.config
    ldims = LLMDims(
        hidden=int(c.hidden_size),
        layers=int(c.num_hidden_layers),
        heads=int(c.num_attention_heads),
        kv_heads=int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
        ffn=int(c.intermediate_size),
        vocab=int(m.llm.get_output_embeddings().weight.shape[0]),
    )
    head = m.ctc_head
    return ModelDims(
        encoder=edims,
        llm=ldims,
        stack=int(m.projector.stack),
        proj_hidden=int(m.projector.fc1.out_features),
        ctc_vocab=int(head.out_features) if head is not None else 0,
        hop=int(enc.feature_settings.hop_length),
    )
