"""Loaded weights checked for NaN and infinity, naming the file and the tensor.

A weights file damaged in place keeps its size and loads: bytes 0xff read as NaN (float32, bf16, fp16),
and a NaN weight makes every loss NaN. What is loaded from outside the run is checked once, as it is
loaded: a pretrained LLM (`speechlm.model.llm.build_llm`), a pretrained encoder
(`speechlm.model.encoders.build_encoder`) and a checkpoint's tensors
(`speechlm.use.checkpoint_files.load_trained_state`, which agrees on the result over the ranks). The check
reads every floating-point tensor once, in chunks (no full-size boolean copy of a large matrix): about
the cost of one pass over the weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from speechlm.errors import NonFiniteError

CHUNK = 1 << 24  # elements per isfinite() call: a bounded temporary whatever the tensor's size
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".nemo")


def count_non_finite(t: torch.Tensor) -> int:
    """NaN and infinite elements of `t` (0 for integer and boolean tensors); a DTensor: its local shard."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    flat = t.detach().reshape(-1)
    return int(sum(int((~torch.isfinite(part)).sum()) for part in flat.split(CHUNK)))


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int, int] | None:
    """(name, non-finite elements, elements) of the first tensor of `named` that holds a NaN or an
    infinity, or None."""
    for name, t in named:
        bad = count_non_finite(t)
        if bad:
            return name, bad, t.numel()
    return None


def weights_file_of(source: str | Path, name: str) -> Path:
    """The file of `source` (a weights file, or a `save_pretrained` directory) that holds the tensor
    `name`: the index's entry (sharded weights), else the directory's only weights file, else `source`.
    `name` may carry a prefix the file's keys lack (a wrapper module's): the longest suffix that is a key
    of the index is taken."""
    src = Path(source)
    if not src.is_dir():
        return src
    parts = name.split(".")
    for index in sorted(src.glob("*.index.json")):
        try:
            weight_map = dict(json.loads(index.read_text()).get("weight_map") or {})
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        for i in range(len(parts)):
            key = ".".join(parts[i:])
            if key in weight_map:
                return src / str(weight_map[key])
    files = [f for f in sorted(src.iterdir()) if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)]
    return files[0] if len(files) == 1 else src


def non_finite_message(where: str | Path, found: tuple[str, int, int], fix: str) -> str:
    name, bad, numel = found
    return (
        f"{where}: tensor {name} holds {bad} NaN or infinite values (of {numel}): the weights are damaged "
        f"(a file corrupted in place keeps its size and loads) or were saved from a diverged run; {fix}"
    )


def check_loaded_weights(module: Any, source: str | Path, what: str) -> None:
    """Refuse `module`, just loaded from `source`, when a tensor of its state holds a NaN or an infinity
    (a NonFiniteError naming the file and the tensor; `what`: the config key that named `source`)."""
    found = first_non_finite(module.state_dict().items())
    if found is not None:
        raise NonFiniteError(
            non_finite_message(
                weights_file_of(source, found[0]),
                found,
                f"restore {what}={source} from where it came from (download or export it again)",
            )
        )
