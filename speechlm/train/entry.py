"""`speechlm train CONFIG [--cp-size C] [--tp-size T] [overrides]` and `python -m speechlm.train ...`.

Reads top to bottom: config → validator (before any weights load) → layout → data → model → fit →
final evaluation. Under `torchrun` every process runs this; rank 0 prints and writes the logs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

OVERRIDES_HELP = """\
dotted overrides (KEY=VALUE, any field of the config), for example:
  trainer.max_steps=50 trainer.run_dir=runs/try1 trainer.grad_accum=2 trainer.max_minutes=10
  trainer.val_every=100 trainer.ckpt_every=100 trainer.resume=auto trainer.precision=32
  model.packed_sequences=false model.attention_backend=reference model.dropout=0 model.ctc_weight=0.3
  sampler.max_batch_duration=32 sampler.max_batch_tokens=4096 sampler.temperature=0.3 sampler.seed=1
  optim.lr=1e-3 optim.warmup_steps=50 optim.unfreeze_step=0 parallel.cp_attention=allgather
Unknown keys are errors. `model.dropout=0` turns off every source of randomness in the forward pass.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a speech LLM from a config",
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a speech LLM. Launch several processes with "
        "`torchrun --nproc-per-node N -m speechlm.train CONFIG --cp-size C --tp-size T`.",
    )
    add_train_arguments(p)
    p.set_defaults(func=run_train_command)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML experiment config, e.g. configs/demo.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE (see below)")
    p.add_argument("--cp-size", type=int, default=None, help="context-parallel size (parallel.cp_size)")
    p.add_argument("--tp-size", type=int, default=None, help="tensor-parallel size (parallel.tp_size)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config, layout and plan; exit")


def run_train_command(args: argparse.Namespace) -> int:
    from speechlm.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.cp_size is not None:
        overrides.append(f"parallel.cp_size={args.cp_size}")
    if args.tp_size is not None:
        overrides.append(f"parallel.tp_size={args.tp_size}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from parallel.validator import ValidationError
    from speechlm.train.data import DroppedDataError

    try:
        result = train(cfg, dry_run=args.dry_run)
    except ValidationError as e:
        print(str(e), file=sys.stderr)
        return 1
    except DroppedDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if result is not None else 1


def world_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def train(cfg: Any, *, dry_run: bool = False) -> dict[str, Any] | None:
    import lightning as L
    import torch

    from parallel.mesh import ParallelDims
    from speechlm.config import to_dict
    from speechlm.data.dataset import SpeechDataset
    from speechlm.data.manifest import load_manifest
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.train.callbacks import (
        CheckpointCallback,
        MetricsWriter,
        TimeLimit,
        ValidationCallback,
        build_progress_bar,
    )
    from speechlm.train.checkpoint import CheckpointError, resolve_resume, restore_training_state
    from speechlm.train.data import StepLoader, build_sampler
    from speechlm.train.evaluate import Evaluator
    from speechlm.train.faults import FaultInjector, active_faults
    from speechlm.train.module import SpeechLLMModule, TokenizerInfo
    from speechlm.train.strategy import SpeechParallelStrategy

    rank, world_size = world_from_env()
    t = cfg.trainer
    run_dir = Path(t.run_dir)

    # 1. data tables (cheap) and the validator, before any weights are built
    train_table = load_manifest(cfg.data.train_manifest)
    val_table = load_manifest(cfg.data.val_manifest) if cfg.data.val_manifest else None
    durations = train_table.column("duration").to_numpy()
    summary = {"n_rows": len(train_table), "max_duration": float(durations.max()) if len(durations) else 0.0}
    from speechlm.validate import validate_at_fit_start

    validate_at_fit_start(cfg, world_size, rank=rank, manifest_summary=summary)  # before any weights load
    dims = ParallelDims(
        world_size,
        cfg.parallel.dp_replicate,
        cfg.parallel.dp_shard,
        cfg.parallel.cp_size,
        cfg.parallel.tp_size,
    )
    dp_rank = dims.dp_rank(rank)

    tokenizer = Tokenizer(cfg.data.tokenizer)
    instruction_ids = tuple(tokenizer.encode(cfg.data.instruction)) if cfg.data.instruction else ()
    tok = TokenizerInfo(
        len(tokenizer),
        tokenizer.pad_id,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.audio_id,
        instruction_ids,
    )
    sampler = build_sampler(cfg, train_table, dp_rank=dp_rank, dp_size=dims.dp)
    if rank == 0:
        print(f"layout: {dims.describe()}  (this process: rank {rank}, dp_rank {dp_rank})")
        print(
            f"train manifest: {cfg.data.train_manifest}: {len(train_table)} utterances, "
            f"{float(durations.sum()) / 3600:.2f} h; {len(sampler)} micro-batches per dp rank per epoch, "
            f"{len(sampler) // t.grad_accum} optimizer steps per epoch"
        )
    if dry_run:
        if rank == 0:
            import yaml

            print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return {}

    # 2. model, strategy, callbacks
    L.seed_everything(t.seed, workers=True, verbose=False)
    train_ds = SpeechDataset(
        train_table, tokenizer, max_tokens=cfg.data.max_tokens, sample_rate=cfg.data.sample_rate
    )
    loader = StepLoader(
        sampler,
        train_ds,
        grad_accum=t.grad_accum,
        num_workers=cfg.data.num_workers,
        pin_memory=torch.cuda.is_available(),
        seed=t.seed,
        dp_rank=dp_rank,
        max_dropped_fraction=cfg.data.max_dropped_fraction,
    )
    module = SpeechLLMModule(cfg, tok)
    module.dims = dims
    if rank == 0:
        n_params = sum(p.numel() for p in module.model.parameters())
        print(
            f"model: {n_params / 1e6:.2f}M parameters; packed_sequences={cfg.model.packed_sequences}, "
            f"attention={cfg.model.attention_backend}, ctc_weight={cfg.model.ctc_weight}"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        import yaml

        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    metrics = MetricsWriter(run_dir, t.log_every)
    faults = active_faults()  # the fault-injection harness (speechlm faults); empty in normal runs
    callbacks: list[Any] = [
        metrics,
        *([FaultInjector(faults)] if faults else []),
        build_progress_bar(),
    ]
    evaluator = Evaluator(cfg, tokenizer, val_table, dims, rank) if val_table is not None else None
    if evaluator is not None and t.val_every > 0:
        callbacks.append(
            ValidationCallback(
                evaluator,
                metrics,
                run_dir,
                every=t.val_every,
                best_metric=t.best_metric,
                patience=t.early_stopping_patience,
            )
        )
    if t.max_minutes:
        callbacks.append(TimeLimit(t.max_minutes))
    # last: it sees a SIGTERM that arrived while the callbacks above ran (validation) and saves first
    callbacks.append(CheckpointCallback(run_dir, t.ckpt_every, t.keep_last))
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if world_size > 1 else 1
    strategy = SpeechParallelStrategy(dims, process_group_backend="nccl" if accelerator == "cuda" else "gloo")
    loggers = build_loggers(run_dir)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=max(1, world_size // max(devices, 1)),
        strategy=strategy,
        max_steps=t.max_steps,
        max_epochs=-1,
        logger=loggers,
        callbacks=callbacks,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=max(1, t.log_every),
        enable_model_summary=False,
        precision="32-true",
        deterministic=False,
    )

    # 3. resume: model, optimizer and loops through fit; data position and RNG states per rank here
    step, pos = 0, None  # type: tuple[int, dict[str, int] | None]
    try:
        ckpt = resolve_resume(t.resume, run_dir, log=print if rank == 0 else (lambda _m: None))
        if ckpt is not None:
            step, pos = restore_training_state(
                ckpt, loader, module, resume_data=t.resume_data, rank=rank, world_size=world_size
            )
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    if pos is not None:
        if rank == 0:
            metrics.truncate_after(step)
            print(f"resuming from {ckpt} (optimizer step {step}, epoch {pos['epoch']}, "
                  f"micro-batch {pos['position']} of it; data: {t.resume_data})")  # fmt: skip
    if t.validate_only:
        # evaluation only: restore the checkpoint (if any) through fit, with no optimizer step to take
        trainer.fit_loop.epoch_loop.max_steps = step if ckpt is not None else 0
    if ckpt is None and rank == 0:
        metrics.truncate_after(0)  # a fresh run starts a fresh history
        old = run_dir / "checkpoints"
        if any(old.glob("step_*")):
            print(
                f"note: {old} holds checkpoints of an earlier run; this run starts from scratch (add "
                f"trainer.resume=auto to continue that run instead); they are replaced as new ones are saved"
            )
    module.data_pipeline = loader
    t0 = time.time()
    with warnings.catch_warnings():
        # Lightning's "dataloader is not resumable" warning: StepLoader resumes itself (restore_training_state)
        warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
        trainer.fit(
            module,
            train_dataloaders=loader,
            ckpt_path=str(ckpt) if ckpt is not None else None,
            weights_only=True,
        )
    elapsed = time.time() - t0

    # 4. final evaluation: greedy WER per language on the chosen split
    result: dict[str, Any] = {"steps": trainer.global_step, "train_minutes": elapsed / 60}
    final_table = train_table if t.final_eval_split == "train" else val_table
    if final_table is not None and not trainer.received_sigterm:
        final_eval = Evaluator(cfg, tokenizer, final_table, dims, rank, max_batches=None)
        wer = final_eval(module)
        result.update(wer)
        if rank == 0:
            from speechlm.train.evaluate import format_wer_table

            counts: dict[str, int] = {}
            for lang in final_table.column("lang").to_pylist():
                counts[lang] = counts.get(lang, 0) + 1
            print(
                f"\nfinal greedy WER on the {t.final_eval_split} split after {trainer.global_step} steps "
                f"({elapsed / 60:.1f} min):"
            )
            print(format_wer_table(wer, counts))
            (run_dir / "eval.json").write_text(json.dumps({"split": t.final_eval_split, **result}, indent=2))
            with (run_dir / "eval_decodes.jsonl").open("w") as f:
                for lang, ref, hyp in final_eval.last_decodes:
                    f.write(json.dumps({"lang": lang, "ref": ref, "hyp": hyp}, ensure_ascii=False) + "\n")
            from speechlm.train.plots import plot_learning_curve

            png = plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
            print(f"wrote {run_dir / 'eval.json'}, {png}")
    return result


def build_loggers(run_dir: Path) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger

    loggers: list[Any] = [CSVLogger(str(run_dir), name="csv", version="")]
    try:
        import tensorboard  # noqa: F401
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(str(run_dir), name="tb", version=""))
    except ImportError:
        pass
    return loggers
