"""Local attention ops with log-sum-exp: values, gradients, merging, varlen, CUDA argument plumbing.

Letters: B batch, H heads, L length (Lq, Lk), D head dim, T packed tokens.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

import parallel.attention_ops as ops
from parallel.attention_ops import (
    attn_bwd,
    attn_fwd_lse,
    merge_partials,
    varlen_attention_reference,
)
from parallel.ring_attention import ring_attention_thd

SCALE = 0.37


def naive_attention(q_BHLD: Tensor, k_BHLD: Tensor, v_BHLD: Tensor, causal: bool, scale: float = SCALE):
    """Softmax attention written out (GQA by repeat_interleave); returns (out, lse)."""
    group = q_BHLD.shape[1] // k_BHLD.shape[1]
    k = k_BHLD.repeat_interleave(group, dim=1)
    v = v_BHLD.repeat_interleave(group, dim=1)
    s = q_BHLD @ k.transpose(-1, -2) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def _qkv(b: int, hq: int, hkv: int, lq: int, lk: int, d: int = 8, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_fwd_matches_naive(causal: bool, hkv: int) -> None:
    q, k, v = _qkv(2, 4, hkv, 7, 7)
    out, lse = attn_fwd_lse(q, k, v, causal=causal, scale=SCALE)
    ref_out, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 7)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=1e-5)


def test_lse_is_fp32_for_bf16_inputs() -> None:
    q, k, v = _qkv(1, 2, 2, 5, 5, dtype=torch.bfloat16)
    out, lse = attn_fwd_lse(q, k, v, causal=True, scale=SCALE)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2])
def test_bwd_matches_autograd_of_naive(causal: bool, hkv: int) -> None:
    q, k, v = _qkv(2, 4, hkv, 6, 6, seed=1)
    grad = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(2))
    out, lse = attn_fwd_lse(q, k, v, causal=causal, scale=SCALE)
    dq, dk, dv = attn_bwd(grad, q, k, v, out, lse, causal=causal, scale=SCALE)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = torch.autograd.grad(naive_attention(qd, kd, vd, causal)[0], (qd, kd, vd), grad.double())
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, exp in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)


def test_rectangular_causal_is_rejected() -> None:
    q, k, v = _qkv(1, 2, 2, 3, 5)
    with pytest.raises(ValueError, match="square block"):
        attn_fwd_lse(q, k, v, causal=True, scale=SCALE)


def test_merge_of_key_halves_equals_full_attention() -> None:
    q, k, v = _qkv(2, 4, 2, 5, 9, seed=3)
    full_out, full_lse = attn_fwd_lse(q, k, v, causal=False, scale=SCALE)
    out_a, lse_a = attn_fwd_lse(q, k[:, :, :4], v[:, :, :4], causal=False, scale=SCALE)
    out_b, lse_b = attn_fwd_lse(q, k[:, :, 4:], v[:, :, 4:], causal=False, scale=SCALE)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, full_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)
    out_ba, lse_ba = merge_partials(out_b, lse_b, out_a, lse_a)  # symmetric
    torch.testing.assert_close(out_ba, out, atol=1e-6, rtol=1e-6)


def test_merge_handles_rows_that_saw_no_key() -> None:
    q, k, v = _qkv(1, 2, 2, 4, 3, seed=4)
    out_a, lse_a = attn_fwd_lse(q, k, v, causal=False, scale=SCALE)
    empty_out, empty_lse = attn_fwd_lse(q, k[:, :, :0], v[:, :, :0], causal=False, scale=SCALE)
    assert torch.isneginf(empty_lse).all() and (empty_out == 0).all()
    for first, second in (((out_a, lse_a), (empty_out, empty_lse)), ((empty_out, empty_lse), (out_a, lse_a))):
        out, lse = merge_partials(*first, *second)
        torch.testing.assert_close(out, out_a)
        torch.testing.assert_close(lse, lse_a)
    # per row: row 0 empty in a, row 1 empty in b, row 2 empty in both (garbage outs are ignored)
    oa, ob = torch.randn(3, 4), torch.randn(3, 4)
    oa[0], ob[1] = math.nan, math.nan
    la = torch.tensor([-math.inf, 0.5, -math.inf])
    lb = torch.tensor([1.5, -math.inf, -math.inf])
    ob[2] = math.nan
    out, lse = merge_partials(oa, la, ob, lb)
    torch.testing.assert_close(out[0], ob[0])
    torch.testing.assert_close(out[1], oa[1])
    assert (out[2] == 0).all() and torch.isneginf(lse[2])
    torch.testing.assert_close(lse[:2], torch.tensor([1.5, 0.5]))


def test_merge_is_stable_for_large_lse() -> None:
    oa, ob = torch.ones(2, 3), torch.zeros(2, 3)
    la = torch.tensor([1.0e4, -1.0e4])
    lb = la + torch.tensor([math.log(3.0), 0.0])  # weights 1/4, 3/4 and 1/2, 1/2
    out, lse = merge_partials(oa, la, ob, lb)
    torch.testing.assert_close(out[:, 0], torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(lse, torch.logaddexp(la.double(), lb.double()).float())


@pytest.mark.parametrize("hkv", [4, 2])
def test_split_backward_with_merged_stats_adds_up(hkv: int) -> None:
    """The fact ring attention relies on: per key block, attn_bwd with the *merged* out/lse."""
    q, k, v = _qkv(1, 4, hkv, 6, 10, seed=5)
    grad = torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(6))
    out, lse = attn_fwd_lse(q, k, v, causal=False, scale=SCALE)
    dq, dk, dv = attn_bwd(grad, q, k, v, out, lse, causal=False, scale=SCALE)
    parts = [
        attn_bwd(grad, q, k[:, :, sl], v[:, :, sl], out, lse, causal=False, scale=SCALE)
        for sl in (slice(0, 3), slice(3, 10))
    ]
    torch.testing.assert_close(parts[0][0] + parts[1][0], dq, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]], dim=2), dk, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]], dim=2), dv, atol=1e-6, rtol=1e-5)


def _naive_varlen(q_THD, k_THD, v_THD, cu_q, cu_k, causal):
    outs = []
    for n in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        if qs.stop == qs.start:
            continue
        if ks.stop == ks.start:
            outs.append(torch.zeros(qs.stop - qs.start, q_THD.shape[1], v_THD.shape[2], dtype=q_THD.dtype))
            continue
        to_bhld = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
        out, _ = naive_attention(to_bhld(q_THD[qs]), to_bhld(k_THD[ks]), to_bhld(v_THD[ks]), causal)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 1])
def test_varlen_reference_matches_per_sequence_naive(causal: bool, hkv: int) -> None:
    lengths = [5, 1, 0, 5, 8, 3]  # repeated lengths share a batch; an empty sequence in the middle
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    t = cu[-1]
    g = torch.Generator().manual_seed(7)
    q, grad = torch.randn(t, 4, 8, generator=g), torch.randn(t, 4, 8, generator=g)
    k, v = torch.randn(t, hkv, 8, generator=g), torch.randn(t, hkv, 8, generator=g)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention_reference(
        qa, ka, va, torch.tensor(cu), torch.tensor(cu), causal=causal, scale=SCALE
    )
    out.backward(grad)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = _naive_varlen(qd, kd, vd, cu, cu, causal)
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    for got, exp in zip((qa.grad, ka.grad, va.grad), (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)


def test_varlen_reference_with_different_q_and_k_lengths() -> None:
    cu_q, cu_k = [0, 2, 5, 5, 9], [0, 6, 7, 10, 10]  # the last sequence has queries but no keys
    g = torch.Generator().manual_seed(8)
    q, k, v = (
        torch.randn(9, 2, 8, generator=g),
        torch.randn(10, 2, 8, generator=g),
        torch.randn(10, 2, 8, generator=g),
    )
    out = varlen_attention_reference(
        q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), causal=False, scale=SCALE
    )
    torch.testing.assert_close(
        out.double(), _naive_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, False)
    )
    with pytest.raises(ValueError, match="Lq == Lk"):
        varlen_attention_reference(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), causal=True, scale=SCALE)


# ----------------------------------------------------------------------------- CUDA branch plumbing


def _bind(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map a call to the real aten schema's argument names (fails on extra/missing arguments)."""
    schema = getattr(torch.ops.aten, name).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{name}: {len(args)} positional arguments, the schema has {len(positional)}")
    bound = {a.name: x for a, x in zip(positional, args)}
    names = {a.name for a in schema.arguments}
    for key, x in kwargs.items():
        if key not in names or key in bound:
            raise TypeError(f"{name}: unexpected or repeated argument {key}")
        bound[key] = x
    for a in schema.arguments:
        if a.name not in bound:
            if not a.has_default_value():
                raise TypeError(f"{name}: missing argument {a.name}")
            bound[a.name] = a.default_value
    return bound


class FakeCudaAten:
    """Stands in for ``torch.ops.aten`` with CPU tensors posing as CUDA ones.

    Each call is first replayed on meta copies through the *real* op (schema and shape check),
    then computed with the CPU kernels and returned in the CUDA kernels' output format
    (efficient attention pads its LSE to a multiple of 32 rows; the padding holds NaN here).
    """

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _replay_on_meta(self, name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        meta = lambda x: x.to("meta") if isinstance(x, Tensor) else x  # noqa: E731
        getattr(torch.ops.aten, name)(*map(meta, args), **{k: meta(x) for k, x in kwargs.items()})
        self.calls.append(name)
        return _bind(name, args, kwargs)

    def _scaled_dot_product_flash_attention(self, *args, **kwargs):
        a = self._replay_on_meta("_scaled_dot_product_flash_attention", args, kwargs)
        q, k = a["query"], a["key"]
        assert q.dtype in (torch.float16, torch.bfloat16) and a["dropout_p"] == 0.0
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, a["value"], 0.0, a["is_causal"], scale=a["scale"]
        )
        rng = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
        return out, lse, None, None, q.shape[2], k.shape[2], *rng, torch.empty(0)

    def _scaled_dot_product_efficient_attention(self, *args, **kwargs):
        a = self._replay_on_meta("_scaled_dot_product_efficient_attention", args, kwargs)
        q = a["query"]
        assert a["compute_log_sumexp"] and a["attn_bias"] is None and a["dropout_p"] == 0.0
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, a["key"], a["value"], 0.0, a["is_causal"], scale=a["scale"]
        )
        padded = torch.full((*lse.shape[:2], math.ceil(q.shape[2] / 32) * 32), math.nan)
        padded[..., : q.shape[2]] = lse
        return out, padded, torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)

    def _scaled_dot_product_flash_attention_backward(self, *args, **kwargs):
        a = self._replay_on_meta("_scaled_dot_product_flash_attention_backward", args, kwargs)
        q, k, lse = a["query"], a["key"], a["logsumexp"]
        assert a["cum_seq_q"] is None and a["cum_seq_k"] is None, "dense kernel needs undefined cum_seq"
        assert (a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2])
        assert lse.is_contiguous() and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        assert a["philox_seed"].dtype == torch.uint64  # taken from a real forward
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            a["grad_out"], q, k, a["value"], a["out"], lse, 0.0, a["is_causal"], scale=a["scale"]
        )

    def _scaled_dot_product_efficient_attention_backward(self, *args, **kwargs):
        a = self._replay_on_meta("_scaled_dot_product_efficient_attention_backward", args, kwargs)
        q, lse = a["query"], a["logsumexp"]
        assert a["attn_bias"] is None and list(a["grad_input_mask"]) == [True, True, True, False]
        assert lse.is_contiguous() and lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            a["grad_out_"], q, a["key"], a["value"], a["out"], lse[..., : q.shape[2]].contiguous(),
            0.0, a["is_causal"], scale=a["scale"],
        )  # fmt: skip
        return dq, dk, dv, None


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudaAten:
    fake = FakeCudaAten()
    monkeypatch.setattr(ops, "_aten", fake)
    monkeypatch.setattr(ops, "_uses_cuda_kernels", lambda t: True)
    monkeypatch.setattr(ops, "_RNG_PLACEHOLDERS", {})
    return fake


@pytest.mark.parametrize(
    "dtype,kernel", [(torch.bfloat16, "flash"), (torch.float16, "flash"), (torch.float32, "efficient")]
)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_branch_plumbing_with_fake_ops(
    fake_cuda: FakeCudaAten, dtype, kernel: str, causal: bool
) -> None:
    q, k, v = _qkv(2, 4, 2, 40, 40, seed=9, dtype=dtype)  # 40 rows: the efficient LSE is padded to 64
    grad = torch.randn(2, 4, 40, 8, generator=torch.Generator().manual_seed(10)).to(dtype)
    with pytest.MonkeyPatch.context() as cpu:  # expected values from the CPU branch
        cpu.setattr(ops, "_aten", torch.ops.aten)
        cpu.setattr(ops, "_uses_cuda_kernels", lambda t: False)
        exp_out, exp_lse = attn_fwd_lse(q, k, v, causal=causal, scale=SCALE)
        exp_grads = attn_bwd(grad, q, k, v, exp_out, exp_lse, causal=causal, scale=SCALE)
    out, lse = attn_fwd_lse(q, k, v, causal=causal, scale=SCALE)
    grads = attn_bwd(grad, q, k, v, out, lse, causal=causal, scale=SCALE)
    assert lse.shape == (2, 4, 40) and not lse.isnan().any()
    torch.testing.assert_close(out, exp_out)
    torch.testing.assert_close(lse, exp_lse)
    for got, exp in zip(grads, exp_grads):
        torch.testing.assert_close(got, exp)
    forward = f"_scaled_dot_product_{kernel}_attention"
    assert fake_cuda.calls == [forward, forward, forward + "_backward"]  # fwd, rng placeholders, bwd


def test_cuda_branch_end_to_end_with_fake_ops(fake_cuda: FakeCudaAten) -> None:
    cu = torch.tensor([0, 8, 24, 32])
    g = torch.Generator().manual_seed(11)
    q, k, v = (
        torch.randn(32, 4, 8, generator=g),
        torch.randn(32, 2, 8, generator=g),
        torch.randn(32, 2, 8, generator=g),
    )
    grad = torch.randn(32, 4, 8, generator=g)
    results = []
    for fn in (varlen_attention_reference, ring_attention_thd):
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        if fn is ring_attention_thd:
            out = fn(qa, ka, va, cu, group=None, cp_size=1, cp_rank=0, scale=SCALE)
        else:
            out = fn(qa, ka, va, cu, cu, causal=True, scale=SCALE)
        out.backward(grad)
        results.append([out.detach(), qa.grad, ka.grad, va.grad])
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = _naive_varlen(qd, kd, vd, cu.tolist(), cu.tolist(), True)
    ref.backward(grad.double())
    for got in results:
        for x, exp in zip(got, (ref, qd.grad, kd.grad, vd.grad)):
            torch.testing.assert_close(x.double(), exp.detach(), atol=1e-5, rtol=1e-5)
    assert set(fake_cuda.calls) == {
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_branch_against_real_schemas_on_meta(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """The real CUDA ops' meta kernels accept our arguments and give the shapes we rely on."""
    monkeypatch.setattr(ops, "_uses_cuda_kernels", lambda t: t.device.type in ("cuda", "meta"))
    monkeypatch.setattr(ops, "_RNG_PLACEHOLDERS", {})
    q = torch.empty(2, 4, 40, 8, dtype=dtype, device="meta")
    kv = torch.empty(2, 2, 40, 8, dtype=dtype, device="meta")
    out, lse = attn_fwd_lse(q, kv, kv, causal=True, scale=SCALE)
    assert (
        out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    )
    dq, dk, dv = attn_bwd(out, q, kv, kv, out, lse, causal=True, scale=SCALE)
    assert dq.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape


def test_cuda_branch_needs_head_dim_multiple_of_8(fake_cuda: FakeCudaAten) -> None:
    q, k, v = _qkv(1, 2, 2, 4, 4, d=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        attn_fwd_lse(q, k, v, causal=True, scale=SCALE)
