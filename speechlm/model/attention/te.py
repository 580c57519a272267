"""transformer-engine backend: ``transformer_engine.pytorch.DotProductAttention`` with ``qkv_format="thd"``.

Letters: B batch, S padded length, T packed tokens, M real tokens of a padded batch, H query heads,
G key/value heads, D head dim.

One ``DotProductAttention`` per (heads, KV groups, head dim, scale, dropout) is cached outside the
model (it holds no parameters), configured with ``attn_mask_type="padding_causal"`` and GQA
(``num_gqa_groups=G``). THD streams use the given cu_seqlens; padded batches are unpadded first.
TE's THD output is ``[T, H * D]``. Install with ``pip install speechlm[te]``; set
``NVTE_FUSED_ATTN=0`` where the validator says so. The cached core's training mode follows the
calling module's (``module.training``; grad mode when called without a module).

Context parallelism (``cp_context``, the model's `parallel.cp_attention.CPAttentionContext`): TE's own
THD ring (``cp_comm_type="p2p"``). The context hands each part of the local stream that is split over one
group (`parallel.cp_attention.CPSplit`: the whole CP group under dynamic CP; under hybrid degrees one part
per degree, over this rank's aligned sub-group of that degree) to a core whose context-parallel group is
that group, set once per cached core with ``set_context_parallel_group``. Our CP layout (rank r of a
group of d keeps chunks r and 2d-1-r of every sequence split over it) is TE's dual-chunk-swap layout, so
a part goes in with its sequences' global cu_seqlens (local boundaries times d); the whole sequences use
a CP-free core. TE's all-gather and a2a CP have no THD path, so ``parallel.cp_attention=allgather`` is
refused (the validator says so first, rule ``te-cp-allgather``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from parallel.cp_attention import CPAttentionContext, CPSplit
from speechlm.model.attention.layouts import as_thd, read_attention_context, read_varlen_args, to_thd
from speechlm.model.attention.registry import BackendUnavailableError, attention_backend

_CORES: dict[tuple[Any, ...], Any] = {}
# parallel.cp_attention -> transformer-engine's cp_comm_type; TE's all-gather and a2a CP have no THD path
TE_CP_COMM_TYPES = {"ring": "p2p"}


def _import_te() -> Any:
    try:
        import transformer_engine.pytorch as te  # type: ignore[import-not-found]  # lazy: optional
    except ImportError as e:
        raise BackendUnavailableError(
            f"attention backend 'te' needs transformer-engine, which is not installed ({e}): "
            "run `pip install speechlm[te]` or choose another backend"
        ) from e
    return te


def _cp_stream() -> Any:
    """The side stream TE overlaps its CP steps on (None without CUDA, where TE cannot run anyway)."""
    return torch.cuda.Stream() if torch.cuda.is_available() else None


def get_core_attention(
    te: Any,
    *,
    heads: int,
    groups: int,
    head_dim: int,
    scale: float,
    dropout: float,
    cp: CPSplit | None = None,
) -> Any:
    """The cached ``DotProductAttention`` for these shapes; with ``cp`` (a part of the stream split over one
    CP group or sub-group) one whose context-parallel group is set, once, to that group with TE's p2p
    ring: one core per group (keyed by its global ranks)."""
    key: tuple[Any, ...] = (heads, groups, head_dim, float(scale), float(dropout))
    if cp is not None:
        comm = TE_CP_COMM_TYPES.get(cp.kind)
        if comm is None:
            raise ValueError(
                f"parallel.cp_attention={cp.kind} with attention backend 'te': transformer-engine's "
                "all-gather context parallelism has no THD (packed) path; set parallel.cp_attention=ring "
                "(TE's p2p ring)"
            )
        key += (comm, tuple(cp.global_ranks))
    core = _CORES.get(key)
    if core is None:
        core = te.DotProductAttention(
            num_attention_heads=heads,
            kv_channels=head_dim,
            num_gqa_groups=groups,
            attention_dropout=dropout,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            softmax_scale=scale,
        )
        if cp is not None:
            core.set_context_parallel_group(cp.group, list(cp.global_ranks), _cp_stream(), comm)
        _CORES[key] = core
    return core


def _call_core(
    core: Any, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int
) -> Tensor:
    """One THD call; TE returns [T, H * D], given back as [T, H, D]."""
    out = core(
        q_THD.contiguous(),
        k_TGD.contiguous(),
        v_TGD.contiguous(),
        qkv_format="thd",
        attn_mask_type="padding_causal",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_k,
    )
    return out.reshape(*q_THD.shape[:2], v_TGD.shape[2])


@attention_backend("te")
def attend_te(
    module: nn.Module,
    query_BHSD: Tensor,
    key_BGSD: Tensor,
    value_BGSD: Tensor,
    attention_mask: Tensor | None,
    *,
    scale: float,
    dropout: float,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    te = _import_te()
    H, G, D = query_BHSD.shape[1], key_BGSD.shape[1], query_BHSD.shape[3]
    core = get_core_attention(te, heads=H, groups=G, head_dim=D, scale=scale, dropout=dropout)
    # TE picks its kernels by training mode too: follow the model, never the dropout rate (dropout=0
    # in inference mode would let TE choose backends that have no backward)
    training = bool(getattr(module, "training", torch.is_grad_enabled()))
    core.train(training)
    cp = read_attention_context(kwargs).cp
    if cp is not None:
        return _attend_te_cp(te, core, cp, query_BHSD, key_BGSD, value_BGSD, kwargs, scale, dropout, training)
    t = as_thd("te", query_BHSD, key_BGSD, value_BGSD, attention_mask, kwargs)
    out = _call_core(
        core, t.q_THD, t.k_TGD, t.v_TGD, t.cu_seqlens_q, t.cu_seqlens_k, t.max_seqlen_q, t.max_seqlen_k
    )
    return t.restore(out)


def _attend_te_cp(
    te: Any,
    core: Any,
    cp: CPAttentionContext,
    query_BHSD: Tensor,
    key_BGSD: Tensor,
    value_BGSD: Tensor,
    kwargs: Any,
    scale: float,
    dropout: float,
    training: bool,
) -> tuple[Tensor, None]:
    """Context parallelism through TE's own THD ring. Each part of the local stream split over one group
    (`parallel.cp_attention.CPSplit`; hybrid degrees: one per degree, over its sub-group) holds this
    rank's chunks r and 2d-1-r of each of its sequences (`parallel.cp_shard`), which is TE's
    dual-chunk-swap layout over that group, so TE gets the part's local tokens with its sequences'
    *global* boundaries (``split.cu_global``) through the core of that group; the whole sequences attend
    locally through the CP-free core with their local boundaries."""
    if read_varlen_args(kwargs, query_BHSD.device) is None:
        raise ValueError(
            "cp_context (context parallelism) needs a THD batch: pass cu_seq_lens_q/k to the model"
        )
    H, G, D = query_BHSD.shape[1], key_BGSD.shape[1], query_BHSD.shape[3]

    def attend_split(q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, split: CPSplit) -> Tensor:
        cp_core = get_core_attention(
            te, heads=H, groups=G, head_dim=D, scale=scale, dropout=dropout, cp=split
        )
        cp_core.train(training)
        cu, m = split.cu_global, split.max_global  # every split sequence at its full (global) length
        return _call_core(cp_core, q_THD, k_TGD, v_TGD, cu, cu, m, m)

    out_THD = cp.run(
        to_thd(query_BHSD),
        to_thd(key_BGSD),
        to_thd(value_BGSD),
        attend_split,
        lambda q, k, v, w: _call_core(core, q, k, v, w.cu_seqlens_q, w.cu_seqlens_k, w.max_q, w.max_k),
    )
    return out_THD.unsqueeze(0), None
