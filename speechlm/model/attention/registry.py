"""The one attention backend registry: which backends exist, whether they are installed, and how
transformers finds them.

A backend is registered with the `attention_backend` decorator on its implementation::

    @attention_backend("flex", has_dropout=False)
    def attend_flex(module, query_BHSD, key_BGSD, value_BGSD, attention_mask, *, scale, dropout, **kwargs):
        ...  # -> (out_BSHD, None)

The decorator does what every backend would otherwise open with: q/k/v to one dtype
(`layouts.match_dtypes`), the softmax scale resolved (`layouts.default_scale`), a CP context
refused when the backend's capability row says it has no CP path, attention dropout refused when
``dropout=False``. It returns a function with transformers' attention signature
``fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)`` and adds it
to the registry. Capabilities (THD, BSHD, CP, CPU, ...) are the row of
``parallel.backend_caps.BACKENDS``; nothing here repeats them. Layout helpers (THD views,
unpadding, masks) live in `layouts`.

**transformers' registries are process-wide.** Nothing is registered with transformers at import.
`ensure_registered(name)`, called when a model is built with that backend, writes the function to
transformers' global ``AttentionInterface`` and our pass-through mask function
(`pass_padding_mask`) to its global ``AttentionMaskInterface``, both under ``speechlm_<name>``
(``speechlm_fa`` for flash: transformers reserves names holding "flash"). The prefix keeps our
entries apart from transformers' own implementations; registering again replaces the entry with
the same function, so it is idempotent. Every model in the process built with
``attn_implementation="speechlm_<name>"`` uses that function.

THD (packed): batch dimension 1, the model's forward received ``cu_seq_lens_q/k`` and
``max_length_q/k`` (we always pass them; transformers' own packed-sequence detection from position
ids is never relied on). BSHD (padded): no cu_seqlens; ``attention_mask`` is the 2-D ``[B, S]``
padding mask (True = real token), passed through untouched by `pass_padding_mask`; each backend
applies causality itself.

Adding a backend: add its row to ``parallel/backend_caps.py``, write
``speechlm/model/attention/<name>.py`` with its decorated implementation (import optional packages
inside the function), and import the module in ``speechlm/model/attention/__init__.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from parallel.backend_caps import BACKENDS, BackendCaps
from speechlm.model.attention.layouts import default_scale, match_dtypes, read_attention_context

ATTN_PREFIX = "speechlm_"

AttentionFn = Callable[..., tuple[Tensor, Tensor | None]]


class BackendUnavailableError(ImportError):
    """The selected attention backend needs a package that is not installed (or cannot run here)."""


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: AttentionFn
    caps: BackendCaps

    @property
    def attn_implementation(self) -> str:
        # transformers treats any implementation name containing "flash" as its own flash-attn
        # integration (and tries to load a kernel), so "flash" is spelled "fa" here.
        return ATTN_PREFIX + self.name.replace("flash", "fa")


_REGISTRY: dict[str, AttentionBackend] = {}


def register_backend(name: str, fn: AttentionFn, *, replace: bool = False) -> AttentionBackend:
    """Add a backend function; its capabilities are looked up in ``parallel.backend_caps.BACKENDS``."""
    if name not in BACKENDS:
        raise KeyError(
            f"attention backend {name!r} has no capability row; add one to parallel/backend_caps.py "
            f"(known: {', '.join(BACKENDS)})"
        )
    if name in _REGISTRY and not replace and _REGISTRY[name].fn is not fn:
        raise ValueError(
            f"attention backend {name!r} is already registered; pass replace=True to override it"
        )
    backend = AttentionBackend(name=name, fn=fn, caps=BACKENDS[name])
    _REGISTRY[name] = backend
    return backend


def attention_backend(name: str, *, has_dropout: bool = True) -> Callable[[Callable[..., Any]], AttentionFn]:
    """Decorator: wrap ``impl(module, q, k, v, attention_mask, *, scale, dropout, **kwargs)`` into a
    transformers attention function with the shared checks, and register it as `name` (see above)."""
    if name not in BACKENDS:
        raise KeyError(
            f"attention backend {name!r} has no capability row; add one to parallel/backend_caps.py"
        )
    caps = BACKENDS[name]

    def wrap(impl: Callable[..., Any]) -> AttentionFn:
        @functools.wraps(impl)
        def fn(
            module: nn.Module,
            query_BHSD: Tensor,
            key_BGSD: Tensor,
            value_BGSD: Tensor,
            attention_mask: Tensor | None,
            scaling: float | None = None,
            dropout: float = 0.0,
            **kwargs: Any,
        ) -> tuple[Tensor, Tensor | None]:
            q, k, v = match_dtypes(query_BHSD, key_BGSD, value_BGSD)
            if not caps.cp:
                refuse_cp_context(name, kwargs)
            if not has_dropout:
                check_no_dropout(name, dropout)
            return impl(
                module, q, k, v, attention_mask, scale=default_scale(q, scaling), dropout=dropout, **kwargs
            )

        register_backend(name, fn)
        return fn

    return wrap


def get_backend(name: str) -> AttentionBackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown attention backend {name!r}; registered: {', '.join(sorted(_REGISTRY)) or 'none'}"
        ) from None


def registered_backends() -> list[str]:
    return sorted(_REGISTRY)


def is_installed(name: str) -> bool:
    module = get_backend(name).caps.module
    if module is None or sys.modules.get(module) is not None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_backends() -> list[str]:
    """Registered backends whose required package is importable here."""
    return [n for n in registered_backends() if is_installed(n)]


def check_installed(name: str) -> None:
    caps = get_backend(name).caps
    if not is_installed(name):
        extra = f"pip install speechlm[{caps.pip_extra}]" if caps.pip_extra else f"pip install {caps.module}"
        raise BackendUnavailableError(
            f"attention backend {name!r} needs the Python package {caps.module!r}, which is not installed: "
            f"run `{extra}`, or choose another backend (installed: {', '.join(available_backends())})"
        )


def pass_padding_mask(*, attention_mask: Tensor | None = None, **_: Any) -> Tensor | None:
    """Mask function for our backends: hand the 2-D padding mask (or None) to the attention as is."""
    return attention_mask


def ensure_registered(name: str) -> str:
    """Check the backend is installed, register it with transformers, return the attn_implementation."""
    from transformers import (
        AttentionInterface,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )
    from transformers.masking_utils import (
        AttentionMaskInterface,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )

    backend = get_backend(name)
    check_installed(name)
    AttentionInterface.register(backend.attn_implementation, backend.fn)
    AttentionMaskInterface.register(backend.attn_implementation, pass_padding_mask)
    return backend.attn_implementation


def refuse_cp_context(backend: str, kwargs: Mapping[str, Any]) -> None:
    """Backends without a context-parallel path in this build raise here (the validator says so first)."""
    if read_attention_context(kwargs).cp is not None:
        raise ValueError(
            f"the {backend} attention backend has no context-parallel path in this build; use "
            f"model.attention_backend=reference with cp > 1"
        )


def check_no_dropout(backend: str, dropout: float) -> None:
    if dropout:
        raise ValueError(
            f"attention backend {backend!r} has no attention dropout, got dropout={dropout}; build the LLM "
            "with dropout 0 (the default of SpeechLLM) or use the 'flash', 'te' or 'sdpa' backend"
        )
