"""Ring and all-gather CP attention vs the single-process varlen reference (gloo, 2 and 4 ranks).

Letters: T global tokens, t local tokens, H heads, D head dim.

Every rank builds the same seeded global q/k/v and upstream grad, shards its part, runs forward
and backward, and returns its local out/dq/dk/dv; the parent compares them, rank-major, with the same rows of
``varlen_attention_reference`` on the global sequence. One spawn per world size runs all cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from helpers import BACKENDS, device_for, skip_unless_backend

from parallel.allgather_attention import allgather_attention_thd
from parallel.attention_ops import varlen_attention_reference
from parallel.cp_shard import cp_all_rank_indices_thd, shard_thd
from parallel.ring_attention import ring_attention_thd
from parallel.testing import run_distributed

D = 8
IMPLS = {"ring": ring_attention_thd, "allgather": allgather_attention_thd}


@dataclass(frozen=True)
class Case:
    seqlens: tuple[int, ...]
    hq: int
    hkv: int
    causal: bool = True
    dtype: torch.dtype = torch.float32

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.seqlens).cumsum(0).tolist()], dtype=torch.int32)


def _cases(cp: int) -> list[Case]:
    g = torch.Generator().manual_seed(100 + cp)
    unit = 2 * cp
    rand = tuple(int(x) * unit for x in torch.randint(1, 4, (3,), generator=g))
    return [
        Case((8 * cp,), 4, 4),  # one sequence
        Case((unit, *rand), 4, 2),  # GQA, a sequence of exactly 2*cp (chunk size 1)
        Case((unit, unit, 3 * unit), 2, 2),  # two sequences with c=1 share one batch
        Case((2 * unit, 0, unit), 4, 1),  # an empty sequence in cu_seqlens; MQA
        Case(rand, 4, 2, causal=False),
        Case((2 * unit, unit), 2, 1, dtype=torch.bfloat16),
    ]


def _global_inputs(case: Case, index: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1234 + index)
    t = sum(case.seqlens)
    q = torch.randn(t, case.hq, D, generator=g)
    k = torch.randn(t, case.hkv, D, generator=g)
    v = torch.randn(t, case.hkv, D, generator=g)
    grad = torch.randn(t, case.hq, D, generator=g)
    return q, k, v, grad


def _run_case(
    case: Case,
    index: int,
    group: dist.ProcessGroup | None,
    cp: int,
    rank: int,
    device: torch.device | str = "cpu",
) -> dict:
    q, k, v, grad = (x.to(device) for x in _global_inputs(case, index))
    local, cu_local, _ = shard_thd({"q": q, "k": k, "v": v, "grad": grad}, case.cu_seqlens, cp, rank)
    results = {}
    for name, impl in IMPLS.items():
        ql, kl, vl = (local[n].to(case.dtype).clone().requires_grad_() for n in ("q", "k", "v"))
        out = impl(
            ql, kl, vl, cu_local, group=group, cp_size=cp, cp_rank=rank, scale=D**-0.5, causal=case.causal
        )
        out.backward(local["grad"].to(case.dtype))
        results[name] = [x.detach().float().cpu() for x in (out, ql.grad, kl.grad, vl.grad)]
    return results


def _worker(rank: int, world_size: int, cases: list[Case], backend: str = "gloo") -> dict:
    dev = device_for(backend, rank)
    results = {"world": [_run_case(c, i, None, world_size, rank, dev) for i, c in enumerate(cases)]}
    if world_size == 4:  # CP over non-contiguous sub-groups {0, 2} and {1, 3}: global-rank mapping
        subgroups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group = subgroups[rank % 2]
        results["sub"] = [_run_case(c, i, group, 2, rank // 2, dev) for i, c in enumerate(_cases(2)[:2])]
    return results


def _reference(case: Case, index: int) -> list[torch.Tensor]:
    q, k, v, grad = (x.requires_grad_() for x in _global_inputs(case, index))
    cu = case.cu_seqlens
    out = varlen_attention_reference(q, k, v, cu, cu, causal=case.causal, scale=D**-0.5)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _check(case: Case, index: int, per_rank: list[dict], cp: int, label: str) -> None:
    expected = _reference(case, index)
    atol = 1e-5 if case.dtype == torch.float32 else 4e-2
    rank_major_T = cp_all_rank_indices_thd(case.cu_seqlens, cp).flatten()  # the ranks' pieces, in order
    for impl in IMPLS:
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = torch.cat([r[impl][j] for r in per_rank])
            err = (got - expected[j][rank_major_T]).abs().max().item()
            assert err <= atol, f"{label} {impl} {name}: max abs error {err:.3g} > {atol} for {case}"


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_reference(cp: int, backend: str) -> None:
    skip_unless_backend(backend, cp)
    cases = _cases(cp)
    results = run_distributed(_worker, cp, backend, cases, backend, timeout_s=180)
    for i, case in enumerate(cases):
        _check(case, i, [r["world"][i] for r in results], cp, f"cp={cp} case {i}")
    if cp == 4:
        for members in ([0, 2], [1, 3]):
            for i, case in enumerate(_cases(2)[:2]):
                _check(case, i, [results[m]["sub"][i] for m in members], 2, f"sub-group {members} case {i}")


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("causal", [True, False])
def test_cp_size_one_needs_no_process_group(impl: str, causal: bool) -> None:
    case = Case((6, 4, 10), 4, 2, causal=causal)
    q, k, v, grad = _global_inputs(case, 0)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out = IMPLS[impl](
        qa, ka, va, case.cu_seqlens, group=None, cp_size=1, cp_rank=0, scale=None, causal=causal
    )
    out.backward(grad)
    expected = _reference(Case(case.seqlens, 4, 2, causal=causal), 0)
    for got, exp in zip((out, qa.grad, ka.grad, va.grad), expected):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    assert math.isfinite(out.sum().item())


def test_odd_local_length_is_rejected() -> None:
    q = torch.randn(6, 2, D)
    with pytest.raises(ValueError, match="local sequence 1 has length 3"):
        ring_attention_thd(q, q, q, torch.tensor([0, 2, 5, 6]), group=None, cp_size=1, cp_rank=0, scale=None)


# ----------------------------------------------------------------------------- run_distributed itself


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # rank 0 would wait here forever: run_distributed must not
    return rank


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        import time

        time.sleep(3600)
    return rank


@pytest.mark.multiproc
def test_run_distributed_reports_a_failing_rank() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)--- rank 1 ---.*ValueError: rank one says no"):
        run_distributed(_fail_on_rank_one, 2, timeout_s=60)


@pytest.mark.multiproc
def test_run_distributed_kills_a_hang() -> None:
    with pytest.raises(TimeoutError, match=r"ranks still running: \[(0, )?1\]"):
        run_distributed(_hang_on_rank_one, 2, timeout_s=5)
