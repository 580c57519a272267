"""Varlen kernel interface with log-sum-exp: the one call that ring and all-gather CP attention build on.

Letters: T packed tokens, H query heads, G key/value heads (GQA: H % G == 0), D head dim, N sequences.

    varlen_fwd(q_THD, k_TGD, v_TGD, meta, causal, scale) -> (out_THD, lse_HT)
    varlen_bwd(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, meta, causal, scale) -> (dq, dk, dv)

One call covers every sequence of a pack: sequence n's queries are rows cu_q[n]:cu_q[n+1] and see
only keys cu_k[n]:cu_k[n+1]. LSE layout (documented once, used everywhere): fp32, shape (H, T_q),
natural log, -inf for a query row with no keys (the neutral element of `merge_partials`); this is
flash-attn's varlen layout and torch 2.13's `varlen_attn(..., return_aux=AuxRequest(lse=True))`.
K/V keep their G heads (no expansion at the interface; a kernel without native GQA expands inside).
With ``causal`` every sequence must have as many queries as keys (square blocks), so top-left and
bottom-right causal alignment agree on every device.

Host-side integers: `VarlenMeta` (`parallel.varlen_meta`) carries cu_seqlens on the device (int32)
*and* as host tuples with the max lengths. It is built once per micro-batch (`build_varlen_meta`) and
handed to every layer, so no layer syncs the device to read lengths.

Kernels: `VARLEN_KERNELS` maps a name to its (fwd, bwd) pair; `select_varlen_kernel` picks one by
device, dtype and compute capability among those registered:
- `reference`: the SDPA-with-LSE kernels of `parallel.attention_ops`, one launch per distinct (Lq, Lk)
  pair, exact, any device and dtype (what CI runs);
- `torch_varlen` (CUDA builds of torch): torch's own flash-attention varlen ops, one launch per pack;
- `flash` / `flash3` (where flash-attn 2 / flash-attn 3 is importable): flash-attn's own varlen
  functions, called by keyword from the installed release's signature (`parallel.varlen_flash`).
On CUDA in fp16/bf16 the order is flash3 (compute capability 9.x only) > flash > torch_varlen; fp32
and other devices get the reference. `KERNEL_CALLS` counts calls into the interface (what
`speechlm bench attention-calls` reads).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from parallel.attention_ops import IndexBlock, block_attn_bwd_, block_attn_rows
from parallel.varlen_flash import installed_flash_kernels
from parallel.varlen_meta import VarlenMeta, build_varlen_meta

__all__ = [
    "VarlenMeta",
    "build_varlen_meta",
    "varlen_fwd",
    "varlen_bwd",
    "select_varlen_kernel",
    "varlen_attention",
    "VARLEN_KERNELS",
    "KERNEL_CALLS",
]

KERNEL_CALLS: Counter[str] = Counter()  # "fwd"/"bwd" -> calls into the interface since the last clear()


def _check_call(q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, meta: VarlenMeta, causal: bool) -> None:
    if q_THD.dim() != 3 or k_TGD.dim() != 3 or v_TGD.shape != k_TGD.shape:
        raise ValueError(
            f"varlen attention takes q (T, H, D) and k, v (T, G, D) of one shape; got "
            f"{tuple(q_THD.shape)}, {tuple(k_TGD.shape)}, {tuple(v_TGD.shape)}"
        )
    if q_THD.shape[1] % k_TGD.shape[1]:
        raise ValueError(f"{q_THD.shape[1]} query heads are not a multiple of {k_TGD.shape[1]} K/V heads")
    if (meta.cu_q[-1], meta.cu_k[-1]) != (q_THD.shape[0], k_TGD.shape[0]):
        raise ValueError(
            f"cu_seqlens end at ({meta.cu_q[-1]}, {meta.cu_k[-1]}) tokens but q has {q_THD.shape[0]} "
            f"and k {k_TGD.shape[0]}: build the VarlenMeta from this pack's boundaries"
        )
    if causal and meta.cu_q != meta.cu_k:
        raise ValueError(
            "causal varlen attention needs every sequence to have as many queries as keys "
            "(square blocks); pass causal=False for a rectangular step"
        )


def _index_blocks(meta: VarlenMeta, causal: bool, device: torch.device) -> list[IndexBlock]:
    """The pack's sequences grouped by (queries, keys) lengths: one gathered batch per distinct pair.

    Built once per pack (every layer, forward and backward, asks for the same blocks): cached on the
    host boundaries, which are the whole of what the blocks depend on."""
    return _index_blocks_of(meta.cu_q, meta.cu_k, causal, device)


@functools.lru_cache(maxsize=16)
def _index_blocks_of(
    cq: tuple[int, ...], ck: tuple[int, ...], causal: bool, device: torch.device
) -> list[IndexBlock]:
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for n in range(len(cq) - 1):
        lq, lk = cq[n + 1] - cq[n], ck[n + 1] - ck[n]
        if lq and lk:
            groups.setdefault((lq, lk), []).append((cq[n], ck[n]))
    blocks = []
    for (lq, lk), starts in sorted(groups.items()):
        s = torch.tensor(starts, dtype=torch.long, device=device)
        q_rows = s[:, :1] + torch.arange(lq, device=device)
        k_rows = s[:, 1:] + torch.arange(lk, device=device)
        blocks.append(IndexBlock(q_rows, k_rows, causal))
    return blocks


def reference_fwd(
    q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, meta: VarlenMeta, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Exact reference on any device: one SDPA-with-LSE launch per distinct (Lq, Lk) pair, no syncs.

    Every query row belongs to one sequence, so to one block: each block's result is written in place
    (what `block_attn_fwd_`'s merge into the (0, -inf) start gives bit for bit, without its dozen
    elementwise ops per block and layer: issue 26, item 5)."""
    T, H, _ = q_THD.shape
    acc = torch.float32  # the LSE layout; out in fp32 as merge_partials would give it
    out_THD = torch.zeros(T, H, v_TGD.shape[2], dtype=acc, device=q_THD.device)
    lse_TH = torch.full((T, H), -torch.inf, dtype=acc, device=q_THD.device)
    for block in _index_blocks(meta, causal, q_THD.device):
        rows, o, lse = block_attn_rows(q_THD, k_TGD, v_TGD, block, scale=scale)
        out_THD.index_copy_(0, rows, o.float())
        lse_TH.index_copy_(0, rows, lse)
    return out_THD.to(q_THD.dtype), lse_TH.T


def reference_bwd(
    dout_THD: Tensor,
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    out_THD: Tensor,
    lse_HT: Tensor,
    meta: VarlenMeta,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `reference_fwd`; (out, lse) may be merged over several key blocks (see attention_ops)."""
    acc = torch.float32  # merge_partials accumulates in fp32
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q_THD, k_TGD, v_TGD))
    lse_TH = lse_HT.T
    for block in _index_blocks(meta, causal, q_THD.device):
        block_attn_bwd_(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_TH, block, dq, dk, dv, scale=scale)
    return dq.to(q_THD.dtype), dk.to(k_TGD.dtype), dv.to(v_TGD.dtype)


def _aten_flash() -> tuple[Any, Any]:
    """torch's own flash-attention varlen ops (the kernels behind `torch.nn.attention.varlen`); one
    indirection so that tests can stand in for them on a machine without CUDA."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def torch_varlen_fwd(
    q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, meta: VarlenMeta, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """torch's flash varlen forward (CUDA, fp16/bf16): K/V keep their G heads (flash-attn 2 takes GQA
    natively), the LSE comes back as (H, T) fp32, the interface's layout. The same positional call
    works on torch 2.10, 2.11 and 2.13 (the keyword arguments that changed, `enable_gqa` and the
    window sizes of `varlen_attn`, are not used)."""
    fwd, _ = _aten_flash()
    out, lse, *_ = fwd(
        q_THD, k_TGD, v_TGD, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k,
        0.0, causal, False, scale=scale,
    )  # fmt: skip
    return out, lse.float()


def torch_varlen_bwd(
    dout_THD: Tensor,
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    out_THD: Tensor,
    lse_HT: Tensor,
    meta: VarlenMeta,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `torch_varlen_fwd` with (out, lse) as given, so a ring may pass the merged ones."""
    _, bwd = _aten_flash()
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q_THD.device)  # no dropout: never read
    unused = torch.empty(0, device=q_THD.device)
    dq, dk, dv = bwd(
        dout_THD, q_THD, k_TGD, v_TGD, out_THD.to(q_THD.dtype), lse_HT.float().contiguous(),
        meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k, 0.0, causal, rng_state, unused,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


VARLEN_KERNELS: dict[str, tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, ...]]]] = {
    "reference": (reference_fwd, reference_bwd),
}
if torch.backends.cuda.is_built() and hasattr(torch.ops.aten, "_flash_attention_forward"):
    VARLEN_KERNELS["torch_varlen"] = (torch_varlen_fwd, torch_varlen_bwd)
VARLEN_KERNELS.update(installed_flash_kernels())  # find_spec only: flash-attn is imported at the first call


FORCE_KERNEL_ENV = "SPEECHLM_VARLEN_KERNEL"


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; one indirection so that tests can stand in for a GPU."""
    return torch.cuda.get_device_capability(device)


def select_varlen_kernel(
    device: torch.device | str, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> str:
    """The kernel for this device and dtype among those registered: for fp16/bf16 on CUDA flash3 (on
    compute capability 9.x, read from the device unless given), flash, torch_varlen; else the reference.
    ``SPEECHLM_VARLEN_KERNEL=NAME`` in the environment forces one registered kernel (an escape hatch
    when an installed flash-attn misbehaves)."""
    forced = os.environ.get(FORCE_KERNEL_ENV)
    if forced:
        if forced not in VARLEN_KERNELS:
            raise ValueError(
                f"{FORCE_KERNEL_ENV}={forced!r} is not a varlen kernel registered here "
                f"(registered: {', '.join(VARLEN_KERNELS)}); unset it or pick one of those"
            )
        return forced
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if "flash3" in VARLEN_KERNELS and (capability or _cuda_capability(device))[0] == 9:
            return "flash3"
        for name in ("flash", "torch_varlen"):
            if name in VARLEN_KERNELS:
                return name
    return "reference"


def varlen_fwd(
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    meta: VarlenMeta,
    *,
    causal: bool,
    scale: float | None = None,
    kernel: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(out_THD in q's dtype, lse_HT fp32) over every sequence of the pack, in one call."""
    _check_call(q_THD, k_TGD, v_TGD, meta, causal)
    KERNEL_CALLS["fwd"] += 1
    fwd, _ = VARLEN_KERNELS[kernel or select_varlen_kernel(q_THD.device, q_THD.dtype)]
    return fwd(q_THD, k_TGD, v_TGD, meta, causal, scale)


def varlen_bwd(
    dout_THD: Tensor,
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    out_THD: Tensor,
    lse_HT: Tensor,
    meta: VarlenMeta,
    *,
    causal: bool,
    scale: float | None = None,
    kernel: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `varlen_fwd`; dk/dv keep K/V's G heads."""
    _check_call(q_THD, k_TGD, v_TGD, meta, causal)
    KERNEL_CALLS["bwd"] += 1
    _, bwd = VARLEN_KERNELS[kernel or select_varlen_kernel(q_THD.device, q_THD.dtype)]
    dq, dk, dv = bwd(dout_THD, q_THD, k_TGD, v_TGD, out_THD, lse_HT, meta, causal, scale)
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_THD: Tensor,
        k_TGD: Tensor,
        v_TGD: Tensor,
        meta: VarlenMeta,
        causal: bool,
        scale: float | None,
    ) -> Tensor:
        out, lse = varlen_fwd(q_THD, k_TGD, v_TGD, meta, causal=causal, scale=scale)
        ctx.save_for_backward(q_THD, k_TGD, v_TGD, out, lse)
        ctx.meta, ctx.causal, ctx.scale = meta, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout_THD: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = varlen_bwd(
            dout_THD.contiguous(), q, k, v, out, lse, ctx.meta, causal=ctx.causal, scale=ctx.scale
        )
        return dq, dk, dv, None, None, None


def varlen_attention(
    q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, meta: VarlenMeta, *, causal: bool, scale: float | None = None
) -> Tensor:
    """Differentiable packed attention over every sequence of the pack: one `varlen_fwd` call forward
    and one `varlen_bwd` call backward (the local attention of one process, and of dynamic CP's whole
    sequences)."""
    return _VarlenAttention.apply(q_THD, k_TGD, v_TGD, meta, causal, scale)
