"""The LightningModule: one `training_step` is one optimizer step over `grad_accum` micro-batches.

Objective of an optimizer step (the same for any packing, accumulation or parallel layout):

    loss = sum_tokens CE / N_tok  +  ctc_weight * sum_clips CTC / N_clip

where N_tok is the number of labelled tokens and N_clip the number of clips in the *whole* step
(all micro-batches, all data-parallel ranks). Both counts are known from the token lengths before any
forward pass, so each micro-batch is back-propagated with its own sum divided by the step's global
count: accumulation and packing never change the objective. Under data parallelism every rank's
gradient is later averaged over `dp_cp` ranks, so the local loss is multiplied by that size.

Manual optimization keeps the accumulation loop, clipping and the two-phase encoder schedule in one
readable place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from parallel.mesh import ParallelDims
from speechlm.config import ExperimentConfig
from speechlm.data.dataset import DROP_REASONS
from speechlm.data.drops import drop_advice, drop_listing, drop_reasons
from speechlm.data.run_inputs import TokenizerInfo
from speechlm.errors import DataError
from speechlm.model.build import build_speech_llm, frozen_state_keys
from speechlm.model.flops import Trainable, dims_of_model, step_flops
from speechlm.model.trainable import train_modes_of
from speechlm.train.checkpoint import restore_rng_state
from speechlm.train.data import DroppedDataError, StepBatch, StepLoader
from speechlm.train.distributed import build_distributed_context
from speechlm.train.precision import PrecisionPolicy, precision_policy
from speechlm.train.preempt import SIGTERM_FLAG
from speechlm.train.schedule import build_optimizer, sync_schedule_to_step
from speechlm.train.step import StepContext, StepCounts, agree_step, clip_model_gradients, run_optimizer_step
from speechlm.train.throughput import (
    STEP_METRIC_KEYS,
    device_peak_tflops,
    memory_figures,
    step_metrics,
    warn_implausible_peak,
)


@dataclass(frozen=True)
class StepTotals:
    """What one optimizer step's agreement gave: its normalisers (labelled tokens, CTC clips), what it
    read (samples = utterances, clips), audio seconds and drop counts, summed over data-parallel ranks."""

    counts: StepCounts
    audio_seconds: float
    dropped: dict[str, int]

    @property
    def utterances(self) -> int:
        """Samples the step read: a conversation is one, whatever its clips and transcripts."""
        return self.counts.samples


class SpeechLLMModule(L.LightningModule):
    """`dims`: the `parallel.mesh.ParallelDims` of the run (None: one process); `data_pipeline`: the
    `StepLoader` (told which steps were trained, so a checkpoint holds the data position)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        tok: TokenizerInfo,
        *,
        dims: ParallelDims | None = None,
        data_pipeline: StepLoader | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.tok = tok
        self.dims = dims
        self.data_pipeline = data_pipeline
        self.automatic_optimization = False
        self.model = build_speech_llm(cfg.model, tok)  # what trains marked: full, frozen or LoRA

        self.flop_dims = dims_of_model(self.model)  # sizes for the FLOP count, read before parallelism
        self.peak_tflops: float | None = None  # the device's peak (0: unknown), read at the first step
        self.step_ctx = StepContext()  # replaced once, by configure_model
        self.precision = PrecisionPolicy()  # fp32 until configure_model decides (once, on the device)
        # counters carried in checkpoints
        self.utterances_seen = 0
        self.audio_seconds_seen = 0.0
        self.dropped: dict[str, int] = {}
        self._t_last: float | None = None
        self.parallelized = False
        self.pending_rng: dict[str, Any] | None = None
        self.last_metrics: dict[str, Any] | None = None
        self.preempted = False  # all ranks agreed on a SIGTERM (set once, by training_step)
        self.deadline: float | None = None  # trainer.max_minutes (callbacks.TimeLimit), agreed per step

    # --- parallelism -----------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Decide the precision (once: `speechlm.train.precision`), then, once the strategy has built the
        mesh, apply TP, activation checkpointing and FSDP2, bind the model's CP hooks and build the step
        context. With one process the model is left as it is."""
        if self.parallelized:
            return
        device = self._training_device()
        self.precision = precision_policy(self.cfg, self.dims, device)
        if self.dims is not None and self.dims.world_size > 1:
            self.step_ctx = build_distributed_context(self.model, self.dims, self.cfg, device, self.precision)
        else:
            self.step_ctx = StepContext(precision=self.precision)
        self.parallelized = True

    def _training_device(self) -> torch.device:
        """The device training runs on: the strategy's. Lightning calls `configure_model` before it moves
        the module there, so `self.device` is still the CPU then (it is the answer only without a Trainer)."""
        try:
            return self.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            return self.device

    # --- optimizer ----------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        opt, sched = build_optimizer(self.model, self.cfg)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # --- training -------------------------------------------------------------------------------
    def training_step(self, step_batch: StepBatch, batch_idx: int) -> torch.Tensor | None:
        t_start = time.perf_counter()
        opt = self.optimizers()
        sched: Any = self.lr_schedulers()
        step = self.global_step
        totals, sigterm, time_up = self._agree_step(step_batch)
        if sigterm:  # every rank agreed at this step: train nothing more, save the last step, exit 143
            self.preempted = True
            self.last_metrics = None
            self.trainer.should_stop = True
            return None
        lrs = sched.get_last_lr()  # the rates this step uses (the scheduler moves on inside the step)
        res = run_optimizer_step(
            self.model,
            step_batch.micro_batches,
            self.step_ctx,
            opt,
            sched,
            self.cfg,
            step=step,
            backward=self.manual_backward,
            clip=self._clip_gradients,
            counts=totals.counts,
            flop_count=self._count_flops,
        )
        work = res.pop("work")
        self._update_counters(step_batch, totals)
        if time_up:  # trainer.max_minutes passed on some rank: this step is the last (agreed by all)
            self.trainer.should_stop = True
        now = time.perf_counter()
        dt = now - self._t_last if self._t_last is not None else float("nan")
        self._t_last = now
        self.last_metrics = {
            "step": step + 1,
            **res,
            "lr": lrs[0],
            "lr_encoder": lrs[1],
            "utt_per_s": totals.utterances / dt if dt == dt and dt > 0 else None,
            "audio_hours": self.audio_seconds_seen / 3600.0,
            "epoch": step_batch.position["epoch"],
            "rows_digest": step_batch.rows_digest(),
            "dropped_step": sum(totals.dropped.values()),  # rows of this step not readable
            **{f"dropped_{k}": v for k, v in sorted(self.dropped.items())},  # totals since the start
            **self._step_figures(step_batch, totals, work, t_start),
        }
        self.log("loss", res["loss"], prog_bar=True, on_step=True, batch_size=1, sync_dist=False)
        self.log("lr", self.last_metrics["lr"], prog_bar=True, on_step=True, batch_size=1)
        if self.last_metrics["utt_per_s"] is not None:
            self.log("utt/s", self.last_metrics["utt_per_s"], prog_bar=True, on_step=True, batch_size=1)
        self.log("audio_h", self.last_metrics["audio_hours"], prog_bar=True, on_step=True, batch_size=1)
        for key in STEP_METRIC_KEYS:  # throughput, MFU, memory, times: CSV/TensorBoard; two on the console
            if self.last_metrics.get(key) is not None:
                bar = key in ("tokens_per_s", "mfu")
                self.log(key, float(self.last_metrics[key]), prog_bar=bar, on_step=True, batch_size=1)
        return torch.tensor(res["loss"])

    def _count_flops(self, works: list[Any], encoder_frozen: bool) -> float:
        """Training FLOPs of this rank's micro-batches (`speechlm.model.flops`; what trains decides the factors)."""
        trainable = Trainable(encoder=not encoder_frozen, llm=self.cfg.model.llm.train == "full")
        return step_flops(self.flop_dims, works, trainable)

    def _step_figures(self, step_batch: Any, totals: StepTotals, work: Any, t_start: float) -> dict[str, Any]:
        """Throughput, MFU, memory and times of this step (`speechlm.train.throughput`)."""
        wait = float(getattr(step_batch, "data_wait_s", 0.0))
        if self.peak_tflops is None:  # once: the device does not change
            self.peak_tflops = device_peak_tflops(self.device, self.cfg.trainer.peak_tflops) or 0.0
        figures = step_metrics(
            work,
            step_s=wait + time.perf_counter() - t_start,
            data_wait_s=wait,
            audio_s_rank=0.0 if getattr(step_batch, "error", None) else step_batch.audio_seconds,
            audio_s_total=totals.audio_seconds,
            world_size=self.dims.world_size if self.dims is not None else 1,
            peak=self.peak_tflops or None,
        )
        return {**figures, **memory_figures(self.device)}

    def _clip_gradients(self) -> float:
        return clip_model_gradients(self.model, self.cfg.optim.grad_clip, self.step_ctx.clip_grad_norm)

    def _agree_step(self, step_batch: Any) -> tuple[StepTotals, bool, bool]:
        """The step's one small all-reduce (before any forward, `step.agree_step`): labelled tokens and
        clips (the objective's normalisers; clips are the utterances), audio seconds and drop counts
        summed over data-parallel ranks, and the stop flags of every rank (SIGTERM received, data error
        found, `trainer.max_minutes` passed, a clip failed on the one rank that decoded it: then every rank
        reads the step again with every clip decoded, `StepLoader.redecode`, and agrees once more), so that
        all ranks act on them at the same step (`speechlm/train/preempt.py`).

        Returns the totals, whether to stop for SIGTERM (before this step) and whether the time limit
        has passed (after this step); raises the DroppedDataError of the rank
        that found one on every rank, and a DataError on every rank when no rank read any utterance
        of the step (training on nothing, possible with data.max_dropped_fraction=1)."""
        reasons = sorted(DROP_REASONS)
        error = getattr(step_batch, "error", None)
        local = [0.0] if error else [step_batch.audio_seconds]
        local += [0.0 if error else float(step_batch.dropped.get(r, 0)) for r in reasons]
        agreed = agree_step(
            self.model,
            step_batch.micro_batches,
            self.step_ctx,
            extra=local,
            flags=[
                SIGTERM_FLAG.requested,
                error is not None,
                self.deadline is not None and time.time() > self.deadline,
                any(getattr(b, "local_failure", None) for b in step_batch.micro_batches),
            ],
            skip=error is not None,
        )
        sigterm, data_error, time_up, redecode = agreed.flags
        if redecode and not data_error and self.data_pipeline is not None:
            # a clip failed to decode on the one rank that read it (data.decode_local): every rank reads
            # the step's rows again, every clip decoded, and agrees on those counts instead
            again = self.data_pipeline.redecode(step_batch)
            step_batch.micro_batches, step_batch.dropped = again.micro_batches, again.dropped
            return self._agree_step(step_batch)
        if data_error:
            parts = self.step_ctx.collectives.gather_objects(error)
            rank, first = next((r, e) for r, e in enumerate(parts) if e)
            raise DroppedDataError(f"rank {rank}: {first}" if len(parts) > 1 else first)
        dropped = {r: int(round(v)) for r, v in zip(reasons, agreed.extra[1:]) if v}
        totals = StepTotals(agreed.counts, float(agreed.extra[0]), dropped)
        if totals.utterances == 0 and not sigterm:
            self._raise_empty_step(step_batch, totals)
        return totals, sigterm, time_up

    def _raise_empty_step(self, step_batch: Any, totals: StepTotals) -> None:
        """No sample of the step was read on any rank: name the rows, why each was dropped and what to
        do about those reasons (`speechlm.data.drops.drop_advice`)."""
        files = [f for part in self.step_ctx.collectives.gather_objects(
            [f for b in step_batch.micro_batches for f in b.dropped_files]) for f in part]  # fmt: skip
        n = sum(totals.dropped.values())
        raise DataError(
            f"optimizer step {self.global_step + 1}: every one of its {n} samples was dropped, on every rank "
            f"({drop_reasons(totals.dropped)}); training on nothing is refused whatever "
            f"data.max_dropped_fraction is:\n  {drop_listing(files)}\nTo go on: {drop_advice(totals.dropped)}"
        )

    def _update_counters(self, step_batch: Any, totals: StepTotals) -> None:
        self.utterances_seen += totals.utterances
        self.audio_seconds_seen += totals.audio_seconds
        for k, v in totals.dropped.items():
            self.dropped[k] = self.dropped.get(k, 0) + v
        if self.data_pipeline is not None:
            self.data_pipeline.mark_consumed(step_batch.position)

    # --- checkpoint extras ----------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # plain values only (meta.pt is loaded with weights_only=True); the data position and the RNG
        # states are per rank and saved next to the shards (train/checkpoint/save.py)
        checkpoint["speechlm"] = {
            "utterances_seen": int(self.utterances_seen),
            "audio_seconds_seen": float(self.audio_seconds_seen),
            "dropped": {str(k): int(v) for k, v in self.dropped.items()},
            # the frozen base a frozen/LoRA checkpoint leaves out (checked on resume: checkpoint.check_frozen_base)
            "base": self.base_record(),
        }

    def base_record(self) -> dict[str, Any]:
        return {
            **train_modes_of(self.model).as_record(),
            "llm_pretrained": self.cfg.model.llm.pretrained,
            "encoder_pretrained": self.cfg.model.encoder.pretrained,
        }

    def frozen_state_keys(self) -> frozenset[str]:
        """This module's state-dict keys of the frozen parameters (left out of checkpoints)."""
        return frozen_state_keys(self.model)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        extra = checkpoint.get("speechlm", {})
        self.utterances_seen = extra.get("utterances_seen", 0)
        self.audio_seconds_seen = extra.get("audio_seconds_seen", 0.0)
        self.dropped = dict(extra.get("dropped", {}))

    def on_train_end(self) -> None:
        # the epoch training stopped in holds its DataLoader workers: not needed by the final evaluation
        if self.data_pipeline is not None and hasattr(self.data_pipeline, "close"):
            self.data_pipeline.close()

    def on_train_start(self) -> None:
        if self.trainer.is_global_zero:  # a peak in another unit: MFU would be off by the unit's factor
            warn_implausible_peak(self.cfg.trainer.peak_tflops)
        # RNG states are restored last, after Lightning's own seeding, so a resumed run draws the same numbers

        restore_rng_state(self.pending_rng)
        self.pending_rng = None
        # the learning rates come from the *current* schedule at the restored step: a checkpoint stores the
        # rate of its own run, which differs when the resumed run changes trainer.max_steps (train longer)
        sched: Any = self.lr_schedulers()
        if sched is not None:
            sync_schedule_to_step(sched, self.global_step)
