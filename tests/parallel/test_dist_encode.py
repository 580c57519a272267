"""Placed audio encoding across CP ranks (`parallel.dist_encode.encode_placed`): owners, dummies,
differentiable gather of the split sequences' clips, whole clips kept on their owner, CTC once.

Letters: B clips, N audio samples, U frames, C conv channels, H embedding width.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from parallel.cp_layout import NullCPLayout
from parallel.dist_encode import encode_placed
from parallel.fsdp import apply_fsdp
from parallel.testing import run_distributed

STRIDE = 4
DUMMY_LEN = 16
# per case: (audio lengths in samples, the CP rank that encodes each clip, whether it is gathered).
# "three": every clip gathered, uneven owners; "one": rank 1 encodes only a dummy; "four": every clip
# gathered; "mixed": two gathered clips and two whole ones that stay on their owner.
CASES = {
    "three": ([40, 27, 33], [0, 0, 1], [True, True, True]),
    "one": ([21], [0], [True]),
    "four": ([12, 40, 8, 29], [0, 1, 0, 1], [True, True, True, True]),
    "mixed": ([12, 40, 8, 29], [1, 0, 0, 1], [True, False, True, False]),
}


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


def build_case(name: str, cases: dict[str, Any] = CASES) -> tuple[TinyEncoder, Tensor, Tensor, list[Tensor]]:
    torch.manual_seed(0)
    enc = TinyEncoder()
    lens = cases[name][0]
    audio_BN = torch.randn(len(lens), max(lens))
    for i, n in enumerate(lens):
        audio_BN[i, n:] = 0.0
    weights = [torch.randn(n // STRIDE, 6) for n in lens]  # fixed per-clip loss weights
    return enc, audio_BN, torch.tensor(lens), weights


def ctc_like(hidden_BUC: Tensor, lens_B: Tensor) -> Tensor:
    """Stand-in for an auxiliary CTC loss on the encoder hidden states of some clips."""
    return sum((hidden_BUC[i, : int(n)] ** 2).sum() for i, n in enumerate(lens_B)) + hidden_BUC.new_zeros(())


def on_rank(name: str, rank: int) -> list[int]:
    """The clips whose embeddings rank ``rank`` holds: the gathered ones and its own whole ones."""
    _, owners, gathered = CASES[name]
    return [i for i, (o, g) in enumerate(zip(owners, gathered)) if g or o == rank]


def rank_loss(embeds: list[Tensor | None], weights: list[Tensor], clips: list[int], rank: int) -> Tensor:
    """The part of the loss one CP rank computes, from the clips it holds."""
    parts = [((rank + 1) * e * weights[i]).sum() for i in clips if (e := embeds[i]) is not None]
    return sum(parts) + weights[0].new_zeros(())


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    out: dict[str, Any] = {}
    for name, fsdp in [(n, False) for n in CASES] + [("three", True), ("one", True)]:
        enc, audio_BN, lens_B, weights = build_case(name)
        _, owners, gathered = CASES[name]
        if fsdp:  # the encoder sharded over the CP ranks, as in training; needs the dummy on rank 1
            apply_fsdp(enc, mesh, blocks=[enc.conv], mp_policy=None)
        res = encode_placed(
            enc,
            audio_BN,
            lens_B,
            owners=owners,
            gathered=gathered,
            group=dist.group.WORLD,
            cp_rank=rank,
            cp_size=world_size,
            dummy_len=DUMMY_LEN,
        )
        hidden_bUC, out_lens_b = res.extra
        ctc = ctc_like(hidden_bUC, out_lens_b) * res.weight
        (rank_loss(res.embeds, weights, on_rank(name, rank), rank) + ctc).backward()
        grads = {k: (None if p.grad is None else p.grad) for k, p in enc.named_parameters()}
        if fsdp:  # FSDP2 averaged over the 2 ranks: undo it to get the sum
            grads = {k: g.full_tensor() * world_size for k, g in grads.items()}
        out[f"fsdp_{name}" if fsdp else name] = {
            "embeds": [None if e is None else e.detach() for e in res.embeds],
            "clips": res.clips,
            "weight": res.weight,
            "ctc": ctc.detach(),
            "grads": {k: (None if g is None else g.detach().clone()) for k, g in grads.items()},
        }
    return out


def reference(name: str, cp: int) -> dict[str, Any]:
    """Single process: all clips at once, the loss = sum over the cp ranks' parts + CTC on all clips."""
    enc, audio_BN, lens_B, weights = build_case(name)
    embeds, (hidden_BUC, out_lens_B) = enc(audio_BN, lens_B)
    ctc = ctc_like(hidden_BUC, out_lens_B)
    total = sum(rank_loss(list(embeds), weights, on_rank(name, r), r) for r in range(cp)) + ctc
    total.backward()
    return {
        "embeds": [e.detach() for e in embeds],
        "ctc": ctc.detach(),
        "grads": {k: p.grad.clone() for k, p in enc.named_parameters()},
    }


def test_null_layout_encodes_every_clip_in_one_call() -> None:
    enc, audio_BN, lens_B, _ = build_case("three")
    layout = NullCPLayout()
    res = layout.encode(enc, audio_BN, lens_B, layout.place([5, 6, 7]))
    ref = reference("three", 1)
    assert res.clips == [0, 1, 2] and res.weight == 1.0
    for got, want in zip(res.embeds, ref["embeds"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.multiproc
def test_encode_placed_cp2_matches_single_process() -> None:
    results = run_distributed(_worker, 2)
    for name, (lens, owners, _) in CASES.items():
        ref = reference(name, cp=2)
        per_rank = [r[name] for r in results]
        for r, got in enumerate(per_rank):
            assert len(got["embeds"]) == len(lens)
            for i, (e, want) in enumerate(zip(got["embeds"], ref["embeds"], strict=True)):
                if i in on_rank(name, r):
                    torch.testing.assert_close(e, want, rtol=1e-6, atol=1e-6)
                else:  # a whole clip of the other rank never comes here
                    assert e is None
            mine = [i for i, o in enumerate(owners) if o == r]
            assert sorted(got["clips"]) == mine and got["weight"] == (1.0 if mine else 0.0)
        # CTC on local clips only: each clip counted once across the CP group.
        torch.testing.assert_close(sum(g["ctc"] for g in per_rank), ref["ctc"], rtol=1e-5, atol=1e-6)
        # Every rank's encoder is in the graph (dummies with weight zero), and the CP sum of the
        # encoder gradients is the single-process gradient of the total loss.
        for key, want in ref["grads"].items():
            rank_grads = [g["grads"][key] for g in per_rank]
            assert all(g is not None for g in rank_grads), f"{name}: a rank got no gradient for {key}"
            torch.testing.assert_close(sum(rank_grads), want, rtol=1e-5, atol=1e-5)
    # B=1: rank 1 only ran a dummy; its gradient is exactly zero (weight zero), not missing.
    assert results[1]["one"]["clips"] == [] and results[1]["one"]["weight"] == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in results[1]["one"]["grads"].values())
    # Encoder under FSDP2 over the CP ranks: no hang with a dummy-only rank; the averaged gradient
    # times cp is the single-process gradient of the total loss.
    for name in ("three", "one"):
        ref = reference(name, cp=2)
        for got in results:
            for key, want in ref["grads"].items():
                torch.testing.assert_close(got[f"fsdp_{name}"]["grads"][key], want, rtol=1e-5, atol=1e-5)


# hybrid CP degrees at cp 4 (issue 40): per case (audio lengths, owners, gather groups (first, d); d = 1:
# whole on its owner). "nested": a clip over all four ranks, one over each pair; "one-pair": only ranks
# 0-1 gather at degree 2 (ranks 2-3 skip that level), rank 3 owns no clip with audio but still takes the
# degree-4 gather.
SUB_CASES = {
    "nested": (
        [40, 27, 33, 21, 12, 16],
        [0, 1, 3, 2, 2, 3],
        [(0, 4), (0, 2), (2, 2), (2, 1), (2, 2), (3, 1)],
    ),
    "one-pair": ([40, 27, 33, 21], [1, 0, 2, 2], [(0, 4), (0, 2), (2, 1), (2, 1)]),
}


def _sub_holders(name: str, rank: int) -> list[int]:
    """The clips rank ``rank`` must hold: those gathered to a group it is in, and its own whole ones."""
    _, owners, groups = SUB_CASES[name]
    return [i for i, (o, (f, d)) in enumerate(zip(owners, groups)) if f <= rank < f + d or o == rank]


def _sub_worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    subgroups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    out: dict[str, Any] = {}
    for name, fsdp in [(n, False) for n in SUB_CASES] + [(n, True) for n in SUB_CASES]:
        enc, audio_BN, lens_B, weights = build_case(name, SUB_CASES)
        _, owners, groups = SUB_CASES[name]
        if fsdp:  # FSDP2 over the four ranks: its collectives must not cross the sub-groups' gathers
            apply_fsdp(enc, mesh, blocks=[enc.conv], mp_policy=None)
        res = encode_placed(
            enc,
            audio_BN,
            lens_B,
            owners=owners,
            gathered=[d > 1 for _, d in groups],
            group=dist.group.WORLD,
            cp_rank=rank,
            cp_size=world_size,
            dummy_len=DUMMY_LEN,
            gather_groups=groups,
            subgroups=subgroups,
        )
        hidden_bUC, out_lens_b = res.extra
        loss = rank_loss(res.embeds, weights, _sub_holders(name, rank), rank)
        (
            loss + ctc_like(hidden_bUC, out_lens_b) * res.weight + sum(u.sum() * 0 for u in res.unused)
        ).backward()
        grads = {k: p.grad for k, p in enc.named_parameters()}
        if fsdp:
            grads = {k: g.full_tensor() * world_size for k, g in grads.items()}
        out[f"{name}{'-fsdp' if fsdp else ''}"] = {
            "embeds": [None if e is None else e.detach() for e in res.embeds],
            "grads": {k: (None if g is None else g.detach().clone()) for k, g in grads.items()},
        }
    return out


@pytest.mark.multiproc
def test_a_split_sequences_clip_is_gathered_to_its_sub_group_only() -> None:
    """cp 4 with hybrid degrees: a clip goes to the ranks of its sequence's group only (None elsewhere), with
    its owner's values; the CP sum of the encoder gradients is one process's gradient of the sum of the
    ranks' losses, with and without FSDP2 over the four ranks (no hang where one pair skips a level)."""
    results = run_distributed(_sub_worker, 4)
    for name in SUB_CASES:
        enc, audio_BN, lens_B, weights = build_case(name, SUB_CASES)
        embeds, (hidden_BUC, out_lens_B) = enc(audio_BN, lens_B)
        total = sum(rank_loss(list(embeds), weights, _sub_holders(name, r), r) for r in range(4))
        (total + ctc_like(hidden_BUC, out_lens_B)).backward()
        for key in (name, f"{name}-fsdp"):
            for r, got in enumerate(results):
                held = [i for i, e in enumerate(got[key]["embeds"]) if e is not None]
                assert held == _sub_holders(name, r), (key, r)
                for i in held:
                    torch.testing.assert_close(
                        got[key]["embeds"][i], embeds[i].detach(), rtol=1e-6, atol=1e-6
                    )
            for k, p in enc.named_parameters():
                ranks = [got[key]["grads"][k] for got in results]
                got_sum = ranks[0] if key.endswith("fsdp") else sum(ranks)  # FSDP2 returns the sum already
                torch.testing.assert_close(got_sum, p.grad, rtol=1e-5, atol=1e-5)
