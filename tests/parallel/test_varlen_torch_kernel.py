"""The `torch_varlen` kernel of the varlen interface (torch's flash-attention varlen ops), on CPU with
the ops stood in for: the arguments we pass (int32 boundaries, host-int max lengths, causal, scale,
K/V with their own G heads, no dropout), the LSE layout we return, and the kernel choice by device and
dtype. The kernels themselves run on a GPU (`pytest -m gpu`, tests/test_gpu_kit.py)."""

from __future__ import annotations

import pytest
import torch

import parallel.varlen as varlen
from parallel.varlen import build_varlen_meta, reference_bwd, reference_fwd


class FakeFlash:
    """Records the calls and answers with the reference kernel, in flash's return conventions."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale=None):
        self.calls.append(
            ("fwd", (q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug), {"scale": scale})
        )
        meta = build_varlen_meta(cu_q.tolist(), cu_k.tolist())
        out, lse = reference_fwd(q, k, v, meta, causal, scale)
        return out, lse, torch.zeros(2), torch.zeros(2), torch.empty(0)

    def bwd(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *, scale=None
    ):
        self.calls.append(("bwd", (dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused),
                           {"scale": scale}))  # fmt: skip
        meta = build_varlen_meta(cu_q.tolist(), cu_k.tolist())
        return reference_bwd(dout, q, k, v, out, lse, meta, causal, scale)


@pytest.fixture()
def fake(monkeypatch):
    f = FakeFlash()
    monkeypatch.setattr(varlen, "_aten_flash", lambda: (f.fwd, f.bwd))
    monkeypatch.setitem(
        varlen.VARLEN_KERNELS, "torch_varlen", (varlen.torch_varlen_fwd, varlen.torch_varlen_bwd)
    )
    return f


def test_forward_and_backward_pass_what_flash_expects(fake):
    torch.manual_seed(0)
    cu = [0, 5, 12, 13, 24]  # lengths 5, 7, 1, 11: not multiples of 8
    q = torch.randn(24, 8, 16)
    k, v = torch.randn(24, 2, 16), torch.randn(24, 2, 16)  # GQA: 2 K/V heads for 8 query heads
    meta = build_varlen_meta(cu)
    out, lse = varlen.varlen_fwd(q, k, v, meta, causal=True, scale=0.3, kernel="torch_varlen")
    name, args, kw = fake.calls[0]
    assert name == "fwd" and kw == {"scale": 0.3}
    assert args[1].shape[1] == 2 and args[2].shape[1] == 2  # K/V not expanded to the query heads
    assert args[3].dtype == torch.int32 and args[3].tolist() == cu
    assert (args[5], args[6]) == (11, 11) and all(type(x) is int for x in args[5:7])
    assert args[7:10] == (0.0, True, False)  # no dropout, causal, no debug mask
    assert lse.shape == (8, 24) and lse.dtype == torch.float32  # (H, T), the interface's layout
    ref_out, ref_lse = reference_fwd(q, k, v, meta, True, 0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)

    dout = torch.randn_like(out)
    merged_out = out.float()  # a ring hands in its merged fp32 accumulator cast back: we cast to q's dtype
    dq, dk, dv = varlen.varlen_bwd(dout, q, k, v, merged_out, lse.T.contiguous().T, meta, causal=True,
                                   scale=0.3, kernel="torch_varlen")  # fmt: skip
    name, args, kw = fake.calls[1]
    assert name == "bwd" and kw == {"scale": 0.3}
    assert args[4].dtype == q.dtype and args[5].is_contiguous() and args[5].dtype == torch.float32
    assert args[10:12] == (0.0, True) and args[12].dtype == torch.uint64 and args[12].shape == (2,)
    assert dk.shape == k.shape and dv.shape == v.shape  # gradients keep the G heads
    ref = reference_bwd(dout, q, k, v, out, lse, meta, True, 0.3)
    for got, want in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got, want)


def test_kernel_choice_by_device_and_dtype(fake):
    assert varlen.select_varlen_kernel("cuda", torch.bfloat16) == "torch_varlen"
    assert varlen.select_varlen_kernel("cuda", torch.float16) == "torch_varlen"
    assert (
        varlen.select_varlen_kernel("cuda", torch.float32) == "reference"
    )  # flash takes half precision only
    assert varlen.select_varlen_kernel("cpu", torch.bfloat16) == "reference"


def test_not_registered_on_a_cpu_build():
    assert ("torch_varlen" in varlen.VARLEN_KERNELS) == torch.backends.cuda.is_built()
