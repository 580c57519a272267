"""`ExperimentConfig`, the whole experiment (one field per section), its rules across sections, and what
the rest of the code asks of a loaded config (its keys, the inputs training needs, derived settings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from speechlm.config.data import DataConfig, SamplerConfig
from speechlm.config.keys import ConfigError, KeySpec, MissingInputError, Section, key_specs
from speechlm.config.model import ModelConfig
from speechlm.config.run import OptimConfig, ParallelConfig, TrainerConfig


@dataclass
class ExperimentConfig(Section):
    """The whole experiment; `validate()` checks every section, then the rules across sections."""

    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def problems(self) -> list[str]:
        d, t = self.data, self.trainer
        out = []
        if d.val_manifest is None:
            if t.final_eval_split in ("val", "both"):
                out.append(
                    f"trainer.final_eval_split={t.final_eval_split!r} but data.val_manifest is not set: set "
                    "data.val_manifest=PATH, or use trainer.final_eval_split=train or none"
                )
            if t.val_every > 0:
                out.append(
                    f"trainer.val_every={t.val_every} but data.val_manifest is not set, so nothing would be "
                    "validated: set data.val_manifest=PATH, or trainer.val_every=0"
                )
        return out


# every key of the config by dotted name, read from the sections' fields (the one declaration of each key)
KEYS: Mapping[str, KeySpec] = MappingProxyType(key_specs(ExperimentConfig))


def leaf_keys(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config (the fields that are not sections)."""
    return list(key_specs(cls, prefix))


def get_key(cfg: Any, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_config(cfg: ExperimentConfig, origin: Mapping[str, str] | None = None) -> None:
    """`cfg.validate(origin)`: every section's keys against their rules and its own rules, then the rules
    across sections.

    The parallel layout rules (sizes against the world size, backends, ...) live in the validator.
    `origin` maps dotted keys to where they were set (a file or the command line) for the message.
    """
    cfg.validate(origin)


def require_inputs(cfg: ExperimentConfig) -> None:
    """What training reads and has no default: the training data and the tokenizer."""
    if cfg.data.train_manifest is None and cfg.data.input_cfg is None:
        raise ConfigError(
            "no training data: set data.train_manifest=PATH (a manifest, shard folder, NeMo manifest, ...) "
            "or data.input_cfg (several weighted datasets) in the config or on the command line"
        )
    if cfg.data.tokenizer is None and cfg.model.llm.pretrained is None:
        raise ConfigError(
            "no tokenizer: set data.tokenizer=PATH (a .model file; build one with `speechlm tokenizer train`), "
            "or model.llm.pretrained=DIR to use that LLM's own tokenizer"
        )
    # input paths that are set must exist (trainer.resume is checked by the resume code, which knows
    # what a checkpoint is); named resolved, so a wrong folder shows
    for key in ("data.train_manifest", "data.val_manifest", "data.tokenizer", "data.input_cfg",
                "model.encoder.pretrained", "model.llm.pretrained"):  # fmt: skip
        value = get_key(cfg, key)
        if isinstance(value, str) and not Path(value).exists():
            make = {
                "data.tokenizer": "; train one with `speechlm tokenizer train`",
                "data.train_manifest": "; build one with `speechlm manifest build`",
                "data.val_manifest": "; build one with `speechlm manifest build` (or set it to null)",
            }.get(key, "")
            raise MissingInputError(
                f"{key}={value} does not exist{make}; a relative path in a config file resolves against "
                "the file's folder, one on the command line against the working directory"
            )


def final_eval_split(cfg: ExperimentConfig) -> str:
    """The split the final evaluation scores: "train", "val", "both" or "none" ("auto": val if there is one)."""
    split = cfg.trainer.final_eval_split
    if split == "auto":
        return "val" if cfg.data.val_manifest is not None else "none"
    return split


def eval_batch_duration(cfg: ExperimentConfig) -> float:
    """Seconds of audio per greedy-decoding batch: `trainer.eval_batch_duration`, else 4x the training budget."""
    if cfg.trainer.eval_batch_duration is not None:
        return float(cfg.trainer.eval_batch_duration)
    return 4.0 * float(cfg.sampler.max_batch_duration or 60.0)
