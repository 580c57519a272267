"""Calls into the varlen kernel interface per attention layer, forward and backward, on CPU/gloo.

For packs of ``--utterances`` (default 20 and 200) speech-like sequences (16-160 tokens) and cp in
``--cp`` (default 1, 2, 4), one attention layer (4 query heads, 2 K/V heads, head dim 16, fp32) runs
forward and backward the way training runs it: one process calls `parallel.varlen.varlen_attention`
over the whole pack; under CP every rank places the pack (`parallel.cp_placement`), keeps its share
and runs `PlacedCPAttention` (ring or all-gather attention, ``--attention``, over the split sequences,
one local varlen call over its whole ones), with ``cp_split_threshold`` 0 (every sequence split) and ``auto``. The counts are read from
`parallel.varlen.KERNEL_CALLS` on every rank; the maximum over ranks is reported. Target: at most
2·cp calls forward and 2·cp backward per layer, whatever the number of utterances.

Usage: ``speechlm bench attention-calls [--utterances 20,200] [--cp 1,2,4] [--attention ring,allgather]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HEADS, KV_HEADS, DIM = 4, 2, 16


def pack_lengths(n: int, seed: int = 0) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(16, 161, (n,), generator=g)]


def one_layer(
    rank: int, world: int, lengths: list[int], threshold: Any, kind: str = "ring"
) -> dict[str, int]:
    import torch

    from parallel.varlen import KERNEL_CALLS, build_varlen_meta, varlen_attention

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if world == 1:
        meta = build_varlen_meta([0, *torch.tensor(lengths).cumsum(0).tolist()])
        t = meta.cu_q[-1]
        q = torch.randn(t, HEADS, DIM, requires_grad=True)
        k, v = (torch.randn(t, KV_HEADS, DIM, requires_grad=True) for _ in range(2))
        KERNEL_CALLS.clear()
        out = varlen_attention(q, k, v, meta, causal=True, scale=DIM**-0.5)
        out.square().sum().backward()
        return dict(KERNEL_CALLS)

    import torch.distributed as dist

    from parallel.cp_attention import CPAttention
    from parallel.cp_placement import place_sequences
    from parallel.cp_shard import shard_placed_thd

    group = dist.group.WORLD
    local = place_sequences(lengths, world, threshold=threshold, pair_cost=1 / (6 * 1024)).local(rank)
    padded = local.padded_lengths
    cu = torch.tensor([0, *torch.tensor(padded, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    x = {
        "q": torch.randn(t, HEADS, DIM),
        "k": torch.randn(t, KV_HEADS, DIM),
        "v": torch.randn(t, KV_HEADS, DIM),
    }
    parts, cu_local, _ = shard_placed_thd(x, cu, local.n_split, world, rank)
    q, k, v = (parts[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    meta = build_varlen_meta(cu_local)
    attn = CPAttention(group, world, rank, kind).for_split_prefix(local.n_split, meta)
    KERNEL_CALLS.clear()
    out = attn.attention(q, k, v, cu_local, DIM**-0.5)
    out.square().sum().backward()
    return dict(KERNEL_CALLS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench attention-calls", description=__doc__.split("\n")[0])
    ap.add_argument("--utterances", default="20,200")
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--attention", default="ring,allgather", help="CP attention kinds (cp > 1)")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv)

    from parallel.testing import run_distributed

    records = []
    for n in [int(x) for x in args.utterances.split(",")]:
        lengths = pack_lengths(n)
        for cp in [int(x) for x in args.cp.split(",")]:
            runs = (
                [("-", "-")] if cp == 1 else [(k, t) for k in args.attention.split(",") for t in (0, "auto")]
            )
            for kind, threshold in runs:
                if cp == 1:
                    per_rank = [one_layer(0, 1, lengths, threshold)]
                else:
                    per_rank = run_distributed(one_layer, cp, "gloo", lengths, threshold, kind, timeout_s=600)
                rec = {
                    "cp": cp,
                    "utterances": n,
                    "attention": kind,
                    "cp_split_threshold": threshold,
                    "forward_calls_per_layer": max(c.get("fwd", 0) for c in per_rank),
                    "backward_calls_per_layer": max(c.get("bwd", 0) for c in per_rank),
                }
                records.append(rec)
                print(json.dumps(rec), flush=True)
    print(
        f"\n{'cp':>3} {'utterances':>10} {'attention':>10} {'split':>6} {'fwd calls':>10} {'bwd calls':>10} {'2*cp':>5}"
    )
    for r in records:
        print(
            f"{r['cp']:>3} {r['utterances']:>10} {r['attention']:>10} {r['cp_split_threshold']!s:>6} "
            f"{r['forward_calls_per_layer']:>10} {r['backward_calls_per_layer']:>10} {2 * r['cp']:>5}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
