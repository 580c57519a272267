"""Pre-launch checks of a parallel layout: rule tables over one pure context.

`validate(config, world_size, env, device_capability, installed)` answers "will this layout run,
and run correctly?" in milliseconds, before any process group, model or data exists. Everything
it knows arrives as an argument: the environment variables, the GPU's compute capability (None for
CPU) and the installed versions of torch, transformer-engine, flash-attn and cuDNN. Nothing is read
from the machine here, so a laptop can validate a 64-GPU job by passing the job's values.

One concern per module:
- `context`: `ValidationContext` and `build_context`, which reads the arguments once (dp_shard=-1
  resolved by `parallel.mesh.resolve_dp_shard`, the backend's capabilities, the rounding unit, the
  capability and the installed package names normalized);
- `versions`: reading version strings and `VERSION_TABLE`, the version ranges a backend cannot use;
- `rules`: the `Rule` row and `PARALLEL_RULES`, the table of parallelism rules; `docs/validator.md`
  is generated from the full table by `scripts/gen_validator_docs.py`;
- `engine`: `evaluate`, `validate`, `has_errors`, `check_or_raise`;
- `report`: `Finding`, `ValidationError`, `format_findings`.

`speechlm.preflight.rules.RULES` is `PARALLEL_RULES` followed by the training rules (sampler budget,
encoder packing, gradient accumulation); `speechlm validate` and the trainer run that full table.

The config is duck-typed (the attributes of `speechlm.config.ExperimentConfig`); fields that the
config may not have yet are read with getattr and a default. The rules tie keys together (sizes
against the world size, backends against the layout and the GPU); the range or choice set of a
single key is the config's (`ExperimentConfig.validate()`, which `build_context` runs first). No torch import; the standard library
only, except `packaging` (a dependency of the project) for reading versions in `versions`.
"""

from parallel.validator.context import (
    MODULE_DISTRIBUTIONS,
    READ_ENV_KEYS,
    REFERENCE_SCALE_WORLD_SIZE,
    ValidationContext,
    build_context,
    normalize_installed,
    parse_capability,
    required_packages,
)
from parallel.validator.engine import check_or_raise, evaluate, has_errors, validate
from parallel.validator.report import ERROR, WARNING, Finding, Level, ValidationError, format_findings
from parallel.validator.rules import (
    CPU_FORWARD_ONLY,
    FUSED_ATTN_BROKEN_CAPABILITIES,
    HALF_PRECISION_ONLY,
    MIN_CAPABILITY,
    PARALLEL_RULES,
    Applies,
    Rule,
)
from parallel.validator.versions import (
    VERSION_TABLE,
    VersionRange,
    in_range,
    parse_version,
    try_parse_version,
)

__all__ = [
    "CPU_FORWARD_ONLY",
    "ERROR",
    "FUSED_ATTN_BROKEN_CAPABILITIES",
    "HALF_PRECISION_ONLY",
    "MIN_CAPABILITY",
    "MODULE_DISTRIBUTIONS",
    "PARALLEL_RULES",
    "READ_ENV_KEYS",
    "REFERENCE_SCALE_WORLD_SIZE",
    "VERSION_TABLE",
    "WARNING",
    "Applies",
    "Finding",
    "Level",
    "Rule",
    "ValidationContext",
    "ValidationError",
    "VersionRange",
    "build_context",
    "check_or_raise",
    "evaluate",
    "format_findings",
    "has_errors",
    "in_range",
    "normalize_installed",
    "parse_capability",
    "parse_version",
    "required_packages",
    "try_parse_version",
    "validate",
]
