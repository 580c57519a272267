"""Callbacks: per-step metrics log, periodic and preemption checkpoints, validation (metrics per task).

All of them act on optimizer steps (one `training_step` is one optimizer step).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L

from speechlm.config import TRAIN_PREFIX
from speechlm.errors import RunDirError
from speechlm.io import atomic_write_text
from speechlm.metrics import PERCENT_METRICS, lower_is_better, split_metric_name
from speechlm.train.checkpoint import (
    layout_of,
    save_checkpoint_atomic,
    step_dir_name,
    writes_data_position,
)
from speechlm.train.faults import Fault, fault_point, global_rank
from speechlm.train.preempt import SIGTERM_FLAG
from speechlm.train.progress import reliance_warning
from speechlm.use.eval_report import LLM_ALONE, RELIANCE


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def data_state_of(trainer) -> dict[str, Any] | None:
    """The data position of this rank's dp rank (what the last trained step leaves behind) on the
    first rank of each dp group, which writes it into the checkpoint; None on its cp/tp peers."""
    module = trainer.lightning_module
    pipeline = getattr(module, "data_pipeline", None)
    if pipeline is None or not writes_data_position(getattr(module, "dims", None), trainer.global_rank):
        return None
    return pipeline.state_dict()


def layout_of_trainer(trainer) -> dict[str, int] | None:
    """The run's (dp_replicate, dp_shard, cp, tp), recorded in each checkpoint's complete.json."""
    return layout_of(getattr(trainer.lightning_module, "dims", None))


class MetricsWriter(L.Callback):
    """Appends one JSON object per optimizer step to `RUN_DIR/metrics.jsonl` (rank 0 only).

    On resume, entries after the resumed step are dropped first, so the file always describes one
    consistent history.
    """

    def __init__(self, run_dir: Path, log_every: int = 1):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.log_every = max(1, log_every)

    def truncate_after(self, step: int) -> None:
        """Keep the records up to `step`. A last line cut short (a kill while writing) is dropped with a
        note; a bad line elsewhere is a RunDirError naming the file and the line."""
        if not self.path.exists():
            return
        lines = self.path.read_text(errors="replace").splitlines()
        keep = []
        for i, ln in enumerate(lines):
            if not ln.strip():
                continue
            try:
                rec = json.loads(ln)
                rec_step = int(rec["step"])
            except (ValueError, KeyError, TypeError) as e:
                if i == len(lines) - 1:
                    print(
                        f"note: {self.path} line {i + 1} is cut short (a kill while writing?); dropped: {ln[:80]!r}"
                    )
                    continue
                raise RunDirError(
                    f"{self.path} line {i + 1} is not a metrics record ({e}): {ln[:80]!r}. Remove that line "
                    f"(or the file, to lose the logged history) and resume again"
                ) from None
            if rec_step <= step:
                keep.append(ln)
        atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))

    def write(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(_jsonable(record)) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = getattr(pl_module, "last_metrics", None)
        if trainer.is_global_zero and m and (m["step"] % self.log_every == 0 or m["step"] == 1):
            self.write({"kind": "train", **m, "time": time.time()})


class CheckpointCallback(L.Callback):
    """Every `every` optimizer steps, at the end of training (also with every=0: the final evaluation
    runs after it, so a SIGTERM there never loses the trained weights), and on SIGTERM.

    SIGTERM (`speechlm/train/preempt.py`): the handler only sets a flag; the ranks agree on it at the
    start of a step (`SpeechLLMModule._agree_step`), which then trains nothing and sets
    `pl_module.preempted`; here every rank saves the last trained step and training stops.
    Must be the last callback of the list.
    """

    def __init__(self, run_dir: Path, every: int, keep_last: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.every = every
        self.keep_last = keep_last
        self.last_saved_step = -1
        self.run_id: str | None = None  # this run's lineage (checkpoint.adopt_lineage); rotation uses it
        self.prior_seconds = 0.0  # training time of the run's earlier launches (restored from meta.pt)
        self.started: float | None = None

    def save(self, trainer) -> Path:
        step = trainer.global_step
        path = save_checkpoint_atomic(
            trainer,
            self.root,
            step_dir_name(step),
            keep_last=self.keep_last,
            data_state=data_state_of(trainer),
            run_id=self.run_id,
            layout=layout_of_trainer(trainer),
        )
        self.last_saved_step = step
        return path

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning installed its own SIGTERM handler as fit started: ours owns the signal (preempt.py)

        SIGTERM_FLAG.install()
        # the state fit starts from is on disk already when it was resumed (nothing to save at step 0)
        self.last_saved_step = trainer.global_step
        self.started = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every > 0 and step % self.every == 0 and self.last_saved_step != step:
            self.save(trainer)
        if getattr(pl_module, "preempted", False):
            trainer.should_stop = True
            if step == 0:
                if trainer.is_global_zero:
                    print("\nSIGTERM before the first optimizer step: nothing to save; exiting", flush=True)
                return
            path = self.save(trainer) if self.last_saved_step != step else self.root / step_dir_name(step)
            if trainer.is_global_zero:
                print(
                    f"\nSIGTERM: saved checkpoint {path}; exiting. Resume with trainer.resume=auto",
                    flush=True,
                )

    def state_dict(self) -> dict[str, Any]:
        now = time.time() - self.started if self.started is not None else 0.0
        return {"train_seconds": self.prior_seconds + now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prior_seconds = float(state.get("train_seconds", 0.0))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self.last_saved_step and trainer.global_step > 0:
            self.save(trainer)


class ValidationCallback(L.Callback):
    """Greedy decoding + each task's metrics every `every` steps; keeps the best checkpoint; early stops.

    `best_metric` is any key of the validation's result (`speechlm.metrics`); a lower value is better for
    loss, wer and cer, a higher one for bleu, chrf and accuracy; a training-split key (`train_wer`, with
    `trainer.val_train_batches`) goes the way of the metric it prefixes. The best value is saved with the
    metric's name: a run resumed with another `trainer.best_metric` starts its best and its patience
    afresh."""

    def __init__(
        self,
        evaluate_fn,
        metrics: MetricsWriter,
        run_dir: Path,
        *,
        every: int,
        best_metric: str,
        patience: int = 0,
    ):
        self.evaluate_fn = evaluate_fn  # (pl_module) -> dict of metrics, identical on every rank
        self.metrics = metrics
        self.every = every
        self.best_metric = best_metric
        self.lower_is_better = lower_is_better(best_metric.removeprefix(TRAIN_PREFIX))
        self.patience = patience
        self.best: float | None = None
        self.bad_evals = 0
        self.root = Path(run_dir) / "checkpoints"
        self.run_id: str | None = None  # set by checkpoint.adopt_lineage

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every <= 0 or step % self.every != 0 or getattr(pl_module, "preempted", False):
            return
        fault_point("val", step)  # the fault-injection harness (speechlm faults); a no-op otherwise
        result = self.evaluate_fn(pl_module)
        if not result:
            return
        if trainer.is_global_zero:
            self.metrics.write({"kind": "val", "step": step, **result, "time": time.time()})
            print(f"\n[val step {step}] {summarize_scores(result)}", flush=True)
            warning = reliance_warning({"step": step, **result})
            if warning:
                print(warning, flush=True)
        value = result.get(self.best_metric)
        if value is None:
            return
        if self.best is None or (value < self.best if self.lower_is_better else value > self.best):
            self.best = value
            self.bad_evals = 0
            save_checkpoint_atomic(
                trainer,
                self.root,
                "best",
                update_latest=False,
                data_state=data_state_of(trainer),
                run_id=self.run_id,
                layout=layout_of_trainer(trainer),
            )
        else:
            self.bad_evals += 1
            if self.patience > 0 and self.bad_evals >= self.patience:
                if trainer.is_global_zero:
                    print(
                        f"early stopping: {self.best_metric} did not improve for {self.patience} validations"
                    )
                trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals, "metric": self.best_metric}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        metric = state.get("metric", "wer")  # checkpoints from before the metric was saved: wer or loss
        if "metric" in state and metric != self.best_metric:
            print(
                f"note: the checkpoint's best validation {metric}={state.get('best')} is not a "
                f"{self.best_metric} (trainer.best_metric changed): the best and the patience start afresh",
                flush=True,
            )
            return
        self.best = state.get("best")
        self.bad_evals = state.get("bad_evals", 0)


def summarize_scores(result: dict[str, Any]) -> str:
    """One line of a validation's scores: wer and wer_<lang> (ASR), each other task's overall metrics
    (`wer=12.3% wer_hi=10.2% ast/bleu=20.1 ast/chrf=41.0`), the LLM-alone WER (joint decoding on) and the
    audio reliance (`llm_wer=99.2% audio_reliance=0.31`), then the same of the training split when
    `trainer.val_train_batches` decoded it (`train_wer=4.1% train_wer_hi=3.0% train_llm_wer=98.0% ...`)."""
    parts = []
    for prefix in ("", TRAIN_PREFIX):
        for key, value in result.items():  # in the order of the result (its metrics sorted)
            name = split_metric_name(key.removeprefix(prefix)) if key.startswith(prefix) else None
            if key.startswith(TRAIN_PREFIX) != bool(prefix) or name is None or key == f"{prefix}asr/wer":
                continue  # the other split's; not a metric; or the same as `wer`
            task, metric, lang = name
            if task is None or lang is None:  # today's wer and wer_<lang>, and each task's overall scores
                parts.append(
                    f"{key}={100 * value:.1f}%" if metric in PERCENT_METRICS else f"{key}={value:.1f}"
                )
        for key in (f"{prefix}{LLM_ALONE}wer", f"{prefix}{RELIANCE}"):  # the LLM alone; the audio reliance
            if isinstance(result.get(key), float):
                reliance = key.endswith(RELIANCE)
                parts.append(f"{key}={result[key]:.2f}" if reliance else f"{key}={100 * result[key]:.1f}%")
    return " ".join(parts)


class TimeLimit(L.Callback):
    """Stops training after `minutes` of wall clock: the module checks the deadline at the start of each
    optimizer step and the ranks agree on it in the step's one all-reduce (`SpeechLLMModule._agree_step`);
    the step where any rank found it passed is the last one trained."""

    def __init__(self, minutes: float):
        self.deadline = time.time() + 60 * minutes

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.deadline = self.deadline


class FaultInjector(L.Callback):
    """Acts on `sigterm@N` and `sigkill@N`; must come before the checkpoint callback."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if Fault("sigkill", step) in self.faults and global_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if Fault("sigterm", step) in self.faults:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the flag; the next step agrees on it
