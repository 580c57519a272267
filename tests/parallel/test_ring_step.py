"""The ring step as a pure function (parallel/ring_step.py): all cp ranks simulated in one process."""

from __future__ import annotations

import pytest
import torch

from parallel.attention_ops import varlen_attention_reference
from parallel.cp_shard import cp_all_rank_indices_thd, shard_thd
from parallel.ring_step import plan_ring_step, simulate_ring_attention
from parallel.varlen import KERNEL_CALLS

H, G, D = 4, 2, 8


def make_pack(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, G, G))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, cu


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_simulated_ring_matches_one_unsplit_call_forward_and_backward(cp: int) -> None:
    lens = [2 * cp * m for m in (1, 3, 2, 5)]
    q, k, v, cu = make_pack(lens)
    dout = torch.randn(q.shape[0], H, D, generator=torch.Generator().manual_seed(1))
    shards = [shard_thd({"q": q, "k": k, "v": v, "g": dout}, cu, cp, r) for r in range(cp)]
    local_cu = shards[0][1].tolist()
    KERNEL_CALLS.clear()
    outs, grads = simulate_ring_attention(
        [s[0]["q"] for s in shards],
        [s[0]["k"] for s in shards],
        [s[0]["v"] for s in shards],
        local_cu,
        dout_local=[s[0]["g"] for s in shards],
    )
    # one varlen call per ring step and rank, forward and backward, whatever the number of sequences
    assert KERNEL_CALLS == {"fwd": cp * cp, "bwd": cp * cp}
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qa, ka, va, cu, cu, causal=True)
    ref.backward(dout)
    rank_major_T = cp_all_rank_indices_thd(cu, cp).flatten()  # the ranks' pieces, in order
    torch.testing.assert_close(torch.cat(outs), ref.detach()[rank_major_T], atol=2e-5, rtol=2e-5)
    assert grads is not None
    for i, want in enumerate((qa.grad, ka.grad, va.grad)):
        got = torch.cat([grads[3 * r + i] for r in range(cp)])
        torch.testing.assert_close(got, want[rank_major_T], atol=5e-5, rtol=5e-5)


def test_plans_follow_the_three_cases() -> None:
    local_cu = [0, 4, 10]  # two sequences, halves of 2 and 3 tokens
    diag = plan_ring_step(local_cu, 0, 1, 4)
    assert diag.causal and diag.q_rows is None and diag.k_rows is None
    earlier = plan_ring_step(local_cu, 1, 1, 4)  # src 0 < rank 1: all queries, first half of K/V
    assert not earlier.causal and earlier.q_rows is None
    assert earlier.k_rows.tolist() == [0, 1, 4, 5, 6] and earlier.meta.cu_k == (0, 2, 5)
    later = plan_ring_step(local_cu, 2, 1, 4)  # src 3 > rank 1: second half of queries, all K/V
    assert later.k_rows is None and later.q_rows.tolist() == [2, 3, 7, 8, 9]
    assert later.meta.cu_q == (0, 2, 5) and later.meta.cu_k == (0, 4, 10)


def test_plan_refuses_odd_local_lengths_and_bad_steps() -> None:
    with pytest.raises(ValueError, match="odd"):
        plan_ring_step([0, 3], 1, 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        plan_ring_step([0, 4], 2, 0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_simulated_ring_on_cuda_matches_an_fp64_unsplit_call(cp: int, dtype: torch.dtype) -> None:
    """On one GPU, head dim 64, odd per-chunk lengths: bf16 within 2e-2, fp32 within 1e-4 of fp64."""
    lens = [2 * cp * m for m in (3, 7, 1, 13)]
    g = torch.Generator().manual_seed(2)
    T = sum(lens)
    q, k, v = (torch.randn(T, n, 64, generator=g, dtype=torch.float64) for n in (H, G, G))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ref = varlen_attention_reference(q, k, v, cu, cu, causal=True)
    shards = [shard_thd({"q": q, "k": k, "v": v}, cu, cp, r) for r in range(cp)]
    dev = [{n: x.to("cuda", dtype) for n, x in s[0].items()} for s in shards]
    outs, _ = simulate_ring_attention(
        [s["q"] for s in dev], [s["k"] for s in dev], [s["v"] for s in dev], shards[0][1].tolist()
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    got = torch.cat([o.double().cpu() for o in outs])
    torch.testing.assert_close(got, ref[cp_all_rank_indices_thd(cu, cp).flatten()], atol=tol, rtol=tol)
