"""Local attention kernels that also return the log-sum-exp (LSE), and tools built on them.

Letters: B batch (or a group of equal-length sequences), H heads (Hq query, Hkv key/value),
L sequence length (Lq queries, Lk keys), D head dim, T packed tokens, N sequences.

For queries q_i and keys k_j, with s_ij = scale * q_i.k_j:

    lse_i = log sum_j exp(s_ij)          out_i = sum_j exp(s_ij - lse_i) v_j

Given partial results (out_a, lse_a) and (out_b, lse_b) over disjoint key sets, the result over
their union is lse = logaddexp(lse_a, lse_b), out = w_a*out_a + w_b*out_b with
w_b = exp(lse_b - lse) = sigmoid(lse_b - lse_a) and w_a = 1 - w_b (:func:`merge_partials`).
The backward of a split attention is exact if each key block is differentiated with the *merged*
(out, lse) of the full row: dq adds up over blocks and each block's dk/dv is its own share.
Ring and all-gather CP attention are built on exactly these two facts.

Causal semantics: ``causal=True`` is only accepted for square blocks (Lq == Lk), where query i
sees keys j <= i. The CPU kernel aligns a rectangular causal mask top-left and the CUDA flash
kernel bottom-right; refusing rectangles keeps both devices identical, and the CP schedules
only ever need square causal blocks (every other block is fully visible or skipped).

GQA: K/V with Hkv < Hq heads are expanded with repeat_interleave (query head h uses K/V head
h // (Hq/Hkv), as in transformers' ``repeat_kv``) and dk/dv are summed back over each group.

Kernels: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); on CUDA
``aten._scaled_dot_product_flash_attention`` for fp16/bf16 and
``aten._scaled_dot_product_efficient_attention`` for fp32 (flash has no fp32). Both CUDA
kernels need a head dim that is a multiple of 8 (at most 256 for flash).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parallel.cp_shard import inverse_permutation

__all__ = [
    "attn_fwd_lse",
    "attn_bwd",
    "merge_partials",
    "expand_kv_heads",
    "reduce_kv_heads",
    "local_attention",
    "varlen_attention_reference",
    "IndexBlock",
    "block_attn_fwd_",
    "block_attn_bwd_",
    "block_attn_rows",
]

# The op namespace is a module attribute so tests can swap in fakes that check the CUDA plumbing.
_aten: Any = torch.ops.aten
_EFFICIENT_LSE_ALIGN = 32  # the CUDA efficient kernel pads its LSE rows to a multiple of 32


def _uses_cuda_kernels(t: Tensor) -> bool:
    return t.device.type == "cuda"


def _resolve_scale(scale: float | None, head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def expand_kv_heads(x_BHLD: Tensor, n_q_heads: int) -> Tensor:
    """Repeat each of the Hkv heads Hq/Hkv times along dim 1 (no copy when Hkv == Hq)."""
    n_kv = x_BHLD.shape[1]
    if n_kv == n_q_heads:
        return x_BHLD
    if n_q_heads % n_kv != 0:
        raise ValueError(f"query heads ({n_q_heads}) must be a multiple of key/value heads ({n_kv})")
    return x_BHLD.repeat_interleave(n_q_heads // n_kv, dim=1)


def reduce_kv_heads(dx_BHLD: Tensor, n_kv_heads: int) -> Tensor:
    """Adjoint of :func:`expand_kv_heads`: sum the Hq/Hkv copies of each K/V head."""
    b, hq, seq, d = dx_BHLD.shape
    if hq == n_kv_heads:
        return dx_BHLD
    return dx_BHLD.view(b, n_kv_heads, hq // n_kv_heads, seq, d).sum(dim=2)


def _check_block(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (B, H, L, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal=True needs a square block (Lq == Lk), got Lq={q.shape[2]}, Lk={k.shape[2]}; "
            "split a rectangular causal block into a full part and a square causal part"
        )


# ----------------------------------------------------------------------------- CUDA plumbing


def _cuda_kernel(q: Tensor) -> str:
    """'flash' for fp16/bf16 (no fp32 flash kernel exists), else 'efficient'."""
    return "flash" if q.dtype in (torch.float16, torch.bfloat16) else "efficient"


def _cuda_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if q.shape[-1] % 8 != 0:
        raise ValueError(
            f"the CUDA attention kernels need a head dim that is a multiple of 8, got {q.shape[-1]}"
        )
    if _cuda_kernel(q) == "flash":
        # -> (out, lse [B,H,Lq] fp32, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug)
        res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    # -> (out, lse [B,H,ceil(Lq/32)*32] fp32, philox_seed, philox_offset)
    res = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return res[0], res[1][..., : q.shape[2]]


_RNG_PLACEHOLDERS: dict[tuple[str, str, torch.dtype], tuple[Tensor, Tensor]] = {}


def _rng_placeholders(q: Tensor) -> tuple[Tensor, Tensor]:
    """The (philox_seed, philox_offset) tensors the CUDA forward returns for q's kernel.

    Without dropout the backward never reads their values, but their dtype and shape changed
    across torch versions, so take them from a real forward on a tiny input (once per kernel).
    """
    key = (_cuda_kernel(q), str(q.device), q.dtype)
    if key not in _RNG_PLACEHOLDERS:
        tiny = q.new_zeros(1, 1, 1, q.shape[-1])
        if key[0] == "flash":
            res = _aten._scaled_dot_product_flash_attention(tiny, tiny, tiny, 0.0, False, False, scale=1.0)
            _RNG_PLACEHOLDERS[key] = (res[6], res[7])
        else:
            res = _aten._scaled_dot_product_efficient_attention(
                tiny, tiny, tiny, None, True, 0.0, False, scale=1.0
            )
            _RNG_PLACEHOLDERS[key] = (res[2], res[3])
    return _RNG_PLACEHOLDERS[key]


def _cuda_bwd(
    g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    philox_seed, philox_offset = _rng_placeholders(q)
    if _cuda_kernel(q) == "flash":
        # undefined (None) cum_seq tensors select the dense, non-varlen kernel
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
            philox_seed, philox_offset, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    pad = (-lse.shape[-1]) % _EFFICIENT_LSE_ALIGN  # give back the padded LSE shape the forward made
    lse_padded = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, out, lse_padded.contiguous(), philox_seed, philox_offset, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


# ----------------------------------------------------------------------------- public ops


def attn_fwd_lse(
    q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, *, causal: bool, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of one block: (out_BHLD in q's dtype, lse_BHL in fp32). Not differentiable.

    K/V may have fewer heads than Q (GQA). A query row with no keys (Lk == 0) gets out 0 and
    lse -inf, the neutral element of :func:`merge_partials`.
    """
    _check_block(q_BHLD, k_BHLD, v_BHLD, causal)
    b, hq, lq, d = q_BHLD.shape
    scale = _resolve_scale(scale, d)
    if lq == 0 or k_BHLD.shape[2] == 0:
        out = q_BHLD.new_zeros(b, hq, lq, v_BHLD.shape[-1])
        return out, torch.full((b, hq, lq), -math.inf, dtype=torch.float32, device=q_BHLD.device)
    q = q_BHLD.contiguous()
    k = expand_kv_heads(k_BHLD, hq).contiguous()
    v = expand_kv_heads(v_BHLD, hq).contiguous()
    if _uses_cuda_kernels(q):
        out, lse = _cuda_fwd(q, k, v, causal, scale)
    else:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def attn_bwd(
    grad_out_BHLD: Tensor,
    q_BHLD: Tensor,
    k_BHLD: Tensor,
    v_BHLD: Tensor,
    out_BHLD: Tensor,
    lse_BHL: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of one block, in the dtypes of q, k, v; dk/dv have K/V's heads.

    ``out``/``lse`` may be the merged result over *all* key blocks of these queries: then dq is
    this block's share of the full dq and dk/dv are exact for this block (see module docstring).
    """
    _check_block(q_BHLD, k_BHLD, v_BHLD, causal)
    b, hq, lq, d = q_BHLD.shape
    hkv = k_BHLD.shape[1]
    scale = _resolve_scale(scale, d)
    if lq == 0 or k_BHLD.shape[2] == 0:
        return torch.zeros_like(q_BHLD), torch.zeros_like(k_BHLD), torch.zeros_like(v_BHLD)
    dtype = q_BHLD.dtype
    q = q_BHLD.contiguous()
    k = expand_kv_heads(k_BHLD, hq).contiguous()
    v = expand_kv_heads(v_BHLD, hq).contiguous()
    g = grad_out_BHLD.to(dtype).contiguous()
    out = out_BHLD.to(dtype).contiguous()
    lse = lse_BHL.float().contiguous()
    if _uses_cuda_kernels(q):
        dq, dk, dv = _cuda_bwd(g, q, k, v, out, lse, causal, scale)
    else:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    return dq, reduce_kv_heads(dk, hkv).to(k_BHLD.dtype), reduce_kv_heads(dv, hkv).to(v_BHLD.dtype)


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint key sets of the same queries; returns fp32 (out, lse).

    ``lse`` has ``out``'s shape without the last (D) dim. Uses w_b = sigmoid(lse_b - lse_a),
    out = out_a - w_b*(out_a - out_b), lse = max - logsigmoid(max - min), which never
    exponentiates a large positive number. A row whose lse is -inf in one partial (it saw no
    key there) takes the other partial unchanged, whatever that partial's out holds; a row that
    is -inf in both stays out 0, lse -inf.
    """
    oa, ob = out_a.float(), out_b.float()
    la, lb = lse_a.float(), lse_b.float()
    a_empty, b_empty = torch.isneginf(la), torch.isneginf(lb)
    hi, lo = torch.maximum(la, lb), torch.minimum(la, lb)
    lse = torch.where(a_empty & b_empty, hi, hi - torch.nn.functional.logsigmoid(hi - lo))
    w_b = torch.sigmoid(lb - la).unsqueeze(-1)
    out = oa - w_b * (oa - ob)
    out = torch.where(b_empty.unsqueeze(-1), oa, out)
    out = torch.where(a_empty.unsqueeze(-1), ob, out)
    out = torch.where((a_empty & b_empty).unsqueeze(-1), torch.zeros_like(out), out)
    return out, lse


class _LocalAttention(torch.autograd.Function):
    """Differentiable wrapper of :func:`attn_fwd_lse` / :func:`attn_bwd` (returns out only)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> Tensor:
        out, lse = attn_fwd_lse(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attn_bwd(grad_out, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def local_attention(
    q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, *, causal: bool, scale: float | None = None
) -> Tensor:
    """Differentiable attention of one block (GQA allowed) through the LSE kernels."""
    return _LocalAttention.apply(q_BHLD, k_BHLD, v_BHLD, causal, scale)


def _group_rows(cu_q: list[int], cu_k: list[int]) -> dict[tuple[int, int], list[int]]:
    """Sequence ids grouped by (Lq, Lk), so that equal-shaped sequences run as one batch."""
    groups: dict[tuple[int, int], list[int]] = {}
    for n in range(len(cu_q) - 1):
        groups.setdefault((cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]), []).append(n)
    return groups


def varlen_attention_reference(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
) -> Tensor:
    """Single-process packed (varlen) attention: sequence n's queries see only sequence n's keys.

    Differentiable (autograd through :func:`local_attention`). Sequences with equal (Lq, Lk) are
    gathered into one (B, H, L, D) batch, the results scattered back to their rows with an
    inverse permutation. With ``causal`` every sequence must have Lq == Lk. K/V may have fewer
    heads (GQA). Queries of a sequence with no keys get 0. This is the test oracle for the CP
    backends and the non-CP path of the reference attention backend.
    """
    if q_THD.dim() != 3 or k_THD.dim() != 3 or v_THD.dim() != 3:
        raise ValueError("q, k, v must be (T, H, D)")
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} sequences but cu_seqlens_k has {len(cu_k) - 1}")
    if cu_q[-1] != q_THD.shape[0] or cu_k[-1] != k_THD.shape[0]:
        raise ValueError(
            f"cu_seqlens end at {cu_q[-1]} (q) and {cu_k[-1]} (k) but q has {q_THD.shape[0]} tokens "
            f"and k has {k_THD.shape[0]}"
        )
    device = q_THD.device
    rows, outs = [], []
    for (lq, lk), seqs in _group_rows(cu_q, cu_k).items():
        if causal and lq != lk:
            raise ValueError(
                f"causal attention needs Lq == Lk per sequence; sequence {seqs[0]} has {lq} vs {lk}"
            )
        if lq == 0:
            continue
        starts_q = torch.tensor([cu_q[n] for n in seqs], device=device)
        starts_k = torch.tensor([cu_k[n] for n in seqs], device=device)
        idx_q_BL = starts_q[:, None] + torch.arange(lq, device=device)
        idx_k_BL = starts_k[:, None] + torch.arange(lk, device=device)
        q = q_THD[idx_q_BL].transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)
        k = k_THD[idx_k_BL].transpose(1, 2)
        v = v_THD[idx_k_BL].transpose(1, 2)
        out_BHLD = local_attention(q, k, v, causal=causal, scale=scale)
        rows.append(idx_q_BL.flatten())
        outs.append(out_BHLD.transpose(1, 2).flatten(0, 1))
    if not outs:
        return q_THD.new_zeros(q_THD.shape[0], q_THD.shape[1], v_THD.shape[-1])
    out_TD = torch.cat(outs)
    row_T = torch.cat(rows)
    if row_T.numel() != q_THD.shape[0]:  # tokens outside every sequence cannot happen (checked above)
        raise AssertionError("internal error: varlen rows do not cover all query tokens")
    return out_TD.index_select(0, inverse_permutation(row_T))


# ----------------------------------------------------------------------------- index blocks on THD


@dataclass(frozen=True)
class IndexBlock:
    """A batch of n equal-shaped attention blocks addressed by row indices into THD tensors.

    Block b pairs query rows ``q_rows_BL[b]`` with key rows ``k_rows_BL[b]``; ``causal`` applies
    the square causal mask (query i sees key j <= i, in the order the rows are listed).
    """

    q_rows_BL: Tensor  # (n, Lq) rows of the query/out/grad tensors
    k_rows_BL: Tensor  # (n, Lk) rows of the key/value tensors
    causal: bool


def _gather_BHLD(x_THD: Tensor, rows_BL: Tensor) -> Tensor:
    return x_THD[rows_BL].transpose(1, 2)  # (n, L, H, D) -> (n, H, L, D)


def _rows_first(x_BH_L_: Tensor) -> Tensor:
    """(n, H, L, ...) -> (n*L, H, ...), the row order of ``rows_BL.flatten()``."""
    return x_BH_L_.transpose(1, 2).flatten(0, 1)


def block_attn_rows(
    q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, block: IndexBlock, *, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``block``'s attention as rows: (query rows [n*Lq], out [n*Lq, Hq, D], lse [n*Lq, Hq] in fp32)."""
    o, lse = attn_fwd_lse(
        _gather_BHLD(q_THD, block.q_rows_BL),
        _gather_BHLD(k_THD, block.k_rows_BL),
        _gather_BHLD(v_THD, block.k_rows_BL),
        causal=block.causal,
        scale=scale,
    )
    return block.q_rows_BL.flatten(), _rows_first(o), _rows_first(lse)


def block_attn_fwd_(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    block: IndexBlock,
    out_acc_THD: Tensor,
    lse_acc_TH: Tensor,
    *,
    scale: float | None,
) -> None:
    """Attend ``block``'s queries to its keys and merge the result in place into the fp32
    accumulators (out [T, Hq, D], lse [T, Hq]; start them at 0 and -inf)."""
    rows, o, lse = block_attn_rows(q_THD, k_THD, v_THD, block, scale=scale)
    merged_out, merged_lse = merge_partials(
        out_acc_THD.index_select(0, rows), lse_acc_TH.index_select(0, rows), o, lse
    )
    out_acc_THD.index_copy_(0, rows, merged_out)
    lse_acc_TH.index_copy_(0, rows, merged_lse)


def block_attn_bwd_(
    grad_out_THD: Tensor,
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    out_THD: Tensor,
    lse_TH: Tensor,
    block: IndexBlock,
    dq_acc_THD: Tensor,
    dk_acc_THD: Tensor,
    dv_acc_THD: Tensor,
    *,
    scale: float | None,
) -> None:
    """Add ``block``'s share of dq, dk, dv into the fp32 accumulators, given the merged
    (out, lse) of every query row over all its key blocks."""
    dq, dk, dv = attn_bwd(
        _gather_BHLD(grad_out_THD, block.q_rows_BL),
        _gather_BHLD(q_THD, block.q_rows_BL),
        _gather_BHLD(k_THD, block.k_rows_BL),
        _gather_BHLD(v_THD, block.k_rows_BL),
        _gather_BHLD(out_THD, block.q_rows_BL),
        lse_TH[block.q_rows_BL].transpose(1, 2),
        causal=block.causal,
        scale=scale,
    )
    q_rows, k_rows = block.q_rows_BL.flatten(), block.k_rows_BL.flatten()
    dq_acc_THD.index_add_(0, q_rows, _rows_first(dq).float())
    dk_acc_THD.index_add_(0, k_rows, _rows_first(dk).float())
    dv_acc_THD.index_add_(0, k_rows, _rows_first(dv).float())
