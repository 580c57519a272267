"""The CP layout (`parallel.cp_layout`) and the parallel/ module graph around it.

Letters: B clips, T packed tokens, H hidden, N sequences.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from parallel.cp_attention import PlacedCPAttention
from parallel.cp_layout import DynamicCPLayout, NullCPLayout
from parallel.cp_placement import place_sequences
from parallel.cp_shard import shard_placed_thd
from parallel.rounding import round_lengths
from parallel.varlen_meta import build_varlen_meta

REPO = Path(__file__).resolve().parents[2]


def parallel_imports(path: Path) -> set[str]:
    """The parallel.* modules a file imports, at any depth (TYPE_CHECKING blocks and functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("parallel.")
        ):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("parallel.")}
    return out


def test_varlen_kernels_and_interface_do_not_import_each_other():
    """parallel.varlen imports the flash kernels; the kernels take the boundaries from varlen_meta."""
    flash = parallel_imports(REPO / "parallel" / "varlen_flash.py")
    assert "parallel.varlen" not in flash
    assert "parallel.varlen_meta" in flash


def test_null_layout_keeps_every_sequence_whole_and_rounds_like_packing():
    layout = NullCPLayout(round_cp=2, tp=2)
    plan = layout.place([5, 9, 3])
    assert plan.indices == [0, 1, 2] and plan.n_split == 0
    assert plan.padded_lengths == round_lengths([5, 9, 3], 2, 2) == [8, 12, 4]
    assert plan.clip_owners == [0, 0, 0] and plan.gathered == [False] * 3
    assert NullCPLayout(pad_to_multiple=16).place([5, 9]).padded_lengths == [5, 11]
    x = {"x": torch.arange(24.0)}
    cu = torch.tensor([0, 8, 20, 24])
    parts, cu_local, max_local = layout.shard(x, cu, 12, plan)
    assert parts["x"] is x["x"] and cu_local is cu and max_local == 12
    assert layout.attention_context(build_varlen_meta(cu), 0) is None
    assert (layout.cp_size, layout.cp_rank, layout.tp) == (1, 0, 2)


@pytest.mark.parametrize("threshold", [0, 10, "auto"])
def test_dynamic_layout_places_and_shards_every_rank_like_the_pure_functions(threshold):
    """No process group: place and shard are pure, per rank; the attention context is built per micro-batch."""
    lens, cp = [30, 7, 5, 12, 3], 2
    placement = place_sequences(lens, cp, threshold=threshold, tp=1)
    for rank in range(cp):
        layout = DynamicCPLayout(group=None, cp_size=cp, cp_rank=rank, kind="ring", threshold=threshold)
        plan = layout.place(lens)
        assert plan.indices == placement.local_indices(rank)
        assert plan.clip_owners == placement.clip_owners() and plan.gathered == list(placement.split)
        cu = torch.tensor([0, *torch.tensor(plan.padded_lengths).cumsum(0).tolist()])
        x = {"x": torch.arange(int(cu[-1]), dtype=torch.float32)}
        parts, cu_local, max_local = layout.shard(x, cu, 0, plan)
        want, want_cu, want_max = shard_placed_thd(x, cu, plan.n_split, cp, rank)
        assert torch.equal(parts["x"], want["x"]) and torch.equal(cu_local, want_cu) and max_local == want_max
        ctx = layout.attention_context(build_varlen_meta(cu_local), plan.n_split)
        assert isinstance(ctx, PlacedCPAttention) and ctx.n_split == plan.n_split
        assert (ctx.kind, ctx.cp_size, ctx.cp_rank, ctx.global_ranks) == ("ring", cp, rank, [0, 1])
