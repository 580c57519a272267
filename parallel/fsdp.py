"""FSDP2 (``fully_shard``) over the data-parallel x context-parallel ranks.

Mesh: FSDP2 shards parameters over ``dp_shard_cp`` (dp_shard x cp). CP ranks hold identical weights
(they split the tokens of one batch, not the model), so they can shard the weights between them like
data-parallel ranks do. With ``dp_replicate > 1`` the mesh is 2-D ``(dp_replicate, dp_shard_cp)``
and ``fully_shard`` does HSDP: sharded within a ``dp_shard_cp`` group, replicated (all-reduced)
across groups. If TP is on, the TP-sharded parameters are already DTensors on the ``tp`` mesh;
``fully_shard`` adds the data-parallel dimension on top of them (2-D FSDP x TP).

Gradients: FSDP2 AVERAGES gradients over its mesh (reduce-scatter divided by the number of
shards, and under HSDP also averaged across replicas), i.e. over all dp_replicate*dp_shard*cp ranks.
Our loss is ``sum of token CE / global count of labelled tokens`` computed per rank on its own tokens,
and the gradient we want is the SUM of the per-rank gradients; the trainer therefore multiplies the
local loss by dp*cp (``ParallelDims.dp_cp``) before backward. TP needs no factor (see parallel/tp.py).

Gradient clipping: with TP and FSDP2 together the gradients live on two meshes (2-D
(dp_shard_cp, tp) for the TP-sharded weights, 1-D dp_shard_cp for the rest), and
``torch.nn.utils.clip_grad_norm_`` fails on them (it stacks norms from different meshes).
`clip_grad_norm_` here reduces each mesh's norm separately, then combines them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["apply_fsdp", "clip_grad_norm_", "default_mp_policy"]


def default_mp_policy(device_type: str) -> MixedPrecisionPolicy | None:
    """bf16 compute parameters with fp32 gradient reduction on CUDA; None (full fp32) elsewhere."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def _sort_deepest_first(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Order blocks so that a block nested inside another is sharded first (FSDP2 goes bottom-up)."""
    depth = {id(m): name.count(".") + 1 if name else 0 for name, m in model.named_modules()}
    seen: set[int] = set()
    ordered = []
    for block in blocks:
        if id(block) not in depth:
            raise ValueError(
                f"FSDP block {type(block).__name__} is not a submodule of {type(model).__name__}; "
                "blocks_fn must return modules of the model being sharded"
            )
        if block is model:
            raise ValueError("the root module must not be listed as a block: apply_fsdp shards it last")
        if id(block) not in seen:
            seen.add(id(block))
            ordered.append(block)
    return sorted(ordered, key=lambda m: -depth[id(m)])


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Sequence[nn.Module],
    mp_policy: MixedPrecisionPolicy | None,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` each block (one all-gather / reduce-scatter unit each), then the root, in place.

    ``mesh``: the 1-D ``dp_shard_cp`` mesh, or the 2-D ``(dp_replicate, dp_shard_cp)`` mesh for HSDP.
    ``reshard_after_forward`` applies to the blocks; the root keeps its (small) parameters gathered.
    Parameters outside every block (embeddings, norms, heads, small modules) belong to the root unit.
    Build the optimizer after this call: the parameters become DTensors.
    """
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in _sort_deepest_first(model, blocks):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters are the first needed in backward: keep them gathered after forward.
    fully_shard(model, reshard_after_forward=False, **kwargs)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients in place to a global norm of ``max_norm``; return the norm before clipping.

    Works for plain tensors and for DTensor gradients on any mix of meshes: the norm of each mesh's
    group is completed over its ranks (``full_tensor``) and the group norms are combined (the p-norm
    of the group p-norms is the p-norm of everything; max for ``inf``). Every rank gets the same norm.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    group_norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        group_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = torch.nn.utils.get_total_norm(group_norms, norm_type)
    clip_coef = min(1.0, max_norm / (float(total_norm) + 1e-6))
    if clip_coef < 1.0:
        for g in grads:
            g.mul_(clip_coef)
    return total_norm
