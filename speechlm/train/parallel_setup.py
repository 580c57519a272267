"""Turn the mesh into a `StepContext` and a parallelized model (TP → activation checkpointing → FSDP2).

With one process nothing is wrapped and the context is trivial.
"""

from __future__ import annotations

from typing import Any

from speechlm.train.step import StepContext


def setup_parallel(module: Any, mesh: Any) -> StepContext:
    ctx = StepContext.single(module.cfg, module.tok)
    dims = getattr(module, "dims", None)
    if dims is None or dims.world_size == 1:
        return ctx
    from speechlm.train.distributed import build_distributed_context

    return build_distributed_context(module, dims, ctx)
