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

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from speechlm.config import ExperimentConfig
from speechlm.train.schedule import decoder_lr_lambda, encoder_frozen, encoder_lr_lambda
from speechlm.train.step import StepContext, compute_micro_losses, count_step_targets


@dataclass
class TokenizerInfo:
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    audio_id: int
    instruction_ids: tuple[int, ...] = ()


class SpeechLLMModule(L.LightningModule):
    def __init__(self, cfg: ExperimentConfig, tok: TokenizerInfo):
        super().__init__()
        from speechlm.model.speech_llm import SpeechLLM

        self.cfg = cfg
        self.tok = tok
        self.automatic_optimization = False
        self.model = SpeechLLM(
            cfg.model,
            vocab_size=tok.vocab_size,
            pad_id=tok.pad_id,
            bos_id=tok.bos_id,
            eos_id=tok.eos_id,
            audio_id=tok.audio_id,
        )
        self.step_ctx = StepContext.single(cfg, tok)
        # counters carried in checkpoints
        self.utterances_seen = 0
        self.audio_seconds_seen = 0.0
        self.dropped: dict[str, int] = {}
        self._t_last: float | None = None
        self.parallelized = False
        self.data_pipeline: Any = (
            None  # the StepLoader (set by the entrypoint): told which steps were trained
        )
        self.pending_rng: dict[str, Any] | None = None
        self.dims: Any = None

    # --- parallelism -----------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Apply TP, activation checkpointing and FSDP2 once the strategy has built the mesh.

        With one process nothing is wrapped and the step context stays trivial."""
        if self.parallelized:
            return
        if self.dims is not None and self.dims.world_size > 1:
            from speechlm.train.distributed import build_distributed_context

            self.step_ctx = build_distributed_context(self, self.dims, self.step_ctx)
        self.parallelized = True

    # --- optimizer ----------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        opt, sched = build_optimizer(self.model, self.cfg)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # --- training -------------------------------------------------------------------------------
    def _autocast(self) -> Any:
        p = self.cfg.trainer.precision
        dev = self.device.type
        use_bf16 = p == "bf16" or (p == "auto" and dev == "cuda" and torch.cuda.is_bf16_supported())
        return torch.autocast(dev, dtype=torch.bfloat16) if use_bf16 else nullcontext()

    def training_step(self, step_batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        sched: Any = self.lr_schedulers()
        step = self.global_step
        self._sum_step_stats(step_batch)
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
            autocast=self._autocast,
        )
        self._update_counters(step_batch)
        now = time.perf_counter()
        dt = now - self._t_last if self._t_last is not None else float("nan")
        self._t_last = now
        n_utts_step = step_batch.num_utterances_global
        self.last_metrics = {
            "step": step + 1,
            **res,
            "lr": lrs[0],
            "lr_encoder": lrs[1],
            "utt_per_s": n_utts_step / dt if dt == dt and dt > 0 else None,
            "audio_hours": self.audio_seconds_seen / 3600.0,
            "epoch": step_batch.position["epoch"],
            "rows_digest": step_batch.rows_digest(),
            "dropped_step": sum(step_batch.dropped_global.values()),  # rows of this step not readable
            **{f"dropped_{k}": v for k, v in sorted(self.dropped.items())},  # totals since the start
        }
        self.log("loss", res["loss"], prog_bar=True, on_step=True, batch_size=1, sync_dist=False)
        self.log("lr", self.last_metrics["lr"], prog_bar=True, on_step=True, batch_size=1)
        if self.last_metrics["utt_per_s"] is not None:
            self.log("utt/s", self.last_metrics["utt_per_s"], prog_bar=True, on_step=True, batch_size=1)
        self.log("audio_h", self.last_metrics["audio_hours"], prog_bar=True, on_step=True, batch_size=1)
        return torch.tensor(res["loss"])

    def _clip_gradients(self) -> float:
        return clip_model_gradients(self.model, self.cfg.optim.grad_clip, getattr(self, "clip_fn", None))

    def _sum_step_stats(self, step_batch: Any) -> None:
        """Utterances, audio seconds and drop counts of this step, summed over data-parallel ranks."""
        from speechlm.data.dataset import DROP_REASONS

        reasons = sorted(DROP_REASONS)
        local = [float(step_batch.num_utterances), step_batch.audio_seconds]
        local += [float(step_batch.dropped.get(r, 0)) for r in reasons]
        total = self.step_ctx.sum_counts_over_dp(local)
        step_batch.num_utterances_global = int(round(total[0]))
        step_batch.audio_seconds_global = float(total[1])
        step_batch.dropped_global = {r: int(round(v)) for r, v in zip(reasons, total[2:]) if v}

    def _update_counters(self, step_batch: Any) -> None:
        self.utterances_seen += step_batch.num_utterances_global
        self.audio_seconds_seen += step_batch.audio_seconds_global
        for k, v in step_batch.dropped_global.items():
            self.dropped[k] = self.dropped.get(k, 0) + v
        if self.data_pipeline is not None:
            self.data_pipeline.mark_consumed(step_batch.position)

    # --- checkpoint extras ----------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # plain values only (meta.pt is loaded with weights_only=True); the data position and the RNG
        # states are per rank and saved next to the shards (train/checkpoint.py)
        checkpoint["speechlm"] = {
            "utterances_seen": int(self.utterances_seen),
            "audio_seconds_seen": float(self.audio_seconds_seen),
            "dropped": {str(k): int(v) for k, v in self.dropped.items()},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        extra = checkpoint.get("speechlm", {})
        self.utterances_seen = extra.get("utterances_seen", 0)
        self.audio_seconds_seen = extra.get("audio_seconds_seen", 0.0)
        self.dropped = dict(extra.get("dropped", {}))

    def on_train_start(self) -> None:
        # RNG states are restored last, after Lightning's own seeding, so a resumed run draws the same numbers
        from speechlm.train.checkpoint import restore_rng_state

        restore_rng_state(self.pending_rng)
        self.pending_rng = None
        # the learning rates come from the *current* schedule at the restored step: a checkpoint stores the
        # rate of its own run, which differs when the resumed run changes trainer.max_steps (train longer)
        sched: Any = self.lr_schedulers()
        if sched is not None:
            sync_schedule_to_step(sched, self.global_step)


def build_optimizer(model: Any, cfg: ExperimentConfig) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with two groups (decoder side, audio encoder) and one LambdaLR with a schedule per group."""
    o, t = cfg.optim, cfg.trainer
    enc_ids = {id(p) for p in model.encoder_parameters()}
    enc = [p for p in model.parameters() if id(p) in enc_ids and p.requires_grad]
    rest = [p for p in model.parameters() if id(p) not in enc_ids and p.requires_grad]
    groups = [
        {"params": rest, "lr": o.lr, "name": "decoder"},
        {"params": enc, "lr": o.encoder_lr if o.encoder_lr is not None else o.lr, "name": "encoder"},
    ]
    betas = (float(o.betas[0]), float(o.betas[1]))
    opt = torch.optim.AdamW(groups, betas=betas, weight_decay=o.weight_decay, eps=1e-8)
    max_steps, floor = t.max_steps, o.min_lr_ratio
    lambdas = [
        lambda s: decoder_lr_lambda(s, warmup_steps=o.warmup_steps, max_steps=max_steps, min_lr_ratio=floor),
        lambda s: encoder_lr_lambda(
            s,
            unfreeze_step=o.unfreeze_step,
            encoder_warmup_steps=o.encoder_warmup_steps,
            warmup_steps=o.warmup_steps,
            max_steps=max_steps,
            min_lr_ratio=floor,
        ),
    ]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas)


def sync_schedule_to_step(sched: Any, step: int) -> None:
    """Set every group's learning rate to base_lr * lambda(step) of this run's LambdaLR."""
    lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched.last_epoch = step
    sched._last_lr = lrs


def run_optimizer_step(
    model: Any,
    micro_batches: list[Any],
    ctx: Any,
    opt: Any,
    sched: Any,
    cfg: ExperimentConfig,
    *,
    step: int,
    backward: Any = None,
    clip: Any = None,
    autocast: Any = None,
) -> dict[str, Any]:
    """One optimizer step over `micro_batches` (this rank's share); returns the step's global metrics.

    Shared by the Lightning `training_step` and the multi-process equivalence tests.
    """
    backward = backward or (lambda loss: loss.backward())
    frozen = encoder_frozen(step, cfg.optim.unfreeze_step)
    n_tok, n_clip = count_step_targets(micro_batches, ctx)
    w_ctc = cfg.model.ctc_weight
    ce_total = torch.zeros((), dtype=torch.float64)
    ctc_total = torch.zeros((), dtype=torch.float64)
    for b in micro_batches:
        with autocast() if autocast is not None else nullcontext():  # forward only
            out = compute_micro_losses(model, b, ctx, encoder_frozen=frozen)
        loss = out.ce_sum / max(n_tok, 1)
        if w_ctc > 0 and out.ctc_sum is not None:
            loss = loss + w_ctc * out.ctc_sum / max(n_clip, 1)
        # gradients are averaged over the dp*cp group by FSDP2; grad_scale turns that into a sum
        backward(loss * ctx.grad_scale * out.weight)
        ce_total += out.ce_sum.detach().double().cpu() * out.weight
        if out.ctc_sum is not None:
            ctc_total += out.ctc_sum.detach().double().cpu() * out.weight
    grad_norm = clip() if clip is not None else clip_model_gradients(model, cfg.optim.grad_clip, None)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    ce_total, ctc_total = ctx.sum_over_data_ranks(ce_total, ctc_total)
    ce = float(ce_total) / max(n_tok, 1)
    ctc = float(ctc_total) / max(n_clip, 1)
    return {
        "loss": ce + (w_ctc * ctc if w_ctc > 0 else 0.0),
        "ce": ce,
        "ctc": ctc if w_ctc > 0 else None,
        "grad_norm": grad_norm,
        "tokens": n_tok,
        "utterances": n_clip,
        "encoder_frozen": frozen,
    }


def clip_model_gradients(model: Any, max_norm: float | None, clip_fn: Any) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm and max_norm > 0 else math.inf
    norm = (
        clip_fn(params, limit)
        if clip_fn is not None
        else torch.nn.utils.clip_grad_norm_(params, limit, foreach=False)
    )
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
