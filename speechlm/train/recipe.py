"""The recipe of `speechlm train` (`train`), read top to bottom: config → validator (before any weights
load) → layout → data → model → trainer → resume → fit → final evaluation. Under `torchrun` every
process runs this; rank 0 prints and writes the logs. The command line is `speechlm.train.entry`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pyarrow as pa
import torch
import yaml

from parallel.mesh import ParallelDims
from speechlm.config import TRAIN_PREFIX, ExperimentConfig, final_eval_split, require_inputs, to_dict
from speechlm.data.plan import trim_warning
from speechlm.data.run_inputs import (
    RUN_TOKENIZER_DIR,
    RunTokenizer,
    TokenizerInfo,
    build_run_prompt,
    load_run_tokenizer,
    manifest_langs,
    open_manifests,
    read_chat_template,
    run_dataset,
    tokenizer_info,
)
from speechlm.data.sampler.stateful import DurationBucketBatchSampler
from speechlm.metrics import lower_is_better
from speechlm.model.clip_planner import ClipPlanner
from speechlm.packing.prompt import PromptFormat
from speechlm.preflight import checks as preflight
from speechlm.preflight.rules import EPOCH_PLAN_RULE
from speechlm.preflight.validate import validate_at_fit_start
from speechlm.train.callbacks import (
    CheckpointCallback,
    FaultInjector,
    MetricsWriter,
    TimeLimit,
    ValidationCallback,
)
from speechlm.train.checkpoint import COMPLETE_NAME, resume_run, step_dir_name
from speechlm.train.data import DroppedDataError, StepLoader
from speechlm.train.distributed import build_cp_layout
from speechlm.train.eval_rows import periodic_train_rows
from speechlm.train.evaluate import final_evaluation, with_train_split
from speechlm.train.faults import active_faults
from speechlm.train.lightning_compat import keeping_csv_logger
from speechlm.train.module import SpeechLLMModule
from speechlm.train.notices import quiet_known_notices
from speechlm.train.preempt import SIGTERM_FLAG
from speechlm.train.progress import StepProgress, run_summary
from speechlm.train.run_dir import check_run_dir, prepare_run_dir, resolve_explicit_resume
from speechlm.train.strategy import SpeechParallelStrategy
from speechlm.use.evaluator import EvaluationInterrupted, Evaluator

__all__ = ["DroppedDataError", "train"]  # what the command line (speechlm.train.entry) reads


def world_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def train(cfg: ExperimentConfig, *, dry_run: bool = False) -> dict[str, Any] | None:
    """The recipe (`run_recipe`). The SIGTERM handler it installs for the run is the caller's again when
    it returns or raises: a process that goes on after training in-process (a test, a notebook, a
    multiprocessing pool forked afterwards, whose workers must die on SIGTERM) keeps its own."""

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with quiet_known_notices():  # Lightning's adverts and known harmless warnings (notices.py)
            return run_recipe(cfg, dry_run=dry_run)
    finally:
        if previous is not None:  # None: a handler not installed from Python, which cannot be put back
            signal.signal(signal.SIGTERM, previous)


def run_recipe(cfg: ExperimentConfig, *, dry_run: bool = False) -> dict[str, Any] | None:
    """The recipe; each step is a function of its own below or in the module that owns it."""

    rank, world_size = world_from_env()
    run_dir = Path(cfg.trainer.run_dir)
    started = time.time()
    # 1. manifests, the validator (before any weights are built), the layout, tokenizer and sampler
    inputs = prepare_inputs(cfg, rank, world_size)
    if dry_run:
        print_resolved_config(cfg, rank)
        return {}
    # the run dir: writable, not another run's; the resume checkpoint verified and its config compared
    ckpt = prepare_run_dir(cfg, run_dir, rank, resolved=inputs.resume)
    save_run_tokenizer(inputs.tokenizer, run_dir, rank)
    # 2. data pipeline, model, callbacks, trainer
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    loader = build_step_loader(cfg, inputs)
    module = SpeechLLMModule(cfg, inputs.tok, dims=inputs.dims, data_pipeline=loader)
    if cfg.data.decode_local and inputs.dims.cp > 1:  # each CP rank decodes the clips it encodes
        hidden = module.model.llm.config.hidden_size
        layout = build_cp_layout(cfg, inputs.dims, rank, hidden, planning=True)
        loader.decode_local(ClipPlanner.of(module.model, layout))
        if rank == 0:
            print(
                f"data: each of the {inputs.dims.cp} CP ranks decodes only the clips it encodes (data.decode_local)"
            )
    announce_model(cfg, module, run_dir, rank)
    metrics, trainer = build_trainer(cfg, inputs, run_dir)
    # 3. resume: model, optimizer and loops through fit; data position and RNG states per rank here
    ckpt = resume_run(cfg, ckpt, loader, module, trainer, metrics, rank=rank, world_size=world_size)
    # 4. fit (SIGTERM: a flag the ranks agree on once per step, speechlm/train/preempt.py)
    SIGTERM_FLAG.install()
    elapsed = fit(trainer, module, loader, ckpt)
    # 5. final evaluation: greedy WER per language on the chosen split; the weights are saved already
    result: dict[str, Any] = {
        "steps": trainer.global_step,
        "train_minutes": total_train_minutes(trainer, elapsed),
    }
    if module.preempted:
        result["preempted"] = True
    elif already_evaluated(cfg, run_dir, ckpt, trainer.global_step):
        if rank == 0:
            print(
                f"the run had already finished at step {trainer.global_step} and {run_dir / 'eval.json'} "
                "holds its evaluation: kept as it is (trainer.validate_only=true evaluates again)"
            )
    else:
        try:
            result.update(final_evaluation(cfg, inputs, module, run_dir, result, rank))
        except EvaluationInterrupted as e:
            if rank == 0:
                saved = run_dir / "checkpoints" / step_dir_name(trainer.global_step)
                where = (
                    f"the trained weights are in {saved}" if saved.is_dir() else "no checkpoint was written"
                )
                print(
                    f"\nSIGTERM during the final evaluation ({e}): {where}; eval.json was not written. Evaluate "
                    f"later with trainer.resume={saved} trainer.validate_only=true",
                    file=sys.stderr,
                    flush=True,
                )
            result["preempted"] = True
    # 6. the end-of-run summary (rank 0): steps, audio, time, throughput/MFU, best validation, outputs
    print_run_summary(cfg, run_dir, result, time.time() - started, rank)
    return result


def print_run_summary(
    cfg: ExperimentConfig, run_dir: Path, result: dict[str, Any], wall_seconds: float, rank: int
) -> None:
    if rank != 0:
        return

    metric = cfg.trainer.best_metric
    summary = run_summary(
        run_dir,
        steps=int(result["steps"]),
        wall_seconds=wall_seconds,
        train_minutes=float(result["train_minutes"]),
        best_metric=metric,
        lower_is_better=lower_is_better(metric.removeprefix(TRAIN_PREFIX)),
        preempted=bool(result.get("preempted")),
    )
    print(f"\n{summary}", flush=True)


def already_evaluated(cfg: ExperimentConfig, run_dir: Path, ckpt: Path | None, step: int) -> bool:
    """A resumed launch of a finished run (no step trained, eval.json of that step and split written):
    its final evaluation would only rewrite eval.json with the same figures."""

    if ckpt is None or cfg.trainer.validate_only:
        return False
    try:
        saved_step = json.loads((Path(ckpt) / COMPLETE_NAME).read_text()).get("step")
        ev = json.loads((run_dir / "eval.json").read_text())
    except (OSError, ValueError):
        return False
    split = final_eval_split(cfg)
    same_split = ev.get("split") == split or (split == "both" and ev.get("split") == "val" and "train" in ev)
    return saved_step == step and ev.get("steps") == step and same_split


def total_train_minutes(
    trainer: Any,  # Any: a Trainer (Lightning's callbacks list is untyped)
    elapsed: float,
) -> float:
    """Minutes of training of the whole run: the earlier launches' (saved in checkpoints by
    CheckpointCallback) plus this one's, so a resumed launch does not report only its own."""
    prior = sum(cb.prior_seconds for cb in trainer.callbacks if isinstance(cb, CheckpointCallback))
    return (prior + elapsed) / 60


@dataclass(frozen=True)
class RunInputs:
    """What the run reads before it builds anything heavy (the pre-flight's results, each built once)."""

    train_table: pa.Table
    val_table: pa.Table | None
    dims: ParallelDims
    rank: int
    tokenizer: RunTokenizer
    tok: TokenizerInfo
    sampler: DurationBucketBatchSampler
    chat_template: str  # data.chat_template's text, read once (read_chat_template)
    resume: Path | None  # an explicit trainer.resume, resolved and verified once (None: auto or none)


def prepare_inputs(cfg: ExperimentConfig, rank: int, world_size: int) -> RunInputs:
    """Open and check everything the run reads, before the model is built (speechlm/preflight/checks.py).

    `speechlm validate` runs the same checks that need only files (`preflight.check_inputs`,
    `preflight.summarize` and the validator's rules), so it refuses what this refuses."""
    require_inputs(cfg)  # training data and tokenizer have no defaults: name the key to set
    run_dir = Path(cfg.trainer.run_dir)
    check_run_dir(run_dir)  # a file in the way would fail the first save, steps later
    resume = resolve_explicit_resume(cfg.trainer.resume, run_dir)  # resolved once: prepare_run_dir takes it
    # any source (parquet, NeMo, tar shards, ...), memory-mapped from the index cache: texts and paths
    # stay on disk until a clip is loaded (speechlm/data/sources/mmap_cache.py)
    train_table, val_table = open_manifests(cfg)
    # the LLM's own tokenizer with model.llm.pretrained (tags for the manifests' languages added), else
    # data.tokenizer's SentencePiece model; the chat template is read and the prompt format built once
    tokenizer = load_run_tokenizer(cfg, manifest_langs(train_table, val_table))
    preflight.check_inputs(cfg, train_table, val_table, tokenizer)  # languages, tags, nulls: train and val
    preflight.check_llm(cfg, tokenizer)  # the LLM's files, its tokenizer, LoRA's target modules
    template = read_chat_template(cfg)
    prompt = build_run_prompt(cfg, tokenizer, template)
    summary = {**preflight.summarize(train_table, cfg), **preflight.tokenizer_summary(cfg)}
    validate_at_fit_start(cfg, world_size, rank=rank, manifest_summary=summary)  # before any weights load
    dims = ParallelDims.from_config(world_size, cfg.parallel)
    dp_rank = dims.dp_rank(rank)
    # the epoch plan (the sampler training uses) against dp * grad_accum: the validator's last rule
    plan, sampler = preflight.summarize_plan(cfg, train_table, world_size, dp_rank=dp_rank)
    validate_at_fit_start(
        cfg, world_size, rank=rank, manifest_summary={**summary, **plan}, rules=(EPOCH_PLAN_RULE,)
    )
    assert sampler is not None  # an epoch with no plan was refused by EPOCH_PLAN_RULE just above
    tok = tokenizer_info(cfg, tokenizer, prompt)
    if rank == 0:
        print(describe_prompt(tokenizer, prompt))
        durations = train_table.column("duration").to_numpy()
        print(f"layout: {dims.describe()}  (this process: rank {rank}, dp_rank {dp_rank})")
        print(
            f"train data: {cfg.data.train_manifest if cfg.data.input_cfg is None else 'data.input_cfg'}: "
            f"{len(train_table)} utterances, "
            f"{float(durations.sum()) / 3600:.2f} h; {len(sampler)} micro-batches per dp rank per epoch, "
            f"{len(sampler) // cfg.trainer.grad_accum} optimizer steps per epoch"
        )
        warning = trim_warning(sampler.plan, cfg.trainer.grad_accum, fixes="train")
        if warning:  # the newcomer's dp=8 demo lost 41% of its utterances without a word
            print(warning, file=sys.stderr)
        if sampler.plan.too_long:  # data.max_duration: never a silent loss
            print(
                f"data.max_duration={cfg.data.max_duration:g} s leaves {sampler.plan.too_long} of epoch "
                f"{sampler.plan.epoch}'s utterances out of training (longer clips)"
            )
    return RunInputs(train_table, val_table, dims, rank, tokenizer, tok, sampler, template, resume)


def print_resolved_config(cfg: ExperimentConfig, rank: int) -> None:
    if rank == 0:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe_prompt(tokenizer: RunTokenizer, prompt: PromptFormat) -> str:
    """One line on the run's tokenizer and prompt form, e.g. ``prompt: chat template of DIR (stop <|im_end|>)``."""
    kind = "the LLM's tokenizer" if hasattr(tokenizer, "added_ids") else "SentencePiece"
    form = (
        f"chat template of {tokenizer.path}"
        if prompt.templated
        else "plain [bos, audio, instruction, transcript, eos]"
    )
    return (
        f"tokenizer: {kind} {tokenizer.path} ({len(tokenizer)} ids); prompt: {form} "
        f"(stop {tokenizer.id_to_piece(prompt.stop_id)})"
    )


def save_run_tokenizer(tokenizer: RunTokenizer, run_dir: Path, rank: int) -> None:
    """Rank 0 writes a Hugging Face tokenizer with the tokens this run added (`HFTokenizer.save`) to
    run_dir/tokenizer: their ids follow the manifests' languages, so evaluating, transcribing or
    exporting a checkpoint later loads this copy (`load_text_tokenizer`) rather than the LLM's. The
    files are replaced one by one (a kill leaves the previous copy or the new one, per file); every
    resume writes them again. A SentencePiece run writes nothing (data.tokenizer is its tokenizer)."""
    if rank == 0 and hasattr(tokenizer, "added_ids"):
        tokenizer.save(run_dir / RUN_TOKENIZER_DIR)


def build_step_loader(cfg: ExperimentConfig, inputs: RunInputs) -> Any:

    t = cfg.trainer
    # rows rendered by the run's renderer
    train_ds = run_dataset(cfg, inputs.train_table, inputs.tokenizer, template=inputs.chat_template)
    return StepLoader(
        inputs.sampler,
        train_ds,
        grad_accum=t.grad_accum,
        num_workers=cfg.data.num_workers,
        pin_memory=torch.cuda.is_available(),
        seed=t.seed,
        dp_rank=inputs.dims.dp_rank(inputs.rank),
        max_dropped_fraction=cfg.data.max_dropped_fraction,
    )


def announce_model(cfg: ExperimentConfig, module: SpeechLLMModule, run_dir: Path, rank: int) -> None:
    """Print the model size and write RUN_DIR/config.yaml (rank 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank != 0:
        return

    n_params = sum(p.numel() for p in module.model.parameters())
    n_trained = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    m = cfg.model
    print(
        f"model: {n_params / 1e6:.2f}M parameters, {n_trained / 1e6:.2f}M trained (llm.train={m.llm.train}, "
        f"encoder.train={m.encoder.train}); packed_sequences={cfg.model.packed_sequences}, "
        f"attention={cfg.model.attention_backend}, ctc_weight={cfg.model.ctc_weight}"
    )
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def build_trainer(cfg: ExperimentConfig, inputs: RunInputs, run_dir: Path) -> tuple[Any, Any]:
    """(metrics writer, Lightning Trainer) with the callbacks in the order they must run."""

    t = cfg.trainer
    metrics = MetricsWriter(run_dir, t.log_every)
    faults = active_faults()  # the fault-injection harness (speechlm faults); empty in normal runs
    # the step display: a redrawing line on a terminal, plain lines in logs (train/progress.py); it
    # replaces Lightning's bar, which counts an epoch's batches and draws to logs as well
    callbacks: list[Any] = [metrics, *([FaultInjector(faults)] if faults else []), StepProgress()]
    if inputs.val_table is not None and t.val_every > 0:
        template = inputs.chat_template
        evaluator: Any = Evaluator(cfg, inputs.tokenizer, inputs.val_table, inputs.rank, template=template)
        if t.val_train_batches > 0:  # the same training rows at every validation (evaluate.py module doc)
            rows = periodic_train_rows(cfg, inputs.train_table, inputs.val_table)
            train_eval = Evaluator(  # its rows fit val_train_batches; val_max_batches cuts the val split only
                cfg,
                inputs.tokenizer,
                inputs.train_table,
                inputs.rank,
                None,
                split="train",
                rows=rows,
                template=template,
            )
            evaluator = with_train_split(evaluator, train_eval)
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
    world_size = inputs.dims.world_size
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if world_size > 1 else 1
    backend = "nccl" if accelerator == "cuda" else "gloo"
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=max(1, world_size // max(devices, 1)),
        strategy=SpeechParallelStrategy(inputs.dims, process_group_backend=backend),
        max_steps=t.max_steps,
        max_epochs=-1,
        logger=build_loggers(run_dir),
        callbacks=callbacks,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=max(1, t.log_every),
        enable_model_summary=False,
        enable_progress_bar=False,
        precision="32-true",
        deterministic=False,
    )
    return metrics, trainer


def fit(trainer: L.Trainer, module: SpeechLLMModule, loader: StepLoader, ckpt: Path | None) -> float:
    """`trainer.fit`, restoring `ckpt` (weights, optimizer, loops); returns the wall seconds."""
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
    return time.time() - t0


def build_loggers(run_dir: Path) -> list[Any]:
    """CSV (kept whole on resume: lightning_compat.keeping_csv_logger) and TensorBoard if installed."""
    loggers: list[Any] = [keeping_csv_logger(str(run_dir), name="csv")]
    try:
        import tensorboard  # noqa: F401  # lazy: optional (the tensorboard extra)
        from lightning.pytorch.loggers import TensorBoardLogger  # lazy: only with tensorboard installed

        loggers.append(TensorBoardLogger(str(run_dir), name="tb", version=""))
    except ImportError:
        pass
    return loggers
