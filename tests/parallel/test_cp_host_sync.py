"""Under CP no attention layer reads the pack's boundaries back from the device: the ring's step plans
(or the all-gather's local boundaries) are built once per micro-batch from host integers
(`CPAttention.prepare`, held by `PlacedCPAttention`) and handed to every layer.

One process (cp_size 1, no process group): the layer's cu_seqlens tensor raises on any read to the
host, and the result must still equal plain varlen attention, forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from parallel.cp_attention import CPAttention
from parallel.varlen import build_varlen_meta, varlen_attention


class NoHostReads(torch.Tensor):
    """A cu_seqlens tensor that fails the test if anything reads it to the host."""

    def tolist(self):  # type: ignore[override]
        raise AssertionError("a layer read cu_seqlens to the host (a device sync per layer)")

    def item(self):  # type: ignore[override]
        raise AssertionError("a layer read cu_seqlens to the host (a device sync per layer)")

    def __iter__(self):
        raise AssertionError("a layer iterated cu_seqlens on the host")


@pytest.mark.parametrize("kind", ["ring", "allgather"])
def test_layers_read_no_boundaries_from_the_device(kind):
    torch.manual_seed(0)
    cu = [0, 6, 10, 18, 22]
    T, H, G, D = cu[-1], 4, 2, 8
    q = torch.randn(T, H, D, dtype=torch.float32, requires_grad=True)
    k = torch.randn(T, G, D, dtype=torch.float32, requires_grad=True)
    v = torch.randn(T, G, D, dtype=torch.float32, requires_grad=True)
    meta = build_varlen_meta(cu)  # the one read per micro-batch
    placed = CPAttention(None, 1, 0, kind).for_split_prefix(len(cu) - 1, meta)
    cu_layer = torch.tensor(cu, dtype=torch.int32).as_subclass(NoHostReads)
    for _ in range(3):  # three layers
        out = placed.attention(q, k, v, cu_layer, None)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = varlen_attention(q, k, v, meta, causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad)
