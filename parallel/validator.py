"""Pre-launch checks of a parallel layout: one table of rules over one pure context.

`validate(config, world_size, env, device_capability, installed)` answers "will this layout run,
and run correctly?" in milliseconds, before any process group, model or data exists. Everything
it knows arrives as an argument: the environment variables, the GPU's compute capability (None for
CPU) and the installed versions of torch, transformer-engine, flash-attn and cuDNN. Nothing is read
from the machine here, so a laptop can validate a 64-GPU job by passing the job's values.

How it is built:
- `build_context` turns the arguments into a `ValidationContext` once (dp_shard=-1 resolved to
  `world_size // (dp_replicate * cp * tp)`, the backend's capabilities, the rounding unit, ...).
- `RULES` is the table. A row is (id, level, applies, reason, fix, doc). `applies(ctx)` returns a
  falsy value when the rule does not fire, or True / a detail string / a list of detail strings
  when it does. `reason` and `fix` are `str.format` templates over `ctx.template_fields()` plus
  `{details}` (or callables of (ctx, details)). `doc` explains the rule in docs/validator.md, which
  `scripts/gen_validator_docs.py` generates from this same table.
- A level that depends on the context is two rows with distinct ids (e.g. `te-fused-attn-sm120`,
  an error, and `te-fused-attn`, a warning), so each id always has one level.
- `VERSION_TABLE` lists version ranges a backend cannot use, each with its reason and source.

The config is duck-typed (the attributes of `speechlm.config.ExperimentConfig`); fields that the
config may not have yet are read with getattr and a default. Standard library only.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from parallel.backend_caps import BACKENDS, BackendCaps, thd_backends
from parallel.rounding import rounding_unit

Level = Literal["error", "warning"]
ERROR: Level = "error"
WARNING: Level = "warning"

# compute capabilities on which transformer-engine's cuDNN fused attention backward amplifies
# gradients with THD inputs (finite loss first, then divergence); NVTE_FUSED_ATTN=0 is required there
FUSED_ATTN_BROKEN_CAPABILITIES: frozenset[tuple[int, int]] = frozenset({(12, 0)})
# oldest GPU generation each backend's kernels run on (FlashAttention-2 kernels: Ampere, sm_80, and newer)
MIN_CAPABILITY: dict[str, tuple[int, int]] = {"flash": (8, 0), "torch_varlen": (8, 0)}
# backends whose forward runs on CPU although the backward does not (validation-only runs are fine)
CPU_FORWARD_ONLY: frozenset[str] = frozenset({"flex"})
# backends whose kernels take only fp16/bf16 q/k/v (te: with THD, which runs only on its fused or flash path)
HALF_PRECISION_ONLY: frozenset[str] = frozenset({"flash", "torch_varlen", "te"})
# world size from which the reference backend is flagged as slow on GPUs
REFERENCE_SCALE_WORLD_SIZE = 8
# environment variables the rules read (the only ones echoed in the JSON context)
READ_ENV_KEYS: tuple[str, ...] = ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN")
# distribution name of each backend's import module (backend_caps.module)
MODULE_DISTRIBUTIONS: dict[str, str] = {
    "transformer_engine": "transformer-engine",
    "flash_attn": "flash-attn",
}
_PACKAGE_ALIASES: dict[str, str] = {
    "transformer-engine-torch": "transformer-engine",
    "te": "transformer-engine",
    "flash": "flash-attn",
    "flash-attention": "flash-attn",
}


@dataclass(frozen=True)
class Finding:
    level: Level
    rule_id: str
    reason: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return {"level": self.level, "rule_id": self.rule_id, "reason": self.reason, "fix": self.fix}


class ValidationError(RuntimeError):
    """The layout cannot run; `findings` holds every finding (errors and warnings)."""

    def __init__(self, message: str, findings: Sequence[Finding], report: str = ""):
        super().__init__(message)
        self.findings = list(findings)
        self.report = report or message


# --------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionRange:
    """Versions of `package` that `backend` cannot use: low <= version < high (None: unbounded)."""

    backend: str  # a backend name, or "*" for every backend
    package: str  # distribution name as in `installed`: torch, transformer-engine, flash-attn, cudnn
    low: str | None
    high: str | None
    kind: Literal["minimum", "broken"]  # "minimum": below the oldest supported; "broken": known bad
    reason: str
    source: str


VERSION_TABLE: tuple[VersionRange, ...] = (
    VersionRange(
        backend="*",
        package="torch",
        low=None,
        high="2.6",
        kind="minimum",
        reason="the oldest torch this project supports (its declared dependency torch>=2.6)",
        source="pyproject.toml dependency",
    ),
    VersionRange(
        backend="torch_varlen",
        package="torch",
        low=None,
        high="2.10",
        kind="minimum",
        reason="torch.nn.attention.varlen (varlen_attn) first ships in torch 2.10",
        source="PyTorch 2.10 docs, torch.nn.attention.varlen; pytorch/pytorch#164502 (Oct 2025)",
    ),
    VersionRange(
        backend="flash",
        package="flash-attn",
        low=None,
        high="2.6",
        kind="minimum",
        reason="oldest flash-attn this project supports for its varlen kernels",
        source="pyproject.toml extra `flash` (flash-attn>=2.6)",
    ),
    VersionRange(
        backend="te",
        package="transformer-engine",
        low=None,
        high="1.11",
        kind="minimum",
        reason="oldest transformer-engine this project supports for THD DotProductAttention",
        source="pyproject.toml extra `te` (transformer-engine[pytorch]>=1.11)",
    ),
)


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: '2.13.0+cpu' -> (2, 13, 0, 0), '9.1' -> (9, 1, 0, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if not m:
        raise ValueError(f"cannot read a version number from {text!r}; write it like 2.6.0")
    parts = [int(p) for p in m.group(1).split(".")][:4]
    return tuple(parts + [0] * (4 - len(parts)))


def _try_parse_version(text: str | None) -> tuple[int, ...] | None:
    try:
        return parse_version(text) if text else None
    except ValueError:
        return None


def in_range(version: str, low: str | None, high: str | None) -> bool:
    v = parse_version(version)
    return (low is None or v >= parse_version(low)) and (high is None or v < parse_version(high))


def normalize_installed(installed: Mapping[str, str | None]) -> dict[str, str | None]:
    """Lower-case distribution names with dashes (transformer_engine -> transformer-engine)."""
    out: dict[str, str | None] = {}
    for name, version in installed.items():
        key = str(name).strip().lower().replace("_", "-")
        key = _PACKAGE_ALIASES.get(key, key)
        out[key] = None if version is None or str(version).strip().lower() in ("", "none") else str(version)
    return out


def required_packages(backend: str) -> list[str]:
    """Distributions a backend needs: torch, plus its accelerator package if any."""
    caps = BACKENDS.get(backend)
    packages = ["torch"]
    if caps is not None and caps.module is not None:
        packages.append(MODULE_DISTRIBUTIONS.get(caps.module, caps.module.replace("_", "-")))
    return packages


def parse_capability(value: Any) -> tuple[int, int] | None:
    """(major, minor) from (9, 0), 9.0, '12.0', 'sm_90', 'sm120'; None / 'none' / 'cpu' mean no GPU."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return int(value[0]), int(value[1])
    text = str(value).strip().lower()
    if text in ("", "none", "cpu"):
        return None
    m = re.fullmatch(r"sm_?(\d+)(\d)", text)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = re.fullmatch(r"(\d+)(?:\.(\d+))?", text)
    if m:
        return int(m.group(1)), int(m.group(2) or 0)
    raise ValueError(
        f"device capability {value!r} is not understood; write it like 9.0, 12.0 or sm_90, or none for CPU"
    )


# --------------------------------------------------------------------------------------------
# Context
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValidationContext:
    world_size: int
    dp_replicate: int
    dp_shard: int  # as configured; -1 means "the rest of the world size"
    dp_shard_resolved: int | None  # None when the world size cannot be split that way
    cp: int
    tp: int
    packed: bool
    backend: str
    caps: BackendCaps | None  # None for a backend not in backend_caps
    validate_only: bool
    grad_accum: int
    llm_heads: int
    llm_kv_heads: int
    encoder_heads: int
    encoder_tp: bool
    pad_to_multiple: int | None  # configured rounding (model.pad_to_multiple); None: automatic
    sampler_mode: str
    max_batch_duration: float | None
    max_batch_tokens: int | None
    epoch_size: int | None
    device_capability: tuple[int, int] | None
    env: Mapping[str, str]
    installed: Mapping[str, str | None]
    manifest: Mapping[str, Any] | None
    encoder_kind: str = "parakeet"  # model.encoder.kind
    encoder_packed: bool | None = None  # model.encoder.packed (None: on where supported)
    precision: str = "auto"  # trainer.precision

    @property
    def on_gpu(self) -> bool:
        return self.device_capability is not None

    @property
    def device(self) -> str:
        if self.device_capability is None:
            return "cpu"
        major, minor = self.device_capability
        return f"GPU sm_{major}{minor} (capability {major}.{minor})"

    @property
    def layout(self) -> str:
        return "THD (packed)" if self.packed else "BSHD (padded)"

    @property
    def dp(self) -> int | None:
        return None if self.dp_shard_resolved is None else self.dp_replicate * self.dp_shard_resolved

    @property
    def rounding_unit(self) -> int:
        """Every packed stream length must divide by this: lcm(2cp, cp*tp) under CP, else tp."""
        return rounding_unit(max(self.cp, 1), max(self.tp, 1))

    def env_flag_is_zero(self, key: str) -> bool:
        """True when the variable is set to an integer 0 (how transformer-engine reads NVTE_* flags)."""
        raw = self.env.get(key)
        try:
            return raw is not None and int(raw.strip()) == 0
        except ValueError:
            return False

    def template_fields(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "dp": self.dp,
            "cp": self.cp,
            "tp": self.tp,
            "backend": self.backend,
            "layout": self.layout,
            "device": self.device,
            "grad_accum": self.grad_accum,
            "rounding_unit": self.rounding_unit,
            "pad_to_multiple": self.pad_to_multiple,
            "thd_backends": ", ".join(thd_backends()),
            "bshd_backends": ", ".join(n for n, b in BACKENDS.items() if b.bshd),
            "cp_backends": ", ".join(n for n, b in BACKENDS.items() if b.cp),
            "cpu_backends": ", ".join(n for n, b in BACKENDS.items() if b.cpu),
            "known_backends": ", ".join(BACKENDS),
            "nvte_fused_attn": _show_env(self.env.get("NVTE_FUSED_ATTN")),
            "scale_world_size": REFERENCE_SCALE_WORLD_SIZE,
        }

    def describe(self) -> str:
        dp = "?" if self.dp is None else str(self.dp)
        return (
            f"dp={dp}, cp={self.cp}, tp={self.tp}, world={self.world_size}, backend={self.backend}, "
            f"packed={str(self.packed).lower()}"
        )

    def as_dict(self) -> dict[str, Any]:
        cap = self.device_capability
        return {
            "world_size": self.world_size,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "dp_shard_resolved": self.dp_shard_resolved,
            "cp_size": self.cp,
            "tp_size": self.tp,
            "packed_sequences": self.packed,
            "attention_backend": self.backend,
            "validate_only": self.validate_only,
            "device_capability": None if cap is None else f"{cap[0]}.{cap[1]}",
            "env": {k: self.env[k] for k in READ_ENV_KEYS if k in self.env},
            "installed": dict(self.installed),
            "rounding_unit": self.rounding_unit,
        }


def _show_env(raw: str | None) -> str:
    return "unset" if raw is None else f"set to {raw!r}"


def _resolve_dp_shard(world_size: int, dp_replicate: int, dp_shard: int, cp: int, tp: int) -> int | None:
    if dp_shard != -1:
        return dp_shard if dp_shard >= 1 else None
    rest = dp_replicate * cp * tp
    if rest < 1 or world_size % rest or world_size < rest:
        return None
    return world_size // rest


def build_context(
    config: Any,
    world_size: int,
    env: Mapping[str, str],
    device_capability: Any,
    installed: Mapping[str, str | None],
    manifest_summary: Mapping[str, Any] | None = None,
) -> ValidationContext:
    """Read everything the rules need from the arguments, once."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    par, model, trainer, sampler = config.parallel, config.model, config.trainer, config.sampler
    dp_replicate, dp_shard = int(par.dp_replicate), int(par.dp_shard)
    cp, tp = int(par.cp_size), int(par.tp_size)
    backend = str(model.attention_backend)
    pad = getattr(model, "pad_to_multiple", None)
    return ValidationContext(
        world_size=world_size,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        dp_shard_resolved=_resolve_dp_shard(world_size, dp_replicate, dp_shard, cp, tp),
        cp=cp,
        tp=tp,
        packed=bool(model.packed_sequences),
        backend=backend,
        caps=BACKENDS.get(backend),
        validate_only=bool(getattr(trainer, "validate_only", False)),
        grad_accum=int(getattr(trainer, "grad_accum", 1)),
        llm_heads=int(model.llm.num_heads),
        llm_kv_heads=int(getattr(model.llm, "num_kv_heads", None) or model.llm.num_heads),
        encoder_heads=int(model.encoder.num_heads),
        encoder_tp=bool(getattr(model.encoder, "tensor_parallel", False)),
        pad_to_multiple=None if pad is None else int(pad),
        sampler_mode=str(getattr(sampler, "mode", "temperature")),
        max_batch_duration=getattr(sampler, "max_batch_duration", None),
        max_batch_tokens=getattr(sampler, "max_batch_tokens", None),
        epoch_size=getattr(sampler, "epoch_size", None),
        device_capability=parse_capability(device_capability),
        env=dict(env),
        installed=normalize_installed(installed),
        manifest=dict(manifest_summary) if manifest_summary is not None else None,
        encoder_kind=str(getattr(model.encoder, "kind", "parakeet")),
        encoder_packed=getattr(model.encoder, "packed", None),
        precision=str(getattr(trainer, "precision", "auto")),
    )


# --------------------------------------------------------------------------------------------
# Rule table
# --------------------------------------------------------------------------------------------

Applies = Callable[[ValidationContext], bool | str | list[str]]


@dataclass(frozen=True)
class Rule:
    id: str  # stable kebab-case id; an interface (scripts and docs refer to it)
    level: Level
    when: str  # the condition in words, for the docs' index
    applies: Applies
    reason: str | Callable[[ValidationContext, str], str]  # template over template_fields() + {details}
    fix: str | Callable[[ValidationContext, str], str]  # the same; a callable's docstring goes in the docs
    doc: str  # why the rule exists, for docs/validator.md

    def render(self, ctx: ValidationContext, details: str) -> Finding:
        fields = {**ctx.template_fields(), "details": details}

        def fill(text: str | Callable[[ValidationContext, str], str]) -> str:
            return text(ctx, details) if callable(text) else text.format_map(fields)

        return Finding(self.level, self.id, fill(self.reason), fill(self.fix))


def _world_size_problems(ctx: ValidationContext) -> list[str]:
    out = [
        f"parallel.{name}={value} must be >= 1"
        for name, value in (("dp_replicate", ctx.dp_replicate), ("cp_size", ctx.cp), ("tp_size", ctx.tp))
        if value < 1
    ]
    if out:
        return out
    fixed = ctx.dp_replicate * ctx.cp * ctx.tp
    if ctx.dp_shard == -1:
        if ctx.dp_shard_resolved is None:
            out.append(
                f"dp_shard=-1 takes the rest of world size {ctx.world_size}, but {ctx.world_size} is not a "
                f"positive multiple of dp_replicate*cp*tp = {ctx.dp_replicate}*{ctx.cp}*{ctx.tp} = {fixed}"
            )
    elif ctx.dp_shard < 1:
        out.append(f"parallel.dp_shard={ctx.dp_shard} must be -1 (the rest) or >= 1")
    elif fixed * ctx.dp_shard != ctx.world_size:
        out.append(
            f"dp_replicate*dp_shard*cp*tp = {ctx.dp_replicate}*{ctx.dp_shard}*{ctx.cp}*{ctx.tp} = "
            f"{fixed * ctx.dp_shard}, but the world size is {ctx.world_size}"
        )
    return out


def _te_fused_attn_on(ctx: ValidationContext) -> bool:
    return (
        ctx.packed
        and ctx.backend == "te"
        and not ctx.validate_only
        and not ctx.env_flag_is_zero("NVTE_FUSED_ATTN")
    )


def _te_thd_without_backend(ctx: ValidationContext) -> str:
    if not (ctx.packed and ctx.backend == "te" and ctx.env_flag_is_zero("NVTE_FUSED_ATTN")):
        return ""
    if ctx.env_flag_is_zero("NVTE_FLASH_ATTN"):
        return "NVTE_FLASH_ATTN=0 turns off its flash-attn path too"
    if ctx.installed.get("flash-attn") is None:
        return "flash-attn is not installed"
    return ""


def _heads_problems(ctx: ValidationContext) -> list[str]:
    if ctx.tp <= 1:
        return []
    heads = [("model.llm.num_heads", ctx.llm_heads), ("model.llm.num_kv_heads", ctx.llm_kv_heads)]
    if ctx.encoder_tp:
        heads.append(("model.encoder.num_heads", ctx.encoder_heads))
    return [f"{name}={n} is not divisible by tp={ctx.tp}" for name, n in heads if n % ctx.tp]


def _rounding_problem(ctx: ValidationContext) -> str:
    m = ctx.pad_to_multiple
    if m is None:
        return ""
    if m < 1:
        return f"model.pad_to_multiple={m} must be >= 1"
    if ctx.packed and m % ctx.rounding_unit:
        return (
            f"model.pad_to_multiple={m} is not a multiple of {ctx.rounding_unit} "
            f"(lcm(2*cp, cp*tp) for cp>1, tp for cp=1), so a CP rank's share need not divide by tp={ctx.tp}"
        )
    if not ctx.packed and ctx.tp > 1 and m % ctx.tp:
        return (
            f"model.pad_to_multiple={m} is not a multiple of tp={ctx.tp}, so the padded length "
            "need not divide across the sequence-parallel ranks"
        )
    return ""


def _missing_packages(ctx: ValidationContext) -> list[str]:
    if ctx.caps is None:
        return []
    return [f"{p} is not installed" for p in required_packages(ctx.backend) if ctx.installed.get(p) is None]


def _install_fix(ctx: ValidationContext, details: str) -> str:
    """pip install the missing package (`pip install 'speechlm[EXTRA]'` for an accelerator), or pick
    another backend."""
    hints = []
    for package in required_packages(ctx.backend):
        if ctx.installed.get(package) is not None:
            continue
        extra = ctx.caps.pip_extra if ctx.caps is not None and package != "torch" else None
        hints.append(f"pip install 'speechlm[{extra}]'" if extra else f"pip install {package}")
    others = ", ".join(n for n in BACKENDS if n != ctx.backend)
    return f"{'; '.join(hints)} (or set model.attention_backend to another backend: {others})"


def _bad_versions(ctx: ValidationContext) -> list[str]:
    out = []
    for row in VERSION_TABLE:
        if row.backend not in ("*", ctx.backend) or ctx.caps is None:
            continue
        version = ctx.installed.get(row.package)
        if version is None or _try_parse_version(version) is None:
            continue  # not installed (another rule) or not a readable version
        if in_range(version, row.low, row.high):
            bound = f"< {row.high}" if row.low is None else f"in [{row.low}, {row.high or 'any'})"
            out.append(f"{row.package} {version} ({bound}: {row.reason})")
    return out


def _needs_gpu(ctx: ValidationContext) -> bool:
    if ctx.caps is None or ctx.on_gpu or ctx.caps.cpu:
        return False
    return not (ctx.validate_only and ctx.backend in CPU_FORWARD_ONLY)


def _gpu_too_old(ctx: ValidationContext) -> str:
    need = MIN_CAPABILITY.get(ctx.backend)
    cap = ctx.device_capability
    if need is None or cap is None or cap >= need:
        return ""
    return (
        f"{ctx.backend} needs compute capability {need[0]}.{need[1]} or newer, this GPU has {cap[0]}.{cap[1]}"
    )


def _faster_alternatives(ctx: ValidationContext) -> list[str]:
    return [
        n
        for n, b in BACKENDS.items()
        if n != ctx.backend
        and b.gpu
        and not b.cpu
        and (b.thd if ctx.packed else b.bshd)
        and (b.cp or ctx.cp == 1)
    ]


def _fp32_into_half_only_kernel(ctx: ValidationContext) -> bool:
    if ctx.precision != "32" or ctx.backend not in HALF_PRECISION_ONLY:
        return False
    return ctx.packed or ctx.backend != "te"  # te's unfused BSHD path takes fp32


def _reference_at_scale(ctx: ValidationContext) -> str:
    if ctx.backend != "reference" or not ctx.on_gpu or ctx.world_size < REFERENCE_SCALE_WORLD_SIZE:
        return ""
    return ", ".join(_faster_alternatives(ctx))


def _budget_problems(ctx: ValidationContext) -> list[str]:
    tokens, seconds = ctx.max_batch_tokens, ctx.max_batch_duration
    if tokens is not None:
        if tokens <= 0:
            return [f"sampler.max_batch_tokens={tokens} must be positive"]
        if tokens < ctx.rounding_unit:
            return [
                f"sampler.max_batch_tokens={tokens} is below one rounded sequence "
                f"({ctx.rounding_unit} tokens for cp={ctx.cp}, tp={ctx.tp}), so no utterance fits"
            ]
        return []
    if seconds is None:
        return ["neither sampler.max_batch_duration nor sampler.max_batch_tokens is set"]
    if seconds <= 0:
        return [f"sampler.max_batch_duration={seconds} must be positive"]
    return []


# encoder kinds with a padding-free (packed) path; the others compute their padding frames
PACKED_ENCODER_KINDS: frozenset[str] = frozenset({"parakeet"})


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _longest_over_budget(ctx: ValidationContext) -> list[str]:
    man = ctx.manifest or {}
    out = []
    if ctx.max_batch_tokens is not None and ctx.max_batch_tokens > 0 and man.get("max_tokens") is not None:
        unit = math.lcm(ctx.rounding_unit, ctx.pad_to_multiple or 1)
        longest = _round_up(int(man["max_tokens"]), unit)
        if longest > ctx.max_batch_tokens:
            out.append(
                f"the longest utterance has {int(man['max_tokens'])} tokens, {longest} after rounding to a "
                f"multiple of {unit}, above sampler.max_batch_tokens={ctx.max_batch_tokens}"
            )
    elif ctx.max_batch_tokens is None and ctx.max_batch_duration and man.get("max_duration") is not None:
        if float(man["max_duration"]) > ctx.max_batch_duration:
            out.append(
                f"the longest utterance lasts {float(man['max_duration']):g} s, above "
                f"sampler.max_batch_duration={ctx.max_batch_duration:g} s"
            )
    return out


def _grad_accum_problem(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    if man.get("n_rows") is None or ctx.dp is None:
        return ""
    per_epoch = int(man["n_rows"])
    if ctx.sampler_mode == "temperature" and ctx.epoch_size:
        per_epoch = int(ctx.epoch_size)
    most = per_epoch // ctx.dp
    if most >= ctx.grad_accum:
        return ""
    return (
        f"{per_epoch} utterances per epoch over dp={ctx.dp} ranks give at most {most} micro-batches per rank "
        f"(one utterance each), fewer than trainer.grad_accum={ctx.grad_accum}"
    )


RULES: tuple[Rule, ...] = (
    Rule(
        id="world-size-mismatch",
        level=ERROR,
        when="dp_replicate * dp_shard * cp * tp differs from the world size",
        applies=_world_size_problems,
        reason="the parallel sizes do not multiply to the world size: {details}",
        fix="make dp_replicate*dp_shard*cp*tp equal the world size {world_size} "
        "(parallel.dp_shard=-1 takes the rest), or launch that many processes",
        doc="The device mesh is dp_replicate x dp_shard x cp x tp and must tile the launched processes "
        "exactly. With dp_shard=-1 the world size must be a multiple of dp_replicate*cp*tp.",
    ),
    Rule(
        id="backend-unknown",
        level=ERROR,
        when="model.attention_backend is not in parallel/backend_caps.py",
        applies=lambda c: c.caps is None,
        reason="model.attention_backend={backend} is not a known attention backend",
        fix="set model.attention_backend to one of: {known_backends}",
        doc="Every other backend rule reads the capability table; a backend missing from it cannot be "
        "checked.",
    ),
    Rule(
        id="bshd-with-cp",
        level=ERROR,
        when="padded (BSHD) layout with cp > 1",
        applies=lambda c: not c.packed and c.cp > 1,
        reason="padded (BSHD) layout with cp={cp}: the CP attention path cannot apply a padding mask, so "
        "padded keys and values leak into real tokens (a finite loss at step 1, then NaN)",
        fix="set model.packed_sequences=true (THD packing), or parallel.cp_size=1",
        doc="Context parallelism cuts every sequence into 2*cp chunks and passes keys and values between "
        "ranks; no padding mask travels with them, so padding positions take part in attention. This "
        "has been seen as a finite loss at step 1 and NaN from step 2.",
    ),
    Rule(
        id="thd-backend-no-varlen",
        level=ERROR,
        when="packed (THD) layout with a backend that has no varlen/THD path",
        applies=lambda c: c.packed and c.caps is not None and not c.caps.thd,
        reason="packed (THD) layout with model.attention_backend={backend}, which has no varlen/THD path "
        "(cu_seqlens), so utterances in one pack would attend to each other",
        fix="set model.attention_backend to a backend with a THD path ({thd_backends}), "
        "or model.packed_sequences=false",
        doc="A THD pack concatenates utterances into one stream; only a backend driven by cu_seqlens keeps "
        "each utterance's attention inside its own span.",
    ),
    Rule(
        id="bshd-backend-no-padding",
        level=ERROR,
        when="padded (BSHD) layout with a backend that only takes THD",
        applies=lambda c: not c.packed and c.caps is not None and not c.caps.bshd,
        reason="padded (BSHD) layout with model.attention_backend={backend}, which cannot take a padded "
        "batch",
        fix="set model.packed_sequences=true, or use a backend with a BSHD path ({bshd_backends})",
        doc="Some backends (torch's varlen_attn) accept only a flat token stream with cu_seqlens.",
    ),
    Rule(
        id="backend-no-cp",
        level=ERROR,
        when="cp > 1 with a backend that has no context-parallel path",
        applies=lambda c: c.cp > 1 and c.caps is not None and not c.caps.cp,
        reason="cp={cp} with model.attention_backend={backend}, which has no context-parallel path in "
        "this build",
        fix="set model.attention_backend to a backend with CP support ({cp_backends}), or parallel.cp_size=1",
        doc="Under CP each rank holds 2 of the 2*cp chunks of every sequence, so the backend must exchange "
        "keys and values between ranks (ring or all-gather); backend_caps.py says which backends do.",
    ),
    Rule(
        id="te-fused-attn-sm120",
        level=ERROR,
        when="THD + transformer-engine + NVTE_FUSED_ATTN not 0, on compute capability 12.0, training",
        applies=lambda c: _te_fused_attn_on(c) and c.device_capability in FUSED_ATTN_BROKEN_CAPABILITIES,
        reason="transformer-engine with packed (THD) inputs on {device} and NVTE_FUSED_ATTN "
        "{nvte_fused_attn}: cuDNN's fused attention backward amplifies gradients on this GPU",
        fix="export NVTE_FUSED_ATTN=0 on every rank (transformer-engine then runs THD through flash-attn, "
        "which must be installed)",
        doc="transformer-engine uses cuDNN fused attention unless NVTE_FUSED_ATTN=0 (unset and empty both "
        "leave it on). On compute capability 12.0 its backward with THD inputs amplifies gradients and "
        "training diverges. Validation-only runs (trainer.validate_only, no backward) are not flagged.",
    ),
    Rule(
        id="te-fused-attn",
        level=WARNING,
        when="the same as te-fused-attn-sm120, on any other GPU",
        applies=lambda c: (
            _te_fused_attn_on(c) and c.on_gpu and c.device_capability not in FUSED_ATTN_BROKEN_CAPABILITIES
        ),
        reason="transformer-engine with packed (THD) inputs and NVTE_FUSED_ATTN {nvte_fused_attn} trains "
        "through cuDNN's fused attention backward, which amplifies gradients on sm_120; on {device} that "
        "is not known to happen, but this project has not verified it",
        fix="export NVTE_FUSED_ATTN=0 on every rank, unless you have compared gradients against the "
        "reference backend",
        doc="A warning, because the gradient amplification has only been seen on compute capability 12.0. "
        "Not raised on CPU (te cannot run there; see backend-needs-gpu) nor for validation-only runs.",
    ),
    Rule(
        id="te-thd-needs-flash-attn",
        level=ERROR,
        when="THD + transformer-engine + NVTE_FUSED_ATTN=0 without a usable flash-attn",
        applies=_te_thd_without_backend,
        reason="transformer-engine with packed (THD) inputs and NVTE_FUSED_ATTN=0 has no attention path "
        "left: its unfused attention does not take THD and {details}",
        fix="install flash-attn (pip install 'speechlm[flash]') and leave NVTE_FLASH_ATTN unset, or set "
        "model.attention_backend=flash",
        doc="transformer-engine runs THD through cuDNN fused attention or flash-attn; its unfused path "
        "refuses qkv_format=thd. With fused attention off, flash-attn must be installed and enabled.",
    ),
    Rule(
        id="heads-not-divisible-by-tp",
        level=ERROR,
        when="tp > 1 and an attention or KV head count not divisible by tp",
        applies=_heads_problems,
        reason="tensor parallelism splits attention heads evenly over tp={tp} ranks: {details}",
        fix="choose a parallel.tp_size that divides every listed head count",
        doc="Column-parallel Q/K/V projections give each TP rank num_heads/tp query heads and "
        "num_kv_heads/tp key/value heads. The encoder's heads count only when "
        "model.encoder.tensor_parallel is true.",
    ),
    Rule(
        id="rounding-not-divisible",
        level=ERROR,
        when="a configured model.pad_to_multiple that does not keep each CP rank's share divisible by tp",
        applies=_rounding_problem,
        reason="the configured rounding cannot shard the {layout} layout over cp={cp}, tp={tp}: {details}",
        fix="remove model.pad_to_multiple (the automatic rounding is always legal) or set it to a "
        "multiple of {rounding_unit}",
        doc="Each sequence is cut into 2*cp chunks and each CP rank's share is split again over tp for "
        "sequence parallelism, so a packed stream must divide by lcm(2*cp, cp*tp), or by tp when cp=1. "
        "The automatic rounding ensures this; an explicit model.pad_to_multiple must be a multiple of "
        "that unit (of tp for the BSHD layout).",
    ),
    Rule(
        id="backend-not-installed",
        level=ERROR,
        when="a package the backend needs (torch, transformer-engine, flash-attn) is not installed",
        applies=_missing_packages,
        reason="model.attention_backend={backend} needs packages that are not installed: {details}",
        fix=_install_fix,
        doc="Accelerator packages are imported lazily, so a missing one would otherwise fail only after "
        "the model is loaded. Pass --assume-installed NAME=VERSION to validate for another machine.",
    ),
    Rule(
        id="backend-version-unsupported",
        level=ERROR,
        when="an installed version falls in a refused range of the version table",
        applies=_bad_versions,
        reason="model.attention_backend={backend} cannot use the installed versions: {details}",
        fix="upgrade the listed package past the version shown, or pick another backend",
        doc="Each row of the version table below names the backend, the refused range, why, and where "
        "that comes from. 'minimum' rows are the oldest versions supported, not known bugs.",
    ),
    Rule(
        id="fp32-with-half-precision-kernel",
        level=ERROR,
        when="trainer.precision=32 with flash, torch_varlen or te-THD (kernels for fp16/bf16 only)",
        applies=_fp32_into_half_only_kernel,
        reason="trainer.precision=32 sends fp32 q/k/v into model.attention_backend={backend}, whose "
        "kernels accept only fp16 and bf16: the first attention call would fail on the GPU",
        fix="set trainer.precision=bf16 (or auto), or set model.attention_backend=reference (or sdpa, "
        "flex) to train in fp32",
        doc="flash-attn's varlen kernels, torch's varlen_attn and transformer-engine's THD paths (cuDNN "
        "fused attention, flash-attn) are half-precision kernels. The rule checks the configured "
        "precision; `auto` autocasts to bf16 on GPUs that support it.",
    ),
    Rule(
        id="backend-needs-gpu",
        level=ERROR,
        when="a backend without CPU kernels (or without a CPU backward) on a run with no GPU",
        applies=_needs_gpu,
        reason="model.attention_backend={backend} needs a CUDA GPU to train (no CPU kernels, or no CPU "
        "backward), and this run has no GPU",
        fix="use a CPU-capable backend ({cpu_backends}); to validate a GPU job from a CPU machine pass "
        "--device-capability (e.g. 9.0)",
        doc="torch_varlen, flash and te are CUDA-only. FlexAttention has a CPU forward but no CPU backward, "
        "so it is accepted on CPU for validation-only runs only. This covers CP on a GPU-only backend "
        "on CPU.",
    ),
    Rule(
        id="gpu-too-old-for-backend",
        level=ERROR,
        when="flash or torch_varlen on a GPU older than Ampere (compute capability 8.0)",
        applies=_gpu_too_old,
        reason="{details}",
        fix="use model.attention_backend=reference or sdpa on this GPU, or run on Ampere (sm_80) or newer",
        doc="FlashAttention-2 kernels, which torch's varlen_attn also calls, need compute capability 8.0 "
        "or newer.",
    ),
    Rule(
        id="reference-at-scale",
        level=WARNING,
        when=f"the reference backend on GPUs with world size >= {REFERENCE_SCALE_WORLD_SIZE}, when a "
        "fused GPU backend exists for the layout",
        applies=_reference_at_scale,
        reason="model.attention_backend=reference on {world_size} GPUs: it is the correctness reference "
        "built from unfused torch ops, slower than the fused kernels",
        fix="for speed set model.attention_backend to one of: {details} (after checking it against "
        "reference)",
        doc="Only raised when backend_caps offers a GPU backend for this layout (THD or BSHD, and CP when "
        "cp > 1); while reference is the only backend with CP, CP jobs are not flagged.",
    ),
    Rule(
        id="sampler-budget-invalid",
        level=ERROR,
        when="no micro-batch budget, a non-positive one, or a token budget below one rounded sequence",
        applies=_budget_problems,
        reason="the micro-batch budget cannot hold any sequence: {details}",
        fix="set sampler.max_batch_duration (seconds) or sampler.max_batch_tokens to a positive budget "
        "of at least one rounded sequence ({rounding_unit} tokens)",
        doc="The sampler packs utterances up to a budget of seconds or tokens (max_batch_tokens wins when "
        "set) and refuses a missing or non-positive one. A token budget below one rounded sequence "
        "(lcm(2*cp, cp*tp) tokens) cannot hold even the shortest utterance after CP/TP rounding.",
    ),
    Rule(
        id="budget-below-longest-utterance",
        level=WARNING,
        when="the longest utterance (after rounding) exceeds the micro-batch budget; needs manifest_summary",
        applies=_longest_over_budget,
        reason="the micro-batch budget is smaller than the longest utterance: {details}; the sampler packs "
        "such an utterance alone into an over-budget micro-batch",
        fix="raise the budget above the longest utterance (after rounding), or filter long utterances "
        "out of the manifest",
        doc="Checked only when the caller passes manifest_summary: max_tokens is the longest sequence in "
        "the units the token budget counts (audio + text + prompt tokens), max_duration the longest clip "
        "in seconds. A warning: training goes on, but memory sized for the budget may not hold that "
        "micro-batch.",
    ),
    Rule(
        id="encoder-packed-unsupported",
        level=ERROR,
        when="model.encoder.packed=true with an encoder kind that has no padding-free path",
        applies=lambda c: c.encoder_packed is True and c.encoder_kind not in PACKED_ENCODER_KINDS,
        reason=lambda c, d: (
            f"model.encoder.packed=true but encoder.kind={c.encoder_kind!r} has no "
            f"padding-free path (only {', '.join(sorted(PACKED_ENCODER_KINDS))})"
        ),
        fix="set model.encoder.packed=false, or leave it unset (padded for this encoder)",
        doc="The packed encoder path (features, subsampling, conformer layers on real frames only) exists "
        "for FastConformer/Parakeet. Whisper's encoder takes a fixed 30 s window by design and a NeMo "
        "module is run as loaded; both compute their padding frames.",
    ),
    Rule(
        id="encoder-runs-padded",
        level=WARNING,
        when="model.encoder.packed is unset and the encoder kind has no padding-free path",
        applies=lambda c: c.encoder_packed is None and c.encoder_kind not in PACKED_ENCODER_KINDS,
        reason=lambda c, d: (
            f"encoder.kind={c.encoder_kind!r} runs on padded clips: its cost grows with "
            "the longest clip of each micro-batch, not with the audio"
        ),
        fix="nothing to change for correctness; set model.encoder.packed=false to silence this, or use "
        "encoder.kind=parakeet for a padding-free encoder",
        doc="A reminder that the padding-free encoder is Parakeet-only: with Whisper or NeMo encoders the "
        "encoder, projector input and CTC head compute padding frames, so a wide duration mix wastes "
        "encoder FLOPs (see docs/benchmarks.md).",
    ),
    Rule(
        id="grad-accum-exceeds-batches",
        level=ERROR,
        when="fewer possible micro-batches per data-parallel rank than trainer.grad_accum; needs "
        "manifest_summary",
        applies=_grad_accum_problem,
        reason="the epoch has no complete optimizer step: {details}",
        fix="lower trainer.grad_accum, use fewer data-parallel ranks, or train on more utterances",
        doc="Every data-parallel rank gets the same number of micro-batches, trimmed to a multiple of "
        "grad_accum. A micro-batch holds at least one utterance, so there are at most n_rows // dp per "
        "rank (sampler.epoch_size replaces n_rows in temperature mode); below grad_accum the trim "
        "leaves nothing and the sampler raises after the model has loaded. Needs manifest_summary.",
    ),
)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def evaluate(ctx: ValidationContext, rules: Sequence[Rule] = RULES) -> list[Finding]:
    """Run every rule over the context; errors first, each level in table order."""
    findings = []
    for rule in rules:
        hit = rule.applies(ctx)
        if not hit:
            continue
        details = "; ".join(hit) if isinstance(hit, list) else (hit if isinstance(hit, str) else "")
        findings.append(rule.render(ctx, details))
    return sorted(findings, key=lambda f: f.level != ERROR)


def validate(
    config: Any,
    world_size: int,
    env: Mapping[str, str],
    device_capability: Any,
    installed: Mapping[str, str | None],
    *,
    manifest_summary: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """Findings for running `config` on `world_size` processes; pure (nothing read from the machine).

    env: environment variables of the ranks; device_capability: (major, minor), 9.0, "12.0" or None
    (CPU); installed: distribution name -> version or None (torch, transformer-engine, flash-attn,
    cudnn); manifest_summary: optional {"n_rows", "max_duration", "max_tokens"} of the training manifest.
    """
    return evaluate(build_context(config, world_size, env, device_capability, installed, manifest_summary))


def has_errors(findings: Sequence[Finding]) -> bool:
    return any(f.level == ERROR for f in findings)


def format_findings(findings: Sequence[Finding], width: int = 100) -> str:
    """A readable table: level and rule id, then the reason and the fix wrapped underneath."""
    lines = []
    for f in findings:
        lines.append(f"{f.level.upper():<8} {f.rule_id}")
        for label, text in (("reason", f.reason), ("fix", f.fix)):
            lines.extend(
                textwrap.wrap(
                    text,
                    width=width,
                    initial_indent=f"         {label + ':':<8}",
                    subsequent_indent=" " * 17,
                    break_on_hyphens=False,
                )
            )
    return "\n".join(lines)


def check_or_raise(findings: Sequence[Finding], log: Callable[[str], Any] = print, rank: int = 0) -> None:
    """At fit start: rank 0 logs the warnings and the errors once; every rank raises on an error.

    The `ValidationError` message is one line naming the rule ids (so 64 ranks do not print 64 tables);
    the full table is `error.report` and was logged by rank 0.
    """
    errors = [f for f in findings if f.level == ERROR]
    warnings = [f for f in findings if f.level != ERROR]
    if rank == 0 and warnings:
        log(f"parallel layout: {len(warnings)} warning(s)\n" + format_findings(warnings))
    if not errors:
        return
    report = f"parallel layout invalid: {len(errors)} error(s)\n" + format_findings(errors)
    if rank == 0:
        log(report)
    ids = ", ".join(f.rule_id for f in errors)
    raise ValidationError(
        f"parallel layout invalid ({ids}); rank 0 logged the reasons and fixes, "
        "or run `speechlm validate CONFIG` to see them",
        findings,
        report,
    )
