"""The run's one precision decision: bf16 compute through FSDP2's mixed precision or through autocast.

Decided once (`SpeechLLMModule.configure_model`), from `trainer.precision`, the layout and the device:

| trainer.precision | device                 | model fully sharded (dp*cp > 1) | compute | applied by           |
| ----------------- | ---------------------- | ------------------------------- | ------- | -------------------- |
| 32                | any                    | any                             | fp32    | nothing              |
| bf16              | any                    | yes                             | bf16    | FSDP2 policy         |
| bf16              | any                    | no                              | bf16    | autocast (forwards)  |
| auto              | CUDA with bf16         | yes / no                        | bf16    | FSDP2 / autocast     |
| auto              | CPU, or CUDA w/o bf16  | any                             | fp32    | nothing              |

Under FSDP2 the policy (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`) all-gathers the
parameters in bf16 and reduce-scatters the gradients in fp32; autocast on top would only add casts, so
it is off there. Without FSDP (one process, or TP alone) the parameters stay fp32 and the forwards run
under `torch.autocast(bf16)`. The cross-entropy and CTC log-softmax are computed in fp32 either way
(`speechlm/model/speech_llm.py`). The optimizer states and master weights stay fp32 in both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from parallel.mesh import ParallelDims
from speechlm.config import ExperimentConfig, Precision, choices_of

AppliedBy = Literal["none", "autocast", "fsdp"]
PRECISIONS = choices_of(Precision)  # the config's one list


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute dtype and the one mechanism that applies it (see the module docstring)."""

    compute_dtype: torch.dtype = torch.float32
    applied_by: AppliedBy = "none"
    device_type: str = "cpu"

    @property
    def uses_autocast(self) -> bool:
        return self.applied_by == "autocast"

    @property
    def mp_policy(self) -> Any:
        """The FSDP2 `MixedPrecisionPolicy` for `parallelize`, or None (fp32 parameters)."""
        if self.applied_by != "fsdp":
            return None

        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    def autocast(self) -> AbstractContextManager[Any]:
        """The context the training forwards run in: bf16 autocast, or nothing."""
        if self.uses_autocast:
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        return nullcontext()

    def describe(self) -> str:
        dtype = str(self.compute_dtype).removeprefix("torch.")
        return dtype if self.applied_by == "none" else f"{dtype} ({self.applied_by})"


def decide_precision(
    precision: str, device_type: str, *, fully_sharded: bool, bf16_supported: bool
) -> PrecisionPolicy:
    """The decision table of the module docstring, as a pure function."""
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda" and bf16_supported)
    if not bf16:
        return PrecisionPolicy(torch.float32, "none", device_type)
    return PrecisionPolicy(torch.bfloat16, "fsdp" if fully_sharded else "autocast", device_type)


def precision_policy(
    cfg: ExperimentConfig, dims: ParallelDims | None, device: torch.device
) -> PrecisionPolicy:
    """The run's policy from `trainer.precision`, the layout (`dims`, None for one process) and the device."""
    fully_sharded = dims is not None and dims.world_size > 1 and dims.fully_sharded
    bf16_supported = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return decide_precision(
        str(cfg.trainer.precision),
        device.type,
        fully_sharded=fully_sharded,
        bf16_supported=bf16_supported,
    )
