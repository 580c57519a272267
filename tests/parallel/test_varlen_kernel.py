"""The varlen kernel interface (parallel/varlen.py): one call per pack, LSE layout (H, T), GQA, backward."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.attention_ops import varlen_attention_reference
from parallel.varlen import KERNEL_CALLS, build_varlen_meta, select_varlen_kernel, varlen_bwd, varlen_fwd

LENS = [5, 1, 13, 7, 0, 9]  # not multiples of 8, with an empty and a one-token sequence
H, G, D = 4, 2, 16


def make_qkv(lens_q, lens_k, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, D, generator=g, dtype=dtype)
    k = torch.randn(sum(lens_k), G, D, generator=g, dtype=dtype)
    v = torch.randn(sum(lens_k), G, D, generator=g, dtype=dtype)
    return q, k, v


def cumsum(lens):
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


def dense_lse_HT(q, k, cu_q, cu_k, causal, scale):
    """log-sum-exp of every query row, in fp64 by a dense loop (the oracle for the LSE layout)."""
    k_full = k.repeat_interleave(H // G, dim=1)
    lse = torch.full((H, q.shape[0]), -math.inf, dtype=torch.float64)
    for n in range(len(cu_q) - 1):
        for i in range(cu_q[n], cu_q[n + 1]):
            keys = k_full[cu_k[n] : cu_k[n + 1]]
            if causal:
                keys = keys[: i - cu_q[n] + 1]
            if len(keys):
                lse[:, i] = torch.logsumexp(scale * torch.einsum("hd,khd->hk", q[i], keys), dim=1)
    return lse


@pytest.mark.parametrize("causal", [True, False])
def test_forward_matches_per_sequence_attention_and_lse_is_HT(causal: bool) -> None:
    lens_k = LENS if causal else [3, 4, 11, 2, 6, 0]
    q, k, v = make_qkv(LENS, lens_k)
    meta = build_varlen_meta(cumsum(LENS), cumsum(lens_k))
    scale = D**-0.5
    out, lse = varlen_fwd(q, k, v, meta, causal=causal, scale=scale)
    ref = varlen_attention_reference(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, causal=causal, scale=scale
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # fp32 accumulation of fp64 inputs
    assert lse.dtype == torch.float32 and lse.shape == (H, q.shape[0])
    want = dense_lse_HT(q, k, meta.cu_q, meta.cu_k, causal, scale)
    torch.testing.assert_close(lse.double(), want, atol=1e-5, rtol=1e-5)


def test_backward_matches_autograd_with_gqa_heads_kept() -> None:
    q, k, v = make_qkv(LENS, LENS, dtype=torch.float32)  # the CPU backward kernel keeps an fp32 LSE
    meta = build_varlen_meta(torch.tensor(cumsum(LENS)))
    out, lse = varlen_fwd(q, k, v, meta, causal=True)
    dout = torch.randn_like(out)
    dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, meta, causal=True)
    assert dk.shape == k.shape and dv.shape == v.shape  # G heads, not expanded
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    varlen_attention_reference(qa, ka, va, meta.cu_seqlens_q, meta.cu_seqlens_k, causal=True).backward(dout)
    for got, want in ((dq, qa.grad), (dk, ka.grad), (dv, va.grad)):
        torch.testing.assert_close(got, want)


def test_one_interface_call_per_pack_whatever_the_number_of_sequences() -> None:
    for n in (2, 200):
        lens = [3] * n
        q, k, v = make_qkv(lens, lens, dtype=torch.float32)
        meta = build_varlen_meta(cumsum(lens))
        KERNEL_CALLS.clear()
        out, lse = varlen_fwd(q, k, v, meta, causal=True)
        varlen_bwd(torch.ones_like(out), q, k, v, out, lse, meta, causal=True)
        assert KERNEL_CALLS == {"fwd": 1, "bwd": 1}


def test_meta_holds_host_integers_built_once() -> None:
    meta = build_varlen_meta(torch.tensor([0, 5, 6, 19]), [0, 2, 2, 9])
    assert (meta.cu_q, meta.cu_k, meta.max_q, meta.max_k) == ((0, 5, 6, 19), (0, 2, 2, 9), 13, 7)
    assert meta.cu_seqlens_q.dtype == torch.int32 and meta.cu_seqlens_k.tolist() == [0, 2, 2, 9]


@pytest.mark.parametrize(
    "cu_q,cu_k,match",
    [([1, 5], None, "start at 0"), ([0, 5, 3], None, "never decrease"), ([0, 5], [0, 2, 4], "sequences")],
)
def test_bad_boundaries_are_refused_with_the_fix(cu_q, cu_k, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_varlen_meta(cu_q, cu_k)


def test_call_checks_name_the_mismatch() -> None:
    q, k, v = make_qkv([4, 4], [4, 4])
    with pytest.raises(ValueError, match="end at"):
        varlen_fwd(q, k, v, build_varlen_meta([0, 4, 9]), causal=False)
    q2, k2, v2 = make_qkv([4, 4], [3, 5])
    with pytest.raises(ValueError, match="square blocks"):
        varlen_fwd(q2, k2, v2, build_varlen_meta([0, 4, 8], [0, 3, 8]), causal=True)


def test_cpu_and_fp32_select_the_reference_kernel() -> None:
    assert select_varlen_kernel("cpu", torch.bfloat16) == "reference"
    assert select_varlen_kernel("cuda", torch.float32) == "reference"
