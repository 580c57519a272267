"""Typed experiment config: dataclasses composed into one `ExperimentConfig`.

YAML is for storage; dotted overrides (`model.packed_sequences=true`) change single fields on the
command line (`split_override` reads them, for every command). Unknown keys are errors that name the
key and list the valid ones, so a typo never silently falls back to a default. Each key is declared
once, as a section field `key(default, doc, rule)`: type, default, meaning and valid values; from it
come the checks, the messages and docs/config.md. A choice field is a `Literal` type, refused while
parsing when the value is not one of its members; each section's `validate()` checks its keys' rules
and the rules among them, and `ExperimentConfig.validate()` the rules across sections. Rules of the
parallel layout live in the validator (parallel/validator/).

    choices.py     the Literal types of the choice keys
    rules.py       valid values: Num, OneOf, Text, Flag, Seq, ...
    keys.py        key(), the field metadata, Section.validate, ConfigError
    data.py        DataConfig, SamplerConfig
    model.py       EncoderConfig, LoRAConfig, LLMConfig, ModelConfig
    run.py         ParallelConfig, OptimConfig, TrainerConfig
    experiment.py  ExperimentConfig, KEYS (every key by dotted name), require_inputs, derived settings
    overrides.py   dotted overrides: split_override, parse_command_line
    load.py        load_config: YAML, overrides, type conversion, input paths; to_dict
    docs.py        docs/config.md
"""

from speechlm.config.choices import (
    ATTENTION_BACKENDS,
    ENCODER_KINDS,
    LLM_FAMILIES,
    AttentionBackend,
    ConvNorm,
    CPAttention,
    CTCReduction,
    EncoderKind,
    EncoderTrain,
    FinalEvalSplit,
    LangTags,
    LLMFamily,
    LLMTrain,
    LossTurns,
    Precision,
    ReadMode,
    ResumeData,
    SampleRate,
    SamplerMode,
    SplitAuto,
    TextNormalize,
    choices_of,
)
from speechlm.config.data import DataConfig, SamplerConfig
from speechlm.config.docs import CROSS_FIELD_RULES
from speechlm.config.experiment import (
    KEYS,
    ExperimentConfig,
    check_config,
    eval_batch_duration,
    final_eval_split,
    get_key,
    leaf_keys,
    require_inputs,
)
from speechlm.config.keys import ConfigError, KeySpec, MissingInputError, Section, key
from speechlm.config.load import (
    REMOVED_KEYS,
    SWEEP_SPEC_KEYS,
    apply_override,
    clone,
    from_dict,
    load_config,
    resolve_config_paths,
    resolve_path_value,
    to_dict,
)
from speechlm.config.model import LORA_TARGETS_DEFAULT, EncoderConfig, LLMConfig, LoRAConfig, ModelConfig
from speechlm.config.overrides import is_override, parse_command_line, split_override
from speechlm.config.rules import (
    SEED_MAX,
    TRAIN_PREFIX,
    Either,
    Flag,
    InputList,
    MetricName,
    Names,
    Num,
    OneOf,
    Rule,
    Seq,
    TaskLists,
    Text,
)
from speechlm.config.run import OptimConfig, ParallelConfig, TrainerConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "CROSS_FIELD_RULES",
    "ENCODER_KINDS",
    "KEYS",
    "LLM_FAMILIES",
    "LORA_TARGETS_DEFAULT",
    "REMOVED_KEYS",
    "SEED_MAX",
    "SWEEP_SPEC_KEYS",
    "TRAIN_PREFIX",
    "AttentionBackend",
    "CPAttention",
    "CTCReduction",
    "ConfigError",
    "ConvNorm",
    "DataConfig",
    "Either",
    "EncoderConfig",
    "EncoderKind",
    "EncoderTrain",
    "ExperimentConfig",
    "FinalEvalSplit",
    "Flag",
    "InputList",
    "KeySpec",
    "LLMConfig",
    "LLMFamily",
    "LLMTrain",
    "LangTags",
    "LoRAConfig",
    "LossTurns",
    "MetricName",
    "MissingInputError",
    "ModelConfig",
    "Names",
    "Num",
    "OneOf",
    "OptimConfig",
    "ParallelConfig",
    "Precision",
    "ReadMode",
    "ResumeData",
    "Rule",
    "SampleRate",
    "SamplerConfig",
    "SamplerMode",
    "Section",
    "Seq",
    "SplitAuto",
    "TaskLists",
    "Text",
    "TextNormalize",
    "TrainerConfig",
    "apply_override",
    "check_config",
    "choices_of",
    "clone",
    "eval_batch_duration",
    "final_eval_split",
    "from_dict",
    "get_key",
    "is_override",
    "key",
    "leaf_keys",
    "load_config",
    "parse_command_line",
    "require_inputs",
    "resolve_config_paths",
    "resolve_path_value",
    "split_override",
    "to_dict",
]
