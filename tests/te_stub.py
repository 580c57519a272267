"""Stand in for transformer-engine (it cannot be installed on the CPU machine): one place that puts a fake
``transformer_engine.pytorch`` module, holding a given ``DotProductAttention`` class, into
``sys.modules`` and empties the te backend's core cache, so the next `attend_te` builds its core from it."""

from __future__ import annotations

import sys
import types
from typing import Any


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
