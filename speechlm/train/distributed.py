"""Wire a `SpeechLLM` to the mesh: TP → activation checkpointing → FSDP2, plus the CP step context.

Who sums over what (dims from `parallel.mesh.ParallelDims`):
- the labelled-token and clip counts of a step are summed over `dp` (CP/TP peers hold the same batch);
- every rank's loss is its share: CE over its CP shard of the packed stream, CTC over the clips it
  encoded (each clip on exactly one CP rank), both divided by the *global* counts;
- FSDP2 averages gradients over `dp_shard_cp` (and `dp_replicate` under HSDP), so the local loss is
  multiplied by dp*cp (`StepContext.grad_scale`) to turn that average into the sum the objective needs;
- TP peers compute identical losses; nothing is summed over `tp`.

The model's CP layout (`parallel.cp_layout`: placement, placed encoding, sharding of the packed stream,
CP attention) is built here from the mesh and handed to it once (`SpeechLLM.set_cp_layout`); the frozen
`StepContext` carries the rank's one collectives object (`ParallelDims.collectives`) and the run's one
precision policy (`speechlm.train.precision`).

FSDP2 hooks `forward()`: the training step calls `model(batch)` once per micro-batch, and evaluation
calls `generate_greedy`, the one other registered entry point. Inside, the model calls its pieces
directly, so every piece that owns parameters is its own FSDP unit: each decoder layer, the token
embedding, the rest of the LLM (norm, LM head), the encoder, the projector and the CTC head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from parallel.cp_layout import CPLayout, DynamicCPLayout, NullCPLayout
from parallel.fsdp import clip_grad_norm_
from parallel.hybrid_layout import HybridCPLayout
from parallel.mesh import ParallelDims
from parallel.parallelize import parallelize
from parallel.tp import apply_tp, check_tp_heads, find_decoder_layers
from speechlm.config import ExperimentConfig
from speechlm.model.speech_llm import SpeechLLM
from speechlm.train.precision import PrecisionPolicy, precision_policy
from speechlm.train.step import StepContext


def speech_llm_blocks(model: Any) -> list[torch.nn.Module]:  # Any: parallelize's blocks_fn takes any module
    """FSDP units, deepest first; each is called through its own forward() by the training step."""
    llm = model.llm
    blocks: list[torch.nn.Module] = list(find_decoder_layers(llm))
    blocks.append(llm.get_input_embeddings())
    blocks.append(llm)
    blocks.append(model.encoder)
    blocks.append(model.projector)
    if getattr(model, "ctc_head", None) is not None:
        blocks.append(model.ctc_head)
    return blocks


def parallelize_speech_llm(
    model: Any,  # Any: the SpeechLLM, replaced by its parallelized module
    dims: ParallelDims,
    cfg: ExperimentConfig,
    precision: PrecisionPolicy,
) -> Any:
    """TP, activation checkpointing, FSDP2 (with `precision`'s mixed-precision policy, if it has one)."""
    if dims.tp > 1:
        llm_cfg = model.llm.config
        check_tp_heads(llm_cfg.num_attention_heads, llm_cfg.num_key_value_heads, dims.tp)
    model = parallelize(
        model,
        dims,
        blocks_fn=speech_llm_blocks,
        tp_fn=lambda m, tp_mesh: apply_tp(m.get_submodule("llm"), tp_mesh),
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        device_type=precision.device_type,
        mp_policy=precision.mp_policy,
    )

    if isinstance(model, FSDPModule):
        # the training step calls these pieces instead of forward(); give them the root's FSDP hooks
        for name in FSDP_ENTRY_METHODS:
            register_fsdp_forward_method(model, name)  # type: ignore[arg-type]
    if isinstance(model.encoder, FSDPModule):
        # a micro-batch with a clip sharded over the CP group runs the encoder through forward_with_slices
        register_fsdp_forward_method(model.encoder, "forward_with_slices")  # type: ignore[arg-type]
    return model


# SpeechLLM methods besides forward() that the training layer calls from outside (evaluation)
FSDP_ENTRY_METHODS = ("generate_greedy", "generate_for_batch")


def build_distributed_context(
    model: SpeechLLM,
    dims: ParallelDims,
    cfg: ExperimentConfig,
    device: torch.device,
    precision: PrecisionPolicy | None = None,
) -> StepContext:
    """Parallelize `model` in place (TP, activation checkpointing, FSDP2 under `precision`, decided from
    the config and layout when not given), set its CP layout, and return the step's frozen context.
    Called once per layout (`SpeechLLMModule.configure_model`)."""
    rank = dist.get_rank()
    precision = precision or precision_policy(cfg, dims, device)
    parallelize_speech_llm(model, dims, cfg, precision)

    model.set_cp_layout(build_cp_layout(cfg, dims, rank, model.llm.config.hidden_size))
    return StepContext(
        grad_scale=float(dims.dp_cp),
        clip_grad_norm=clip_grad_norm_,
        rank=rank,
        collectives=dims.collectives(rank, device),
        precision=precision,
    )


def build_cp_layout(
    cfg: ExperimentConfig, dims: ParallelDims, rank: int, hidden: int, *, planning: bool = False
) -> CPLayout:
    """The model's CP layout on this rank (`parallel.cp_layout`): the null one at cp = 1, else dynamic
    CP over the mesh's CP group (``parallel.cp_split_threshold``; 0 splits every sequence), or hybrid
    degrees over its aligned sub-groups (``parallel.cp_degrees=hybrid``, `parallel.hybrid_layout`).
    ``planning``: without the groups (placement only, `CPLayout.for_planning`: the data pipeline's, built
    before the mesh)."""
    if dims.cp == 1:
        return NullCPLayout(tp=dims.tp, pad_to_multiple=cfg.model.pad_to_multiple)
    common: dict[str, Any] = dict(
        group=None if planning else dims.mesh["cp"].get_group(),
        cp_size=dims.cp,
        cp_rank=dims.cp_rank(rank),
        kind=cfg.parallel.cp_attention,
        tp=dims.tp,
        pair_cost=1.0 / (6 * hidden),
        pad_to_multiple=cfg.model.pad_to_multiple,
    )
    if cfg.parallel.cp_degrees == "hybrid":  # every rank creates every sub-group, in one order
        return HybridCPLayout(**common, subgroups={} if planning else dims.build_cp_subgroups(rank))
    return DynamicCPLayout(**common, threshold=cfg.parallel.cp_split_threshold)  # "auto" or tokens
