"""The parallel rules: the `Rule` row and `PARALLEL_RULES`, the table of checks on a parallel layout.

A row is (id, level, when, applies, reason, fix, doc). `applies(ctx)` returns a falsy value when the
rule does not fire, or True / a detail string / a list of detail strings when it does. `reason` and
`fix` are `str.format` templates over `ctx.template_fields()` plus `{details}` (or callables of
(ctx, details)). A level that depends on the context is two rows with distinct ids (e.g.
`te-fused-attn-sm120`, an error, and `te-fused-attn`, a warning), so each id always has one level.

Every row ties several keys (or a key and the machine) together; a single key's range or choices is
checked by the config's sections (`speechlm.config`), before any rule runs. The rows cover the world
size and mesh, head counts under TP, the rounding unit, attention backends
against the layout, CP, the environment, the GPU and the installed packages, and fp32 into
half-precision kernels. Rules about training rather than parallelism (the sampler's budget, the
encoder's packed path, gradient accumulation) live in `speechlm.preflight.rules`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from parallel.backend_caps import BACKENDS
from parallel.validator.context import REFERENCE_SCALE_WORLD_SIZE, ValidationContext, required_packages
from parallel.validator.report import ERROR, WARNING, Finding, Level
from parallel.validator.versions import VERSION_TABLE, try_parse_version

# compute capabilities on which transformer-engine's cuDNN fused attention backward amplifies
# gradients with THD inputs (finite loss first, then divergence); NVTE_FUSED_ATTN=0 is required there
FUSED_ATTN_BROKEN_CAPABILITIES: frozenset[tuple[int, int]] = frozenset({(12, 0)})
# compute capabilities on which transformer-engine's THD context parallelism (its p2p ring) is known-good:
# A100 (8.0) and H100/H200 (9.0), where TE's CP is developed and NeMo/Megatron run it; add a row only
# after `pytest -m gpu` and a gradient comparison against the reference backend on that GPU
TE_CP_VERIFIED_CAPABILITIES: frozenset[tuple[int, int]] = frozenset({(8, 0), (9, 0)})
# compute capabilities where transformer-engine's own PR validated THD context parallelism with fused
# attention off (NVTE_FUSED_ATTN=0: its flash-attn path, flash-attn installed) in bf16; accepted with a
# warning because this project has not measured it there (item 8 of issue 21)
TE_CP_PR_VALIDATED_CAPABILITIES: frozenset[tuple[int, int]] = frozenset({(12, 0)})
# oldest GPU generation each backend's kernels run on (FlashAttention-2 kernels: Ampere, sm_80, and newer)
MIN_CAPABILITY: dict[str, tuple[int, int]] = {"flash": (8, 0), "torch_varlen": (8, 0)}
# backends whose forward runs on CPU although the backward does not (validation-only runs are fine)
CPU_FORWARD_ONLY: frozenset[str] = frozenset({"flex"})
# backends whose kernels take only fp16/bf16 q/k/v (te: with THD, which runs only on its fused or flash path)
HALF_PRECISION_ONLY: frozenset[str] = frozenset({"flash", "torch_varlen", "te"})


Applies = Callable[[ValidationContext], bool | str | list[str]]


@dataclass(frozen=True)
class Rule:
    id: str  # stable kebab-case id; an interface (scripts and docs refer to it)
    level: Level
    when: str  # the condition in words, for the docs' index
    applies: Applies
    reason: str | Callable[[ValidationContext, str], str]  # template over ctx.template_fields() + {details}
    fix: str | Callable[[ValidationContext, str], str]  # the same; a callable's docstring goes in the docs
    doc: str  # why the rule exists, for docs/validator.md

    def render(self, ctx: ValidationContext, details: str) -> Finding:
        fields = {**ctx.template_fields(), "details": details}

        def fill(text: str | Callable[[ValidationContext, str], str]) -> str:
            return text(ctx, details) if callable(text) else text.format_map(fields)

        return Finding(self.level, self.id, fill(self.reason), fill(self.fix))


def _world_size_problems(ctx: ValidationContext) -> list[str]:
    out = []
    fixed = ctx.dp_replicate * ctx.cp * ctx.tp
    if ctx.dp_shard == -1:
        if ctx.dp_shard_resolved is None:
            out.append(
                f"dp_shard=-1 takes the rest of world size {ctx.world_size}, but {ctx.world_size} is not a "
                f"positive multiple of dp_replicate*cp*tp = {ctx.dp_replicate}*{ctx.cp}*{ctx.tp} = {fixed}"
            )
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


def _te_cp(ctx: ValidationContext) -> bool:
    return ctx.backend == "te" and ctx.cp > 1 and ctx.packed


def _te_cp_as_the_pr_recommends(ctx: ValidationContext) -> bool:
    """THD + te + CP on a GPU of TE_CP_PR_VALIDATED_CAPABILITIES, in the setup that PR validated: fused
    attention off (NVTE_FUSED_ATTN=0), flash-attn installed and enabled, bf16 (trainer.precision bf16 or
    auto, which autocasts to bf16 on these GPUs)."""
    return (
        _te_cp(ctx)
        and ctx.device_capability in TE_CP_PR_VALIDATED_CAPABILITIES
        and ctx.env_flag_is_zero("NVTE_FUSED_ATTN")
        and not ctx.env_flag_is_zero("NVTE_FLASH_ATTN")
        and ctx.installed.get("flash-attn") is not None
        and ctx.precision in ("bf16", "auto")
    )


def _te_cp_unverified_gpu(ctx: ValidationContext) -> bool:
    cap = ctx.device_capability
    return (
        _te_cp(ctx)
        and cap is not None
        and cap not in TE_CP_VERIFIED_CAPABILITIES
        and not _te_cp_as_the_pr_recommends(ctx)
    )


def _heads_problems(ctx: ValidationContext) -> list[str]:
    if ctx.tp <= 1:
        return []
    heads = [("model.llm.num_heads", ctx.llm_heads), ("model.llm.num_kv_heads", ctx.llm_kv_heads)]
    return [f"{name}={n} is not divisible by tp={ctx.tp}" for name, n in heads if n % ctx.tp]


def _rounding_problem(ctx: ValidationContext) -> str:
    m = ctx.pad_to_multiple
    if m is None:
        return ""
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
        if version is None or try_parse_version(version) is None:
            continue  # not installed (another rule) or not a readable version
        if row.refuses(version):
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


def _half_precision_only(backend: str, packed: bool) -> bool:
    return backend in HALF_PRECISION_ONLY and (packed or backend != "te")  # te's unfused BSHD path takes fp32


def _faster_alternatives(ctx: ValidationContext) -> list[str]:
    return [
        n
        for n, b in BACKENDS.items()
        if n != ctx.backend
        and b.gpu
        and not b.cpu
        and (b.thd if ctx.packed else b.bshd)
        and (ctx.cp == 1 or (b.cp and ctx.packed))
        and not (ctx.precision == "32" and _half_precision_only(n, ctx.packed))
    ]


def _fp32_into_half_only_kernel(ctx: ValidationContext) -> bool:
    return ctx.precision == "32" and _half_precision_only(ctx.backend, ctx.packed)


def _reference_at_scale(ctx: ValidationContext) -> str:
    if ctx.backend != "reference" or not ctx.on_gpu or ctx.world_size < REFERENCE_SCALE_WORLD_SIZE:
        return ""
    if ctx.packed and ctx.precision != "32":
        return ""  # its THD path already runs the fused varlen kernels in half precision (parallel/varlen.py)
    return ", ".join(_faster_alternatives(ctx))


def _split_threshold_problem(ctx: ValidationContext) -> str:
    t = ctx.cp_split_threshold
    if not isinstance(t, int) or t == 0:  # "auto", or 0: split all
        return ""
    if ctx.cp == 1:
        return f"parallel.cp_split_threshold={t} has no effect without context parallelism (cp=1)"
    if t < 2 * ctx.cp:
        return (
            f"parallel.cp_split_threshold={t} splits sequences shorter than 2*cp={2 * ctx.cp} tokens, "
            "each padded to 2*cp"
        )
    return ""


def _hybrid_degrees_idle(ctx: ValidationContext) -> str:
    if ctx.cp_degrees != "hybrid":
        return ""
    if ctx.cp == 1:
        return "parallel.cp_degrees=hybrid has no effect without context parallelism (cp=1)"
    if ctx.cp_split_threshold != "auto":
        return (
            f"parallel.cp_split_threshold={ctx.cp_split_threshold} is not read with parallel.cp_degrees=hybrid "
            "(the placement chooses each sequence's degree from the balance)"
        )
    return ""


PARALLEL_RULES: tuple[Rule, ...] = (
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
        id="te-cp-allgather",
        level=ERROR,
        when="transformer-engine with cp > 1 and parallel.cp_attention=allgather",
        applies=lambda c: _te_cp(c) and c.cp_attention != "ring",
        reason="model.attention_backend=te with cp={cp} and parallel.cp_attention=allgather: "
        "transformer-engine's all-gather (and a2a) context parallelism has no THD (packed) path",
        fix="set parallel.cp_attention=ring (transformer-engine's p2p ring), or "
        "model.attention_backend=reference to keep the all-gather",
        doc="Under CP the te backend hands the split sequences to transformer-engine's own context "
        "parallelism; of its communication types only p2p (the ring) takes qkv_format=thd.",
    ),
    Rule(
        id="te-cp-unverified-gpu",
        level=ERROR,
        when="transformer-engine with cp > 1 on a GPU not in the known-good table",
        applies=_te_cp_unverified_gpu,
        reason="model.attention_backend=te with cp={cp} on {device}: transformer-engine's THD context "
        "parallelism is known-good on compute capabilities "
        + ", ".join(f"{a}.{b}" for a, b in sorted(TE_CP_VERIFIED_CAPABILITIES))
        + " only",
        fix="use model.attention_backend=reference (ring or all-gather attention on the GPU varlen "
        "kernels), or compare te's gradients against it on this GPU (`pytest -m gpu`) and add the "
        "capability to TE_CP_VERIFIED_CAPABILITIES in parallel/validator/rules.py",
        doc="THD context parallelism in transformer-engine runs a ring of fused-attention or flash-attn "
        "calls per step; its numerics have only been relied on where NeMo and Megatron-LM train with "
        "it (A100, H100/H200). The sm_120 gradient amplification of cuDNN's fused backward (rule "
        "te-fused-attn-sm120) is one reason not to assume other GPUs behave. Without a GPU "
        "(backend-needs-gpu) this rule does not fire; on sm_120 in the setup transformer-engine's PR "
        "validated, te-cp-sm120-unmeasured (a warning) replaces it.",
    ),
    Rule(
        id="te-cp-sm120-unmeasured",
        level=WARNING,
        when="transformer-engine with cp > 1 on compute capability 12.0 with NVTE_FUSED_ATTN=0, flash-attn "
        "installed and bf16",
        applies=_te_cp_as_the_pr_recommends,
        reason="model.attention_backend=te with cp={cp} on {device}: transformer-engine's PR recommends and "
        "validated this setup (NVTE_FUSED_ATTN=0, flash-attn, bf16) on sm_120, but this project has not "
        "measured its gradients there",
        fix="nothing is required; compare te's gradients against model.attention_backend=reference on this "
        "GPU (`pytest -m gpu`) and, if they match, add the capability to TE_CP_VERIFIED_CAPABILITIES in "
        "parallel/validator/rules.py to silence this",
        doc="On sm_120 transformer-engine's THD context parallelism runs through flash-attn once cuDNN's "
        "fused attention is off, which is the configuration the transformer-engine PR that added sm_120 "
        "support recommends and validated. Any other setting on sm_120 stays te-cp-unverified-gpu "
        "(an error); fused attention left on is also te-fused-attn-sm120.",
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
        "num_kv_heads/tp key/value heads. The audio encoder is not tensor-parallel, so its heads do not "
        "count.",
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
        when=f"the reference backend on GPUs with world size >= {REFERENCE_SCALE_WORLD_SIZE}, padded or in "
        "fp32, when a fused GPU backend exists for the layout",
        applies=_reference_at_scale,
        reason="model.attention_backend=reference on {world_size} GPUs with the {layout} layout: there it "
        "runs its exact kernels (padded SDPA, or one launch per distinct sequence length in fp32), slower "
        "than the fused ones",
        fix="for speed set model.attention_backend to one of: {details} (after checking it against "
        "reference)",
        doc="Only raised when backend_caps offers a GPU backend for this layout (THD or BSHD, CP when "
        "cp > 1, fp32 kernels under trainer.precision=32). In half precision the reference backend's THD "
        "path (one process, ring or all-gather CP) already calls the fastest varlen kernel registered "
        "for the GPU (parallel/varlen.py: torch's or flash-attn's), so it is not flagged.",
    ),
    Rule(
        id="cp-degrees-te-unmeasured",
        level=WARNING,
        when="transformer-engine with cp > 1 and parallel.cp_degrees=hybrid",
        applies=lambda c: _te_cp(c) and c.cp_degrees == "hybrid",
        reason="model.attention_backend=te with cp={cp} and parallel.cp_degrees=hybrid: each degree's "
        "sequences go to a transformer-engine core over their CP sub-group, which this project has "
        "checked against a stand-in for transformer-engine only, not on a GPU",
        fix="nothing is required; compare a short run's losses against model.attention_backend=reference "
        "(ring attention per sub-group) on this GPU, or set parallel.cp_degrees=all",
        doc="Hybrid CP degrees (parallel/hybrid_layout.py) split a sequence over an aligned sub-group of "
        "2, 4, ..., cp ranks. The reference backend runs ring or all-gather attention per sub-group; "
        "transformer-engine gets one DotProductAttention per sub-group (its context-parallel group set "
        "once, p2p ring), called on each degree's segment with that segment's global cu_seqlens "
        "(HybridAttention.run), tested with a stand-in (tests/model/test_te_cp.py, "
        "tests/parallel/test_cp_hybrid_attention.py) but never yet on a GPU. A degree needs nothing of "
        "the heads (the ring and the all-gather keep every head on every rank) and its rounding, a "
        "multiple of lcm(2d, d*tp), divides the cp one that pad_to_multiple is checked against and gives "
        "transformer-engine's THD ring the 2d chunks it cuts each sequence into. TE's all-gather CP "
        "is refused for every layout (te-cp-allgather).",
    ),
    Rule(
        id="cp-degrees-idle",
        level=WARNING,
        when="parallel.cp_degrees=hybrid where it changes nothing or overrides a setting",
        applies=_hybrid_degrees_idle,
        reason="{details}",
        fix="set parallel.cp_degrees=all, or parallel.cp_split_threshold=auto",
        doc="With hybrid degrees every sequence's degree (1: whole, 2, 4, ..., cp) comes from the balance "
        "of the ranks' modelled cost (parallel/cp_placement.py, place_hybrid); no token threshold is read.",
    ),
    Rule(
        id="cp-split-threshold",
        level=WARNING,
        when="parallel.cp_split_threshold is set to a token count that cannot help",
        applies=_split_threshold_problem,
        reason="{details}",
        fix="use parallel.cp_split_threshold=auto (split the fewest longest sequences that keep the CP "
        "ranks balanced), 0 (split all), or a threshold well above 2*cp tokens",
        doc="Dynamic CP (parallel/cp_placement.py) splits only sequences longer than the threshold over the "
        "CP group and keeps the others whole on one rank. A threshold below 2*cp tokens splits sequences "
        "into chunks of under one token plus padding; with cp=1 nothing is ever split.",
    ),
)
