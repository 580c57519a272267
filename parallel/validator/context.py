"""The validator's input, read once: `ValidationContext` and `build_context`.

`build_context` turns the arguments of a validation (the config, the world size, the environment
variables, the GPU's compute capability and the installed versions) into one frozen context: dp_shard=-1
resolved by `parallel.mesh.resolve_dp_shard` (the same computation as `ParallelDims`), the backend's
capabilities, the rounding unit, the capability parsed (`parse_capability`) and the package names
normalized (`normalize_installed`). `required_packages` names the distributions a backend needs, and
`ValidationContext.template_fields` the names the rules' reason and fix templates may use. Nothing is
read from the machine here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from parallel.backend_caps import BACKENDS, BackendCaps, thd_backends
from parallel.mesh import resolve_dp_shard
from parallel.rounding import rounding_unit

# environment variables the rules read (the only ones echoed in the JSON context)
READ_ENV_KEYS: tuple[str, ...] = ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN")
# world size from which the reference backend is flagged as slow on GPUs
REFERENCE_SCALE_WORLD_SIZE = 8
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
    pad_to_multiple: int | None  # configured rounding (model.pad_to_multiple); None: automatic
    cp_split_threshold: int | str  # parallel.cp_split_threshold: "auto" or tokens (0: split all)
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
    cp_attention: str = "ring"  # parallel.cp_attention: "ring" or "allgather"
    cp_degrees: str = "all"  # parallel.cp_degrees: "all" (whole or split over all) or "hybrid"
    llm_train: str = "full"  # model.llm.train: "full", "frozen" or "lora"
    llm_pretrained: bool = False  # model.llm.pretrained is set
    llm_train_added_rows: bool = True  # model.llm.train_added_rows (frozen/lora: added tokens' rows train)
    encoder_train: str = "full"  # model.encoder.train: "full" or "frozen"
    encoder_pretrained: bool = False  # model.encoder.pretrained is set
    unfreeze_step: int = 0  # optim.unfreeze_step
    lang_tags: str | None = None  # data.lang_tags ("special": one added token per language), where it exists
    encoder_heads: int = 4  # model.encoder.num_heads (the sizes of an encoder built from the config)
    encoder_layers: int = 3  # model.encoder.num_layers
    encoder_att_context: tuple[int, int] | None = None  # model.encoder.att_context_size; None: full context
    ctc_weight: float = 0.0  # model.ctc_weight
    ctc_reduction: str = "clip"  # model.ctc_reduction: "clip" or "token"

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
            "cp_split_threshold": self.cp_split_threshold,
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
            "cp_attention": self.cp_attention,
            "cp_degrees": self.cp_degrees,
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


def build_context(
    config: Any,
    world_size: int,
    env: Mapping[str, str],
    device_capability: Any,
    installed: Mapping[str, str | None],
    manifest_summary: Mapping[str, Any] | None = None,
) -> ValidationContext:
    """Read everything the rules need from the arguments, once.

    The rules tie keys together; the range or choice set of each single key is the config's own
    (`speechlm.config`'s sections). A config with a `validate()` method is checked by it first, so a
    value its section refuses (parallel.cp_size=0, an unknown attention backend, ...) raises that
    section's ValueError here instead of turning into a finding."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    check = getattr(config, "validate", None)
    if callable(check):
        check()
    par, model, trainer, sampler = config.parallel, config.model, config.trainer, config.sampler
    dp_replicate, dp_shard = int(par.dp_replicate), int(par.dp_shard)
    cp, tp = int(par.cp_size), int(par.tp_size)
    backend = str(model.attention_backend)
    pad = getattr(model, "pad_to_multiple", None)
    return ValidationContext(
        world_size=world_size,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        dp_shard_resolved=resolve_dp_shard(world_size, dp_replicate, dp_shard, cp, tp),
        cp=cp,
        tp=tp,
        packed=bool(model.packed_sequences),
        backend=backend,
        caps=BACKENDS.get(backend),
        validate_only=bool(getattr(trainer, "validate_only", False)),
        grad_accum=int(getattr(trainer, "grad_accum", 1)),
        llm_heads=int(model.llm.num_heads),
        llm_kv_heads=int(getattr(model.llm, "num_kv_heads", None) or model.llm.num_heads),
        pad_to_multiple=None if pad is None else int(pad),
        cp_split_threshold=getattr(par, "cp_split_threshold", "auto"),
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
        cp_attention=str(getattr(par, "cp_attention", "ring")),
        cp_degrees=str(getattr(par, "cp_degrees", "all")),
        llm_train=str(getattr(model.llm, "train", "full")),
        llm_pretrained=getattr(model.llm, "pretrained", None) is not None,
        llm_train_added_rows=bool(getattr(model.llm, "train_added_rows", True)),
        encoder_train=str(getattr(model.encoder, "train", "full")),
        encoder_pretrained=getattr(model.encoder, "pretrained", None) is not None,
        unfreeze_step=int(getattr(getattr(config, "optim", None), "unfreeze_step", 0) or 0),
        lang_tags=getattr(getattr(config, "data", None), "lang_tags", None),
        encoder_heads=int(getattr(model.encoder, "num_heads", 4)),
        encoder_layers=int(getattr(model.encoder, "num_layers", 3)),
        encoder_att_context=getattr(
            model.encoder, "limited_context", lambda: None
        )(),  # (left, right) or None
        ctc_weight=float(getattr(model, "ctc_weight", 0.0) or 0.0),
        ctc_reduction=str(getattr(model, "ctc_reduction", "clip")),
    )
