"""The transformer-engine backend under context parallelism, with a stand-in for transformer-engine
(it cannot be installed here, `te_stub.install_fake_te`): what we pass TE (the CP group set once per
core with the p2p ring, the split sequences' *global* cu_seqlens with this rank's local tokens, dynamic
CP's whole sequences through a CP-free core, training mode; under hybrid degrees one core per sub-group,
each degree's segment with its own global boundaries, the output rows in place), and, on 2 gloo ranks,
a stand-in that computes TE's THD-CP contract (global boundaries, dual-chunk-swap layout) with our own
ring gives the single-process attention forward and backward."""

from __future__ import annotations

import pytest
import torch
from te_stub import install_fake_te, thd_kwargs

from parallel.cp_attention import CPAttention
from parallel.hybrid_layout import HybridAttention, HybridCPLayout
from parallel.mesh import ParallelDims
from parallel.testing import run_distributed
from parallel.varlen import build_varlen_meta, varlen_attention
from speechlm.model.attention.te import _CORES, attend_te

H, G, D, SCALE = 4, 2, 8, 0.3


def _assert_rows_from_cores(ctx, local_cu: list[int], group_size_per_row: list[int]) -> None:
    """attend_te over a stream with these boundaries, in a training and an evaluation step: with the fake
    (``compute=False``: ``q`` plus its core's CP group size) each output row is its input row plus the
    group size of the core that should have produced it."""
    T = local_cu[-1]
    q, k = torch.randn(1, H, T, D), torch.randn(1, G, T, D)
    tag = torch.tensor(group_size_per_row, dtype=q.dtype)[None, :, None, None]
    layer = torch.nn.Linear(1, 1)
    for mode in (True, False):
        out, _ = attend_te(
            layer.train(mode), q, k, k, None, scaling=SCALE, cp_context=ctx, **thd_kwargs(local_cu)
        )
        assert torch.equal(out, q.transpose(1, 2) + tag)


def test_te_gets_the_cp_group_once_and_the_global_boundaries_of_the_split_sequences(monkeypatch):
    log = install_fake_te(monkeypatch, compute=False)
    # cp=2, rank 0 of a group of global ranks [0, 1]: two split sequences (global 8 and 12 tokens: local
    # 4 and 6) then two whole sequences of this rank (5 and 3 tokens)
    local_cu = [0, 4, 10, 15, 18]
    cp = CPAttention(None, 2, 0, "ring").for_split_prefix(2, build_varlen_meta(local_cu))
    # the fake adds its core's CP group size to q: rows 0-9 from the CP core, 10- from the CP-free one
    _assert_rows_from_cores(cp, local_cu, [2] * 10 + [0] * 8)
    assert log["set_cp"] == [(None, [0, 1], None, "p2p")]  # once, on the cached CP core
    assert len(log["init"]) == 2  # one CP core, one CP-free core for the whole sequences
    split, whole = log["calls"][0], log["calls"][1]
    assert split["cp"] == [0, 1] and split["tokens"] == 10
    assert split["cu_seqlens_q"].tolist() == [0, 8, 20]  # global: local x cp
    assert split["max_seqlen_q"] == 12
    assert not whole["cp"] and whole["tokens"] == 8
    assert whole["cu_seqlens_q"].tolist() == [0, 5, 8] and whole["max_seqlen_q"] == 5
    assert [c["training"] for c in log["calls"]] == [True, True, False, False]  # follows the module
    _CORES.clear()


def test_te_runs_each_hybrid_degree_segment_on_the_core_of_its_sub_group(monkeypatch):
    """Hybrid degrees at cp 4, CP rank 3, local degrees [4, 2, 2, 1, 1]: the degree-4 sequence goes to a core
    over the whole CP group, the degree-2 pair to a core over this rank's pair (CP ranks 2 and 3), each
    with its global boundaries (local x d); the whole sequences to the CP-free core; every output row
    comes from its segment's core; one core per group, its group set once."""
    log = install_fake_te(monkeypatch, compute=False)
    g4, g2 = object(), object()  # the CP group and this rank's degree-2 sub-group, opaque to the model
    layout = HybridCPLayout(group=g4, cp_size=4, cp_rank=3, kind="ring", subgroups={2: g2})
    # degree 4: global 16 (local 4); degree 2: global 8 and 12 (local 4, 6); whole: 5 and 3
    local_cu = [0, 4, 8, 14, 19, 22]
    ctx = layout.attention_context(build_varlen_meta(local_cu), 3, (4, 2, 2, 1, 1))
    # rows 0-3 from the core over the group of 4, 4-13 over the pair, 14- from the CP-free core
    _assert_rows_from_cores(ctx, local_cu, [4] * 4 + [2] * 10 + [0] * 8)
    assert log["set_cp"] == [(g4, [0, 1, 2, 3], None, "p2p"), (g2, [2, 3], None, "p2p")]
    assert len(log["init"]) == 3  # a core per CP group, and the CP-free one
    got = [(c["cp"], c["tokens"], c["cu_seqlens_q"].tolist(), c["max_seqlen_q"]) for c in log["calls"][:3]]
    assert got == [([0, 1, 2, 3], 4, [0, 16], 16), ([2, 3], 10, [0, 8, 20], 12), (None, 8, [0, 5, 8], 5)]
    assert [c["training"] for c in log["calls"]] == [True] * 3 + [False] * 3
    _CORES.clear()


def test_hybrid_sub_groups_are_the_mesh_groups_and_an_empty_degree_calls_no_core(monkeypatch):
    """With tp 2 the CP group of tp rank 1 is global ranks [1, 3, 5, 7]: each CP rank's pair is the one
    `ParallelDims.cp_subgroup_ranks` creates. A micro-batch without a degree-4 sequence makes no call over
    the whole group (the members of each group hold the same segments and skip it together)."""
    cp_ranks = [1, 3, 5, 7]
    pairs = [r for d, r in ParallelDims(16, cp=4, tp=2).cp_subgroup_ranks() if d == 2]
    log = install_fake_te(monkeypatch, compute=False)
    segments, cpu = [(4, []), (2, [0, 4]), (1, [0, 2])], torch.device("cpu")
    for cp_rank in range(4):
        ctx = HybridAttention(segments, {2: None, 4: None}, 4, cp_rank, "ring", cp_ranks, cpu)
        assert ctx.subgroup_ranks(2) in pairs and cp_ranks[cp_rank] in ctx.subgroup_ranks(2)
        assert ctx.subgroup_ranks(4) == cp_ranks
        q = torch.randn(1, H, 6, D)
        attend_te(None, q, q[:, :G], q[:, :G], None, scaling=SCALE, cp_context=ctx, **thd_kwargs([0, 4, 6]))
        split = ctx.parts[1]
        assert (split.cp_size, split.cp_rank, split.global_ranks) == (
            2,
            cp_rank % 2,
            tuple(ctx.subgroup_ranks(2)),
        )
    assert [c["cp"] for c in log["calls"][::2]] == [[1, 3], [1, 3], [5, 7], [5, 7]]
    assert [c["cp"] for c in log["calls"][1::2]] == [None] * 4
    with pytest.raises(ValueError, match="4 ranks has 2 global ranks"):
        HybridAttention([], {}, 4, 0, "ring", [0, 1], cpu)
    gathered = HybridAttention(segments, {2: None, 4: None}, 4, 0, "allgather", cp_ranks, cpu)
    with pytest.raises(ValueError, match="parallel.cp_attention=ring"):  # TE has no THD all-gather CP
        attend_te(
            None, q, q[:, :G], q[:, :G], None, scaling=SCALE, cp_context=gathered, **thd_kwargs([0, 4, 6])
        )
    _CORES.clear()


def test_te_refuses_allgather_cp_with_the_fix(monkeypatch):
    install_fake_te(monkeypatch, compute=False)
    cp = CPAttention(None, 2, 0, "allgather").for_split_prefix(1, build_varlen_meta([0, 4]))
    q = torch.randn(1, H, 4, D)
    with pytest.raises(ValueError, match="parallel.cp_attention=ring"):
        attend_te(None, q, q[:, :G], q[:, :G], None, scaling=SCALE, cp_context=cp, **thd_kwargs([0, 4]))
    _CORES.clear()


def _te_cp_rank(rank: int, world: int) -> dict[str, float]:
    """Split sequences (the same on both ranks) plus whole sequences of this rank only, through attend_te
    with the computing stand-in; compared with one process's attention on the rank's rows."""
    import torch.distributed as dist
    from _pytest.monkeypatch import MonkeyPatch

    from parallel.cp_shard import cp_shard_indices_thd, shard_placed_thd

    mp = MonkeyPatch()
    install_fake_te(mp, compute=True)
    torch.manual_seed(0)
    split_lens, whole_lens = [8, 4, 12], [[5, 3], [7]][rank]
    n_split, lens = len(split_lens), split_lens + whole_lens
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    t_split = int(cu[n_split])
    gen = torch.Generator().manual_seed(1)  # the split part: identical on every rank
    split = [torch.randn(t_split, h, D, generator=gen) for h in (H, G, G, H)]
    gen_r = torch.Generator().manual_seed(10 + rank)  # this rank's whole sequences
    whole = [torch.randn(int(cu[-1]) - t_split, h, D, generator=gen_r) for h in (H, G, G, H)]
    full = {n: torch.cat([a, b]) for n, a, b in zip("qkvd", split, whole)}

    # one process: the split sequences in full, the rank's whole ones, with the same upstream gradient
    ref = {n: full[n].clone().requires_grad_(True) for n in "qkv"}
    out_ref = varlen_attention(
        ref["q"], ref["k"], ref["v"], build_varlen_meta(cu.tolist()), causal=True, scale=SCALE
    )
    out_ref.backward(full["d"])

    parts, cu_local, _ = shard_placed_thd(full, cu, n_split, world, rank)
    rows = torch.cat(
        [cp_shard_indices_thd(cu[: n_split + 1], world, rank), torch.arange(t_split, int(cu[-1]))]
    )
    local = {n: parts[n].clone().requires_grad_(True) for n in "qkv"}
    cp = CPAttention(dist.group.WORLD, world, rank, "ring").for_split_prefix(
        n_split, build_varlen_meta(cu_local)
    )
    cl = cu_local.tolist()
    out, _ = attend_te(
        None,
        *(local[n].transpose(0, 1)[None] for n in "qkv"),
        None,
        scaling=SCALE,
        cp_context=cp,
        **thd_kwargs(cl),
    )
    out[0].backward(parts["d"])
    mp.undo()
    err = {"out": (out[0] - out_ref.detach()[rows]).abs().max().item()}
    for n in "qkv":
        err["d" + n] = (local[n].grad - ref[n].grad[rows]).abs().max().item()
    return err


@pytest.mark.multiproc
def test_te_cp_path_on_two_ranks_equals_one_process():
    for errs in run_distributed(_te_cp_rank, 2, "gloo", timeout_s=180):
        assert max(errs.values()) < 1e-5, errs
