"""One long clip over a CP group on CPU/gloo: each rank's activation memory and step time, cp = 1, 2, 4
(issue 25, item 5). Usage: `speechlm bench long-audio [--minutes M ...] [--cp N ...] [--scope encoder|step]
[--check]`; the defaults are 2 and 10 minutes at cp 1, 2, 4 (`--minutes 2 10 30` adds the 30-minute clip).

Every (minutes, cp) runs in cp fresh processes (gloo, one thread each); every rank holds the clip's audio, as
a CP group's peers all receive the same micro-batch, and measures one forward + backward after a warm-up on
a shorter clip (which also allocates the parameter gradients, so they are not counted):

    glibc serves blocks >= 64 KiB by mmap  (mallopt: a freed tensor leaves RSS at once, runs repeat)
    RSS before the step                    (gc, then malloc_trim(0): freed heap goes back to the system)
    echo 5 > /proc/self/clear_refs         the kernel's RSS high-water mark restarts at the current RSS
    ... the step ...
    VmHWM from /proc/self/status           activation memory = VmHWM - RSS before the step

The table's memory is the maximum over the ranks (the rank that bounds the group), its ratio is to cp 1's,
and the target is issue 25's: <= 0.6x at cp 2, <= 0.35x at cp 4. `--check` exits 1 when one is missed.
Step time is the slowest rank's wall time of that one step (it includes the page faults of memory that the
mmap setting hands back and takes again), CPU seconds are summed over the ranks.

Scopes:
- ``encoder`` (default): the log-mel features this rank's slice reads (no gradient;
  `LogMelFeatures.frames_of_clip`, the per-clip normalisation's sums all-reduced over the gloo group, as
  training computes them), then the encoder's `forward_slice` on this rank's `shard_bounds` slice of the
  encoder frames (halo exchange over the gloo group) and the projector, then the backward of the
  projector output's sum. The features are a phase of their own (the high-water mark
  is read after them and restarted): the table shows the whole step (act), the features' phase (feat) and
  the encoder + projector alone (enc), each with its ratio to cp 1.
- ``step``: a whole `SpeechLLM` micro-batch, ``model(batch)`` forward + backward of the training loss,
  with the model parallelized as training does it (`build_distributed_context`: FSDP2 over the CP ranks and
  a `DynamicCPLayout` over the gloo group at cp > 1), a tiny LLM and a transcript of `TOKENS_PER_MINUTE`.
  Whatever `SpeechLLM.forward` does with a long clip under CP is what this measures (with limited context
  it shards the clip's features and encoder over the group).

Sizes (random weights): `ENCODER`, `LLM`, `PROJECTOR` below. On 2 cores, cp = 4 runs 4 processes on 2
cores: step times show the work per rank plus oversubscription, not speed-ups.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a Parakeet (FastConformer) encoder of 4 layers, width 192, 8x subsampling, limited context [64, 64]
ENCODER = dict(
    kind="parakeet",
    hidden_size=192,
    num_layers=4,
    num_heads=4,
    intermediate_size=768,
    subsampling_conv_channels=64,
    subsampling_factor=8,
    num_mel_bins=80,
    conv_norm="layer_norm",
    att_context_size=[64, 64],
)
LLM = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256)
PROJECTOR = dict(projector_stack=2, projector_hidden=256)
VOCAB = 256
TOKENS_PER_MINUTE = 10
SAMPLE_RATE = 16000
WARMUP_SECONDS = 32.0  # the warm-up clip, at most (shorter clips warm up on themselves)
TARGETS = {2: 0.6, 4: 0.35}  # issue 25: activation memory per rank at cp, as a fraction of cp 1's
MIB = 2**20

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


# ------------------------------------------------------------------------------------ memory probes


def status_bytes(status_text: str, key: str) -> int:
    """The value of `key` (``VmHWM``, ``VmRSS``) of a /proc/PID/status text, in bytes (the file says kB)."""
    for line in status_text.splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            value, _, unit = rest.strip().partition(" ")
            if unit != "kB" or not value.isdigit():
                raise ValueError(f"{STATUS}: cannot read {key} from {line!r} (expected '<integer> kB')")
            return int(value) * 1024
    raise ValueError(f"{STATUS}: no {key} line; this benchmark reads Linux's /proc memory counters")


def read_status(key: str) -> int:
    return status_bytes(STATUS.read_text(), key)


def reset_high_water_mark() -> None:
    """Restart this process's VmHWM at its current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError as e:
        raise OSError(
            f"{CLEAR_REFS}: cannot reset the RSS high-water mark ({e.strerror or e}); the benchmark needs Linux "
            "with a writable /proc (not a sandbox that hides it)"
        ) from None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 64 * 1024


def map_large_blocks() -> None:
    """Make glibc serve every block of `MMAP_THRESHOLD` bytes or more with its own mmap, returned on free:
    RSS then follows the live tensors instead of glibc's heap, whose reuse of freed blocks varies from run
    to run (the dynamic mmap threshold), and the high-water marks repeat."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the figures vary more
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD)


def release_free_heap() -> None:
    """Collect garbage and hand glibc's free heap back to the system, so RSS before a step holds live data only."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may keep freed heap, the figures run lower
        pass


@dataclass
class Phase:
    """One measured phase: its peak RSS above the RSS before it, wall and CPU seconds."""

    peak_bytes: int
    wall_s: float
    cpu_s: float


def measure_phase(fn: Callable[[], Any]) -> tuple[Any, Phase, int]:
    """Run `fn` with the high-water mark restarted first: (its result, the phase, RSS before it)."""
    before = read_status("VmRSS")
    reset_high_water_mark()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return out, Phase(read_status("VmHWM") - before, wall, cpu), before


# ------------------------------------------------------------------------------------ inputs and sizes


def make_audio(minutes: float, seed: int = 0) -> Any:
    import torch

    n = int(round(minutes * 60 * SAMPLE_RATE))
    return 0.1 * torch.randn(1, n, generator=torch.Generator().manual_seed(seed)), torch.tensor([n])


def transcript_tokens(minutes: float) -> int:
    return max(4, round(TOKENS_PER_MINUTE * minutes))


def encoder_frames_of(minutes: float) -> int:
    """Encoder frames of a clip of `minutes` (10 ms feature hop, `ENCODER`'s subsampling)."""
    from parallel.frames import planned_encoder_frames

    return planned_encoder_frames(minutes * 60, int(ENCODER["subsampling_factor"]))  # type: ignore[call-overload]


def warmup_minutes(minutes: float, cp: int) -> float:
    """The warm-up clip's length: `WARMUP_SECONDS` (more when cp slices of it would not hold the attention
    window), or the measured clip when that is shorter."""
    window, factor = max(ENCODER["att_context_size"]), int(ENCODER["subsampling_factor"])  # type: ignore[type-var, call-overload]
    seconds = max(WARMUP_SECONDS, (window * cp + 1) * factor / 100)
    return min(minutes, seconds / 60)


def check_sizes(minutes: Sequence[float], cps: Sequence[int]) -> str | None:
    """Why a size cannot run (None when all can): every rank's slice must hold the attention window."""
    window = max(ENCODER["att_context_size"])  # type: ignore[type-var]
    for m in minutes:
        if m <= 0:
            return f"--minutes {m:g}: a clip needs a positive length"
        for cp in cps:
            if cp < 1:
                return f"--cp {cp}: the CP size must be >= 1"
            per_rank = encoder_frames_of(m) // cp
            if cp > 1 and per_rank < window:
                return (
                    f"--minutes {m:g} at --cp {cp}: {per_rank} encoder frames per rank, fewer than the attention "
                    f"window's {window} each rank sends its neighbours; use a longer clip or a smaller --cp"
                )
    return None


# ------------------------------------------------------------------------------------ one rank


def _rank_setup() -> None:
    import warnings

    import torch

    # torch's DeviceMesh warns about slicing flattened dims (`ParallelDims.build_mesh`) on every rank
    warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    map_large_blocks()


def preload() -> None:
    """Import what the ranks use once, here: forked ranks then start without importing it each."""
    import speechlm.model.sharded_encoder
    import speechlm.model.speech_llm
    import speechlm.train.distributed  # noqa: F401


def encoder_rank(rank: int, world: int, minutes: float) -> dict[str, Any]:
    """Scope ``encoder`` on one rank: features (a phase of their own), then the sharded encoder + projector."""
    import torch

    from parallel.clip_placement import shard_bounds
    from parallel.halo import HaloExchange
    from parallel.sharded_clip import reduce_sum
    from speechlm.config import EncoderConfig
    from speechlm.model.encoders import build_encoder
    from speechlm.model.features import LogMelFeatures
    from speechlm.model.projector import FrameStackProjector
    from speechlm.model.sharded_encoder import feature_span

    _rank_setup()
    enc = build_encoder(EncoderConfig(**ENCODER), dropout=0.0).train()  # type: ignore[arg-type]
    stack = int(PROJECTOR["projector_stack"])
    proj = FrameStackProjector(
        enc.output_dim, int(LLM["hidden_size"]), stack, int(PROJECTOR["projector_hidden"])
    )
    features = LogMelFeatures(enc.feature_settings)
    exchange = HaloExchange(torch.distributed.group.WORLD)

    def featurize(audio: Any, lens: Any) -> Any:
        n = int(lens[0])
        total = n // enc.feature_settings.hop_length
        length = int(enc.output_lengths(torch.tensor([total]))[0])
        lo, hi = shard_bounds(length, world, align=stack)[rank]
        span = feature_span(lo, hi, enc.n_convs, total)
        f = 2**enc.n_convs
        own = (min(f * lo, total), min(f * hi, total))
        with torch.no_grad():
            feats = features.frames_of_clip(audio[0], n, span, own, lambda x: reduce_sum(x, None))
        return feats, (lo, hi, span[0], total)

    def encode(feats: Any, where: tuple[int, int, int, int]) -> tuple[int, int]:
        lo, hi, offset, total = where
        x_UE = enc.forward_slice(feats, (lo, hi), exchange, feat_offset=offset, feat_total=total)
        emb, _ = proj(x_UE, torch.tensor([hi - lo]))
        emb.sum().backward()
        return lo, hi

    # warm-up (allocates the parameter gradients, so that the measured step does not count them)
    encode(*featurize(*make_audio(warmup_minutes(minutes, world), seed=1)))
    audio, lens = make_audio(minutes)
    release_free_heap()
    feats_lens, feat_phase, rss0 = measure_phase(lambda: featurize(audio, lens))
    (lo, hi), enc_phase, rss1 = measure_phase(lambda: encode(*feats_lens))
    step_peak = max(feat_phase.peak_bytes, rss1 - rss0 + enc_phase.peak_bytes)
    return {
        "rank": rank,
        "frames": (lo, hi),
        "step_bytes": step_peak,
        "feature_bytes": feat_phase.peak_bytes,
        "encoder_bytes": enc_phase.peak_bytes,
        "wall_s": feat_phase.wall_s + enc_phase.wall_s,
        "cpu_s": feat_phase.cpu_s + enc_phase.cpu_s,
    }


def make_batch(minutes: float, seed: int = 0) -> Any:
    import torch

    from speechlm.data.dataset import Batch

    audio, lens = make_audio(minutes, seed)
    n_tok = transcript_tokens(minutes)
    tokens = torch.randint(5, VOCAB, (1, n_tok), generator=torch.Generator().manual_seed(seed + 1))
    return Batch(
        audio=audio,
        audio_lens=lens,
        tokens=tokens,
        token_lens=torch.tensor([n_tok]),
        langs=["xx"],
        indices=[0],
        durations=lens.float() / SAMPLE_RATE,
        dropped={},
    )


def step_overrides() -> list[str]:
    """The config of scope ``step``: `ENCODER`, `LLM`, `PROJECTOR`, fp32, no dropout, every sequence split."""
    out = [f"model.encoder.{k}={v}" for k, v in ENCODER.items()]
    out += [f"model.llm.{k}={v}" for k, v in LLM.items()]
    out += [f"model.{k}={v}" for k, v in PROJECTOR.items()]
    return [
        *(o.replace(" ", "") for o in out),
        "trainer.precision=32",
        "model.dropout=0",
        "parallel.cp_split_threshold=0",
    ]


def step_rank(rank: int, world: int, minutes: float) -> dict[str, Any]:
    """Scope ``step`` on one rank: ``model(batch)`` forward + backward of the training loss."""
    import torch

    from parallel.mesh import ParallelDims
    from speechlm.config import load_config
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.train.distributed import build_distributed_context

    _rank_setup()
    cfg = load_config(None, [f"parallel.cp_size={world}", *step_overrides()])
    model = SpeechLLM(cfg.model, vocab_size=VOCAB, pad_id=0, bos_id=2, eos_id=3, audio_id=4)
    if world > 1:
        dims = ParallelDims(world, 1, -1, world, 1)
        dims.build_mesh("cpu")
        build_distributed_context(model, dims, cfg, torch.device("cpu"))
    w_ctc = cfg.model.ctc_weight

    def step(batch: Any) -> None:
        out = model(batch)
        loss = out.ce_sum / max(out.n_labelled, 1)
        if w_ctc > 0 and out.ctc_sum is not None:
            loss = loss + w_ctc * out.ctc_sum / max(out.n_clips, 1)
        loss.backward()

    step(make_batch(warmup_minutes(minutes, world), seed=1))
    batch = make_batch(minutes)
    release_free_heap()
    _, phase, _ = measure_phase(lambda: step(batch))
    return {
        "rank": rank,
        "step_bytes": phase.peak_bytes,
        "wall_s": phase.wall_s,
        "cpu_s": phase.cpu_s,
    }


RANK_BODIES: dict[str, Callable[[int, int, float], dict[str, Any]]] = {
    "encoder": encoder_rank,
    "step": step_rank,
}


# ------------------------------------------------------------------------------------ the table


@dataclass
class Row:
    minutes: float
    cp: int
    ranks: list[dict[str, Any]]  # one per rank, in rank order

    def peak(self, key: str = "step_bytes") -> int:
        return max(int(r[key]) for r in self.ranks)

    @property
    def wall_s(self) -> float:
        return max(float(r["wall_s"]) for r in self.ranks)

    @property
    def cpu_s(self) -> float:
        return sum(float(r["cpu_s"]) for r in self.ranks)


def run_size(scope: str, minutes: float, cp: int, timeout_s: float) -> Row:
    from parallel.testing import run_distributed

    ranks = run_distributed(RANK_BODIES[scope], cp, "gloo", minutes, timeout_s=timeout_s)
    return Row(minutes, cp, list(ranks))


def ratio_to_cp1(rows: Sequence[Row], row: Row, key: str = "step_bytes") -> float | None:
    """`row`'s peak over the cp = 1 row of the same clip length (None when that was not run)."""
    base = [r for r in rows if r.minutes == row.minutes and r.cp == 1]
    if not base or base[0].peak(key) <= 0:
        return None
    return row.peak(key) / base[0].peak(key)


def verdict(cp: int, ratio: float | None) -> str:
    """'yes' / 'NO' against issue 25's target at this cp, '-' where there is none (cp 1, no cp 1 row)."""
    target = TARGETS.get(cp)
    if target is None or ratio is None:
        return "-"
    return "yes" if ratio <= target else "NO"


def format_table(scope: str, rows: Sequence[Row]) -> list[str]:
    def mib(n: int) -> str:
        return f"{n / MIB:.0f}"

    def ratio(row: Row, key: str) -> str:
        r = ratio_to_cp1(rows, row, key)
        return "-" if r is None else f"{r:.2f}"

    extra = scope == "encoder"
    head = f"{'minutes':>7} {'cp':>3} {'act MiB':>8} {'x cp1':>6} {'target':>7}"
    if extra:
        head += f" {'feat MiB':>9} {'enc MiB':>8} {'x cp1':>6} {'target':>7}"
    head += f" {'step s':>7} {'cpu s':>7}  per-rank act MiB"
    lines = [head]
    for row in rows:
        r = ratio_to_cp1(rows, row)
        line = f"{row.minutes:>7g} {row.cp:>3} {mib(row.peak()):>8} {ratio(row, 'step_bytes'):>6} {verdict(row.cp, r):>7}"
        if extra:
            r_enc = ratio_to_cp1(rows, row, "encoder_bytes")
            line += (
                f" {mib(row.peak('feature_bytes')):>9} {mib(row.peak('encoder_bytes')):>8}"
                f" {ratio(row, 'encoder_bytes'):>6} {verdict(row.cp, r_enc):>7}"
            )
        per_rank = " ".join(mib(int(x["step_bytes"])) for x in row.ranks)
        lines.append(f"{line} {row.wall_s:>7.1f} {row.cpu_s:>7.1f}  {per_rank}")
    return lines


def failed_targets(rows: Sequence[Row]) -> list[str]:
    """The rows whose step activation memory misses its target, described."""
    out = []
    for row in rows:
        r = ratio_to_cp1(rows, row)
        if verdict(row.cp, r) == "NO":
            out.append(f"{row.minutes:g} min at cp {row.cp}: {r:.2f}x of cp 1 (target <= {TARGETS[row.cp]}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench long-audio", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--minutes",
        type=float,
        nargs="+",
        default=[2.0, 10.0],
        help="clip lengths (default 2 10, about 2 minutes on 2 cores; 30 adds about 5)",
    )
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP sizes (one process per rank)")
    ap.add_argument("--scope", choices=sorted(RANK_BODIES), default="encoder", help="what one step runs")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per (minutes, cp) before giving up"
    )
    args = ap.parse_args(argv)
    problem = check_sizes(args.minutes, args.cp)
    if problem:
        print(f"speechlm bench long-audio: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    preload()
    cps = sorted(set(args.cp))
    rows = []
    for minutes in args.minutes:
        for cp in cps:
            row = run_size(args.scope, minutes, cp, args.timeout)
            rows.append(row)
            print(
                f"{minutes:g} min, cp {cp}: {row.peak() / MIB:.0f} MiB max over ranks, {row.wall_s:.1f} s",
                flush=True,
            )
    enc = ENCODER
    print(
        f"\nscope {args.scope}: one clip per step, Parakeet encoder {enc['num_layers']} layers x {enc['hidden_size']}, "
        f"{enc['subsampling_factor']}x subsampling, context {enc['att_context_size']}"
        + (f", LLM {LLM['num_layers']} layers x {LLM['hidden_size']}" if args.scope == "step" else "")
        + "; act = VmHWM - RSS before the step, max over ranks; cpu s summed over ranks"
    )
    print("\n".join(format_table(args.scope, rows)))
    missed = failed_targets(rows)
    if missed:
        print("targets missed: " + "; ".join(missed))
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
