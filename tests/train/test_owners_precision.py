"""One precision policy (issue 21, item 2): FSDP2 mixed precision or autocast, never both, decided once."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from speechlm.train.precision import PrecisionPolicy, decide_precision, precision_policy

# (trainer.precision, device, bf16 supported, fully sharded) -> (compute dtype, where it is applied)
TABLE = {
    ("32", "cpu", True, False): (torch.float32, "none"),
    ("32", "cpu", True, True): (torch.float32, "none"),
    ("32", "cuda", True, False): (torch.float32, "none"),
    ("32", "cuda", True, True): (torch.float32, "none"),
    ("bf16", "cpu", True, False): (torch.bfloat16, "autocast"),
    ("bf16", "cpu", True, True): (torch.bfloat16, "fsdp"),
    ("bf16", "cuda", True, False): (torch.bfloat16, "autocast"),
    ("bf16", "cuda", True, True): (torch.bfloat16, "fsdp"),
    ("auto", "cpu", True, False): (torch.float32, "none"),
    ("auto", "cpu", True, True): (torch.float32, "none"),
    ("auto", "cuda", True, False): (torch.bfloat16, "autocast"),
    ("auto", "cuda", True, True): (torch.bfloat16, "fsdp"),
    ("auto", "cuda", False, False): (torch.float32, "none"),  # a GPU without bf16: auto means fp32
    ("auto", "cuda", False, True): (torch.float32, "none"),
}


@pytest.mark.parametrize("key", sorted(TABLE), ids=lambda k: "-".join(map(str, k)))
def test_decision_table(key):
    precision, device, bf16_ok, fsdp = key
    dtype, where = TABLE[key]
    policy = decide_precision(precision, device, fully_sharded=fsdp, bf16_supported=bf16_ok)
    assert policy.compute_dtype == dtype
    assert policy.applied_by == where
    assert (policy.mp_policy is not None) == (where == "fsdp")
    assert policy.uses_autocast == (where == "autocast")
    if where == "fsdp":
        assert policy.mp_policy.param_dtype == torch.bfloat16
        assert policy.mp_policy.reduce_dtype == torch.float32


def test_fsdp_mixed_precision_and_autocast_are_never_both_on():
    for precision, device, bf16_ok, fsdp in itertools.product(
        ("32", "bf16", "auto"), ("cpu", "cuda"), (True, False), (True, False)
    ):
        policy = decide_precision(precision, device, fully_sharded=fsdp, bf16_supported=bf16_ok)
        assert not (policy.mp_policy is not None and policy.uses_autocast), policy
        if device == "cpu" or torch.cuda.is_available():  # torch turns CUDA autocast off without a GPU
            with policy.autocast():
                on = torch.is_autocast_enabled(device)
            assert on == policy.uses_autocast, policy


def test_unknown_precision_is_refused_with_the_value():
    with pytest.raises(ValueError, match="'16-mixed'"):
        decide_precision("16-mixed", "cpu", fully_sharded=False, bf16_supported=True)


def test_policy_from_config_and_layout():
    from parallel.mesh import ParallelDims

    cfg = SimpleNamespace(trainer=SimpleNamespace(precision="bf16"))
    assert precision_policy(cfg, None, torch.device("cpu")).applied_by == "autocast"  # one process
    assert (
        precision_policy(cfg, ParallelDims(2, tp=2), torch.device("cpu")).applied_by == "autocast"
    )  # TP only
    assert precision_policy(cfg, ParallelDims(2, cp=2), torch.device("cpu")).applied_by == "fsdp"
    assert precision_policy(cfg, ParallelDims(4, dp_shard=2, tp=2), torch.device("cpu")).applied_by == "fsdp"
    assert PrecisionPolicy().applied_by == "none"  # the default: fp32, nothing applied


def test_the_module_decides_once_and_the_step_reads_it():
    """The module decides once (configure_model) and the step context carries the same object (the
    step's autocast reads it; under a mesh `parallelize_speech_llm` takes its FSDP policy from it)."""
    from parallel_harness import TOK, tiny_config

    from speechlm.train.module import SpeechLLMModule

    cfg = tiny_config()
    cfg.trainer.precision = "bf16"
    module = SpeechLLMModule(cfg, TOK)
    module.configure_model()
    assert module.precision.applied_by == "autocast"
    assert module.step_ctx.precision is module.precision


def test_the_policy_is_decided_for_the_strategys_device_not_the_modules_yet_unmoved_one():
    """Lightning calls configure_model before it moves the module to the GPU: the decision (and the
    collectives' device) must follow the strategy's root device, not `module.device` (still the CPU)."""
    from parallel_harness import TOK, tiny_config

    from speechlm.train.module import SpeechLLMModule

    cfg = tiny_config()
    cfg.trainer.precision = "bf16"
    module = SpeechLLMModule(cfg, TOK)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    module.configure_model()
    assert module.device.type == "cpu"
    assert (module.precision.device_type, module.precision.applied_by) == ("cuda", "autocast")
