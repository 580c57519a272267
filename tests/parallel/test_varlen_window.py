"""Sliding-window attention on packed sequences (`parallel.varlen_window`) is exact against dense masked
attention per sequence: outputs and the gradients of q, k, v and the relative-position bias, for odd
lengths, windows wider than a sequence, zero-width sides, empty sequences and any block size."""

from __future__ import annotations

import pytest
import torch

from parallel.varlen_meta import build_varlen_meta
from parallel.varlen_window import varlen_window_attention

H, D = 3, 8


def dense_reference(q, k, v, lens, left, right, scale, bias):
    """Per sequence: full [H, L, L] scores, bias at distance t - s, -inf outside the window, softmax."""
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        start += n
        if n == 0:
            continue
        t = torch.arange(n)
        dist = t[:, None] - t[None, :]  # t - s
        inside = (dist <= left) & (-dist <= right)
        scores = torch.einsum("thd,shd->hts", q[sl], k[sl]) * scale
        if bias is not None:
            o = (left - dist).clamp(0, left + right)  # offset of key s in query t's window
            b = bias[sl].permute(1, 0, 2).gather(2, o.expand(q.shape[1], n, n))  # [H, L, L]
            scores = scores + b
        scores = scores.masked_fill(~inside, float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v[sl]))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


def make(lens, left, right, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T, W = sum(lens), left + right + 1
    q, k, v = (torch.randn(T, H, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    bias = torch.randn(T, H, W, generator=g, dtype=dtype).requires_grad_()
    return q, k, v, bias


CASES = [
    ([37, 1, 64, 0, 23], (4, 4), None),
    ([37, 1, 64, 0, 23], (0, 0), None),
    ([37, 1, 64, 0, 23], (7, 2), 5),  # asymmetric window, blocks smaller than it
    ([50, 9], (0, 6), 16),  # no left context
    ([13, 5], (40, 40), None),  # a window wider than every sequence: full attention
    ([200], (31, 31), 7),
]


@pytest.mark.parametrize("lens, window, block", CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_window_attention_equals_dense_masked_attention(lens, window, block, with_bias):
    left, right = window
    meta = build_varlen_meta(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))
    q, k, v, bias = make(lens, left, right)
    b = bias if with_bias else None
    got = varlen_window_attention(q, k, v, meta, window=window, scale=0.3, bias_THW=b, block=block)
    want = dense_reference(q, k, v, lens, left, right, 0.3, b)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(want)
    inputs = (q, k, v, bias) if with_bias else (q, k, v)
    g_got = torch.autograd.grad(got, inputs, dout)
    g_want = torch.autograd.grad(want, inputs, dout)
    for name, a, w in zip("qkvb", g_got, g_want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_window_attention_fp32_matches_to_1e5():
    lens, left, right = [301, 17, 88], 16, 16
    meta = build_varlen_meta([0, 301, 318, 406])
    q, k, v, bias = make(lens, left, right, dtype=torch.float32)
    got = varlen_window_attention(q, k, v, meta, window=(left, right), bias_THW=bias)
    torch.testing.assert_close(
        got, dense_reference(q, k, v, lens, left, right, D**-0.5, bias), rtol=1e-5, atol=1e-5
    )


def test_window_attention_scores_a_bounded_number_of_keys_per_query(monkeypatch):
    """Memory grows with T * (C + W), not with L^2: the one SDPA call sees [N, H, C, C + W - 1] scores."""
    import parallel.varlen_window as vw

    shapes = []
    real = vw.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.append((tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(vw.F, "scaled_dot_product_attention", spy)
    T, left, right = 4000, 8, 8
    meta = build_varlen_meta([0, T])
    q = torch.randn(T, 2, 4)
    varlen_window_attention(q, q, q, meta, window=(left, right))
    ((q_shape, k_shape),) = shapes
    assert q_shape == (T // 17 + 1, 2, 17, 4) and k_shape == (T // 17 + 1, 2, 17 + 16, 4)


def test_window_attention_refuses_bad_input():
    meta = build_varlen_meta([0, 5])
    q = torch.randn(5, 2, 4)
    with pytest.raises(ValueError, match="must be >= 0"):
        varlen_window_attention(q, q, q, meta, window=(-1, 3))
    with pytest.raises(ValueError, match="bias_THW must be"):
        varlen_window_attention(q, q, q, meta, window=(1, 1), bias_THW=torch.zeros(5, 2, 2))
    with pytest.raises(ValueError, match="the pack has 6 tokens"):
        varlen_window_attention(
            torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4), meta, window=(1, 1)
        )
