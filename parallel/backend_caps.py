"""What each attention backend can do: one table, read by the model's backend registry and by the validator.

Pure data (no imports beyond the standard library), so the validator can reason about a GPU job on a
laptop. `module` is the Python module that must be importable for the backend to be installed
(None: ships with torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendCaps:
    name: str
    thd: bool  # has a varlen/THD path driven by cu_seqlens
    bshd: bool  # can take a padded batch with an attention mask
    cp: bool  # supported with context parallelism (cp > 1) in this build
    cpu: bool  # forward and backward run on CPU
    gpu: bool  # runs on CUDA
    module: str | None  # import needed to use it (None: torch itself)
    pip_extra: str | None  # `pip install speechlm[EXTRA]` that provides it
    description: str


BACKENDS: dict[str, BackendCaps] = {
    b.name: b
    for b in (
        BackendCaps(
            "reference",
            True,
            True,
            True,
            True,
            True,
            None,
            None,
            "torch SDPA ops with log-sum-exp; ring or all-gather-KV under CP",
        ),
        BackendCaps(
            "torch_varlen",
            True,
            False,
            False,
            False,
            True,
            None,
            None,
            "torch.nn.attention.varlen (CUDA only)",
        ),
        BackendCaps(
            "flex",
            True,
            True,
            False,
            False,
            True,
            None,
            None,
            "FlexAttention with a document block mask (no backward on CPU)",
        ),
        BackendCaps(
            "flash", True, True, False, False, True, "flash_attn", "flash", "flash-attn varlen kernels"
        ),
        BackendCaps(
            "te",
            True,
            True,
            True,
            False,
            True,
            "transformer_engine",
            "te",
            "transformer-engine DotProductAttention (THD via cu_seqlens; its own p2p ring under CP)",
        ),
        BackendCaps(
            "sdpa",
            False,
            True,
            False,
            True,
            True,
            None,
            None,
            "torch scaled_dot_product_attention on padded batches only",
        ),
    )
}


def thd_backends() -> list[str]:
    return [n for n, b in BACKENDS.items() if b.thd]
