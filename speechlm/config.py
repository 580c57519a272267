"""Typed experiment config: dataclasses composed into one `ExperimentConfig`.

YAML is for storage; dotted overrides (`model.packed_sequences=true`) change single fields on the
command line. Unknown keys are errors that name the key and list the valid ones, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from parallel.backend_caps import BACKENDS
from speechlm.errors import UsageError

ATTENTION_BACKENDS = tuple(BACKENDS)  # one owner: the capability table (parallel/backend_caps.py)


class ConfigError(UsageError):
    """A config file or override that cannot be applied; the message names the file and key."""


@dataclass
class DataConfig:
    train_manifest: str = "data/demo_manifest/train.parquet"
    val_manifest: str | None = "data/demo_manifest/val.parquet"
    tokenizer: str = "data/demo_manifest/tokenizer.model"
    sample_rate: int = 16000
    max_tokens: int = 512  # text tokens per utterance after tokenization (truncated beyond)
    num_workers: int = 0
    instruction: str = ""  # optional instruction placed after the audio in the prompt
    # unreadable/missing audio is dropped and counted; more than this fraction of one training micro-batch
    # dropped stops the run with the file names (1.0: never stop)
    max_dropped_fraction: float = 0.5
    # "indexed": the sampler's epoch plan, each clip read by position (tar member or file); "streaming":
    # tar shards read front to back per DataLoader worker, for filesystems where random reads are slow
    # (speechlm.data.sampler.streaming); buffers in utterances
    read_mode: str = "indexed"
    # several datasets weighted against each other (speechlm/data/sources/input_cfg.py): a list of
    # {path, type?, weight?, lang?, name?, tags?} or {group, weight?, inputs: [...]}, or a YAML file of
    # one; replaces train_manifest
    input_cfg: list[Any] | str | None = None
    shuffle_buffer: int = 2000
    sort_buffer: int = 500


@dataclass
class SamplerConfig:
    mode: str = "temperature"  # "temperature" (default) or "exhaustive" (the inherited algorithm)
    temperature: float = 0.3
    max_batch_duration: float | None = 90.0  # seconds of audio per micro-batch
    max_batch_tokens: int | None = None  # token budget instead of seconds (overrides duration)
    length_penalty: float = 0.0  # quadratic length penalty for the token budget
    bucket_boundaries: list[float] = field(default_factory=lambda: [3.0, 5.0, 8.0, 12.0, 16.0])
    epoch_size: int | None = None  # utterances per epoch in temperature mode (default: manifest size)
    seed: int = 0


@dataclass
class EncoderConfig:
    kind: str = "parakeet"  # "parakeet", "whisper" or "nemo"
    pretrained: str | None = None  # local directory (transformers) or .nemo file
    hidden_size: int = 176
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 704
    subsampling_conv_channels: int = 64
    num_mel_bins: int = 80
    tensor_parallel: bool = False
    # normalisation in the Conformer conv module: "auto" (layer_norm from scratch, batch_norm for a
    # pretrained encoder), "layer_norm" (over channels, per frame) or "batch_norm" (frozen running stats)
    conv_norm: str = "auto"
    # padding-free encoder (features, subsampling, conformer layers on real frames only); None: on
    # where the encoder kind supports it (parakeet), off elsewhere. true with whisper/nemo: validator error
    packed: bool | None = None


@dataclass
class LLMConfig:
    family: str = "llama"  # "llama" or "qwen2" when built from a config
    pretrained: str | None = None  # local directory for AutoModelForCausalLM
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 4096


@dataclass
class ModelConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    projector_stack: int = 2  # frames stacked by the projector
    projector_hidden: int = 512
    packed_sequences: bool = True  # THD packing (true) or padded BSHD (false)
    # multiple of the packed total (THD) or of the padded length (BSHD); None: the smallest legal one,
    # lcm(2*cp, cp*tp) (tp when cp=1). Set e.g. 64 for tensor cores; it must be a multiple of that unit.
    pad_to_multiple: int | None = None
    attention_backend: str = "reference"
    dropout: float = 0.0  # 0 turns off every source of randomness in the forward pass
    ctc_weight: float = 0.3  # auxiliary CTC loss on the encoder output; 0 disables it


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world size
    cp_size: int = 1
    tp_size: int = 1
    cp_attention: str = "ring"  # "ring" or "allgather" (reference backend under CP)
    # dynamic CP: sequences longer than this many tokens are split over the CP group, shorter ones live
    # whole on one CP rank; "auto": per micro-batch, split the fewest longest ones that keep the CP
    # ranks' modelled cost within 5% of the mean; 0 splits all (the layout before dynamic CP)
    cp_split_threshold: int | str = "auto"
    activation_checkpointing: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-3
    encoder_lr: float | None = None  # default: lr
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    unfreeze_step: int = 0  # encoder frozen before this optimizer step (0: never frozen)
    encoder_warmup_steps: int = 0


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    max_minutes: float | None = None  # wall-clock limit (checked between optimizer steps)
    grad_accum: int = 1
    precision: str = "auto"  # "auto" (bf16 autocast where supported), "32", "bf16"
    seed: int = 0
    run_dir: str = "runs/demo"
    log_every: int = 1
    val_every: int = 0  # optimizer steps; 0 disables periodic validation
    val_max_batches: int | None = None
    # seconds of audio per greedy-decoding batch (validation, final WER); None: 4x sampler.max_batch_duration.
    # Decoding keeps no activations for backward, so its batches can be larger than training's, and the
    # KV-cache decoder gains most from wide batches (docs/benchmarks.md, greedy decoding)
    eval_batch_duration: float | None = None
    ckpt_every: int = 0  # optimizer steps; 0 disables periodic checkpoints
    keep_last: int = 2
    best_metric: str = "wer"
    early_stopping_patience: int = 0  # validations without improvement; 0 disables
    resume: str | None = None  # "auto" or a checkpoint directory
    # "exact": continue the saved epoch plan at the next unconsumed micro-batch (same dp size, seed and
    # manifest required); "next_epoch": restore model, optimizer and step but start the data at the next
    # epoch — for resuming into a different data-parallel layout, where the old plan has no meaning
    resume_data: str = "exact"
    validate_only: bool = (
        False  # evaluate only (restoring trainer.resume if set): no optimizer step, no backward
    )
    final_eval_split: str = "train"  # "train" or "val": the split scored into eval.json
    # [ckpt engineer] a new run in a run_dir that holds another run moves that run to RUN_DIR.old-<UTC time>
    overwrite: bool = False


@dataclass
class ExperimentConfig:
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Convert a YAML/override value to the declared type, or raise naming the key."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r} for '{key}'")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' must be a mapping, got {value!r}")
        return _from_dict(tp, value, where, prefix=key + ".")  # type: ignore[arg-type]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where}: '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: '{key}' must be an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: '{key}' must be an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: '{key}' must be a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: '{key}' must be a string, got {value!r}")
        return str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: '{key}' must be a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, key, where) if inner is not Any else v for v in value]
        return tuple(items) if origin is tuple else items
    return value


def _from_dict(cls: type, data: dict[str, Any], where: str, prefix: str = "") -> Any:
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key '{prefix}{unknown[0]}'; valid keys under "
            f"'{prefix.rstrip('.') or '<root>'}' are: {', '.join(sorted(types_))}"
        )
    kwargs = {k: _coerce(v, types_[k], prefix + k, where) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)

    def fix(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: fix(v) for k, v in d.items()}
        if isinstance(d, tuple):
            return [fix(v) for v in d]
        return d

    return fix(out)


def apply_override(cfg: ExperimentConfig, override: str, where: str = "command line") -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML then type-checked."""
    if "=" not in override:
        raise ConfigError(f"{where}: override {override!r} must look like key.path=value")
    key, raw = override.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        types_ = _field_types(type(obj))
        if part not in types_:
            parent = ".".join(parts[:i]) or "<root>"
            raise ConfigError(
                f"{where}: unknown key '{key}'; valid keys under '{parent}' are: {', '.join(sorted(types_))}"
            )
        if i == len(parts) - 1:
            value = yaml.safe_load(raw) if raw.strip() else ""
            if types_[part] is str and not isinstance(value, str):
                value = raw  # keep strings such as "32" verbatim
            setattr(obj, part, _coerce(value, types_[part], key, where))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"{where}: '{'.'.join(parts[: i + 1])}' is not a section")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    cfg = ExperimentConfig()
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"{p}: cannot read config ({e.strerror or e})") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        cfg = _from_dict(ExperimentConfig, data, str(p))
    for ov in overrides:
        apply_override(cfg, ov)
    check_config(cfg)
    return cfg


def check_config(cfg: ExperimentConfig) -> None:
    """Checks of single values (cross-field parallelism rules live in the validator)."""
    if cfg.model.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"model.attention_backend={cfg.model.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if cfg.model.encoder.conv_norm not in ("auto", "layer_norm", "batch_norm"):
        raise ConfigError(
            f"model.encoder.conv_norm={cfg.model.encoder.conv_norm!r}: use 'auto', 'layer_norm' or 'batch_norm'"
        )
    if cfg.sampler.mode not in ("temperature", "exhaustive"):
        raise ConfigError(f"sampler.mode={cfg.sampler.mode!r}: use 'temperature' or 'exhaustive'")
    if cfg.parallel.cp_attention not in ("ring", "allgather"):
        raise ConfigError(f"parallel.cp_attention={cfg.parallel.cp_attention!r}: use 'ring' or 'allgather'")
    t = cfg.parallel.cp_split_threshold
    if (isinstance(t, str) and t != "auto") or (isinstance(t, int) and t < 0):
        raise ConfigError(
            f"parallel.cp_split_threshold={t!r}: use 'auto', 0 (split every sequence over the CP group) or a "
            "number of tokens above which a sequence is split"
        )
    for name in ("cp_size", "tp_size", "dp_replicate"):
        if getattr(cfg.parallel, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(cfg.parallel, name)}")
    if not 0.0 <= cfg.data.max_dropped_fraction <= 1.0:
        raise ConfigError(
            f"data.max_dropped_fraction={cfg.data.max_dropped_fraction}: use a fraction in [0, 1] (1 never stops)"
        )
    if cfg.data.input_cfg is not None and cfg.data.train_manifest != DataConfig.train_manifest:
        raise ConfigError(
            f"data.input_cfg and data.train_manifest={cfg.data.train_manifest!r} are both set: give the "
            "training data one way (a single dataset can be one entry of data.input_cfg)"
        )
    if cfg.data.read_mode not in ("indexed", "streaming"):
        raise ConfigError(
            f"data.read_mode={cfg.data.read_mode!r}: use 'indexed' (any order, reads by position) or "
            "'streaming' (tar shards read front to back, for slow random reads)"
        )
    if cfg.data.shuffle_buffer < 1 or cfg.data.sort_buffer < 1:
        raise ConfigError(
            f"data.shuffle_buffer={cfg.data.shuffle_buffer} and data.sort_buffer={cfg.data.sort_buffer} "
            "must be >= 1 utterance"
        )
    if cfg.trainer.resume_data not in ("exact", "next_epoch"):
        raise ConfigError(f"trainer.resume_data={cfg.trainer.resume_data!r}: use 'exact' or 'next_epoch'")
    if cfg.trainer.eval_batch_duration is not None and cfg.trainer.eval_batch_duration <= 0:
        raise ConfigError(
            f"trainer.eval_batch_duration={cfg.trainer.eval_batch_duration}: give seconds > 0 (or null)"
        )
    if cfg.trainer.grad_accum < 1:
        raise ConfigError(f"trainer.grad_accum must be >= 1, got {cfg.trainer.grad_accum}")


def eval_batch_duration(cfg: ExperimentConfig) -> float:
    """Seconds of audio per greedy-decoding batch: `trainer.eval_batch_duration`, else 4x the training budget."""
    if cfg.trainer.eval_batch_duration is not None:
        return float(cfg.trainer.eval_batch_duration)
    return 4.0 * float(cfg.sampler.max_batch_duration or 60.0)


def clone(cfg: ExperimentConfig) -> ExperimentConfig:
    return copy.deepcopy(cfg)
