"""The transformer-engine backend under context parallelism, with a stand-in for transformer-engine
(it cannot be installed here): what we pass TE (the CP group set once per core with the p2p ring, the
split sequences' *global* cu_seqlens with this rank's local tokens, dynamic CP's whole sequences
through a CP-free core, training mode), and, on 2 gloo ranks, a stand-in that computes TE's THD-CP
contract (global boundaries, dual-chunk-swap layout) with our own ring gives the single-process
attention forward and backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from te_stub import install_te_module

from parallel.cp_attention import CPAttention
from parallel.testing import run_distributed
from parallel.varlen import build_varlen_meta, varlen_attention
from speechlm.model.attention.te import _CORES, attend_te

H, G, D, SCALE = 4, 2, 8, 0.3


def install_fake_te(monkeypatch: Any, compute: bool) -> dict[str, list]:
    """A fake ``transformer_engine.pytorch.DotProductAttention`` recording every call. With ``compute`` its
    CP forward follows TE's THD contract through `parallel.ring_attention` and its plain forward is one
    varlen call; otherwise it returns zeros."""
    log: dict[str, list] = {"init": [], "set_cp": [], "calls": []}

    class FakeDPA(torch.nn.Module):
        def __init__(self, **kw: Any):
            super().__init__()
            log["init"].append(kw)
            self.kw, self.cp = kw, None

        def set_context_parallel_group(self, group, ranks, stream, comm_type):
            log["set_cp"].append((group, list(ranks), stream, comm_type))
            self.cp = (group, list(ranks))

        def forward(self, q, k, v, **kw):
            log["calls"].append(dict(cp=self.cp is not None, training=self.training, tokens=q.shape[0], **kw))
            assert kw["qkv_format"] == "thd" and kw["attn_mask_type"] == "padding_causal"
            cu = kw["cu_seqlens_q"]
            assert cu.dtype == torch.int32 and torch.equal(cu, kw["cu_seqlens_kv"])
            if not compute:
                return q.new_zeros(q.shape[0], q.shape[1] * v.shape[2])
            scale = self.kw["softmax_scale"]
            if self.cp is None:
                out = varlen_attention(q, k, v, build_varlen_meta(cu.tolist()), causal=True, scale=scale)
            else:
                import torch.distributed as dist

                from parallel.ring_attention import ring_attention_thd

                group, ranks = self.cp
                cp = len(ranks)
                assert max(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:])) == kw["max_seqlen_q"]
                out = ring_attention_thd(
                    q, k, v, cu // cp, group=group, cp_size=cp, cp_rank=dist.get_rank(group), scale=scale
                )
            return out.reshape(q.shape[0], -1)

    install_te_module(monkeypatch, FakeDPA)
    return log


def _thd_kwargs(cu: list[int]) -> dict[str, Any]:
    t = torch.tensor(cu, dtype=torch.int32)
    m = max(b - a for a, b in zip(cu, cu[1:]))
    return dict(cu_seq_lens_q=t, cu_seq_lens_k=t, max_length_q=m, max_length_k=m)


def test_te_gets_the_cp_group_once_and_the_global_boundaries_of_the_split_sequences(monkeypatch):
    log = install_fake_te(monkeypatch, compute=False)
    # cp=2, rank 0 of a group of global ranks [0, 1]: two split sequences (global 8 and 12 tokens: local
    # 4 and 6) then two whole sequences of this rank (5 and 3 tokens)
    local_cu = [0, 4, 10, 15, 18]
    cp = CPAttention(None, 2, 0, "ring").for_split_prefix(2, build_varlen_meta(local_cu))
    T = local_cu[-1]
    q, k = torch.randn(1, H, T, D), torch.randn(1, G, T, D)
    layer = torch.nn.Linear(1, 1)
    for mode in (True, False):  # a training and an evaluation step
        out, _ = attend_te(
            layer.train(mode), q, k, k, None, scaling=SCALE, cp_context=cp, **_thd_kwargs(local_cu)
        )
        assert out.shape == (1, T, H, D)
    assert log["set_cp"] == [(None, [0, 1], None, "p2p")]  # once, on the cached CP core
    assert len(log["init"]) == 2  # one CP core, one CP-free core for the whole sequences
    split, whole = log["calls"][0], log["calls"][1]
    assert split["cp"] and split["tokens"] == 10
    assert split["cu_seqlens_q"].tolist() == [0, 8, 20]  # global: local x cp
    assert split["max_seqlen_q"] == 12
    assert not whole["cp"] and whole["tokens"] == 8
    assert whole["cu_seqlens_q"].tolist() == [0, 5, 8] and whole["max_seqlen_q"] == 5
    assert [c["training"] for c in log["calls"]] == [True, True, False, False]  # follows the module
    _CORES.clear()


def test_te_refuses_allgather_cp_with_the_fix(monkeypatch):
    install_fake_te(monkeypatch, compute=False)
    cp = CPAttention(None, 2, 0, "allgather").for_split_prefix(1, build_varlen_meta([0, 4]))
    q = torch.randn(1, H, 4, D)
    with pytest.raises(ValueError, match="parallel.cp_attention=ring"):
        attend_te(None, q, q[:, :G], q[:, :G], None, scaling=SCALE, cp_context=cp, **_thd_kwargs([0, 4]))
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
        **_thd_kwargs(cl),
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
