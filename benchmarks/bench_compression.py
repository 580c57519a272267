"""CTC-compressed audio prefix (`model.audio_compression: ctc`) against every frame: the LLM's audio rows per
second of speech and the training step time, with the same trained weights (issue 38, item 3).

Usage: ``speechlm bench compression --run RUN [--manifest M] [--batches 4] [--reps 3] [--minutes 10]
[--json FILE]``. ``--run`` is a run directory (or one of its ``checkpoints/step_*``) trained with
``model.projector_stack: 1`` and a CTC head (``model.ctc_weight > 0``), loaded as `speechlm evaluate` loads
it (`speechlm.use.checkpoint.load_checkpoint`). It is required: an untrained CTC head hears only blanks,
so freshly initialised weights would compress every clip to one row and say nothing about a real model.

What it measures, in one process:

1. **Rows per second of speech.** Every clip of the manifest (default: the run's validation manifest) goes
   through features, encoder and CTC head once (no gradient); with compression the LLM gets the clip's
   kept runs (`speechlm.model.compression.ctc_runs`), without it every projected frame: the encoder's
   frames at the run's stack (1) and at the demo's default ``projector_stack: 2``. Beside them, the
   transcript's tokens per second (language tag left out): the floor that one row per heard token
   approaches. Per language and overall (sums of rows over sums of seconds).
2. **Step time.** ``--batches`` micro-batches of the manifest (evaluation batches of the run's
   ``sampler.max_batch_duration`` seconds, spread over the duration-sorted list), each a training step's
   forward + backward of `SpeechLLM.forward` (CE + ``ctc_weight`` x CTC, as the trainer sums them), with
   ``model.audio_compression`` switched between ``ctc`` and ``none`` on the same module (``none`` with
   sequential positions: aligned positions need compression). One warm-up step per setting, then
   ``--reps`` repetitions, the order of the two settings alternating; the median seconds per step, their
   ratio, and the LLM tokens computed per step (`Placement.computed_tokens`: audio rows + prompt + answer).
3. **A long clip.** Held-out clips and their transcripts concatenated to ``--minutes`` (cycling through
   the manifest if it is shorter), one micro-batch of one row, one step with each setting after a warm-up
   on a 30-second clip: rows, LLM tokens, seconds, and the step's peak RSS above the RSS before it (the
   kernel's high-water mark, restarted before the step). The encoder runs with limited attention context
   (``--context``, default 128 frames either side, in both settings): full attention over a 10-minute clip
   needs tens of GB on a CPU, and the run's clips are a few seconds long, so the window changes little of
   what its CTC head hears.

Model in train mode (what training times), fp32, threads as the process has them (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_long_audio import read_status, release_free_heap, reset_high_water_mark

DEMO_STACK = 2  # the demo's (and the config's) default model.projector_stack
SAMPLE_RATE = 16000
MODES = ("ctc", "none")


@contextlib.contextmanager
def audio_setting(model: Any, mode: str) -> Iterator[None]:
    """``model.cfg.audio_compression = mode`` for the block (positions sequential under ``none``)."""
    cfg = model.cfg
    saved = (cfg.audio_compression, cfg.audio_positions)
    cfg.audio_compression = mode
    if mode == "none":
        cfg.audio_positions = "sequential"
    try:
        yield
    finally:
        cfg.audio_compression, cfg.audio_positions = saved


def check_model(model: Any, where: str) -> None:
    """Refuse a model the comparison cannot run on, naming the setting to change."""
    if model.ctc_head is None:
        raise SystemExit(
            f"error: {where}: the model has no CTC head (model.ctc_weight=0); compression needs one"
        )
    if model.projector.stack != 1:
        raise SystemExit(
            f"error: {where}: model.projector_stack={model.projector.stack}; CTC compression needs a run "
            "trained with model.projector_stack=1"
        )


# ------------------------------------------------------------------------------------ rows per second


@dataclass
class Rates:
    """Sums over clips of one language (or all): seconds of speech, rows, frames, transcript tokens."""

    seconds: float = 0.0
    clips: int = 0
    rows_ctc: int = 0
    frames: int = 0
    rows_stack2: int = 0
    tokens: int = 0

    def add(self, seconds: float, rows: int, frames: int, tokens: int) -> None:
        self.seconds += seconds
        self.clips += 1
        self.rows_ctc += rows
        self.frames += frames
        self.rows_stack2 += -(-frames // DEMO_STACK)
        self.tokens += tokens

    def per_second(self) -> dict[str, float]:
        s = max(self.seconds, 1e-9)
        return {
            "ctc": self.rows_ctc / s,
            "frames": self.frames / s,
            "stack2": self.rows_stack2 / s,
            "tokens": self.tokens / s,
        }


def clip_langs(batch: Any) -> list[str]:
    """The language of each clip of a batch (a row's clips share its language)."""
    langs = list(getattr(batch, "langs", None) or [])
    clip_sample = getattr(batch, "clip_sample", None)
    n = int(batch.audio_lens.numel())
    if not langs:
        return ["all"] * n
    if clip_sample is None:
        return langs
    return [langs[int(r)] for r in clip_sample.tolist()]


def clip_tokens(batch: Any, skip: int) -> list[int]:
    """Transcript tokens per clip, the leading ``skip`` (language tag) left out."""
    lens = getattr(batch, "ctc_token_lens", None)
    if lens is None:
        lens = batch.token_lens
    return [max(int(n) - skip, 0) for n in lens.tolist()]


def compressed_rows(model: Any, batch: Any) -> tuple[list[int], list[int]]:
    """(rows the LLM gets with CTC compression, encoder frames) per clip: one encode, no gradient."""
    import torch  # lazy, as every import of torch here: `--help` and the --run check answer at once

    with torch.no_grad(), audio_setting(model, "ctc"):
        enc = model.encode_audio(batch.audio, batch.audio_lens)
    rows = [int(e.shape[0]) for e in enc.embeds_of(range(len(enc.embeds)))]
    return rows, [int(n) for n in enc.enc_lens_B.tolist()]


def measure_rates(model: Any, batches: Sequence[Any]) -> dict[str, Rates]:
    """Rates per language and ``all`` over every clip of `batches`."""
    out: dict[str, Rates] = {"all": Rates()}
    for batch in batches:
        rows, frames = compressed_rows(model, batch)
        tokens = clip_tokens(batch, model.ctc_skip_leading)
        seconds = (batch.audio_lens.double() / SAMPLE_RATE).tolist()
        for lang, s, r, f, t in zip(clip_langs(batch), seconds, rows, frames, tokens, strict=True):
            for key in {"all", lang}:
                out.setdefault(key, Rates()).add(s, r, f, t)
    return out


# ------------------------------------------------------------------------------------ step time


def train_step(model: Any, batch: Any) -> int:
    """Forward + backward of one micro-batch's training loss; the LLM tokens it computed."""
    out = model(batch)
    loss = out.ce_sum / max(out.n_labelled, 1)
    if out.ctc_sum is not None:
        loss = loss + model.cfg.ctc_weight * out.ctc_sum / max(out.n_clips, 1)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return int(out.placed.computed_tokens) if out.placed is not None else 0


@dataclass
class StepTimes:
    """Wall and CPU seconds per step of each repetition, and the LLM tokens computed per step, of one
    setting. CPU seconds of a one-thread process are its compute alone, the measure that holds on a
    machine shared with other jobs (its wall time also counts the waits for a core)."""

    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    llm_tokens: float = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu_seconds)


def measure_steps(model: Any, batches: Sequence[Any], reps: int) -> dict[str, StepTimes]:
    """Median seconds per step of `batches` with each setting, alternating the order per repetition."""
    out = {mode: StepTimes() for mode in MODES}
    model.train()
    for mode in MODES:  # warm-up: allocators, first-call costs
        with audio_setting(model, mode):
            out[mode].llm_tokens = statistics.mean(train_step(model, b) for b in batches)
    for rep in range(reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            with audio_setting(model, mode):
                t0, c0 = time.perf_counter(), time.process_time()
                for b in batches:
                    train_step(model, b)
                out[mode].seconds.append((time.perf_counter() - t0) / len(batches))
                out[mode].cpu_seconds.append((time.process_time() - c0) / len(batches))
    return out


# ------------------------------------------------------------------------------------ the long clip


def long_batch(samples: Sequence[Any], minutes: float, skip: int) -> tuple[Any, int]:
    """Clips (and transcripts) concatenated, in order and cycling, to at least ``minutes``: a one-row
    `Batch`, and the number of clips in it. The first clip's language tag leads the transcript."""
    import torch  # lazy: torch

    from speechlm.data.batch import Batch

    if not samples:
        raise SystemExit("error: the manifest has no readable clip to build the long clip from")
    need, n = minutes * 60 * SAMPLE_RATE, 0
    audio: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    while sum(a.numel() for a in audio) < need:
        s = samples[n % len(samples)]
        ids = s.ctc_tokens[0] if s.ctc_tokens else s.tokens
        audio.append(s.audio)
        tokens.append(ids if n == 0 else ids[skip:])
        n += 1
    wav, ids = torch.cat(audio)[None], torch.cat(tokens)[None].long()
    lens = torch.tensor([wav.shape[1]])
    batch = Batch(
        audio=wav,
        audio_lens=lens,
        tokens=ids,
        token_lens=torch.tensor([ids.shape[1]]),
        langs=[samples[0].lang],
        indices=[0],
        durations=lens.float() / SAMPLE_RATE,
    )
    return batch, n


def measure_long(model: Any, batch: Any, warmup: Any) -> dict[str, dict[str, float]]:
    """One step of the long clip per setting: rows, LLM tokens, seconds, peak RSS above the RSS before."""
    out: dict[str, dict[str, float]] = {}
    model.train()
    rows, frames = compressed_rows(model, batch)
    for mode in MODES:
        with audio_setting(model, mode):
            train_step(model, warmup)
            release_free_heap()
            before = read_status("VmRSS")
            reset_high_water_mark()
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = train_step(model, batch)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            peak = read_status("VmHWM") - before
        out[mode] = {
            "rows": rows[0] if mode == "ctc" else frames[0],
            "llm_tokens": tokens,
            "step_s": seconds,
            "cpu_s": cpu,
            "peak_rss_mib": peak / 2**20,
        }
    return out


# ------------------------------------------------------------------------------------ the report


def format_table(
    rates: dict[str, Rates],
    steps: dict[str, StepTimes],
    long: dict[str, dict[str, float]] | None,
    **info: Any,
) -> list[str]:
    lines = [
        "audio rows per second of speech the LLM receives "
        "(ctc: measured; frames: every encoder frame, the run's stack 1; stack 2: the demo default)",
        f"{'lang':>5} {'clips':>6} {'speech s':>9} {'ctc':>7} {'frames':>7} {'stack 2':>8} {'tokens':>7}",
    ]
    for lang in sorted(rates, key=lambda k: (k == "all", k)):
        r = rates[lang]
        p = r.per_second()
        lines.append(
            f"{lang:>5} {r.clips:>6} {r.seconds:>9.1f} {p['ctc']:>7.2f} {p['frames']:>7.2f} "
            f"{p['stack2']:>8.2f} {p['tokens']:>7.2f}"
        )
    lines += [
        "",
        f"training step (forward + backward), {info.get('batches', '?')} micro-batches, "
        f"{info.get('reps', '?')} repetitions, median per step (cpu: this process's CPU seconds)",
        f"{'setting':>8} {'wall s':>8} {'cpu s':>8} {'LLM tokens':>11}  wall s of each repetition",
    ]
    for mode in MODES:
        s = steps[mode]
        reps = " ".join(f"{x:.3f}" for x in s.seconds)
        lines.append(f"{mode:>8} {s.median:>8.3f} {s.cpu_median:>8.3f} {s.llm_tokens:>11.0f}  {reps}")
    lines.append(
        f"ctc / none: wall {steps['ctc'].median / steps['none'].median:.2f}x, "
        f"cpu {steps['ctc'].cpu_median / steps['none'].cpu_median:.2f}x, "
        f"LLM tokens {steps['ctc'].llm_tokens / max(steps['none'].llm_tokens, 1):.2f}x"
    )
    if long is not None:
        lines += [
            "",
            f"one {info.get('long_seconds', 0) / 60:.1f}-minute clip ({info.get('long_clips', '?')} held-out "
            f"clips concatenated), one step, encoder context {info.get('context')}",
            f"{'setting':>8} {'audio rows':>11} {'LLM tokens':>11} {'wall s':>8} {'cpu s':>8} {'peak RSS MiB':>13}",
        ]
        for mode in MODES:
            x = long[mode]
            lines.append(
                f"{mode:>8} {x['rows']:>11.0f} {x['llm_tokens']:>11.0f} {x['step_s']:>8.2f} {x['cpu_s']:>8.2f} "
                f"{x['peak_rss_mib']:>13.0f}"
            )
        ctc, none = long["ctc"], long["none"]
        lines.append(
            f"ctc / none: wall {ctc['step_s'] / none['step_s']:.2f}x, cpu {ctc['cpu_s'] / none['cpu_s']:.2f}x, "
            f"LLM tokens {ctc['llm_tokens'] / max(none['llm_tokens'], 1):.2f}x, "
            f"peak RSS {ctc['peak_rss_mib'] / max(none['peak_rss_mib'], 1):.2f}x"
        )
    return lines


def to_json(
    rates: dict[str, Rates],
    steps: dict[str, StepTimes],
    long: dict[str, dict[str, float]] | None,
    **info: Any,
) -> dict[str, Any]:
    return {
        **info,
        "rows_per_second": {
            k: {**r.per_second(), "seconds": r.seconds, "clips": r.clips} for k, r in rates.items()
        },
        "step": {
            m: {
                "median_s": s.median,
                "cpu_median_s": s.cpu_median,
                "seconds": s.seconds,
                "cpu_seconds": s.cpu_seconds,
                "llm_tokens": s.llm_tokens,
            }
            for m, s in steps.items()
        },
        "step_ratio": steps["ctc"].median / steps["none"].median,
        "step_ratio_cpu": steps["ctc"].cpu_median / steps["none"].cpu_median,
        "long_clip": long,
    }


# ------------------------------------------------------------------------------------ main


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """``n`` items evenly spaced over `items` (all of them when there are fewer)."""
    if n >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / max(n - 1, 1))] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench compression", description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=None, help="trained run dir or checkpoint (required: see the docstring)")
    ap.add_argument("--manifest", default=None, help="clips to measure (default: the run's val manifest)")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches timed per setting")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per setting")
    ap.add_argument("--minutes", type=float, default=10.0, help="the long clip's length (0: skip it)")
    ap.add_argument(
        "--context",
        type=int,
        nargs=2,
        default=[128, 128],
        metavar=("LEFT", "RIGHT"),
        help="the encoder's attention context on the long clip, in frames",
    )
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    if not args.run:
        ap.error(
            "--run RUN is required: a run trained with model.projector_stack=1 and a CTC head (an untrained "
            "CTC head hears only blanks, so random weights would compress every clip to one row)"
        )

    import torch  # lazy: torch and the package (after argument checks)

    from speechlm.config import eval_batch_duration
    from speechlm.data.dataset import build_dataloader
    from speechlm.data.run_inputs import run_dataset
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.use.checkpoint import load_checkpoint
    from speechlm.use.evaluator import build_eval_batches

    loaded = load_checkpoint(args.run, log=lambda m: print(m, flush=True))
    cfg, model = loaded.cfg, loaded.model
    check_model(model, str(loaded.ckpt))
    manifest = args.manifest or cfg.data.val_manifest
    if not manifest:
        raise SystemExit(f"error: {loaded.ckpt}: the run has no data.val_manifest; give --manifest")
    table = open_index(manifest)
    ds = run_dataset(cfg, table, loaded.tokenizer)
    # the training micro-batch's seconds (a token-budget sampler has none: the validation batches' then)
    seconds = cfg.sampler.max_batch_duration or eval_batch_duration(cfg)
    plan = build_eval_batches(table, max_batch_duration=seconds)
    print(
        f"{loaded.ckpt} (step {loaded.step}) on {manifest}: {len(table)} rows, {len(plan)} batches",
        flush=True,
    )
    batches = [b for b in build_dataloader(ds, plan, num_workers=0) if len(b)]
    model.eval()
    rates = measure_rates(model, batches)
    print(f"rows per second measured ({time.strftime('%H:%M:%S')})", flush=True)
    timed = spread(batches, args.batches)
    steps = measure_steps(model, timed, args.reps)
    print(f"step times measured ({time.strftime('%H:%M:%S')})", flush=True)
    info: dict[str, Any] = {
        "run": str(loaded.ckpt),
        "manifest": str(manifest),
        "batches": len(timed),
        "reps": args.reps,
        "threads": torch.get_num_threads(),
    }
    long = None
    if args.minutes > 0:
        samples = [s for s in (ds[i] for i in range(len(ds))) if hasattr(s, "audio")]
        batch, n_clips = long_batch(samples, args.minutes, model.ctc_skip_leading)
        warmup, _ = long_batch(samples, 0.5, model.ctc_skip_leading)
        saved_context = model.encoder.att_context
        model.encoder.att_context = tuple(args.context)
        try:
            long = measure_long(model, batch, warmup)
        finally:
            model.encoder.att_context = saved_context
        info |= {
            "long_seconds": float(batch.durations[0]),
            "long_clips": n_clips,
            "context": list(args.context),
        }
    for line in format_table(rates, steps, long, **info):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(rates, steps, long, **info), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
