"""The pre-flight of `speechlm train`: what a run can find out before its first step, checked before it.

`speechlm.train.recipe.prepare_inputs` runs these checks on every rank before the model is built, and
`speechlm validate` runs the ones that need only files (manifests, tokenizer, the epoch plan), so a
run that `validate` accepts does not stop at its first validation or final evaluation on bad input:

- the manifests exist and open, the tokenizer files exist and load (`speechlm.data.run_inputs`);
- every transcript and the instruction use only tags the tokenizer knows, every language of the train
  and val manifests is one of its languages, and no row has a null text, path or language
  (`check_inputs`; the manifests' checks are `speechlm.data.tokenizer_checks.check_table`, a scan over
  the Arrow text column with pyarrow.compute, a chunk at a time);
- every character of the answers and transcripts, after the data.text_normalize rule, is one the
  tokenizer can encode, never <unk> (`speechlm.data.tokenizer_checks.coverage_problems`: a scan over the
  distinct characters);
- the figures the validator's data-side rules read: rows and the longest clip (`summarize`), and,
  once the other rules pass, the epoch plan's micro-batches per data-parallel rank
  (`summarize_plan`, for `epoch-plan-too-short`).

A problem raises a `speechlm.errors.UserError` that names the file, row or key, the value, and the fix.
The run's inputs themselves (manifests, tokenizer, prompt, renderer, dataset) are built by
`speechlm.data.run_inputs`; the run dir and resume checks are training's (`speechlm.train.run_dir`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from parallel.frames import planned_encoder_frames
from parallel.mesh import ParallelDims
from speechlm.config import ExperimentConfig, final_eval_split
from speechlm.data.hf_tokenizer import _read_json, read_chat_template
from speechlm.data.run_inputs import (
    RunTokenizer,
    build_run_prompt,
    load_run_tokenizer,
    manifest_langs,
    open_manifests,
    tokenizer_prefix,
    tokenizer_source,
)
from speechlm.data.sampler.build import build_sampler, longest_row_tokens, token_cost_of
from speechlm.data.sampler.epoch_plan import EpochTooShortError, too_long_message
from speechlm.data.tokenizer_checks import check_table, coverage_problems, known_tags, unknown_tags_in
from speechlm.errors import DataError, UsageError
from speechlm.metrics import MetricSpec, table_pairs
from speechlm.model.llm_preflight import check_pretrained_llm


# --- files ------------------------------------------------------------------------------------------
def check_llm(cfg: ExperimentConfig, tokenizer: RunTokenizer | None) -> None:
    """model.llm.pretrained's files are whole, the run's tokenizer is that LLM's (a Hugging Face one; a
    SentencePiece model allowed by data.allow_sentencepiece_with_pretrained is not), and LoRA's target
    modules name modules of the LLM (`speechlm.model.llm_preflight.check_pretrained_llm`)."""
    check_pretrained_llm(cfg, tokenizer if tokenizer_source(cfg)[1] == "hf" else None)


def validate_llm(cfg: ExperimentConfig) -> list[str]:
    """`check_llm` for `speechlm validate`; a model.llm.pretrained absent here is a note, not an error."""
    pretrained = cfg.model.llm.pretrained
    if pretrained and not Path(pretrained).exists():
        return [
            f"model.llm.pretrained {pretrained} not checked (nor its tokenizer and LoRA targets): it does not exist here"
        ]
    path, kind = tokenizer_source(cfg)
    hf = pretrained and kind == "hf" and path is not None and Path(path).is_dir()
    check_llm(cfg, load_run_tokenizer(cfg) if hf else None)
    return []


def tokenizer_summary(cfg: ExperimentConfig) -> dict[str, Any]:
    """The tokenizer facts the validator's tokenizer rules read (no file is loaded, only looked at):
    tokenizer_kind, llm_pretrained, chat_template (whether the HF tokenizer directory has one; None
    when unknown here) and the escape hatch."""
    path, kind = tokenizer_source(cfg)
    has_template: bool | None = None
    if kind == "hf" and path is not None and Path(path).is_dir():
        try:
            has_template = (
                read_chat_template(Path(path), _read_json(Path(path) / "tokenizer_config.json")) is not None
            )
        except DataError:
            has_template = None
    return {
        "tokenizer_kind": kind if path is not None else None,
        "tokenizer_path": path,
        "llm_pretrained": cfg.model.llm.pretrained,
        "chat_template": has_template,
        "chat_template_setting": cfg.data.chat_template,
        "allow_sentencepiece_with_pretrained": bool(cfg.data.allow_sentencepiece_with_pretrained),
    }


# --- transcripts, languages, the instruction ---------------------------------------------------------
def check_instruction(instruction: str | None, tokenizer: RunTokenizer) -> None:
    """data.instruction may only use tags the tokenizer knows (DI1); a UsageError otherwise."""
    if not instruction:
        return
    known = known_tags(tokenizer)
    bad = unknown_tags_in(instruction, set(known))
    if bad:
        raise UsageError(
            f"data.instruction={instruction!r} contains the tag(s) {', '.join(dict.fromkeys(bad))}, which "
            f"tokenizer {tokenizer.path} does not know (it knows {', '.join(known)}); use one of those tags "
            "or plain text in data.instruction, or retrain the tokenizer with that language"
        )


def check_inputs(
    cfg: ExperimentConfig, train_table: pa.Table, val_table: pa.Table | None, tokenizer: RunTokenizer
) -> None:
    """Everything in the manifests and the instruction that the tokenizer must know, train and val.

    The instruction is a config value (UsageError); the manifests' problems are one DataError."""
    check_instruction(cfg.data.instruction, tokenizer)
    train_name = "data.input_cfg" if cfg.data.input_cfg is not None else f"manifest {cfg.data.train_manifest}"
    rule = cfg.data.text_normalize
    problems = check_table(train_table, train_name, tokenizer)
    problems += coverage_problems(train_table, train_name, tokenizer, rule)
    if val_table is not None:
        val_name = f"val manifest {cfg.data.val_manifest}"
        problems += check_table(val_table, val_name, tokenizer)
        problems += coverage_problems(val_table, val_name, tokenizer, rule)
    if problems:
        raise DataError(" ".join(p if p.endswith(".") else p + "." for p in problems))
    check_eval_metrics(cfg, train_table, val_table)


def check_eval_metrics(cfg: ExperimentConfig, train_table: pa.Table, val_table: pa.Table | None) -> None:
    """Every task of an evaluated split has a metric (trainer.eval_metrics), and trainer.best_metric is a
    metric the validation produces (when there is one): refused now, not at the first validation."""
    spec = MetricSpec.from_config(cfg)
    evaluated = {"val": (val_table, f"val manifest {cfg.data.val_manifest}")}
    split = final_eval_split(cfg)
    if split in ("train", "both") or cfg.trainer.val_train_batches > 0:
        train_name = "data.input_cfg" if cfg.data.input_cfg is not None else cfg.data.train_manifest
        why = (
            f"trainer.final_eval_split={split}" if split in ("train", "both") else "trainer.val_train_batches"
        )
        evaluated["train"] = (train_table, f"training data {train_name} ({why})")
    for table, where in evaluated.values():
        if table is not None:
            for task in sorted({task for task, _ in table_pairs(table)}):
                spec.check_task(task, where)
    if val_table is not None and cfg.trainer.val_every > 0:
        name = cfg.trainer.best_metric
        if name.startswith("train_") and cfg.trainer.val_train_batches == 0:
            raise UsageError(
                f"trainer.best_metric={name!r} is a training-split metric but trainer.val_train_batches=0 (the "
                "validation decodes no training rows): set trainer.val_train_batches=N, or name a val metric"
            )
        # a train_ key: the training rows are chosen in the val split's (task, language) proportions
        spec.check_best_metric(name.removeprefix("train_"), table_pairs(val_table), evaluated["val"][1])


# --- the figures of the validator's data-side rules ---------------------------------------------------
def summarize(table: pa.Table, cfg: ExperimentConfig) -> dict[str, Any]:
    """manifest_summary for the validator's data rules: n_rows, max_duration (seconds: the longest row the
    plan keeps, data.max_duration applied) with its encoder frames (max_encoder_frames), median_duration
    (of those rows) and, under a token
    budget, max_tokens (the longest row's audio + text + prompt tokens, as the sampler counts them)."""
    durations = table.column("duration").to_numpy()
    if cfg.data.max_duration is not None:
        kept = durations[durations <= np.float32(cfg.data.max_duration)]
        if len(durations) and not len(kept):  # the sampler would raise this after the model is built
            raise DataError(too_long_message(durations, cfg.data.max_duration))
        durations = kept
    longest = float(durations.max()) if len(durations) else 0.0
    subsampling = token_cost_of(cfg.model).encoder_subsampling
    summary = {
        "n_rows": len(table),
        "max_duration": longest,
        "median_duration": float(np.median(durations)) if len(durations) else 0.0,
        "max_encoder_frames": planned_encoder_frames(longest, subsampling),
    }
    if cfg.sampler.max_batch_tokens is not None:
        summary["max_tokens"] = longest_row_tokens(cfg, table)
    return summary


def summarize_plan(
    cfg: ExperimentConfig, table: pa.Table, world_size: int, *, dp_rank: int = 0
) -> tuple[dict[str, Any], Any]:
    """(the plan's figures for `epoch-plan-too-short`, the sampler of `dp_rank`, or None when it has no plan).

    Call it once the validator's other rules pass (a valid layout and budget, enough rows): it builds
    epoch 0's plan as training does (`speechlm.data.sampler.build.build_sampler`), once, and returns
    `plan_micro_batches` (packed in the epoch) and `plan_batches_per_rank` (0 when the plan cannot give
    every dp rank a full optimizer step, which the sampler would raise on).
    """
    dims = ParallelDims.from_config(world_size, cfg.parallel)
    sampler = build_sampler(cfg, table, dp_rank=dp_rank, dp_size=dims.dp)
    try:
        per_rank = len(sampler)  # builds epoch 0's plan
    except EpochTooShortError as e:
        return {"plan_micro_batches": e.n_batches, "plan_batches_per_rank": 0}, None
    packed = len(sampler.plan.batch_offsets) - 1
    return {"plan_micro_batches": packed, "plan_batches_per_rank": per_rank}, sampler


# --- speechlm validate -------------------------------------------------------------------------------
def validate_data(
    cfg: ExperimentConfig, manifest: str | None = None
) -> tuple[dict[str, Any] | None, Any, Any, list[str]]:
    """The file checks of train for `speechlm validate`.

    Returns (manifest_summary or None, the config as checked, the train table or None, notes on what
    was skipped); `summarize_plan(config, table, ...)` gives the plan's figures once the other rules pass.

    `manifest` (--manifest) replaces the config's training data and must exist; otherwise the config's
    data.input_cfg or data.train_manifest is used when it exists. The tokenizer and val manifest are
    checked when they exist. Raises the same errors as train for the files it reads.
    """
    notes: list[str] = validate_llm(cfg)
    facts = tokenizer_summary(cfg)
    tok_facts = facts if facts["tokenizer_kind"] == "hf" or facts["llm_pretrained"] else {}
    if manifest is not None:
        data = dataclasses.replace(cfg.data, train_manifest=manifest, input_cfg=None)
        cfg = dataclasses.replace(cfg, data=data)
    elif cfg.data.input_cfg is None and not (
        cfg.data.train_manifest and Path(cfg.data.train_manifest).exists()
    ):
        where = (
            f"data.train_manifest {cfg.data.train_manifest} does not exist here"
            if cfg.data.train_manifest
            else "data.train_manifest is not set"
        )
        notes.append(
            f"data rules not run: {where}; pass --manifest M (or set data.train_manifest) to check the "
            "data as `speechlm train` does"
        )
        return tok_facts or None, cfg, None, notes
    if cfg.data.val_manifest and not Path(cfg.data.val_manifest).exists():
        notes.append(f"val manifest {cfg.data.val_manifest} not checked: it does not exist here")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_manifest=None))
    train_table, val_table = open_manifests(cfg)
    path, kind = tokenizer_source(cfg)
    found = path is not None and (Path(path).is_dir() or Path(f"{tokenizer_prefix(path)}.model").exists())
    refused = bool(cfg.model.llm.pretrained) and kind == "sentencepiece"
    if found and not (refused and not cfg.data.allow_sentencepiece_with_pretrained):
        tokenizer = load_run_tokenizer(cfg, manifest_langs(train_table, val_table))
        check_inputs(cfg, train_table, val_table, tokenizer)
        build_run_prompt(cfg, tokenizer)  # a template that cannot be split fails here, as in train
    elif found:
        notes.append("languages and tags not checked: the tokenizer is refused (see the findings)")
    else:
        notes.append(
            f"languages and tags not checked: data.tokenizer {cfg.data.tokenizer} does not exist here"
        )
    return {**summarize(train_table, cfg), **tok_facts}, cfg, train_table, notes
