"""Attention backends for the decoder LLM, behind one registry (see `registry` for how to add one).

Importing a backend module registers it (its `attention_backend` decorator); its capabilities come
from ``parallel.backend_caps``. Optional packages (flash-attn, transformer-engine) are imported only
when a backend runs. Nothing is registered with transformers until `ensure_registered`.
"""

from speechlm.model.attention import flash, flex, reference, sdpa, te, torch_varlen  # noqa: F401  (registers)
from speechlm.model.attention.registry import (
    ATTN_PREFIX,
    AttentionBackend,
    BackendUnavailableError,
    attention_backend,
    available_backends,
    check_installed,
    ensure_registered,
    get_backend,
    register_backend,
    registered_backends,
)

__all__ = [
    "ATTN_PREFIX",
    "AttentionBackend",
    "BackendUnavailableError",
    "attention_backend",
    "available_backends",
    "check_installed",
    "ensure_registered",
    "get_backend",
    "register_backend",
    "registered_backends",
]
