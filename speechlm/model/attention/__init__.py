"""Attention backends for the decoder LLM, behind one registry (see `registry` for how to add one).

Each line below registers one backend; its capabilities come from ``parallel.backend_caps``.
Optional packages (flash-attn, transformer-engine) are imported only when a backend runs.
"""

from speechlm.model.attention import flash, flex, reference, sdpa, te, torch_varlen
from speechlm.model.attention.registry import (
    ATTN_PREFIX,
    AttentionBackend,
    BackendUnavailableError,
    available_backends,
    check_installed,
    ensure_registered,
    get_backend,
    register_backend,
    registered_backends,
)

register_backend("reference", reference.attend_reference)
register_backend("sdpa", sdpa.attend_sdpa)
register_backend("torch_varlen", torch_varlen.attend_torch_varlen)
register_backend("flex", flex.attend_flex)
register_backend("flash", flash.attend_flash)
register_backend("te", te.attend_te)

__all__ = [
    "ATTN_PREFIX",
    "AttentionBackend",
    "BackendUnavailableError",
    "available_backends",
    "check_installed",
    "ensure_registered",
    "get_backend",
    "register_backend",
    "registered_backends",
]
