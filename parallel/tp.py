"""Tensor parallelism (Megatron-style) for a transformers Llama/Qwen2 ``*ForCausalLM`` decoder.

Letters: B batch, T tokens, H heads (query), G key/value heads, D head dim, E hidden size.

The plan, per decoder layer (``model.layers[i]``), on the ``tp`` sub-mesh:

    self_attn.q_proj, k_proj, v_proj   ColwiseParallel   each rank owns H/tp query and G/tp KV heads
    self_attn.o_proj                   RowwiseParallel   partial sums, all-reduced to a full [B, T, E]
    mlp.gate_proj, mlp.up_proj         ColwiseParallel   each rank owns 1/tp of the intermediate units
    mlp.down_proj                      RowwiseParallel   partial sums, all-reduced

Everything else stays replicated (plain tensors, identical on every TP rank): the token embedding,
the RMSNorms, the rotary embedding and the LM head. Why not shard the ends as well:
- the decoder is called with ``inputs_embeds`` that are built outside it (text embeddings with the
  audio embeddings spliced in), so the embedding table is only a lookup for the text tokens and its
  output must be the full hidden vector anyway;
- a vocab-parallel LM head produces vocab-sharded logits, which needs a vocab-parallel
  cross-entropy (max / sum-exp / target logit reduced over TP) in the loss code. That is future work;
  with a replicated head every TP rank computes the same full logits and loss.

Activations are plain local tensors between modules (``use_local_output=True``): after the colwise
q/k/v projections a rank holds ``[B, T, (H/tp)*D]``, which transformers' attention reshapes with
``view(B, T, -1, D)`` into its local heads, so any attention function registered with
``AttentionInterface`` receives ``q_BHTD`` with H/tp heads and needs no change. The GQA ratio
``num_key_value_groups = H/G`` is unchanged by sharding both H and G by tp. Legacy per-module head
counts (``num_heads``, ``num_key_value_heads`` on the attention module, used by old transformers
versions) are divided by tp on the module, never on the shared config.

Gradients: the colwise input is declared Replicate, so its backward all-reduces the input gradient
over TP; replicated parameters therefore receive the same full gradient on every TP rank, and TP
needs no loss scaling. Sequence parallelism (sharding the norms' activations over T) is not applied.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

__all__ = ["LLM_LAYER_PLAN", "apply_tp", "check_tp_heads", "find_decoder_layers"]

# Submodule names inside one transformers Llama/Qwen2 decoder layer -> parallel style factory.
LLM_LAYER_PLAN: dict[str, type[ColwiseParallel] | type[RowwiseParallel]] = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}

# Head counts some transformers versions keep on the attention module and use in reshapes.
_LEGACY_HEAD_ATTRS = ("num_heads", "num_key_value_heads")


def find_decoder_layers(llm: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers ``*ForCausalLM`` (``llm.model.layers``)."""
    layers = getattr(getattr(llm, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(llm).__name__} has no `model.layers` ModuleList; apply_tp expects a transformers "
            "Llama/Qwen2-style *ForCausalLM (write a plan for this model family instead)"
        )
    return layers


def _head_counts(attn: nn.Module) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of one attention module, read from its projections."""
    head_dim = int(attn.head_dim)  # type: ignore[arg-type]
    q_rows = attn.get_parameter("q_proj.weight").shape[0]
    k_rows = attn.get_parameter("k_proj.weight").shape[0]
    return q_rows // head_dim, k_rows // head_dim, head_dim


def check_tp_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise ValueError unless both head counts divide by tp (the error lists the legal tp sizes)."""
    if num_heads % tp == 0 and num_kv_heads % tp == 0:
        return
    legal = [d for d in range(1, num_kv_heads + 1) if num_heads % d == 0 and num_kv_heads % d == 0]
    raise ValueError(
        f"tensor parallelism splits attention heads across ranks: the LLM has {num_heads} query heads "
        f"and {num_kv_heads} key/value heads, and tp={tp} does not divide both; use tp in {legal}"
    )


def apply_tp(llm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the decoder layers of ``llm`` over the 1-D ``tp_mesh`` in place (see the module docstring).

    Must run before activation checkpointing and FSDP2 (`parallel.parallelize.parallelize` keeps the
    order). A mesh of size 1 leaves the model untouched.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return
    layers = find_decoder_layers(llm)
    for layer in layers:  # check every layer before sharding any
        check_tp_heads(*_head_counts(layer.get_submodule("self_attn"))[:2], tp)
    for layer in layers:
        attn = layer.get_submodule("self_attn")
        plan: dict[str, ParallelStyle] = {
            n: style(use_local_output=True) for n, style in LLM_LAYER_PLAN.items()
        }
        parallelize_module(layer, tp_mesh, plan)
        for attr in _LEGACY_HEAD_ATTRS:
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, getattr(attn, attr) // tp)
