"""The parallel-layout validator: one trigger and one near miss per rule row, the full grid of the
issue's three layout rules, the helpers, and the generated docs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

import parallel.validator
from parallel.backend_caps import BACKENDS
from parallel.validator import (
    ERROR,
    PARALLEL_RULES,
    WARNING,
    Finding,
    ValidationError,
    check_or_raise,
    format_findings,
    in_range,
    normalize_installed,
    parse_capability,
    parse_version,
    try_parse_version,
)
from speechlm.config import ConfigError, ExperimentConfig, apply_override
from speechlm.preflight.rules import RULES, TRAINING_RULES, validate

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = {"torch": "2.13.0", "transformer-engine": "2.5.0", "flash-attn": "2.8.3", "cudnn": "9.10.0"}


def make_config(*overrides: str, **attrs: Any) -> ExperimentConfig:
    """Defaults + dotted overrides; `attrs` ("model__pad_to_multiple"=8) sets fields the config lacks."""
    cfg = ExperimentConfig()
    for ov in overrides:
        apply_override(cfg, ov)
    for path, value in attrs.items():
        *parents, leaf = path.split("__")
        obj: Any = cfg
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


@dataclass
class Case:
    overrides: tuple[str, ...] = ()
    world: int = 1
    env: dict[str, str] = field(default_factory=dict)
    cap: Any = 9.0
    installed: dict[str, str | None] = field(default_factory=lambda: dict(INSTALLED))
    manifest: dict[str, Any] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    def ids(self) -> list[str]:
        cfg = make_config(*self.overrides, **self.attrs)
        findings = validate(
            cfg, self.world, self.env, self.cap, self.installed, manifest_summary=self.manifest
        )
        return [f.rule_id for f in findings]


def _without(name: str) -> dict[str, str | None]:
    return {**INSTALLED, name: None}


# the configuration transformer-engine's sm_120 PR recommends (with NVTE_FUSED_ATTN=0 and flash-attn)
TE_CP_SM120 = ("model.attention_backend=te", "parallel.cp_size=2", "trainer.precision=bf16")

# rule id -> (a case that triggers it, a near miss that does not)
RULE_CASES: dict[str, tuple[Case, Case]] = {
    "world-size-mismatch": (
        Case(("parallel.dp_shard=2",), world=4),
        Case(("parallel.dp_shard=2",), world=2),
    ),
    "bshd-with-cp": (
        Case(("model.packed_sequences=false", "parallel.cp_size=2"), world=2),
        Case(("model.packed_sequences=true", "parallel.cp_size=2"), world=2),
    ),
    "thd-backend-no-varlen": (
        Case(("model.packed_sequences=true", "model.attention_backend=sdpa")),
        Case(("model.packed_sequences=false", "model.attention_backend=sdpa")),
    ),
    "bshd-backend-no-padding": (
        Case(("model.packed_sequences=false", "model.attention_backend=torch_varlen")),
        Case(("model.packed_sequences=true", "model.attention_backend=torch_varlen")),
    ),
    "backend-no-cp": (
        Case(("model.attention_backend=flash", "parallel.cp_size=2"), world=2),
        Case(("model.attention_backend=flash", "parallel.cp_size=1"), world=1),
    ),
    "te-cp-allgather": (
        Case(
            ("model.attention_backend=te", "parallel.cp_size=2", "parallel.cp_attention=allgather"), world=2
        ),
        Case(("model.attention_backend=te", "parallel.cp_size=2", "parallel.cp_attention=ring"), world=2),
    ),
    "te-cp-unverified-gpu": (
        Case(("model.attention_backend=te", "parallel.cp_size=2"), world=2, cap=8.9),
        Case(("model.attention_backend=te", "parallel.cp_size=2"), world=2, cap=9.0),
    ),
    "te-cp-sm120-unmeasured": (
        Case(TE_CP_SM120, world=2, cap=12.0, env={"NVTE_FUSED_ATTN": "0"}),
        Case(TE_CP_SM120, world=2, cap=12.0, env={"NVTE_FUSED_ATTN": "0"}, installed=_without("flash-attn")),
    ),
    "te-fused-attn-sm120": (
        Case(("model.attention_backend=te",), cap=12.0),
        Case(("model.attention_backend=te",), cap=12.0, env={"NVTE_FUSED_ATTN": "0"}),
    ),
    "te-fused-attn": (
        Case(("model.attention_backend=te",), cap=9.0, env={"NVTE_FUSED_ATTN": "1"}),
        Case(("model.attention_backend=te", "trainer.validate_only=true"), cap=9.0),
    ),
    "te-thd-needs-flash-attn": (
        Case(("model.attention_backend=te",), env={"NVTE_FUSED_ATTN": "0"}, installed=_without("flash-attn")),
        Case(("model.attention_backend=te",), env={"NVTE_FUSED_ATTN": "0"}),
    ),
    "heads-not-divisible-by-tp": (
        Case(("parallel.tp_size=3",), world=3),
        Case(("parallel.tp_size=2",), world=2),
    ),
    "rounding-not-divisible": (
        Case(("parallel.cp_size=2", "parallel.tp_size=4"), world=8, attrs={"model__pad_to_multiple": 4}),
        Case(("parallel.cp_size=2", "parallel.tp_size=4"), world=8, attrs={"model__pad_to_multiple": 16}),
    ),
    "cp-degrees-te-unmeasured": (
        Case(("model.attention_backend=te", "parallel.cp_size=2", "parallel.cp_degrees=hybrid"), world=2),
        Case(("model.attention_backend=te", "parallel.cp_size=2", "parallel.cp_degrees=all"), world=2),
    ),
    "cp-degrees-idle": (
        Case(("parallel.cp_size=2", "parallel.cp_degrees=hybrid", "parallel.cp_split_threshold=40"), world=2),
        Case(("parallel.cp_size=2", "parallel.cp_degrees=hybrid"), world=2),
    ),
    "cp-split-threshold": (
        Case(("parallel.cp_size=4", "parallel.cp_split_threshold=5"), world=4),
        Case(("parallel.cp_size=4", "parallel.cp_split_threshold=200"), world=4),
    ),
    "backend-not-installed": (
        Case(("model.attention_backend=flash",), installed=_without("flash-attn")),
        Case(("model.attention_backend=reference",), installed=_without("flash-attn")),
    ),
    "backend-version-unsupported": (
        Case(("model.attention_backend=torch_varlen",), installed={**INSTALLED, "torch": "2.9.1+cu128"}),
        Case(("model.attention_backend=torch_varlen",), installed={**INSTALLED, "torch": "2.10.0+cu128"}),
    ),
    "fp32-with-half-precision-kernel": (
        Case(("model.attention_backend=torch_varlen", "trainer.precision=32")),
        Case(("model.attention_backend=torch_varlen", "trainer.precision=bf16")),
    ),
    "backend-needs-gpu": (
        Case(("model.attention_backend=flash",), cap=None),
        Case(("model.attention_backend=flash",), cap=9.0),
    ),
    "gpu-too-old-for-backend": (
        Case(("model.attention_backend=flash",), cap=7.5),
        Case(("model.attention_backend=flash",), cap=8.0),
    ),
    "reference-at-scale": (
        Case(("model.attention_backend=reference", "model.packed_sequences=false"), world=8, cap=9.0),
        Case(("model.attention_backend=reference", "model.packed_sequences=false"), world=4, cap=9.0),
    ),
    "sampler-budget-invalid": (
        Case(("sampler.max_batch_duration=null",)),
        Case(("sampler.max_batch_duration=30",)),
    ),
    "budget-below-longest-utterance": (
        Case(("sampler.max_batch_duration=90",), manifest={"max_duration": 120.0}),
        Case(("sampler.max_batch_duration=90",), manifest={"max_duration": 30.0}),
    ),
    "encoder-packed-unsupported": (
        Case(("model.encoder.kind=whisper", "model.encoder.packed=true")),
        Case(("model.encoder.kind=parakeet", "model.encoder.packed=true")),
    ),
    "encoder-runs-padded": (
        Case(("model.encoder.kind=whisper",)),
        Case(("model.encoder.kind=whisper", "model.encoder.packed=false")),
    ),
    "whisper-clip-over-window": (
        Case(("model.encoder.kind=whisper",), manifest={"max_duration": 45.0}),
        Case(("model.encoder.kind=whisper",), manifest={"max_duration": 30.0}),
    ),
    "encoder-full-context-long-clip": (
        Case(manifest={"max_duration": 600.0, "max_encoder_frames": 7500}),
        Case(
            ("model.encoder.att_context_size=[64,64]",),
            manifest={"max_duration": 600.0, "max_encoder_frames": 7500},
        ),
    ),
    "ctc-per-clip-long-form": (
        Case(manifest={"max_duration": 600.0, "median_duration": 5.0, "max_encoder_frames": 7500}),
        Case(
            ("model.ctc_reduction=token",),
            manifest={"max_duration": 600.0, "median_duration": 5.0, "max_encoder_frames": 7500},
        ),
    ),
    "grad-accum-exceeds-batches": (
        Case(("trainer.grad_accum=4",), world=4, manifest={"n_rows": 10}),
        Case(("trainer.grad_accum=2",), world=4, manifest={"n_rows": 10}),
    ),
    # enough rows for grad_accum=4 on dp=2, but epoch 0 packs into 6 micro-batches: 3 per rank
    "epoch-plan-too-short": (
        Case(
            ("trainer.grad_accum=4",),
            world=2,
            manifest={"n_rows": 40, "plan_micro_batches": 6, "plan_batches_per_rank": 0},
        ),
        Case(
            ("trainer.grad_accum=4",),
            world=2,
            manifest={"n_rows": 40, "plan_micro_batches": 8, "plan_batches_per_rank": 4},
        ),
    ),
    # the tokenizer facts preflight.tokenizer_summary adds to the summary (issue 22)
    "pretrained-llm-sentencepiece-tokenizer": (
        Case(
            manifest={
                "llm_pretrained": "/llm",
                "tokenizer_kind": "sentencepiece",
                "tokenizer_path": "t.model",
            }
        ),
        Case(
            manifest={
                "llm_pretrained": "/llm",
                "tokenizer_kind": "sentencepiece",
                "allow_sentencepiece_with_pretrained": True,
            }
        ),
    ),
    "chat-template-missing": (
        Case(manifest={"tokenizer_kind": "hf", "chat_template": False, "chat_template_setting": "auto"}),
        Case(manifest={"tokenizer_kind": "hf", "chat_template": False, "chat_template_setting": "none"}),
    ),
    "lora-with-tp": (
        Case(("model.llm.train=lora", "parallel.tp_size=2"), world=2),
        Case(("model.llm.train=frozen", "parallel.tp_size=2"), world=2),
    ),
    "frozen-encoder-with-unfreeze-step": (
        Case(("model.encoder.train=frozen", "optim.unfreeze_step=100")),
        Case(("model.encoder.train=full", "optim.unfreeze_step=100")),
    ),
    "frozen-llm-added-lang-tags": (
        Case(
            (
                "model.llm.train=lora",
                "model.llm.pretrained=/llm",
                "data.lang_tags=special",
                "model.llm.train_added_rows=false",
            )
        ),
        Case(("model.llm.train=lora", "model.llm.pretrained=/llm", "data.lang_tags=special")),
    ),
    "adapting-a-random-llm": (
        Case(("model.llm.train=lora",)),
        Case(("model.llm.train=lora", "model.llm.pretrained=/some/llm")),
    ),
    "freezing-a-random-encoder": (
        Case(("model.encoder.train=frozen",)),
        Case(("model.encoder.train=frozen", "model.encoder.pretrained=/some/encoder")),
    ),
}


def test_every_rule_row_has_a_case() -> None:
    assert set(RULE_CASES) == {r.id for r in RULES}


def test_rule_ids_are_unique_kebab_case_with_static_levels() -> None:
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    for r in RULES:
        assert r.id == r.id.lower() and " " not in r.id and "_" not in r.id, r.id
        assert r.level in (ERROR, WARNING)
        assert r.doc and r.when


@pytest.mark.parametrize("rule_id", [r.id for r in RULES])
def test_rule_triggers_and_near_miss_does_not(rule_id: str) -> None:
    trigger, near_miss = RULE_CASES[rule_id]
    assert rule_id in trigger.ids()
    assert rule_id not in near_miss.ids()


# ---------------------------------------------------------------------------------------------
# The issue's three layout rules over the full grid
# ---------------------------------------------------------------------------------------------

NVTE_VALUES = (None, "", "0", "1")
CAPABILITIES = (None, 9.0, 12.0)


def expected_layout_ids(
    packed: bool, cp: int, backend: str, nvte: str | None, cap: Any, validate_only: bool
) -> set[str]:
    caps = BACKENDS[backend]
    out = set()
    if not packed and cp > 1:
        out.add("bshd-with-cp")
    if packed and not caps.thd:
        out.add("thd-backend-no-varlen")
    if not packed and not caps.bshd:
        out.add("bshd-backend-no-padding")
    if cp > 1 and not caps.cp:
        out.add("backend-no-cp")
    if packed and cp > 1 and backend == "te" and cap is not None and cap != 9.0:
        # sm_120 with fused attention off (flash-attn installed, precision auto = bf16): accepted, with a warning
        out.add("te-cp-sm120-unmeasured" if cap == 12.0 and nvte == "0" else "te-cp-unverified-gpu")
    if packed and backend == "te" and nvte != "0" and not validate_only and cap is not None:
        out.add("te-fused-attn-sm120" if cap == 12.0 else "te-fused-attn")
    if cap is None and not caps.cpu and not (validate_only and backend == "flex"):
        out.add("backend-needs-gpu")
    return out


@pytest.mark.parametrize("validate_only", [False, True])
def test_layout_grid(validate_only: bool) -> None:
    checked = 0
    for packed, cp, backend, nvte, cap in product((False, True), (1, 2), BACKENDS, NVTE_VALUES, CAPABILITIES):
        cfg = make_config(
            f"model.packed_sequences={str(packed).lower()}",
            f"parallel.cp_size={cp}",
            f"model.attention_backend={backend}",
            f"trainer.validate_only={str(validate_only).lower()}",
        )
        env = {} if nvte is None else {"NVTE_FUSED_ATTN": nvte}
        got = {f.rule_id for f in validate(cfg, cp, env, cap, INSTALLED)}
        want = expected_layout_ids(packed, cp, backend, nvte, cap, validate_only)
        assert got == want, (packed, cp, backend, nvte, cap, validate_only)
        checked += 1
    assert checked == 2 * 2 * len(BACKENDS) * len(NVTE_VALUES) * len(CAPABILITIES)


def test_grid_spot_checks_read_like_the_issue() -> None:
    def ids(*ov: str, env: dict[str, str] | None = None, cap: Any = 9.0, world: int = 1) -> set[str]:
        return {f.rule_id for f in validate(make_config(*ov), world, env or {}, cap, INSTALLED)}

    assert "bshd-with-cp" in ids("model.packed_sequences=false", "parallel.cp_size=2", world=2)
    assert ids("model.packed_sequences=false", "parallel.cp_size=1") == set()
    assert ids("model.attention_backend=sdpa") == {"thd-backend-no-varlen"}
    assert ids("model.attention_backend=te", cap=12.0) == {"te-fused-attn-sm120"}
    assert ids("model.attention_backend=te", env={"NVTE_FUSED_ATTN": ""}, cap=12.0) == {"te-fused-attn-sm120"}
    assert ids("model.attention_backend=te", env={"NVTE_FUSED_ATTN": "0"}, cap=12.0) == set()
    assert ids("model.attention_backend=te", cap=9.0) == {"te-fused-attn"}
    assert ids("model.attention_backend=te", "model.packed_sequences=false", cap=12.0) == set()


def test_findings_carry_level_reason_and_fix() -> None:
    cfg = make_config("model.packed_sequences=false", "parallel.cp_size=2")
    (f,) = validate(cfg, 2, {}, None, INSTALLED)
    assert f.level == ERROR and f.rule_id == "bshd-with-cp"
    assert "cp=2" in f.reason and "model.packed_sequences=true" in f.fix
    assert f.as_dict() == {"level": "error", "rule_id": "bshd-with-cp", "reason": f.reason, "fix": f.fix}


def test_thd_error_names_the_backends_with_a_varlen_path() -> None:
    (f,) = validate(make_config("model.attention_backend=sdpa"), 1, {}, None, INSTALLED)
    for name, caps in BACKENDS.items():
        assert (name in f.fix) == caps.thd, name


def test_errors_come_before_warnings() -> None:
    cfg = make_config("model.attention_backend=te", "parallel.tp_size=3")
    findings = validate(cfg, 3, {}, 9.0, INSTALLED)
    assert [f.rule_id for f in findings] == ["heads-not-divisible-by-tp", "te-fused-attn"]


# ---------------------------------------------------------------------------------------------
# Rule details
# ---------------------------------------------------------------------------------------------


def test_world_size_messages_give_the_numbers() -> None:
    (f,) = validate(make_config("parallel.dp_shard=2", "parallel.tp_size=2"), 8, {}, None, INSTALLED)
    assert "1*2*1*2 = 4" in f.reason and "world size is 8" in f.reason
    (f,) = validate(make_config("parallel.tp_size=4"), 6, {}, 9.0, INSTALLED)
    assert "dp_shard=-1" in f.reason and "6" in f.reason and "= 4" in f.reason
    assert (
        validate(make_config("parallel.dp_replicate=2", "parallel.cp_size=2"), 8, {}, None, INSTALLED) == []
    )


def test_encoder_heads_do_not_count_the_encoder_is_not_tensor_parallel() -> None:
    base = ("parallel.tp_size=2", "model.encoder.num_heads=11")  # 176 = 11 * 16, not divisible by tp
    assert validate(make_config(*base), 2, {}, 9.0, INSTALLED) == []
    (f,) = validate(make_config("parallel.tp_size=2", "model.llm.num_kv_heads=1"), 2, {}, 9.0, INSTALLED)
    assert "num_kv_heads=1" in f.reason and "num_heads=4" not in f.reason


@pytest.mark.parametrize(
    ("cp", "tp", "packed", "multiple", "fires"),
    [
        (1, 1, True, 1, False),
        (1, 4, True, 6, True),
        (1, 4, True, 8, False),
        (2, 1, True, 2, True),  # chunks of 2*cp = 4
        (2, 1, True, 4, False),
        (2, 8, True, 8, True),  # lcm(4, 16) = 16: 8 leaves 4 tokens per rank for tp=8
        (2, 8, True, 16, False),
        (1, 2, False, 3, True),  # BSHD: the padded length must divide by tp
        (1, 2, False, 2, False),
    ],
)
def test_rounding_unit(cp: int, tp: int, packed: bool, multiple: int, fires: bool) -> None:
    cfg = make_config(
        f"parallel.cp_size={cp}",
        f"parallel.tp_size={tp}",
        f"model.packed_sequences={str(packed).lower()}",
        "model.llm.num_heads=8",
        "model.llm.num_kv_heads=8",
        model__pad_to_multiple=multiple,
    )
    ids = [f.rule_id for f in validate(cfg, cp * tp, {}, 9.0, INSTALLED)]
    assert ("rounding-not-divisible" in ids) == fires


def test_te_fused_attn_reads_the_flag_like_transformer_engine() -> None:
    cfg = make_config("model.attention_backend=te")
    for value, fires in (("0", False), (" 0 ", False), ("00", False), ("1", True), ("", True), ("no", True)):
        ids = [f.rule_id for f in validate(cfg, 1, {"NVTE_FUSED_ATTN": value}, "12.0", INSTALLED)]
        assert ("te-fused-attn-sm120" in ids) == fires, value


def test_te_cp_on_sm120_as_the_pr_recommends_is_accepted_with_a_warning() -> None:
    env = {"NVTE_FUSED_ATTN": "0"}
    (f,) = validate(make_config(*TE_CP_SM120), 2, env, "12.0", INSTALLED)
    assert f.level == WARNING and f.rule_id == "te-cp-sm120-unmeasured"
    assert "not measured" in f.reason and "sm_120" in f.reason
    check_or_raise([f], log=lambda _: None)  # a warning: training goes on
    # each missing ingredient of the recommendation leaves it unverified (an error), as before
    for overrides, env_, installed in (
        (TE_CP_SM120, {}, INSTALLED),  # fused attention on (also te-fused-attn-sm120)
        (TE_CP_SM120, {**env, "NVTE_FLASH_ATTN": "0"}, INSTALLED),  # flash-attn turned off
        (TE_CP_SM120, env, _without("flash-attn")),  # flash-attn missing
        ((*TE_CP_SM120, "trainer.precision=32"), env, INSTALLED),  # not bf16
    ):
        ids = [f.rule_id for f in validate(make_config(*overrides), 2, env_, "12.0", installed)]
        assert "te-cp-unverified-gpu" in ids and "te-cp-sm120-unmeasured" not in ids, (overrides, env_)
    # other unlisted GPUs stay unverified even with the same settings
    ids = [f.rule_id for f in validate(make_config(*TE_CP_SM120), 2, env, "8.9", INSTALLED)]
    assert ids == ["te-cp-unverified-gpu"]


def test_te_with_fused_attention_off_needs_flash_attn_enabled() -> None:
    cfg = make_config("model.attention_backend=te")
    env = {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0"}
    (f,) = validate(cfg, 1, env, 9.0, INSTALLED)
    assert f.rule_id == "te-thd-needs-flash-attn" and "NVTE_FLASH_ATTN=0" in f.reason
    bshd = make_config("model.attention_backend=te", "model.packed_sequences=false")
    assert validate(bshd, 1, env, 9.0, INSTALLED) == []


def test_missing_and_old_packages() -> None:
    te = make_config("model.attention_backend=te")
    ids = [
        f.rule_id
        for f in validate(te, 1, {"NVTE_FUSED_ATTN": "0"}, 9.0, {"torch": "2.13.0", "flash-attn": "2.8"})
    ]
    assert ids == ["backend-not-installed"]
    (f,) = validate(te, 1, {"NVTE_FUSED_ATTN": "0"}, 9.0, {**INSTALLED, "transformer_engine": "1.10.0"})
    assert f.rule_id == "backend-version-unsupported" and "1.10.0" in f.reason and "< 1.11" in f.reason
    ref = make_config()
    (f,) = validate(ref, 1, {}, None, {"torch": "2.5.1"})
    assert f.rule_id == "backend-version-unsupported" and "torch 2.5.1" in f.reason
    (f,) = validate(ref, 1, {}, None, {})
    assert f.rule_id == "backend-not-installed" and "pip install torch" in f.fix
    assert validate(ref, 1, {}, None, {"torch": "unknown"}) == []  # unreadable version: not judged
    flash = make_config("model.attention_backend=flash")
    (f,) = validate(flash, 1, {}, 9.0, {"torch": "2.13.0", "flash-attn": "none"})
    assert "speechlm[flash]" in f.fix


def test_flex_on_cpu_is_fine_for_validation_only() -> None:
    assert (
        validate(
            make_config("model.attention_backend=flex", "trainer.validate_only=true"), 1, {}, None, INSTALLED
        )
        == []
    )
    (f,) = validate(make_config("model.attention_backend=flex"), 1, {}, None, INSTALLED)
    assert f.rule_id == "backend-needs-gpu"


def test_reference_at_scale_suggests_backends_for_the_layout() -> None:
    (f,) = validate(make_config("model.packed_sequences=false"), 16, {}, 9.0, INSTALLED)
    assert f.level == WARNING and "sdpa" not in f.fix and "torch_varlen" not in f.fix and "flash" in f.fix
    (f,) = validate(make_config("trainer.precision=32"), 16, {}, 9.0, INSTALLED)  # fp32 THD: flex only
    assert f.rule_id == "reference-at-scale" and f.fix.startswith(
        "for speed set model.attention_backend to one of: flex ("
    )
    # half-precision THD, one process or CP: the reference backend already runs the fused varlen kernels
    assert validate(make_config(), 16, {}, 9.0, INSTALLED) == []
    assert validate(make_config("parallel.cp_size=2"), 16, {}, 9.0, INSTALLED) == []
    assert validate(make_config("model.packed_sequences=false"), 16, {}, None, INSTALLED) == []  # CPU


def test_token_budget_counts_the_rounded_length() -> None:
    ov = ("parallel.cp_size=2", "parallel.tp_size=4", "sampler.max_batch_tokens=999")
    cfg = make_config(*ov)
    ids = [f.rule_id for f in validate(cfg, 8, {}, 9.0, INSTALLED, manifest_summary={"max_tokens": 997})]
    assert ids == ["budget-below-longest-utterance"]  # 997 -> 1000 (multiple of lcm(4, 8) = 8) > 999
    (f,) = validate(cfg, 8, {}, 9.0, INSTALLED, manifest_summary={"max_tokens": 997})
    assert f.level == WARNING and "997 tokens, 1000 after rounding" in f.reason
    assert (
        validate(
            make_config(*ov[:2], "sampler.max_batch_tokens=1000"),
            8,
            {},
            9.0,
            INSTALLED,
            manifest_summary={"max_tokens": 997},
        )
        == []
    )
    (f,) = validate(make_config(*ov[:2], "sampler.max_batch_tokens=6"), 8, {}, 9.0, INSTALLED)
    assert f.rule_id == "sampler-budget-invalid" and "8 tokens" in f.reason
    (f,) = validate(make_config("sampler.max_batch_duration=null"), 1, {}, 9.0, INSTALLED)
    assert "neither" in f.reason


def test_grad_accum_uses_epoch_size_in_temperature_mode() -> None:
    cfg = make_config("trainer.grad_accum=4", "sampler.epoch_size=100")
    assert validate(cfg, 4, {}, 9.0, INSTALLED, manifest_summary={"n_rows": 10}) == []
    cfg = make_config("trainer.grad_accum=4", "sampler.epoch_size=100", "sampler.mode=exhaustive")
    (f,) = validate(cfg, 4, {}, 9.0, INSTALLED, manifest_summary={"n_rows": 10})
    assert "at most 2 micro-batches" in f.reason
    (f,) = validate(make_config(), 4, {}, None, INSTALLED, manifest_summary={"n_rows": 3})  # grad_accum=1
    assert f.rule_id == "grad-accum-exceeds-batches" and "at most 0 micro-batches" in f.reason


# ---------------------------------------------------------------------------------------------
# Robustness: any layout yields well-formed findings
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    packed=st.booleans(),
    backend=st.sampled_from([*BACKENDS, "bogus"]),
    cp=st.integers(1, 4),
    tp=st.integers(1, 8),
    dp_replicate=st.integers(1, 3),
    dp_shard=st.sampled_from([-1, 0, 1, 2, 4]),
    world=st.integers(1, 70),
    cap=st.sampled_from([None, (7, 0), (8, 0), (9, 0), (10, 0), (12, 0)]),
    nvte=st.sampled_from([None, "", "0", "1", "x"]),
    validate_only=st.booleans(),
    pad=st.sampled_from([None, 1, 2, 3, 8, 16]),
    tokens=st.sampled_from([None, -1, 4, 4096]),
    manifest=st.sampled_from([None, {}, {"n_rows": 3, "max_duration": 100.0, "max_tokens": 5000}]),
    drop=st.sampled_from([None, "torch", "flash-attn", "transformer-engine"]),
)
def test_findings_are_well_formed(
    packed,
    backend,
    cp,
    tp,
    dp_replicate,
    dp_shard,
    world,
    cap,
    nvte,
    validate_only,
    pad,
    tokens,
    manifest,
    drop,
) -> None:  # type: ignore[no-untyped-def]
    cfg = make_config(
        f"model.packed_sequences={str(packed).lower()}",
        f"parallel.cp_size={cp}",
        f"parallel.tp_size={tp}",
        f"parallel.dp_replicate={dp_replicate}",
        f"parallel.dp_shard={dp_shard}",
        f"trainer.validate_only={str(validate_only).lower()}",
        f"sampler.max_batch_tokens={tokens}",
        model__attention_backend=backend,
        model__pad_to_multiple=pad,
    )
    installed = {k: (None if k == drop else v) for k, v in INSTALLED.items()}
    env = {} if nvte is None else {"NVTE_FUSED_ATTN": nvte}
    try:
        cfg.validate()
    except ConfigError:  # a single key out of its range (bogus backend, dp_shard=0, ...): the config's error
        with pytest.raises(ConfigError):
            validate(cfg, world, env, cap, installed, manifest_summary=manifest)
        return
    findings = validate(cfg, world, env, cap, installed, manifest_summary=manifest)
    known = {r.id: r.level for r in RULES}
    for f in findings:
        assert known[f.rule_id] == f.level
        assert f.reason and f.fix and "{" not in f.reason + f.fix, f
    assert len({f.rule_id for f in findings}) == len(findings)


# ---------------------------------------------------------------------------------------------
# Helpers and fit-start entry point
# ---------------------------------------------------------------------------------------------


def test_parse_capability() -> None:
    assert (
        parse_capability(None) is None
        and parse_capability("none") is None
        and parse_capability("cpu") is None
    )
    assert parse_capability(9.0) == (9, 0) == parse_capability("9.0") == parse_capability("sm_90")
    assert parse_capability("12.0") == (12, 0) == parse_capability("sm120") == parse_capability((12, 0))
    assert parse_capability(8.6) == (8, 6) and parse_capability("10") == (10, 0)
    with pytest.raises(ValueError, match="9.0, 12.0 or sm_90"):
        parse_capability("hopper")


def test_parse_version_and_installed_names() -> None:
    assert parse_version("2.13.0+cpu") == Version("2.13.0")
    assert parse_version("2.10") == parse_version("2.10.0") > parse_version("2.9.1")
    assert parse_version("1.11.0.dev0+abc") > parse_version("1.10.99")
    with pytest.raises(ValueError, match="2.6.0"):
        parse_version("latest")
    assert normalize_installed({"Transformer_Engine": "2.1", "flash_attn": "", "cuDNN": "none"}) == {
        "transformer-engine": "2.1",
        "flash-attn": None,
        "cudnn": None,
    }
    assert normalize_installed({"te": "2.5", "flash": "2.8"}) == {
        "transformer-engine": "2.5",
        "flash-attn": "2.8",
    }


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("2.13.0+cpu", "2.13.0"),  # local label ignored
        ("2.9.1+cu128", "2.9.1"),
        ("2.5.0a0+git1234", "2.5.0"),  # pre-release and local label: its release
        ("2.10.0a0+gitabc", "2.10.0"),
        ("2.6.0rc1", "2.6.0"),
        ("1.11.0.dev0+abc", "1.11.0"),  # dev release
        ("2.5.0.post1", "2.5.0"),  # post release
        ("1.7", "1.7.0"),  # short forms compare like their zero-padded release
        ("2", "2.0.0"),
        ("v2.5", "2.5"),
        (" 2.5 ", "2.5"),
    ],
)
def test_versions_compare_on_the_release_number(text: str, release: str) -> None:
    assert parse_version(text) == Version(release) == try_parse_version(text)


def test_pre_releases_and_local_builds_of_a_bound_count_as_that_release() -> None:
    assert in_range("2.5.0a0+git1234", None, "2.6")
    assert not in_range("2.6.0a0+git1234", None, "2.6")  # a 2.6 nightly is not below 2.6
    assert not in_range("2.10.0a0+gitabc", None, "2.10") and in_range("2.9.1+cu128", None, "2.10")
    assert in_range("2.6.0rc1", "2.6", "2.7") and not in_range("2.7.0.dev0", "2.6", "2.7")
    assert in_range("1.7", None, "1.11") and in_range("1.7", "1.7.0", None)


@pytest.mark.parametrize("text", ["unknown", "latest", "", "none", "2.5-custom", "2.5.0 custom", "2.5.x"])
def test_unreadable_versions_are_unknown_and_not_judged(text: str) -> None:
    assert try_parse_version(text) is None
    if text:
        with pytest.raises(ValueError, match="write it like 2.6.0"):
            parse_version(text)
    if text not in ("", "none"):  # those two mean "not installed", another rule
        # read as 2.5 it would be below 2.6: unknown, it is not judged
        assert validate(make_config(), 1, {}, None, {"torch": text}) == []


@pytest.mark.parametrize(
    ("torch", "refused"),
    [("2.5.0a0+git1234", True), ("2.6.0a0+git1234", False), ("2.13.0+cpu", False), ("1.7", True)],
)
def test_version_rule_reads_pre_releases_and_local_builds(torch: str, refused: bool) -> None:
    ids = [f.rule_id for f in validate(make_config(), 1, {}, None, {"torch": torch})]
    assert ids == (["backend-version-unsupported"] if refused else [])


def test_full_table_is_the_parallel_rules_then_the_training_rules() -> None:
    assert RULES == (*PARALLEL_RULES, *TRAINING_RULES)
    assert [r.id for r in TRAINING_RULES] == [
        "sampler-budget-invalid",
        "budget-below-longest-utterance",
        "encoder-packed-unsupported",
        "encoder-runs-padded",
        "whisper-clip-over-window",
        "encoder-full-context-long-clip",
        "ctc-per-clip-long-form",
        "grad-accum-exceeds-batches",
        "epoch-plan-too-short",
        "pretrained-llm-sentencepiece-tokenizer",
        "chat-template-missing",
        "lora-with-tp",
        "frozen-encoder-with-unfreeze-step",
        "frozen-llm-added-lang-tags",
        "adapting-a-random-llm",
        "freezing-a-random-encoder",
    ]
    # parallel.validator alone runs the parallel rules; the budget rule lives in speechlm
    cfg = make_config("sampler.max_batch_duration=null")
    assert parallel.validator.validate(cfg, 1, {}, 9.0, INSTALLED) == []
    assert [f.rule_id for f in validate(cfg, 1, {}, 9.0, INSTALLED)] == ["sampler-budget-invalid"]


@pytest.mark.parametrize(
    ("attrs", "words"),
    [
        ({"parallel__dp_shard": 0}, "parallel.dp_shard=0"),
        ({"parallel__cp_size": 0}, "parallel.cp_size=0"),
        ({"parallel__tp_size": -1}, "parallel.tp_size=-1"),
        ({"parallel__dp_replicate": 0}, "parallel.dp_replicate=0"),
        ({"model__attention_backend": "xformers"}, "model.attention_backend='xformers'"),
        ({"model__pad_to_multiple": 0}, "model.pad_to_multiple=0"),
        ({"parallel__cp_split_threshold": "half"}, "parallel.cp_split_threshold='half'"),
        ({"sampler__max_batch_duration": 0}, "sampler.max_batch_duration=0"),
        ({"sampler__max_batch_tokens": -8}, "sampler.max_batch_tokens=-8"),
    ],
)
def test_a_value_its_section_refuses_is_an_argument_error_not_a_finding(
    attrs: dict[str, Any], words: str
) -> None:
    """Single-key ranges belong to the config sections (`ExperimentConfig.validate`); the validator's rules
    are about keys together, and a config that skipped the section checks is refused as an argument."""
    cfg = make_config(**attrs)
    with pytest.raises(ValueError, match=re.escape(words)):
        validate(cfg, 1, {}, 9.0, INSTALLED)
    with pytest.raises(ConfigError, match=re.escape(words)):
        cfg.validate()


def test_bad_world_size_is_an_argument_error() -> None:
    with pytest.raises(ValueError, match="world_size"):
        validate(make_config(), 0, {}, None, INSTALLED)


def test_check_or_raise_logs_once_and_raises_on_every_rank() -> None:
    warning = Finding(WARNING, "te-fused-attn", "r1", "f1")
    error = Finding(ERROR, "bshd-with-cp", "r2", "f2")
    logged: list[str] = []
    check_or_raise([warning], log=logged.append, rank=0)
    check_or_raise([warning], log=logged.append, rank=3)
    assert len(logged) == 1 and "te-fused-attn" in logged[0]
    logged.clear()
    for rank in (0, 1):
        with pytest.raises(ValidationError, match="bshd-with-cp") as info:
            check_or_raise([error, warning], log=logged.append, rank=rank)
        assert info.value.findings == [error, warning] and "f2" in info.value.report
    assert len(logged) == 2 and "r2" in logged[1] and "f2" in logged[1]  # rank 0: warnings, then errors
    check_or_raise([], log=logged.append)


def test_format_findings_shows_level_id_reason_and_fix() -> None:
    text = format_findings([Finding(ERROR, "bshd-with-cp", "because " * 30, "do this")])
    assert text.splitlines()[0].split() == ["ERROR", "bshd-with-cp"]
    assert "reason: because" in text and "fix:    do this" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_validator_and_cli_module_do_not_import_torch() -> None:
    code = (
        "import sys, parallel.validator, speechlm.preflight.rules, speechlm.preflight.validate; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# docs/validator.md is generated from the table
# ---------------------------------------------------------------------------------------------


def _load_docs_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gen_validator_docs", ROOT / "scripts" / "gen_validator_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_list_every_rule_and_are_current() -> None:
    gen = _load_docs_script()
    text = (ROOT / "docs" / "validator.md").read_text()
    assert text == gen.render(), "docs/validator.md is stale: run python scripts/gen_validator_docs.py"
    for rule in RULES:
        assert f"### `{rule.id}` ({rule.level})" in text
        assert rule.doc in text
        for part in (rule.reason, rule.fix):
            assert (part if isinstance(part, str) else " ".join((part.__doc__ or "").split())) in text
    assert gen.main(["--check"]) == 0


def test_docs_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    gen = _load_docs_script()
    stale = tmp_path / "validator.md"
    stale.write_text("old\n")
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert gen.main(["--out", str(stale)]) == 0 and gen.main(["--check", "--out", str(stale)]) == 0


@pytest.mark.parametrize(
    "backend,packed,fires",
    [
        ("flash", "true", True),
        ("torch_varlen", "true", True),
        ("te", "true", True),
        ("te", "false", False),
        ("reference", "true", False),
        ("flex", "true", False),
    ],
)
def test_fp32_with_a_half_precision_kernel_is_an_error_naming_the_fix(
    backend: str, packed: str, fires: bool
) -> None:
    cfg = make_config(
        f"model.attention_backend={backend}", f"model.packed_sequences={packed}", "trainer.precision=32"
    )
    findings = [
        f for f in validate(cfg, 1, {}, 9.0, INSTALLED) if f.rule_id == "fp32-with-half-precision-kernel"
    ]
    assert bool(findings) == fires
    if fires:
        assert findings[0].level == ERROR and "trainer.precision=bf16" in findings[0].fix


@pytest.mark.parametrize(
    ("cp", "threshold", "fires"),
    [(1, 100, True), (1, "auto", False), (2, 3, True), (2, 4, False), (4, 0, False), (4, "auto", False)],
)
def test_cp_split_threshold_rule(cp: int, threshold: Any, fires: bool) -> None:
    ids = Case((f"parallel.cp_size={cp}", f"parallel.cp_split_threshold={threshold}"), world=cp).ids()
    assert ("cp-split-threshold" in ids) == fires
