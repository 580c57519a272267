"""The `flash` and `flash3` kernels of the varlen interface (parallel/varlen_flash.py), on CPU with the
flash-attn modules stood in for. The stand-ins carry the real parameter names of four releases, read
from Dao-AILab/flash-attention: flash-attn 2.6.3 (tuple window, 8 return values, plain functions),
2.8.3 (window_size_left/right, `zero_tensors`, torch custom ops as from 2.7.0, the backward returns only
softmax_d), flash-attn 3 of 7a80279 (2025-01: ~30 required positional parameters) and of main in
2026-08 (all defaults, `out_`, `is_causal` in the backward). They answer with the reference kernel in
flash's conventions (+inf LSE for queries without keys). Checked: the keywords we pass, the LSE layout,
gradients against the reference, a ring's merged (out, lse) in the backward, the kernel choice by
capability and dtype, the errors. The real kernels run on a GPU (`pytest -m gpu`, tests/test_gpu_kit.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import pytest
import torch
from torch import Tensor

import parallel.varlen as varlen
import parallel.varlen_flash as varlen_flash
from parallel.cp_shard import shard_thd
from parallel.ring_step import simulate_ring_attention
from parallel.varlen import build_varlen_meta, reference_bwd, reference_fwd

H, G, D = 8, 2, 16
CALLS: list[tuple[str, dict[str, Any]]] = []


def answer_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool, scale: float):
    """The reference forward with flash-attn 2's rows without keys: out 0, LSE +inf."""
    meta = build_varlen_meta(cu_q.tolist(), cu_k.tolist())
    out, lse = reference_fwd(q, k, v, meta, causal, scale)
    for n in range(len(meta.cu_q) - 1):
        if meta.cu_k[n + 1] == meta.cu_k[n]:
            lse[:, meta.cu_q[n] : meta.cu_q[n + 1]] = torch.inf
    return out, lse


def answer_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, causal, scale) -> None:
    meta = build_varlen_meta(cu_q.tolist(), cu_k.tolist())
    for buf, grad in zip((dq, dk, dv), reference_bwd(dout, q, k, v, out, lse, meta, causal, scale)):
        buf.copy_(grad)


# fmt: off
def fa2_263_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
                block_table=None, leftpad_k=None, seqused_k=None):
    CALLS.append(("fwd", dict(locals())))
    out, lse = answer_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return out, q, k, v, out, lse, torch.empty(0), torch.zeros(2, dtype=torch.int64)


def fa2_263_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, rng_state=None):
    CALLS.append(("bwd", dict(locals())))
    answer_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return dq, dk, dv, torch.empty(0)


@torch.library.custom_op("speechlm_test_fa283::varlen_fwd", mutates_args=())
def fa2_283_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                alibi_slopes: Tensor | None = None, return_softmax: bool = False,
                block_table: Tensor | None = None, leftpad_k: Tensor | None = None,
                seqused_k: Tensor | None = None, zero_tensors: bool = False,
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    CALLS.append(("fwd", dict(locals())))
    out, lse = answer_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return out, lse, torch.empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("speechlm_test_fa283::varlen_bwd", mutates_args=("dq", "dk", "dv"))
def fa2_283_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                dq: Tensor | None, dk: Tensor | None, dv: Tensor | None, cu_seqlens_q: Tensor,
                cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
                rng_state: Tensor | None = None, zero_tensors: bool = False) -> Tensor:
    CALLS.append(("bwd", dict(locals())))
    answer_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return torch.empty(0)


def fa3_2501_fwd(q, k, v, k_new, v_new, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                 seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                 rotary_sin, q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1),
                 sink_token_length=0, softcap=0.0, rotary_interleaved=True, num_splits=1, pack_gqa=None,
                 sm_margin=0):
    CALLS.append(("fwd", dict(locals())))
    out, lse = answer_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return out, lse, torch.empty(0), torch.empty(0)


def fa3_2501_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                 max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                 sink_token_length=0, softcap=0.0, deterministic=False, sm_margin=0):
    CALLS.append(("bwd", dict(locals())))
    answer_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return dq, dk, dv, torch.empty(0)


def fa3_2608_fwd(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                 seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                 causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                 rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    CALLS.append(("fwd", dict(locals())))
    out, lse = answer_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return out, lse, torch.empty(0), torch.empty(0)


def fa3_2608_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                 sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                 softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                 deterministic=False, sm_margin=0):
    CALLS.append(("bwd", dict(locals())))
    answer_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, is_causal, softmax_scale)
    return torch.empty(0)
# fmt: on

RELEASES = {  # release -> (kernel, forward, backward)
    "2.6.3": ("flash", fa2_263_fwd, fa2_263_bwd),
    "2.8.3": ("flash", fa2_283_fwd, fa2_283_bwd),
    "fa3-2025-01": ("flash3", fa3_2501_fwd, fa3_2501_bwd),
    "fa3-2026-08": ("flash3", fa3_2608_fwd, fa3_2608_bwd),
}


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec reads it from sys.modules
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def install(monkeypatch, release: str, fwd=None, bwd=None) -> str:
    """Put stand-in flash modules of `release` into sys.modules and register the kernel; its name."""
    kernel, real_fwd, real_bwd = RELEASES.get(release, ("flash", None, None))
    fwd, bwd = fwd or real_fwd, bwd or real_bwd
    if kernel == "flash":
        iface = _module("flash_attn.flash_attn_interface", _flash_attn_varlen_forward=fwd,
                        _flash_attn_varlen_backward=bwd)  # fmt: skip
        monkeypatch.setitem(sys.modules, "flash_attn", _module("flash_attn", __version__=release,
                                                               flash_attn_interface=iface))  # fmt: skip
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    else:
        iface = _module("flash_attn_interface", _flash_attn_forward=fwd, _flash_attn_backward=bwd)
        monkeypatch.setitem(sys.modules, "flash_attn_interface", iface)
    pair = {"flash": (varlen_flash.flash_fwd, varlen_flash.flash_bwd)}.get(
        kernel, (varlen_flash.flash3_fwd, varlen_flash.flash3_bwd)
    )
    monkeypatch.setitem(varlen.VARLEN_KERNELS, kernel, pair)  # also where registration would skip it
    CALLS.clear()
    return kernel


def make_qkv(lens_q, lens_k, dtype=torch.bfloat16, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), G, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), G, d, generator=g).to(dtype)
    return q, k, v


def cumsum(lens):
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


@pytest.mark.parametrize("release", list(RELEASES))
@pytest.mark.parametrize(
    "lens_q,lens_k,causal",
    [([5, 7, 1, 11], [5, 7, 1, 11], True), ([5, 0, 3, 6], [4, 6, 0, 9], False)],  # 3 queries with no keys
    ids=["causal", "rectangular-with-empty"],
)
def test_forward_and_backward_pass_what_flash_expects(monkeypatch, release, lens_q, lens_k, causal):
    kernel = install(monkeypatch, release)
    q, k, v = make_qkv(lens_q, lens_k)
    meta = build_varlen_meta(cumsum(lens_q), cumsum(lens_k))
    out, lse = varlen.varlen_fwd(q, k, v, meta, causal=causal, scale=0.3, kernel=kernel)
    (name, c), *_ = CALLS
    assert name == "fwd" and c["k"].shape[1] == G and c["v"].shape[1] == G  # K/V not expanded
    assert c["cu_seqlens_q"].dtype == torch.int32 and c["cu_seqlens_q"].tolist() == cumsum(lens_q)
    assert c["cu_seqlens_k"].dtype == torch.int32 and c["cu_seqlens_k"].tolist() == cumsum(lens_k)
    assert (c["max_seqlen_q"], c["max_seqlen_k"]) == (max(lens_q), max(lens_k))
    assert type(c["max_seqlen_q"]) is int and type(c["max_seqlen_k"]) is int  # host integers
    assert c["causal"] is causal and c["softmax_scale"] == 0.3 and c["softcap"] == 0.0
    assert c.get("window_size", (c.get("window_size_left"), c.get("window_size_right"))) == (-1, -1)
    assert c.get("dropout_p", 0.0) == 0.0 and c.get("alibi_slopes") is None and not c.get("return_softmax")
    if release == "fa3-2025-01":  # required off switches
        assert c["out"] is None and c["k_new"] is None and c["q_descale"] is None and c["page_table"] is None
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32  # (H, T), the interface's layout
    ref_out, ref_lse = reference_fwd(q, k, v, meta, causal, 0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)  # -inf (not flash's +inf) for the queries without keys
    if not causal:
        assert lse[:, 5:8].eq(-torch.inf).all() and out[5:8].eq(0).all()

    dout = torch.randn(out.shape).to(out.dtype)
    merged_out = out.float()  # a ring hands in its merged fp32 accumulator
    dq, dk, dv = varlen.varlen_bwd(dout, q, k, v, merged_out, lse.T.contiguous().T, meta, causal=causal,
                                   scale=0.3, kernel=kernel)  # fmt: skip
    name, c = CALLS[1]
    assert name == "bwd" and c["out"].dtype == q.dtype and c["softmax_lse"].dtype == torch.float32
    assert c["softmax_lse"].is_contiguous() and c["softmax_lse"].shape == (H, q.shape[0])
    assert c.get("causal", c.get("is_causal")) is causal and c["softmax_scale"] == 0.3
    assert c["deterministic"] is False and c.get("dropout_p", 0.0) == 0.0 and c.get("rng_state") is None
    assert c["dk"].shape == k.shape and c["dv"].shape == v.shape  # buffers with the G heads
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for got, want in zip((dq, dk, dv), reference_bwd(dout, q, k, v, out, lse, meta, causal, 0.3)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("release", list(RELEASES))
def test_backward_takes_the_merged_out_and_lse_of_a_ring(monkeypatch, release):
    """cp=2 ring simulated with the flash kernel for every step equals the same ring on the reference
    kernel: steps over half the keys use the (out, lse) merged over both steps in their backward."""
    kernel = install(monkeypatch, release)
    lens, cp = [4, 12, 8], 2
    q, k, v = make_qkv(lens, lens)
    dout = torch.randn(q.shape).to(q.dtype)
    cu = torch.tensor(cumsum(lens))
    shards = [shard_thd({"q": q, "k": k, "v": v, "g": dout}, cu, cp, r)[0] for r in range(cp)]
    local_cu = shard_thd({"q": q}, cu, cp, 0)[1].tolist()

    def ring():
        return simulate_ring_attention(*([s[n] for s in shards] for n in "qkv"), local_cu,
                                       dout_local=[s["g"] for s in shards])  # fmt: skip

    want_outs, want_grads = ring()
    monkeypatch.setattr(varlen, "select_varlen_kernel", lambda *a, **kw: kernel)
    outs, grads = ring()
    assert {name for name, _ in CALLS} == {"fwd", "bwd"} and len(CALLS) == 2 * cp * cp
    torch.testing.assert_close(torch.cat(outs), torch.cat(want_outs))  # every rank's piece
    assert grads is not None and want_grads is not None
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)


def test_kernel_choice_by_capability_and_dtype(monkeypatch):
    pair = varlen.VARLEN_KERNELS["reference"]
    for name in ("flash3", "flash", "torch_varlen"):
        monkeypatch.setitem(varlen.VARLEN_KERNELS, name, pair)
    monkeypatch.setattr(varlen, "_cuda_capability", lambda device: (9, 0))
    select = varlen.select_varlen_kernel
    assert select("cuda", torch.bfloat16) == "flash3" and select("cuda:1", torch.float16) == "flash3"
    assert select("cuda", torch.bfloat16, capability=(8, 0)) == "flash"  # flash-attn 3 is for Hopper
    assert select("cuda", torch.float32) == "reference" and select("cpu", torch.bfloat16) == "reference"
    monkeypatch.delitem(varlen.VARLEN_KERNELS, "flash3")

    def no_capability(device):
        raise AssertionError("capability read without flash3 registered")

    monkeypatch.setattr(varlen, "_cuda_capability", no_capability)
    assert select("cuda", torch.bfloat16) == "flash"
    monkeypatch.delitem(varlen.VARLEN_KERNELS, "flash")
    assert select("cuda", torch.bfloat16) == "torch_varlen"


def test_inputs_flash_cannot_take_are_refused_with_the_fix(monkeypatch):
    kernel = install(monkeypatch, "2.8.3")
    meta = build_varlen_meta([0, 8])
    q, k, v = make_qkv([8], [8], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"fp16 or bf16 only.*float32.*bf16.*'reference'"):
        varlen.varlen_fwd(q, k, v, meta, causal=True, kernel=kernel)
    for d, match in ((12, "multiple of 8"), (264, "at most 256")):
        q, k, v = make_qkv([8], [8], d=d)
        with pytest.raises(ValueError, match=f"{match}.*has {d}"):
            varlen.varlen_fwd(q, k, v, meta, causal=True, kernel=kernel)
    assert not CALLS


def test_a_release_with_an_unknown_required_parameter_is_named(monkeypatch):
    def fwd_290(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, new_knob, window_size_left=-1, window_size_right=-1, softcap=0.0):  # fmt: skip
        raise AssertionError("called")

    kernel = install(monkeypatch, "2.9.0", fwd=fwd_290, bwd=fa2_283_bwd)
    q, k, v = make_qkv([8], [8])
    with pytest.raises(TypeError, match=r"flash-attn 2\.9\.0's fwd_290 has a required parameter 'new_knob'"
                       r".*SPEECHLM_VARLEN_KERNEL=torch_varlen.*2\.6\.3 to 2\.8\.3"):  # fmt: skip
        varlen.varlen_fwd(q, k, v, build_varlen_meta([0, 8]), causal=True, kernel=kernel)


def test_flash3_before_varlen_and_flash2_before_2_6_are_refused(monkeypatch):
    def fa3_2411_fwd(q, k, v, softmax_scale, causal, window_size, descale_q=None, descale_k=None,
                     descale_v=None, gqa_parallel=False):  # fmt: skip
        raise AssertionError("called")

    kernel = install(monkeypatch, "fa3-2025-01", fwd=fa3_2411_fwd)
    q, k, v = make_qkv([8], [8])
    meta = build_varlen_meta([0, 8])
    with pytest.raises(TypeError, match="no parameter 'cu_seqlens_q'"):
        varlen.varlen_fwd(q, k, v, meta, causal=True, kernel=kernel)

    def fa2_259_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, return_softmax, block_table):  # fmt: skip
        lse_BHS = torch.zeros(1, H, 128)  # padded to the max length, per sequence
        return q.clone(), q, k, v, q.clone(), lse_BHS, torch.empty(0), torch.zeros(2)

    kernel = install(monkeypatch, "2.5.9", fwd=fa2_259_fwd, bwd=fa2_263_bwd)
    with pytest.raises(RuntimeError, match=r"\(1, 8, 128\).*flash-attn>=2\.6"):
        varlen.varlen_fwd(q, k, v, meta, causal=True, kernel=kernel)


def test_signatures_are_read_once_per_function(monkeypatch):
    kernel = install(monkeypatch, "fa3-2026-08")
    q, k, v = make_qkv([8], [8])
    meta = build_varlen_meta([0, 8])
    varlen.varlen_fwd(q, k, v, meta, causal=True, kernel=kernel)
    misses = varlen_flash._parameters.cache_info().misses
    varlen.varlen_fwd(q, k, v, meta, causal=True, kernel=kernel)
    assert varlen_flash._parameters.cache_info().misses == misses


def test_registered_only_where_flash_attn_is_importable(monkeypatch):
    if importlib.util.find_spec("flash_attn") or importlib.util.find_spec("flash_attn_interface"):
        pytest.skip("flash-attn is installed here")
    assert "flash" not in varlen.VARLEN_KERNELS and "flash3" not in varlen.VARLEN_KERNELS
    assert varlen_flash.installed_flash_kernels() == {}
    assert "flash_attn" not in sys.modules and "flash_attn_interface" not in sys.modules  # nothing imported
    install(monkeypatch, "2.8.3")
    install(monkeypatch, "fa3-2026-08")
    assert set(varlen_flash.installed_flash_kernels()) == {"flash", "flash3"}


def test_a_flash_attn_older_than_2_6_is_not_registered(monkeypatch):
    install(monkeypatch, "2.5.9")
    with pytest.warns(UserWarning, match=r"flash-attn 2\.5\.9 is older than 2\.6.*flash-attn>=2\.6"):
        assert "flash" not in varlen_flash.installed_flash_kernels()
    install(monkeypatch, "2.8.3")
    assert "flash" in varlen_flash.installed_flash_kernels()


def test_the_environment_can_force_a_registered_kernel(monkeypatch):
    monkeypatch.setitem(varlen.VARLEN_KERNELS, "flash", varlen.VARLEN_KERNELS["reference"])
    assert varlen.select_varlen_kernel("cuda", torch.bfloat16) == "flash"
    monkeypatch.setenv("SPEECHLM_VARLEN_KERNEL", "reference")
    assert varlen.select_varlen_kernel("cuda", torch.bfloat16) == "reference"
    monkeypatch.setenv("SPEECHLM_VARLEN_KERNEL", "flash4")
    with pytest.raises(
        ValueError, match=r"SPEECHLM_VARLEN_KERNEL='flash4' is not a varlen kernel registered"
    ):
        varlen.select_varlen_kernel("cuda", torch.bfloat16)
