"""Stand in for transformer-engine (it cannot be installed on the CPU machine): one place that puts a fake
``transformer_engine.pytorch`` module, holding a given ``DotProductAttention`` class, into
``sys.modules`` and empties the te backend's core cache, so the next `attend_te` builds its core from it;
and the recording fake that the CP tests install (`install_fake_te`)."""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from parallel.varlen import build_varlen_meta, varlen_attention


def install_te_module(monkeypatch: Any, dot_product_attention: type) -> None:
    """Install the fake module through ``monkeypatch`` (undone with it) and clear the cached cores."""
    from speechlm.model.attention.te import _CORES

    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.DotProductAttention = dot_product_attention  # type: ignore[attr-defined]
    te_root = types.ModuleType("transformer_engine")
    te_root.pytorch = te_pt  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", te_root)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    _CORES.clear()


def install_fake_te(monkeypatch: Any, compute: bool) -> dict[str, list]:
    """A fake ``transformer_engine.pytorch.DotProductAttention`` recording every construction, every
    ``set_context_parallel_group`` and every call (with the core's CP group's global ranks, None for a
    CP-free core). With ``compute`` its CP forward follows TE's THD contract (global boundaries, this
    rank's dual-chunk-swap rows, its rank in the group) through `parallel.ring_attention` and its plain
    forward is one varlen call; otherwise it returns ``q`` plus the size of its CP group (0 for a CP-free
    core), so a test can tell which core produced each row."""
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
            ranks = self.cp[1] if self.cp is not None else None
            log["calls"].append(dict(cp=ranks, training=self.training, tokens=q.shape[0], **kw))
            assert kw["qkv_format"] == "thd" and kw["attn_mask_type"] == "padding_causal"
            cu = kw["cu_seqlens_q"]
            assert cu.dtype == torch.int32 and torch.equal(cu, kw["cu_seqlens_kv"])
            assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == int((cu[1:] - cu[:-1]).max())
            if not compute:
                return (q + (len(ranks) if ranks else 0)).reshape(q.shape[0], -1)
            scale = self.kw["softmax_scale"]
            if self.cp is None:
                out = varlen_attention(q, k, v, build_varlen_meta(cu.tolist()), causal=True, scale=scale)
            else:
                import torch.distributed as dist  # lazy: only the computing fake runs inside a group

                from parallel.ring_attention import ring_attention_thd

                group, ranks = self.cp
                cp = len(ranks)
                if group is not None:  # TE sends to these global ranks: they must be the group's
                    assert list(dist.get_process_group_ranks(group)) == ranks
                rank = dist.get_rank(group)
                out = ring_attention_thd(
                    q, k, v, cu // cp, group=group, cp_size=cp, cp_rank=rank, scale=scale
                )
            return out.reshape(q.shape[0], -1)

    install_te_module(monkeypatch, FakeDPA)
    return log


def thd_kwargs(cu: list[int]) -> dict[str, Any]:
    """The model's THD keyword arguments for a packed stream with host boundaries ``cu``."""
    t = torch.tensor(cu, dtype=torch.int32)
    m = max(b - a for a, b in zip(cu, cu[1:]))
    return dict(cu_seq_lens_q=t, cu_seq_lens_k=t, max_length_q=m, max_length_k=m)
