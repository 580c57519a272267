"""`parallelize`: the one place that applies TP, then activation checkpointing, then FSDP2.

Why this order:
1. TP first: it replaces the projection weights by DTensors sharded over ``tp`` and installs the
   input/output hooks that redistribute activations. Checkpointing and FSDP2 then see (and wrap) the
   already-sharded modules; FSDP2 in particular needs the TP DTensors to exist so that it can add
   the data-parallel dimension to them (2-D parameters on (dp_shard_cp, tp)).
2. Activation checkpointing second: each block is wrapped so that its forward is recomputed in
   backward (non-reentrant ``torch.utils.checkpoint``). The recomputation replays the TP
   collectives inside the block, which is correct because every TP rank recomputes too. A
   transformers decoder must then run with ``use_cache=False`` (a cache would be appended to twice
   and the recomputed shapes would not match).
3. FSDP2 last, with the checkpoint wrappers as its units: the parameters of a block are all-gathered
   once for the forward and once for the backward (which contains the recomputation), and resharded
   in between. Sharding before wrapping would make the wrapper sit outside the FSDP unit's hooks.

FSDP2 mesh choice (see parallel/fsdp.py for the gradient semantics):
- ``dp_replicate > 1``: the 2-D ``(dp_replicate, dp_shard_cp)`` mesh, i.e. HSDP (this also covers
  ``dp_shard * cp == 1``: a shard group of one rank, pure replication with FSDP2's machinery);
- else ``dp_shard * cp > 1``: the 1-D ``dp_shard_cp`` mesh;
- else (only TP, or one process) no FSDP2.

The model is generic: the caller says which submodules are the sharding/checkpointing units
(``blocks_fn``) and how to apply TP (``tp_fn``, e.g. `parallel.tp.apply_tp` on the LLM submodule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from parallel.fsdp import apply_fsdp, default_mp_policy
from parallel.mesh import ParallelDims

__all__ = ["apply_activation_checkpointing", "parallelize", "select_fsdp_mesh"]

BlocksFn = Callable[[nn.Module], Sequence[nn.Module]]
TpFn = Callable[[nn.Module, DeviceMesh], None]

_DEFAULT = object()  # "pick the mixed-precision policy from the device type"


def apply_activation_checkpointing(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Replace each block (in its parent) by a non-reentrant checkpoint wrapper; return the wrappers.

    State-dict keys do not change (the wrapper strips its own prefix); ``named_parameters`` gains a
    ``_checkpoint_wrapped_module.`` component.
    """
    parent_of: dict[int, tuple[nn.Module, str]] = {}
    for parent in model.modules():
        for child_name, child in parent.named_children():
            parent_of.setdefault(id(child), (parent, child_name))
    wrappers = []
    for block in blocks:
        if id(block) not in parent_of:
            raise ValueError(
                f"cannot checkpoint {type(block).__name__}: it is not a submodule of {type(model).__name__} "
                "(the root itself cannot be wrapped)"
            )
        parent, child_name = parent_of[id(block)]
        wrapper = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        setattr(parent, child_name, wrapper)
        wrappers.append(wrapper)
    return wrappers


def select_fsdp_mesh(dims: ParallelDims) -> DeviceMesh | None:
    """The mesh FSDP2 shards over for this layout, or None when there is no data/context parallelism."""
    if dims.dp_replicate > 1:
        return dims.flat_mesh("dp_replicate", "dp_shard_cp")
    if dims.dp_shard * dims.cp > 1:
        return dims.flat_mesh("dp_shard_cp")
    return None


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    blocks_fn: BlocksFn,
    tp_fn: TpFn | None,
    activation_checkpointing: bool,
    device_type: str,
    mp_policy: MixedPrecisionPolicy | None | object = _DEFAULT,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply TP (if ``dims.tp > 1``), activation checkpointing (if asked), FSDP2 (if dp*cp > 1); in place.

    ``dims.build_mesh`` must have been called when ``dims.world_size > 1``. ``blocks_fn(model)`` is
    evaluated after TP, so it may return the TP-sharded modules. ``mp_policy`` defaults to
    `parallel.fsdp.default_mp_policy(device_type)`. The model's parameters must already be on the
    device. Returns ``model`` (the same object) for chaining; build the optimizer afterwards.
    """
    if dims.tp > 1:
        if tp_fn is None:
            raise ValueError(f"tp={dims.tp} but no tp_fn was given to parallelize()")
        tp_fn(model, dims.mesh["tp"])

    blocks = list(blocks_fn(model))
    if activation_checkpointing:
        blocks = apply_activation_checkpointing(model, blocks)

    fsdp_mesh = select_fsdp_mesh(dims) if dims.world_size > 1 else None
    if fsdp_mesh is not None:
        policy = default_mp_policy(device_type) if mp_policy is _DEFAULT else mp_policy
        assert policy is None or isinstance(policy, MixedPrecisionPolicy)
        apply_fsdp(
            model, fsdp_mesh, blocks=blocks, mp_policy=policy, reshard_after_forward=reshard_after_forward
        )
    return model
