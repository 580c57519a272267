"""flash-attn's own varlen kernels behind the varlen interface (parallel/varlen.py): "flash" and "flash3".

Letters: T packed tokens, H query heads, G key/value heads, D head dim.

- "flash": flash-attn 2, `flash_attn.flash_attn_interface._flash_attn_varlen_forward/_backward` (the
  private pair ring-flash-attn builds on: the forward returns the LSE, the backward takes any (out, lse),
  so a ring can hand it the globally merged ones).
- "flash3": flash-attn 3 (the Hopper build), module `flash_attn_interface`, `_flash_attn_forward/
  _flash_attn_backward`, which take cu_seqlens for varlen since the 2025-01 rewrite.

Both take K/V with their own G heads (native GQA), return the LSE as (H, T) fp32 (checked), and write
the backward into dq/dk/dv buffers we allocate (dk, dv with G heads). They take fp16/bf16 and a head dim
that is a multiple of 8 and at most 256; anything else is refused here with the fix.

Versions. These private functions change signature between releases. flash-attn 2: a tuple
`window_size` up to 2.6.3, `window_size_left/right` from 2.7.0; `softcap` from 2.6.0; `zero_tensors`
from 2.7.4 and `num_splits` on main (2026); 8 return values up to 2.6.3, 4 from 2.7.0; and from 2.7.0
(on torch >= 2.4) a `torch.library` custom op, whose `inspect.signature` is `(*args, **kwargs)` (its
Python function is `_init_fn`). flash-attn 3: ~30 required positional parameters (2025-01), then
`window_size_left/right` and `is_causal` in the backward (2025-07), defaults for all but the tensors
(2025-08), `out` renamed `out_` in the forward (2025-11).
So the call is built by keyword from the installed function's signature (cached per function object):
every parameter we mean something by gets our value (no dropout, our causal flag and scale, no window,
no softcap, no ALiBi, no returned softmax, non-deterministic backward); a parameter we don't know that
has a default keeps it; a required one we know to be an off switch (a None tensor, a 0 count) gets it;
any other required parameter is an error naming it and the installed version. A release older than
2.6 returns a padded (B, H, max_seqlen) LSE: refused with the upgrade.

Rows without keys. flash-attn 2 writes out = 0 and LSE = +inf for the queries of a sequence with no keys
(so its own backward ignores them); the interface says -inf (the neutral element of the LSE merge). The
forward sets those rows to (0, -inf) and the backward zeroes their dq, from host integers only, and only
when such a sequence exists. Ring attention never makes one (parallel/ring_step.py: a step's key half is
L/2 > 0 for every local sequence of length L > 0, and a "second half" step reads all L keys), but a
caller with a rectangular pack may.

Registration: `installed_flash_kernels()` asks importlib.util.find_spec, which imports nothing; the
flash modules are imported at the first call of a kernel. Tested on CPU only with stand-in modules
(tests/parallel/test_varlen_flash_kernel.py); the real kernels run in `pytest -m gpu`
(tests/test_gpu_kit.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from parallel.varlen_meta import VarlenMeta

__all__ = ["installed_flash_kernels", "flash_fwd", "flash_bwd", "flash3_fwd", "flash3_bwd"]

# kernel name -> (module, forward function, backward function, distributions that may hold it)
FLASH_MODULES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "flash": (
        "flash_attn.flash_attn_interface",
        "_flash_attn_varlen_forward",
        "_flash_attn_varlen_backward",
        ("flash-attn",),
    ),
    "flash3": ("flash_attn_interface", "_flash_attn_forward", "_flash_attn_backward", ("flash-attn-3",)),
}
# Signatures modelled (read from Dao-AILab/flash-attention): flash-attn 2.6.0, 2.6.3, 2.7.0, 2.7.4,
# 2.8.0, 2.8.3 and main of 2026-08; flash-attn 3 (hopper/) from 7a80279 (2025-01) to main of 2026-08.
KNOWN_RELEASES = {
    "flash": "flash-attn 2.6.3 to 2.8.3",
    "flash3": "a flash-attn 3 build from 2025-01 to 2026-08",
}

# Required parameters of some releases that we leave off: the value that switches the feature off.
_OFF_SWITCHES: dict[str, Any] = {
    **dict.fromkeys(  # optional tensors (paged KV, rotary, fp8 descales, ALiBi, ...) and None-means-auto knobs
        "k_new v_new qv out out_ cu_seqlens_k_new seqused_q seqused_k sequed_q sequed_k page_table kv_batch_idx "
        "leftpad_k rotary_cos rotary_sin seqlens_rotary q_descale k_descale v_descale block_table "
        "scheduler_metadata pack_gqa alibi_slopes rng_state".split()
    ),
    "sink_token_length": 0,
    "attention_chunk": 0,
    "sm_margin": 0,
    "num_splits": 1,
    "rotary_interleaved": True,
    "zero_tensors": False,
}
# Parameters that must exist (one of each group) for the call to mean what we mean.
_ESSENTIAL = (("cu_seqlens_q",), ("cu_seqlens_k",), ("max_seqlen_q",), ("max_seqlen_k",),
              ("softmax_scale",), ("causal", "is_causal"))  # fmt: skip


def installed_flash_kernels() -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """The flash kernels whose package is importable, without importing it. A flash-attn 2 older than
    2.6 (padded LSE) is left unregistered with a warning, so that the reference backend falls back to
    torch's kernels instead of failing at its first attention call."""
    found: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
    for name, fwd, bwd in (("flash", flash_fwd, flash_bwd), ("flash3", flash3_fwd, flash3_bwd)):
        top = FLASH_MODULES[name][0].split(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):  # a module in sys.modules without a spec
            spec = None
        if spec is None:
            continue
        release = _release(installed_version(name))
        if name == "flash" and release is not None and release < (2, 6):
            warnings.warn(
                f"{installed_version(name)} is older than 2.6 (its varlen LSE is padded): its kernels are "
                "not used by speechlm's varlen interface; upgrade with `pip install 'flash-attn>=2.6'`",
                stacklevel=2,
            )
            continue
        found[name] = (fwd, bwd)
    return found


def _release(version_text: str) -> tuple[int, int] | None:
    """(major, minor) from 'flash-attn 2.5.9' or 'flash-attn 2.8.3.post1'; None when unknown."""
    m = re.search(r" (\d+)\.(\d+)", version_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _flash_functions(kernel: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    module_name, fwd_name, bwd_name, _ = FLASH_MODULES[kernel]
    module = importlib.import_module(module_name)
    return getattr(module, fwd_name), getattr(module, bwd_name)


def installed_version(kernel: str) -> str:
    """The installed release, for error messages ('flash-attn 2.8.3')."""
    module_name, _, _, dists = FLASH_MODULES[kernel]
    version = getattr(sys.modules.get(module_name.split(".")[0]), "__version__", None)
    if version:
        return f"{dists[0]} {version}"
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return f"{dists[0]} (version unknown)"


@functools.cache
def _parameters(fn: Callable[..., Any]) -> tuple[inspect.Parameter, ...]:
    """The parameters of a flash function; a torch custom op exposes its Python function as `_init_fn`."""
    return tuple(inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values())


def _call(kernel: str, fn: Callable[..., Any], meant: dict[str, Any]) -> Any:
    """Call `fn` by keyword with the values we mean, off switches for required parameters we leave off."""
    params = _parameters(fn)
    names = {p.name for p in params}
    fn_name = f"{installed_version(kernel)}'s {getattr(getattr(fn, '_init_fn', fn), '__name__', fn)}"
    fix = (
        f"export SPEECHLM_VARLEN_KERNEL=torch_varlen (or reference) to use another varlen kernel, or pin "
        f"{KNOWN_RELEASES[kernel]}"
    )
    for group in _ESSENTIAL:
        if not names & set(group):
            raise TypeError(f"{fn_name} has no parameter {group[0]!r}, so speechlm cannot call it: {fix}")
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in meant:
            value = meant[p.name]
        elif p.default is not p.empty:
            if p.kind is not p.POSITIONAL_ONLY:
                continue
            value = p.default
        elif p.name in _OFF_SWITCHES:
            value = _OFF_SWITCHES[p.name]
        else:
            raise TypeError(
                f"this {fn_name} has a required parameter {p.name!r} that speechlm does not know: {fix}"
            )
        if p.kind is p.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[p.name] = value
    return fn(*args, **kwargs)


def _check_inputs(kernel: str, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor) -> None:
    if q_THD.dtype not in (torch.float16, torch.bfloat16) or {k_TGD.dtype, v_TGD.dtype} != {q_THD.dtype}:
        raise ValueError(
            f"the {kernel!r} varlen kernel (flash-attn) takes fp16 or bf16 only; got q {q_THD.dtype}, "
            f"k {k_TGD.dtype}, v {v_TGD.dtype}: run attention in bf16 (model dtype or autocast) or use the "
            "'reference' kernel"
        )
    for name, x in (("q/k", q_THD), ("v", v_TGD)):
        d = x.shape[-1]
        if d % 8 or d > 256:
            raise ValueError(
                f"the {kernel!r} varlen kernel (flash-attn) needs a head dim that is a multiple of 8 and at "
                f"most 256; {name} has {d}: use the 'reference' or 'torch_varlen' kernel, or another head dim"
            )


def _rows_without_keys(meta: VarlenMeta) -> list[tuple[int, int]]:
    """Query row ranges of the sequences that have queries but no keys (host integers only)."""
    cq, ck = meta.cu_q, meta.cu_k
    return [(cq[n], cq[n + 1]) for n in range(len(cq) - 1) if cq[n + 1] > cq[n] and ck[n + 1] == ck[n]]


def _lse_HT(kernel: str, lse: Tensor, q_THD: Tensor) -> Tensor:
    T, H = q_THD.shape[:2]
    if lse.shape == (H, T):
        return lse.float()
    hint = " (the padded layout of flash-attn < 2.6: upgrade to flash-attn>=2.6)" if lse.dim() == 3 else ""
    raise RuntimeError(
        f"{installed_version(kernel)} returned a varlen LSE of shape {tuple(lse.shape)}{hint}; the varlen "
        f"interface needs (H, T) = ({H}, {T}): use the torch_varlen or reference kernel, or pin "
        f"{KNOWN_RELEASES[kernel]}"
    )


def _shared_keywords(
    q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, meta: VarlenMeta, causal: bool, scale: float | None
) -> dict[str, Any]:
    """What we mean by the parameters forward and backward share, under every name a release used."""
    return {
        "q": q_THD, "k": k_TGD, "v": v_TGD,
        "cu_seqlens_q": meta.cu_seqlens_q, "cu_seqlens_k": meta.cu_seqlens_k,
        "max_seqlen_q": meta.max_q, "max_seqlen_k": meta.max_k,  # host integers
        "dropout_p": 0.0, "softmax_scale": q_THD.shape[-1] ** -0.5 if scale is None else float(scale),
        "causal": causal, "is_causal": causal,  # causal comes from the flag, the window stays open
        "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
        "softcap": 0.0, "alibi_slopes": None,
    }  # fmt: skip


def _fwd(
    kernel: str,
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    meta: VarlenMeta,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor]:
    _check_inputs(kernel, q_THD, k_TGD, v_TGD)
    fwd, _ = _flash_functions(kernel)
    meant = _shared_keywords(q_THD, k_TGD, v_TGD, meta, causal, scale)
    meant.update(out=None, out_=None, return_softmax=False)  # flash-attn 3's `out(_)` is a buffer to fill
    res = _call(kernel, fwd, meant)
    # flash-attn 2 <= 2.6.3: (out, q, k, v, out_padded, lse, S_dmask, rng_state); later and flash-attn 3:
    # (out, lse, ...)
    out_THD, lse = (res[0], res[5]) if kernel == "flash" and len(res) == 8 else (res[0], res[1])
    lse_HT = _lse_HT(kernel, lse, q_THD)
    for a, b in _rows_without_keys(meta):  # flash-attn 2 wrote LSE +inf for them
        out_THD[a:b] = 0
        lse_HT[:, a:b] = -torch.inf
    return out_THD, lse_HT


def _bwd(
    kernel: str,
    dout_THD: Tensor,
    q_THD: Tensor,
    k_TGD: Tensor,
    v_TGD: Tensor,
    out_THD: Tensor,
    lse_HT: Tensor,
    meta: VarlenMeta,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_inputs(kernel, q_THD, k_TGD, v_TGD)
    _, bwd = _flash_functions(kernel)
    dq, dk, dv = torch.empty_like(q_THD), torch.empty_like(k_TGD), torch.empty_like(v_TGD)
    meant = _shared_keywords(q_THD, k_TGD, v_TGD, meta, causal, scale)
    meant.update(
        dout=dout_THD.to(q_THD.dtype),
        out=out_THD.to(q_THD.dtype),  # a ring's merged fp32 accumulator, cast back
        softmax_lse=lse_HT.float().contiguous(),
        dq=dq, dk=dk, dv=dv, deterministic=False, rng_state=None,
    )  # fmt: skip
    _call(kernel, bwd, meant)  # writes dq, dk, dv (older releases also return them)
    for a, b in _rows_without_keys(meta):
        dq[a:b] = 0
    return dq, dk, dv


# The registered (fwd, bwd) pairs: the interface's signatures with the kernel name bound.
flash_fwd = functools.partial(_fwd, "flash")  # flash-attn 2
flash_bwd = functools.partial(_bwd, "flash")
flash3_fwd = functools.partial(_fwd, "flash3")  # flash-attn 3 (Hopper)
flash3_bwd = functools.partial(_bwd, "flash3")
