"""Wire a `SpeechLLM` to the mesh: TP → activation checkpointing → FSDP2, plus the CP step context.

Who sums over what (dims from `parallel.mesh.ParallelDims`):
- the labelled-token and clip counts of a step are summed over `dp` (CP/TP peers hold the same batch);
- every rank's loss is its share: CE over its CP shard of the packed stream, CTC over the clips it
  encoded (each clip on exactly one CP rank), both divided by the *global* counts;
- FSDP2 averages gradients over `dp_shard_cp` (and `dp_replicate` under HSDP), so the local loss is
  multiplied by dp*cp (`StepContext.grad_scale`) to turn that average into the sum the objective needs;
- TP peers compute identical losses; nothing is summed over `tp`.

The model's CP hooks (distributed encoding, sharding of the packed stream, CP attention) are bound to
it once here (`SpeechLLM.bind_parallel`); the frozen `StepContext` carries the rank's one collectives
object (`ParallelDims.collectives`) and the run's one precision policy (`speechlm.train.precision`).

FSDP2 hooks `forward()`: the training step calls `model(batch)` once per micro-batch, and evaluation
calls `generate_greedy`, the one other registered entry point. Inside, the model calls its pieces
directly, so every piece that owns parameters is its own FSDP unit: each decoder layer, the token
embedding, the rest of the LLM (norm, LM head), the encoder, the projector and the CTC head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parallel.cp_placement import LocalPlacement, place_sequences
from parallel.cp_shard import shard_placed_thd
from parallel.dist_encode import encode_placed
from parallel.fsdp import clip_grad_norm_
from parallel.parallelize import parallelize
from parallel.tp import apply_tp, find_decoder_layers
from parallel.varlen import VarlenMeta, build_varlen_meta, varlen_attention
from speechlm.model.speech_llm import ParallelBinding
from speechlm.packing import PackedBatch
from speechlm.train.precision import PrecisionPolicy, precision_policy
from speechlm.train.step import StepContext


class CPAttention:
    """The object the reference attention backend delegates to under CP (ring or all-gather-KV)."""

    def __init__(self, group: Any, cp_size: int, cp_rank: int, kind: str):
        from parallel.allgather_attention import allgather_attention_thd
        from parallel.ring_attention import ring_attention_thd

        self.fn = ring_attention_thd if kind == "ring" else allgather_attention_thd
        self.kind = kind
        self.group, self.cp_size, self.cp_rank = group, cp_size, cp_rank
        # the group's members as global ranks (transformer-engine's set_context_parallel_group wants them)
        if group is not None and dist.is_initialized():
            self.global_ranks = list(dist.get_process_group_ranks(group))
        else:
            self.global_ranks = list(range(cp_size))

    def prepare(self, host_cu: list[int], device: torch.device) -> dict[str, Any]:
        """What every layer of one micro-batch needs beyond the tensors, from host integers, once:
        the ring's step plans, or the all-gather's calls and permutation. No device sync in any layer."""
        if self.kind == "ring":
            from parallel.ring_attention import plan_ring

            return {"plans": plan_ring(host_cu, host_cu[-1], self.cp_size, self.cp_rank, True, device)}
        from parallel.allgather_attention import plan_allgather

        return {"plan": plan_allgather(host_cu, self.cp_size, self.cp_rank, True, device)}

    def attention(
        self,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        cu_seqlens_local: torch.Tensor,
        scale: float | None,
        prepared: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        return self.fn(
            q_THD,
            k_THD,
            v_THD,
            cu_seqlens_local,
            group=self.group,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            scale=scale,
            causal=True,
            **(prepared or {}),
        )

    def for_split_prefix(self, n_split: int, meta: VarlenMeta) -> PlacedCPAttention:
        return PlacedCPAttention(self, n_split, meta)


class PlacedCPAttention:
    """Dynamic CP: the first ``n_split`` sequences of the local stream are split over the CP group
    (ring or all-gather attention, their K/V travel); the rest are whole on this rank and attend
    locally with no communication. The placement is identical on every CP rank, so either all ranks
    run the collective part or none does.

    Built once per micro-batch from its host boundaries. `attention` is what the reference backend
    calls; a backend with its own CP kernels (transformer-engine) calls `run` with its own two calls
    and reads the split part's *global* boundaries (`split_cu_global`, `split_max_global`: each split
    sequence's full length, the local one times cp) and the group (`group`, `global_ranks`, `kind`)."""

    def __init__(self, cp: CPAttention, n_split: int, meta: VarlenMeta):
        self.cp, self.n_split = cp, n_split
        self.group, self.global_ranks, self.kind = cp.group, cp.global_ranks, cp.kind
        self.cp_size, self.cp_rank = cp.cp_size, cp.cp_rank
        # the whole part's boundaries, from the micro-batch's host integers: no device sync per layer
        t = meta.cu_q[n_split]
        self.t_split = t
        device = meta.cu_seqlens_q.device
        self.whole = build_varlen_meta([c - t for c in meta.cu_q[n_split:]], device=device)
        self._split_cu, self._device = list(meta.cu_q[: n_split + 1]), device

    # built on first use (by the first layer), from host integers: what the ring/all-gather needs, or
    # what a backend with its own CP kernels needs

    @functools.cached_property
    def prepared(self) -> dict[str, Any] | None:
        return self.cp.prepare(self._split_cu, self._device) if self.n_split else None

    @functools.cached_property
    def split_cu_global(self) -> torch.Tensor:
        return torch.tensor(
            [c * self.cp_size for c in self._split_cu], dtype=torch.int32, device=self._device
        )

    @functools.cached_property
    def split_max_global(self) -> int:
        cu = self._split_cu
        return self.cp_size * max((b - a for a, b in zip(cu, cu[1:], strict=False)), default=0)

    def run(
        self,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        split_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        whole_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenMeta], torch.Tensor],
    ) -> torch.Tensor:
        """``split_fn(q, k, v)`` over the split prefix's rows, ``whole_fn(q, k, v, meta)`` over the whole
        sequences' rows (with their local boundaries), concatenated in the local stream's order."""
        t = self.t_split
        parts = []
        if self.n_split:
            parts.append(split_fn(q_THD[:t], k_THD[:t], v_THD[:t]))
        if q_THD.shape[0] > t:
            parts.append(whole_fn(q_THD[t:], k_THD[t:], v_THD[t:], self.whole))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def attention(
        self,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        cu_seqlens_local: torch.Tensor,
        scale: float | None,
    ) -> torch.Tensor:
        """Ring or all-gather attention over the split part, one varlen call over the whole part."""
        n = self.n_split
        return self.run(
            q_THD,
            k_THD,
            v_THD,
            lambda q, k, v: self.cp.attention(q, k, v, cu_seqlens_local[: n + 1], scale, self.prepared),
            lambda q, k, v, meta: varlen_attention(q, k, v, meta, causal=True, scale=scale),
        )


def speech_llm_blocks(model: Any) -> list[torch.nn.Module]:
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


def parallelize_speech_llm(model: Any, dims: Any, cfg: Any, precision: PrecisionPolicy) -> Any:
    """TP, activation checkpointing, FSDP2 (with `precision`'s mixed-precision policy, if it has one)."""
    if dims.tp > 1:
        from parallel.tp import check_tp_heads

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
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if isinstance(model, FSDPModule):
        # the training step calls these pieces instead of forward(); give them the root's FSDP hooks
        for name in FSDP_ENTRY_METHODS:
            register_fsdp_forward_method(model, name)  # type: ignore[arg-type]
    return model


# SpeechLLM methods besides forward() that the training layer calls from outside (evaluation)
FSDP_ENTRY_METHODS = ("generate_greedy",)


def build_distributed_context(
    model: Any, dims: Any, cfg: Any, device: torch.device, precision: PrecisionPolicy | None = None
) -> StepContext:
    """Parallelize `model` in place (TP, activation checkpointing, FSDP2 under `precision`, decided from
    the config and layout when not given), bind its CP hooks, and return the step's frozen context.
    Called once per layout (`SpeechLLMModule.configure_model`)."""
    rank = dist.get_rank()
    mesh = dims.mesh
    precision = precision or precision_policy(cfg, dims, device)
    parallelize_speech_llm(model, dims, cfg, precision)

    binding = ParallelBinding(cp=dims.cp, tp=dims.tp)
    if dims.cp > 1:
        cp_group = mesh["cp"].get_group()
        binding = cp_binding(
            cfg, dims.cp, dims.tp, dims.cp_rank(rank), cp_group, model.llm.config.hidden_size
        )
    model.bind_parallel(binding)
    return StepContext(
        grad_scale=float(dims.dp_cp),
        clip_grad_norm=clip_grad_norm_,
        rank=rank,
        collectives=dims.collectives(rank, device),
        precision=precision,
    )


def cp_binding(cfg: Any, cp: int, tp: int, cp_rank: int, cp_group: Any, hidden: int) -> ParallelBinding:
    """The model's dynamic-CP hooks for this rank (`parallel.cp_placement`; threshold 0 splits all)."""
    threshold = cfg.parallel.cp_split_threshold  # "auto" or tokens
    pad_to = cfg.model.pad_to_multiple

    def place(seq_lens: list[int]) -> LocalPlacement:
        placement = place_sequences(
            seq_lens, cp, threshold=threshold, tp=tp, pair_cost=1.0 / (6 * hidden), pad_to_multiple=pad_to
        )
        return placement.local(cp_rank)

    def shard_packed(packed: PackedBatch, placement: LocalPlacement) -> PackedBatch:
        n_split = placement.n_split
        parts, cu_local, max_local = shard_placed_thd(
            {"x": packed.inputs_embeds, "labels": packed.labels, "pos": packed.position_ids},
            packed.cu_seqlens,
            n_split,
            cp,
            cp_rank,
        )
        x, labels, pos = parts["x"], parts["labels"], parts["pos"]
        return PackedBatch(x, labels, pos, cu_local, int(max_local), packed.seq_lens, cp_split_seqs=n_split)

    def encode_audio(
        model: Any,
        audio_BN: torch.Tensor,
        audio_lens_B: torch.Tensor,
        placement: LocalPlacement,
        *,
        freeze_encoder: bool = False,
    ) -> Any:
        def encode_fn(a: torch.Tensor, lens: torch.Tensor) -> Any:
            out = model.encode_audio(a, lens, freeze_encoder=freeze_encoder)
            return out.embeds, (out.enc_hidden, out.enc_lens)

        res = encode_placed(
            encode_fn,
            audio_BN,
            audio_lens_B,
            owners=placement.placement.clip_owners(),
            gathered=list(placement.placement.split),
            group=cp_group,
            cp_rank=cp_rank,
            cp_size=cp,
        )
        return CPEncoderOutput(res)

    return ParallelBinding(
        cp=cp,
        tp=tp,
        cp_attention=CPAttention(cp_group, cp, cp_rank, cfg.parallel.cp_attention),
        place=place,
        shard_packed=shard_packed,
        encode_audio=encode_audio,
    )


class CPEncoderOutput:
    """Placed encoding (`parallel.dist_encode.encode_placed`) in the shape `SpeechLLM.forward` expects.

    `embeds` holds the clips of the split sequences (gathered, differentiable) and this rank's whole
    sequences' clips (None elsewhere); `enc_hidden`/`enc_lens` the clips this rank encoded (for the
    auxiliary CTC loss, so each clip counts once across CP ranks), and `ctc_slice` says which rows of
    the batch they are. A rank that encoded only a dummy gets its hidden states with `ctc_weight` 0,
    so the CTC head still takes part in FSDP's reduce-scatter.
    """

    def __init__(self, res: Any):
        self.embeds = res.embeds
        if res.local_clips:
            self.enc_hidden, self.enc_lens = res.local_extra
            self.ctc_slice: list[int] | None = list(res.local_clips)
            self.ctc_weight = 1.0
        else:
            self.enc_hidden, self.enc_lens = res.dummy_extra
            self.ctc_slice = None
            self.ctc_weight = 0.0
