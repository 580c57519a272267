"""What `train` shows while it runs and when it ends.

- `StepProgress` (a callback): optimizer steps of `trainer.max_steps` (one `training_step` is one
  optimizer step, whatever `grad_accum` is), the ETA to the last step, loss, learning rate and
  throughput. On a terminal (rank 0, stderr a terminal: `speechlm.progress`) it is a display line that
  redraws; when stdout is not a terminal (a log), or there is no display, stdout gets one plain line
  per tenth of the run instead (logs stay line-based, no carriage returns).
- `run_summary`: the end-of-run summary, read from `RUN_DIR/metrics.jsonl` (steps, audio hours,
  throughput and MFU when the steps logged them, best validation) and the files the run wrote.
- `reliance_warning`: "the LLM is not reading the audio", under a validation's `[val step N]` line and in
  the summary (its last validation), when the audio reliance stays below `RELIANCE_FLOOR` after the
  encoder's CTC has converged (`CTC_CONVERGED`).

Throughput and MFU are displayed from the keys the training step logs (`tokens_per_s`, `audio_s_per_s`,
`mfu`, ...; `utt_per_s` where a run logs no tokens/s); nothing here computes them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import lightning as L

from speechlm.model.flops import MFU_FLAG
from speechlm.progress import Progress, format_duration, is_terminal, progress_enabled
from speechlm.train.checkpoint import list_checkpoints

LINES_PER_RUN = 10  # plain lines a run without a terminal prints (plus the last step's)


def _num(value: Any) -> float | None:
    """A finite float, or None (missing, None, NaN, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# (metrics key, label, format, factor): the step's trailing fields; utt_per_s only without tokens_per_s
STEP_FIELDS = (
    ("loss", "loss", "{:.4f}", 1),
    ("lr", "lr", "{:.3g}", 1),  # 3 significant digits: a warmup rate of 4e-05 is not "0.000"
    ("tokens_per_s", "tok/s", "{:,.0f}", 1),
    ("utt_per_s", "utt/s", "{:.1f}", 1),
    ("audio_s_per_s", "audio s/s", "{:.1f}", 1),
    ("mfu", "MFU", "{:.1f}%", 100),
)


def step_fields(m: dict[str, Any]) -> dict[str, str]:
    """The trailing `label value` fields of a step (`STEP_FIELDS`), each only when the step logged it; an
    MFU above 100% is shown as `MFU_FLAG` (its peak, trainer.peak_tflops, cannot be the device's)."""
    out: dict[str, str] = {}
    for key, label, fmt, factor in STEP_FIELDS:
        value = _num(m.get(key))
        if value is not None and not (key == "utt_per_s" and "tok/s" in out):
            out[label] = MFU_FLAG if key == "mfu" and value > 1 else fmt.format(factor * value)
    return out


def format_step_line(step: int, max_steps: int, m: dict[str, Any], eta: float | None) -> str:
    """The plain line of a step: ``step 20/200 (10%) · ETA 1:02 · loss 3.2100 · lr 0.000123 · ...``."""
    parts = [f"step {step}/{max_steps} ({100 * step / max(max_steps, 1):.0f}%)"]
    if eta is not None:
        parts.append(f"ETA {format_duration(eta)}")
    parts += [f"{k} {v}" for k, v in step_fields(m).items()]
    return " · ".join(parts)


class StepProgress(L.Callback):
    """The display (terminal) or the plain lines (otherwise) of the optimizer steps, on rank 0 only."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = enabled  # None: a terminal decides (speechlm.progress.progress_enabled)
        self.bar: Progress | None = None
        self.every = 1
        self.lines = True

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        total = int(trainer.max_steps)
        active = progress_enabled(0) if self.enabled is None else self.enabled
        self.bar = Progress(total, "train", "steps", initial=trainer.global_step, enabled=active)
        self.every = max(1, total // LINES_PER_RUN)
        self.lines = not self.bar.active or not is_terminal(sys.stdout)
        self.bar.draw()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = getattr(pl_module, "last_metrics", None)
        if self.bar is None or not m:
            return
        step = int(m["step"])
        self.bar.update(step - self.bar.done, **step_fields(m))
        if self.lines and (step % self.every == 0 or step == self.bar.total):
            print(format_step_line(step, int(self.bar.total or step), m, self.bar.eta()), flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# ------------------------------------------------------------------------------------------ summary
def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of metrics.jsonl and the number of lines that are not one (a kill while writing
    leaves a last line cut short; the summary skips it and says so). No file: no records."""
    records: list[dict[str, Any]] = []
    bad = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [v for v in (_num(r.get(key)) for r in records) if v is not None]
    return sum(values) / len(values) if values else None


def throughput_line(train: list[dict[str, Any]]) -> str | None:
    """Mean over the logged steps of each throughput key present (None: no step logged one)."""
    parts = []
    for key, label, fmt in (
        ("tokens_per_s", "tokens/s", "{:,.0f}"),
        ("audio_s_per_s", "audio s/s", "{:,.1f}"),
        ("utt_per_s", "utterances/s", "{:,.1f}"),
    ):
        mean = _mean(train, key)
        if mean is not None:
            parts.append(f"{fmt.format(mean)} {label}")
    return ", ".join(parts) if parts else None


def best_validation(val: list[dict[str, Any]], metric: str, lower_is_better: bool) -> str | None:
    scored = [(v, r) for r in val if (v := _num(r.get(metric))) is not None]
    if not scored:
        return None
    value, rec = (min if lower_is_better else max)(scored, key=lambda vr: vr[0])
    return f"{metric} {value:.4g} at step {rec.get('step')}"


# The audio-reliance warning (docs/metrics.md, "Audio reliance"): a validation whose CTC head has converged
# (its CTC per target token below CTC_CONVERGED) while the decoder's loss moves less than RELIANCE_FLOOR
# nats per token when each sample gets another sample's audio: the decoder writes from its text prior.
RELIANCE_FLOOR = 0.5  # nats per labelled token; the demo's decoder at ~99% LLM-alone WER moved 0.2-0.4
CTC_CONVERGED = 0.5  # nats per CTC target token; the demo's plateau ~1.9, its end ~0.2 (docs/metrics.md)


def reliance_warning(record: dict[str, Any]) -> str | None:
    """The warning of a validation record (`metrics.jsonl`, kind val) whose decoder does not read the audio
    although the encoder's CTC has converged; None otherwise (no reliance, no CTC head, or either bound
    not met)."""
    reliance, ctc = _num(record.get("audio_reliance")), _num(record.get("ctc_per_token"))
    if reliance is None or ctc is None or ctc >= CTC_CONVERGED or reliance >= RELIANCE_FLOOR:
        return None
    llm_wer = _num(record.get("llm_wer"))
    alone = f", LLM-alone WER {100 * llm_wer:.1f}%" if llm_wer is not None else ""
    return (
        f"warning: the LLM is not reading the audio (validation at step {record.get('step')}: audio reliance "
        f"{reliance:.2f} nats/token < {RELIANCE_FLOOR}{alone}) although the encoder's CTC has converged "
        f"(ctc_per_token {ctc:.2f} < {CTC_CONVERGED}): its transcripts come from its text prior. To try: "
        "model.audio_compression=ctc with model.projector_stack=1 and model.audio_positions=aligned; a CTC "
        "warm-up (the encoder trained on CTC before the decoder relies on it: model.ctc_weight higher at first); "
        "a pretrained LLM (model.llm.pretrained) that already copies from its context (docs/metrics.md)"
    )


OUTPUT_FILES = (
    ("config.yaml", "config"),
    ("metrics.jsonl", "metrics"),
    ("csv/metrics.csv", "csv"),
    ("tb", "tensorboard"),
    ("eval.json", "final evaluation"),
    ("eval_decodes.jsonl", "decodes"),
    ("learning_curve.png", "learning curve"),
)


def output_lines(run_dir: Path) -> list[str]:
    """`label: path` of each output the run dir holds (the latest and the best checkpoint first)."""
    lines = []
    ckpts = run_dir / "checkpoints"
    pointer = ckpts / "latest"
    if pointer.is_file():
        lines.append(f"checkpoint (latest): {ckpts / pointer.read_text().strip()}")
    elif ckpts.is_dir() and list_checkpoints(ckpts):
        lines.append(f"checkpoint (latest): {list_checkpoints(ckpts)[-1][1]}")
    if (ckpts / "best").is_dir():
        lines.append(f"checkpoint (best validation): {ckpts / 'best'}")
    for name, label in OUTPUT_FILES:
        if (run_dir / name).exists():
            lines.append(f"{label}: {run_dir / name}")
    return lines


def run_summary(
    run_dir: Path,
    *,
    steps: int,
    wall_seconds: float,
    train_minutes: float,
    best_metric: str,
    lower_is_better: bool,
    preempted: bool = False,
) -> str:
    """The end-of-run summary (see the module doc); a metric absent from metrics.jsonl is left out."""
    records, bad = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    head = f"run summary ({run_dir})" + (
        ": stopped by SIGTERM, resume with trainer.resume=auto" if preempted else ""
    )
    lines = [head, f"  steps: {steps}"]
    hours = _num(train[-1].get("audio_hours")) if train else None
    if hours is not None:
        lines.append(f"  audio: {hours:.3f} h seen")
    lines.append(
        f"  wall time: {format_duration(wall_seconds)} this launch; training {train_minutes:.1f} min in all launches"
    )
    throughput = throughput_line(train)
    if throughput is not None:
        lines.append(f"  mean throughput: {throughput} (over {len(train)} logged steps)")
    mfu, tflops = _mean(train, "mfu"), _mean(train, "tflops_per_s")
    if mfu is not None:
        shown = f"{MFU_FLAG} ({100 * mfu:.1f}%)" if mfu > 1 else f"{100 * mfu:.1f}%"
        lines.append(f"  mean MFU: {shown}" + (f" ({tflops:.3g} TFLOP/s)" if tflops is not None else ""))
    best = best_validation(val, best_metric, lower_is_better)
    lines.append(f"  best validation: {best}" if best else "  best validation: none (no validation ran)")
    warning = reliance_warning(val[-1]) if val else None  # the last validation: where the run ended up
    if warning:
        lines.append(f"  {warning}")
    outputs = output_lines(run_dir)
    if outputs:
        lines.append("  outputs:")
        lines += [f"    {line}" for line in outputs]
    if bad:
        lines.append(f"  note: {bad} line(s) of {run_dir / 'metrics.jsonl'} are not JSON records; skipped")
    return "\n".join(lines)
