"""All-gather CP attention's calls as a pure function (`plan_allgather`), with no process group: every cp
rank simulated in one process against one unsplit varlen call, forward and backward, for cp = 2, 4, 8.

Per rank the gathered K/V is the global K/V (what the all-gather plus the inverse permutation give);
the gradient a rank gets for its own K/V rows is its diagonal share plus every rank's prefix share of
those rows (what the reduce-scatter sums)."""

from __future__ import annotations

import pytest
import torch

from parallel.allgather_attention import GLOBAL, LOCAL, plan_allgather
from parallel.cp_shard import cp_shard_indices_thd
from parallel.ring_step import merge_step, ring_step_bwd, ring_step_fwd
from parallel.varlen import build_varlen_meta, varlen_attention


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
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T, H, G, D = int(cu[-1]), 4, 2, 8
    q, k, v, dout = torch.randn(T, H, D), torch.randn(T, G, D), torch.randn(T, G, D), torch.randn(T, H, D)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = varlen_attention(qr, kr, vr, build_varlen_meta(cu.tolist()), causal=True)
    ref.backward(dout)

    rows = [cp_shard_indices_thd(cu, cp, r) for r in range(cp)]
    local_cu = (cu // cp).tolist()
    dk_global, dv_global = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp):
        plan = plan_allgather(local_cu, cp, r)
        q_l, k_l, v_l, dout_l = (x[rows[r]] for x in (q, k, v, dout))
        sources = {LOCAL: (k_l, v_l), GLOBAL: (k, v)}
        out = torch.zeros(q_l.shape)
        lse = torch.full((H, q_l.shape[0]), -torch.inf)
        for src, call in plan.calls:
            o, l_ = ring_step_fwd(q_l, *sources[src], call)
            out, lse = merge_step(out, lse, o, l_, call)
        torch.testing.assert_close(out, ref.detach()[rows[r]])
        dq_l = torch.zeros_like(q_l)
        for src, call in plan.calls:
            dq_s, dk_s, dv_s = ring_step_bwd(dout_l, q_l, *sources[src], out, lse, call)
            dq_l += dq_s
            if src == LOCAL:
                dk_global.index_add_(0, rows[r], dk_s)
                dv_global.index_add_(0, rows[r], dv_s)
            else:
                dk_global += dk_s
                dv_global += dv_s
        torch.testing.assert_close(dq_l, qr.grad[rows[r]])
    torch.testing.assert_close(dk_global, kr.grad)
    torch.testing.assert_close(dv_global, vr.grad)


def test_odd_local_length_is_refused_with_the_rule():
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        plan_allgather([0, 4, 7], 2, 0)
