"""Distributed audio encoding across CP ranks: shares, dummies, differentiable gather, CTC once.

Letters: B clips, N audio samples, U frames, C conv channels, H embedding width.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from parallel.dist_encode import cp_clip_ranges, encode_distributed, slice_extra
from parallel.fsdp import apply_fsdp
from parallel.testing import run_distributed

STRIDE = 4
DUMMY_LEN = 16
# (audio lengths in samples) per case: 3 clips over cp=2 (rank 1 gets one clip + a dummy),
# 1 clip (rank 1 encodes only a dummy), 4 clips (no dummy).
CASES = {"three": [40, 27, 33], "one": [21], "four": [12, 40, 8, 29]}


class TinyEncoder(nn.Module):
    """Conv1d with kernel = stride (so frames never see padding) then a Linear: U_i = N_i // 4."""

    def __init__(self, channels: int = 5, width: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, channels, kernel_size=STRIDE, stride=STRIDE)
        self.proj = nn.Linear(channels, width)

    def forward(self, audio_BN: Tensor, lens_B: Tensor) -> tuple[list[Tensor], tuple[Tensor, Tensor]]:
        hidden_BUC = torch.tanh(self.conv(audio_BN[:, None, :]).transpose(1, 2))
        out_lens_B = lens_B // STRIDE
        out_BUH = self.proj(hidden_BUC)
        return [out_BUH[i, : int(n)] for i, n in enumerate(out_lens_B)], (hidden_BUC, out_lens_B)


def build_case(name: str) -> tuple[TinyEncoder, Tensor, Tensor, list[Tensor]]:
    torch.manual_seed(0)
    enc = TinyEncoder()
    lens = CASES[name]
    audio_BN = torch.randn(len(lens), max(lens))
    for i, n in enumerate(lens):
        audio_BN[i, n:] = 0.0
    weights = [torch.randn(n // STRIDE, 6) for n in lens]  # fixed per-clip loss weights
    return enc, audio_BN, torch.tensor(lens), weights


def ctc_like(hidden_BUC: Tensor, lens_B: Tensor) -> Tensor:
    """Stand-in for an auxiliary CTC loss on the encoder hidden states of some clips."""
    return sum((hidden_BUC[i, : int(n)] ** 2).sum() for i, n in enumerate(lens_B)) + hidden_BUC.new_zeros(())


def rank_loss(embeds: list[Tensor], weights: list[Tensor], rank: int) -> Tensor:
    """The part of the loss one CP rank computes: every rank uses every clip's embeddings."""
    return sum(((rank + 1) * e * w).sum() for e, w in zip(embeds, weights)) + embeds[0].new_zeros(())


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    out: dict[str, Any] = {}
    for name, fsdp in [(n, False) for n in CASES] + [("three", True), ("one", True)]:
        enc, audio_BN, lens_B, weights = build_case(name)
        if fsdp:  # the encoder sharded over the CP ranks, as in training; needs the dummy on rank 1
            apply_fsdp(enc, mesh, blocks=[enc.conv], mp_policy=None)
        res = encode_distributed(
            enc,
            audio_BN,
            lens_B,
            group=dist.group.WORLD,
            cp_rank=rank,
            cp_size=world_size,
            dummy_len=DUMMY_LEN,
        )
        hidden_bUC, out_lens_b = res.local_extra
        ctc = ctc_like(hidden_bUC, out_lens_b)
        (rank_loss(res.embeds, weights, rank) + ctc).backward()
        grads = {k: (None if p.grad is None else p.grad) for k, p in enc.named_parameters()}
        if fsdp:  # FSDP2 averaged over the 2 ranks: undo it to get the sum
            grads = {k: g.full_tensor() * world_size for k, g in grads.items()}
        out[f"fsdp_{name}" if fsdp else name] = {
            "embeds": [e.detach() for e in res.embeds],
            "local_range": res.local_range,
            "has_dummy": res.dummy_extra is not None,
            "ctc": ctc.detach(),
            "grads": {k: (None if g is None else g.detach().clone()) for k, g in grads.items()},
        }
    return out


def reference(name: str, cp: int) -> dict[str, Any]:
    """Single process: all clips at once, the loss = sum over the cp ranks' parts + CTC on all clips."""
    enc, audio_BN, lens_B, weights = build_case(name)
    embeds, (hidden_BUC, out_lens_B) = enc(audio_BN, lens_B)
    ctc = ctc_like(hidden_BUC, out_lens_B)
    total = sum(rank_loss(embeds, weights, r) for r in range(cp)) + ctc
    total.backward()
    return {
        "embeds": [e.detach() for e in embeds],
        "ctc": ctc.detach(),
        "grads": {k: p.grad.clone() for k, p in enc.named_parameters()},
    }


def test_cp_clip_ranges() -> None:
    assert cp_clip_ranges(3, 2) == [range(0, 2), range(2, 3)]
    assert cp_clip_ranges(1, 2) == [range(0, 1), range(1, 1)]
    assert cp_clip_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert cp_clip_ranges(5, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 5)]
    assert cp_clip_ranges(0, 3) == [range(0, 0)] * 3
    assert cp_clip_ranges(7, 1) == [range(0, 7)]
    for num_clips in range(0, 12):
        for cp in range(1, 6):
            shares = cp_clip_ranges(num_clips, cp)
            assert [i for s in shares for i in s] == list(range(num_clips))  # contiguous, in order, once
            assert max(len(s) for s in shares) <= max(1, -(-num_clips // cp))
    with pytest.raises(ValueError, match="cp >= 1"):
        cp_clip_ranges(3, 0)


def test_slice_extra() -> None:
    pair = namedtuple("pair", "hidden lens")
    extra = {
        "h": torch.arange(6).view(3, 2),
        "parts": (torch.arange(3), [10, 11, 12]),
        "p": pair(torch.ones(3), None),
    }
    got = slice_extra(extra, slice(1, 3))
    assert torch.equal(got["h"], torch.tensor([[2, 3], [4, 5]]))
    assert torch.equal(got["parts"][0], torch.tensor([1, 2])) and got["parts"][1] == [11, 12]
    assert isinstance(got["p"], pair) and got["p"].hidden.shape == (2,) and got["p"].lens is None


def test_single_rank_needs_no_group() -> None:
    enc, audio_BN, lens_B, _ = build_case("three")
    res = encode_distributed(enc, audio_BN, lens_B, group=None, cp_rank=0, cp_size=1)
    ref = reference("three", 1)
    assert res.local_range == range(3) and res.dummy_extra is None
    for got, want in zip(res.embeds, ref["embeds"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.multiproc
def test_encode_distributed_cp2_matches_single_process() -> None:
    results = run_distributed(_worker, 2)
    for name in CASES:
        ref = reference(name, cp=2)
        per_rank = [r[name] for r in results]
        for r, got in enumerate(per_rank):
            assert len(got["embeds"]) == len(CASES[name])
            for e, want in zip(got["embeds"], ref["embeds"], strict=True):
                torch.testing.assert_close(e, want, rtol=1e-6, atol=1e-6)
            assert got["local_range"] == cp_clip_ranges(len(CASES[name]), 2)[r]
        # CTC on local clips only: each clip counted once across the CP group.
        torch.testing.assert_close(sum(g["ctc"] for g in per_rank), ref["ctc"], rtol=1e-5, atol=1e-6)
        # Every rank's encoder is in the graph (dummies with weight zero), and the CP sum of the
        # encoder gradients is the single-process gradient of the total loss.
        for key, want in ref["grads"].items():
            rank_grads = [g["grads"][key] for g in per_rank]
            assert all(g is not None for g in rank_grads), f"{name}: a rank got no gradient for {key}"
            torch.testing.assert_close(sum(rank_grads), want, rtol=1e-5, atol=1e-5)
    assert [r["three"]["has_dummy"] for r in results] == [False, True]
    # B=1: rank 1 only ran a dummy; its gradient is exactly zero (weight zero), not missing.
    assert all(torch.count_nonzero(g) == 0 for g in results[1]["one"]["grads"].values())
    # Encoder under FSDP2 over the CP ranks: no hang with a dummy-only rank; the averaged gradient
    # times cp is the single-process gradient of the total loss.
    for name in ("three", "one"):
        ref = reference(name, cp=2)
        for got in results:
            for key, want in ref["grads"].items():
                torch.testing.assert_close(got[f"fsdp_{name}"]["grads"][key], want, rtol=1e-5, atol=1e-5)
