"""Attention under hybrid CP degrees (`parallel.cp_attention.attention_by_degree`) vs the single-process
varlen reference, gloo: world 4 (degrees 1, 2, 4) and world 8 (1, 2, 8; `slow`), ring and all-gather,
and the transformer-engine backend (`HybridAttention.run`: one TE core per sub-group) over a stand-in
that computes TE's THD-CP contract with our ring (`te_stub.install_fake_te`), with the aligned sub-groups
built as at mesh setup (`ParallelDims.build_cp_subgroups`).

Letters: T tokens, H heads, G key/value heads, D head dim.

Each rank builds the same seeded q/k/v and upstream gradient of the whole padded stream, keeps its rows of
every degree segment of `place_hybrid`'s plan (`HybridPlacement.segments`, each degree-d segment sharded
over its sub-group by `shard_thd`), runs forward and backward, and returns its rows' global indices with its
out/dq/dk/dv; the parent compares them with the same rows of the reference (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from te_stub import install_fake_te, thd_kwargs

from parallel.attention_ops import varlen_attention_reference
from parallel.cp_attention import attention_by_degree
from parallel.cp_placement import HybridPlacement, place_hybrid
from parallel.cp_shard import shard_by_degree, shard_thd
from parallel.hybrid_layout import HybridAttention
from parallel.mesh import ParallelDims
from parallel.testing import run_distributed
from speechlm.model.attention.te import attend_te

H, G, D = 4, 2, 8
KINDS = ("ring", "allgather", "te")  # te: `speechlm.model.attention.te` over `te_stub`'s stand-in
LENGTHS = {
    4: [22, 23, 24, 25, 21, 26, 19],
    8: [22, 23, 24, 25, 21, 26, 19, 27, 20, 18, 22, 24, 23],
}


def _stream(p: HybridPlacement) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """Start row of each padded sequence in the global stream, and its seeded q, k, v, upstream grad."""
    starts = [0]
    for n in p.padded:
        starts.append(starts[-1] + n)
    g = torch.Generator().manual_seed(7)
    t = starts[-1]
    tensors = (torch.randn(t, H, D, generator=g), torch.randn(t, G, D, generator=g))
    tensors += (torch.randn(t, G, D, generator=g), torch.randn(t, H, D, generator=g))
    return starts, tensors


def _local_rows(p: HybridPlacement, starts: list[int], rank: int) -> tuple[torch.Tensor, list]:
    """Rank's global row indices, segment by segment (`shard_by_degree`), and the segments' local host
    boundaries."""
    by_segment = [(d, [p.padded[i] for i in seqs]) for d, seqs in p.segments(rank)]
    order = [i for _, seqs in p.segments(rank) for i in seqs]
    rows = [torch.arange(starts[i], starts[i] + p.padded[i]) for i in order]
    local, segments = shard_by_degree({"idx": torch.cat(rows)}, by_segment, rank)
    return local["idx"], segments


def _attend_te(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: HybridAttention) -> torch.Tensor:
    """The te backend over the local stream, with the stand-in that computes TE's THD-CP contract."""
    from _pytest.monkeypatch import MonkeyPatch

    mp = MonkeyPatch()
    install_fake_te(mp, compute=True)
    cu = [0]
    for _, seg in ctx.segments:
        cu += [cu[-1] + c for c in seg[1:]]
    out, _ = attend_te(
        None,
        *(x.transpose(0, 1)[None] for x in (q, k, v)),
        None,
        scaling=D**-0.5,
        cp_context=ctx,
        **thd_kwargs(cu),
    )
    mp.undo()
    return out[0]


def _worker(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    cp = world_size
    groups = ParallelDims(world_size, cp=cp).build_cp_subgroups(rank)
    groups[cp] = None  # the default group is the CP group here
    p = place_hybrid(LENGTHS[cp], cp)
    starts, (q, k, v, grad) = _stream(p)
    idx, segments = _local_rows(p, starts, rank)
    out = {"idx": [idx]}
    for kind in KINDS:
        ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
        if kind == "te":  # one TE core per sub-group, each segment with its global boundaries
            ctx = HybridAttention(segments, groups, cp, rank, "ring", list(range(cp)), torch.device("cpu"))
            o = _attend_te(ql, kl, vl, ctx)
        else:
            o = attention_by_degree(ql, kl, vl, segments, groups, rank, kind, D**-0.5)
        o.backward(grad[idx])
        out[kind] = [x.detach() for x in (o, ql.grad, kl.grad, vl.grad)]
    return out


def _check(cp: int) -> None:
    p = place_hybrid(LENGTHS[cp], cp)
    assert {1, 2, cp} <= set(p.degree)  # whole, pairs and the whole group in one micro-batch
    starts, (q, k, v, grad) = _stream(p)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    cu = torch.tensor(starts, dtype=torch.int32)
    ref = varlen_attention_reference(q, k, v, cu, cu, causal=True, scale=D**-0.5)
    ref.backward(grad)
    expected = [ref.detach(), q.grad, k.grad, v.grad]
    per_rank = run_distributed(_worker, cp, "gloo", timeout_s=240)
    seen = torch.cat([r["idx"][0] for r in per_rank])
    assert sorted(seen.tolist()) == list(range(starts[-1]))  # every row on exactly one rank
    for r in per_rank:
        for kind in KINDS:
            for name, got, want in zip(("out", "dq", "dk", "dv"), r[kind], expected, strict=True):
                err = (got - want[r["idx"][0]]).abs().max().item()
                assert err <= 1e-5, f"cp {cp} {kind} {name}: max abs error {err:.3g}"


@pytest.mark.multiproc
def test_attention_by_degree_matches_the_reference_at_world_4() -> None:
    _check(4)


@pytest.mark.multiproc
@pytest.mark.slow
def test_attention_by_degree_matches_the_reference_at_world_8() -> None:
    _check(8)


def test_every_rank_creates_the_sub_groups_in_one_order() -> None:
    dims = ParallelDims(16, cp=4, tp=2)
    groups = dims.cp_subgroup_ranks()
    assert groups == [(2, [0, 2]), (2, [4, 6]), (2, [1, 3]), (2, [5, 7]),
                      (2, [8, 10]), (2, [12, 14]), (2, [9, 11]), (2, [13, 15])]  # fmt: skip
    assert [d for d, _ in ParallelDims(8, cp=8).cp_subgroup_ranks()] == [4, 4, 2, 2, 2, 2]
    assert ParallelDims(4, cp=2, tp=2).cp_subgroup_ranks() == [] == ParallelDims(4).cp_subgroup_ranks()


def test_shard_by_degree_keeps_each_rank_its_chunks_of_every_segment() -> None:
    p = place_hybrid(LENGTHS[8], 8)
    starts, _ = _stream(p)
    seen = []
    for rank in range(8):
        idx, segments = _local_rows(p, starts, rank)
        assert [d for d, _ in segments] == [8, 4, 2, 1]  # largest first, the whole part last
        assert sum(cu[-1] for _, cu in segments if cu) == idx.numel() == p.local_tokens(rank)
        pos = 0
        for d, seqs in p.segments(rank):  # each degree-d segment: the rows shard_thd keeps
            if not seqs:
                continue
            rows = torch.cat([torch.arange(starts[i], starts[i] + p.padded[i]) for i in seqs])
            cu = torch.tensor(
                [0, *torch.tensor([p.padded[i] for i in seqs]).cumsum(0).tolist()], dtype=torch.int32
            )
            want = shard_thd(rows, cu, d, rank % d)[0] if d > 1 else rows
            assert torch.equal(idx[pos : pos + want.numel()], want)
            pos += want.numel()
        seen += idx.tolist()
    assert sorted(seen) == list(range(starts[-1]))
    with pytest.raises(ValueError, match="must divide by 4"):
        shard_by_degree({"x": torch.zeros(6)}, [(2, [6])], 0)
    with pytest.raises(ValueError, match="the segments hold 8"):
        shard_by_degree({"x": torch.zeros(9)}, [(2, [8])], 0)
