"""All-gather CP attention's calls as a pure function (`plan_allgather`), with no process group: every cp
rank simulated in one process (`simulate_allgather_attention`) against one unsplit varlen call, forward
and backward, for cp = 2, 4, 8 (the GPU kit runs the same on CUDA kernels)."""

from __future__ import annotations

import pytest
import torch

from parallel.allgather_attention import GLOBAL, LOCAL, plan_allgather, simulate_allgather_attention
from parallel.varlen import KERNEL_CALLS, build_varlen_meta, varlen_attention


def _lengths(cp: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2 * cp * int(x) for x in torch.randint(1, 6, (n,), generator=g)]


@pytest.mark.parametrize("n", [3, 40])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_two_calls_whatever_the_number_of_sequences(cp, n):
    lengths = _lengths(cp, n, seed=n)
    local_cu = [0, *torch.tensor(lengths).div(cp, rounding_mode="floor").cumsum(0).tolist()]
    for rank in range(cp):
        plan = plan_allgather(local_cu, cp, rank)
        expected = 1 if cp == 1 else 2
        assert len(plan.calls) == expected
        if cp > 1:
            (src0, diag), (src1, prefix) = plan.calls
            assert (src0, diag.causal) == (LOCAL, True) and (src1, prefix.causal) == (GLOBAL, False)
            # rank 0's first chunks have no prefix: only the second halves' queries take part
            assert (prefix.q_rows is not None) == (rank == 0)
    assert len(plan_allgather(local_cu, cp, 0, causal=False).calls) == 1


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_simulated_ranks_equal_one_unsplit_call(cp):
    torch.manual_seed(cp)
    lengths = [2 * cp, 0, *_lengths(cp, 5, seed=cp)]  # a sequence of exactly 2*cp, an empty one
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    T, H, G, D = cu[-1], 4, 2, 8
    q, k, v, dout = torch.randn(T, H, D), torch.randn(T, G, D), torch.randn(T, G, D), torch.randn(T, H, D)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = varlen_attention(qr, kr, vr, build_varlen_meta(cu), causal=True)
    ref.backward(dout)
    KERNEL_CALLS.clear()
    out, grads = simulate_allgather_attention(q, k, v, cu, cp, dout)
    assert KERNEL_CALLS == {"fwd": 2 * cp, "bwd": 2 * cp}  # two calls per rank each way
    torch.testing.assert_close(out, ref.detach())
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(got, want)


def test_odd_local_length_is_refused_with_the_rule():
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        plan_allgather([0, 4, 7], 2, 0)
