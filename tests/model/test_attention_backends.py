"""Attention backends: registry, reference THD/BSHD, sdpa, flex (CPU forward), and mocked flash/te/torch_varlen.

Letters: B batch, H query heads, G key/value heads, T packed tokens, S padded length, D head dim.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from te_stub import install_te_module
from transformers import AttentionInterface  # imported before any test puts a fake flash_attn in sys.modules

import speechlm.model.attention.registry as registry
import speechlm.model.attention.torch_varlen as torch_varlen_mod
from parallel.backend_caps import BACKENDS
from speechlm.model.attention import (
    BackendUnavailableError,
    available_backends,
    ensure_registered,
    get_backend,
    register_backend,
)
from speechlm.model.attention.flash import attend_flash
from speechlm.model.attention.flex import attend_flex, get_document_block_mask
from speechlm.model.attention.reference import attend_reference
from speechlm.model.attention.sdpa import attend_sdpa
from speechlm.model.attention.te import _CORES, attend_te
from speechlm.model.attention.torch_varlen import attend_torch_varlen

CU = torch.tensor([0, 5, 12, 15], dtype=torch.int32)
T, H, G, D = 15, 4, 2, 8
SCALE = 0.3


def qkv_thd(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, H, T, D, generator=g),
        torch.randn(1, G, T, D, generator=g),
        torch.randn(1, G, T, D, generator=g),
    )


def varlen_loop(q_THD, k_TGD, v_TGD, cu_q, cu_k, *, causal: bool, scale: float) -> torch.Tensor:
    """Per-sequence SDPA on THD tensors (the stand-in kernel of the mocks)."""
    outs = []
    for s, e, sk, ek in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        o = torch.nn.functional.scaled_dot_product_attention(
            q_THD[s:e].transpose(0, 1),
            k_TGD[sk:ek].transpose(0, 1),
            v_TGD[sk:ek].transpose(0, 1),
            is_causal=causal,
            scale=scale,
            enable_gqa=q_THD.shape[1] != k_TGD.shape[1],
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def thd_kwargs(cu: torch.Tensor = CU) -> dict:
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)


def separate_runs(q_1HTD, k_1GTD, v_1GTD, cu=CU, scale=SCALE) -> torch.Tensor:
    """Per-sequence SDPA with K/V heads repeated by hand: ``[1, T, H, D]``."""
    outs = []
    rep = q_1HTD.shape[1] // k_1GTD.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        q = q_1HTD[:, :, s:e]
        k = k_1GTD[:, :, s:e].repeat_interleave(rep, dim=1)
        v = v_1GTD[:, :, s:e].repeat_interleave(rep, dim=1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
    return torch.cat(outs, dim=2).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_registry_lists_and_registers_with_transformers():
    assert {"reference", "sdpa", "flex", "torch_varlen"} <= set(available_backends())
    assert get_backend("reference").caps.thd and not get_backend("sdpa").caps.thd
    impl = ensure_registered("reference")
    assert impl == "speechlm_reference" and AttentionInterface._global_mapping[impl] is attend_reference
    with pytest.raises(KeyError, match="unknown attention backend 'nope'"):
        get_backend("nope")
    with pytest.raises(KeyError, match="backend_caps"):
        register_backend("my_new_backend", attend_reference)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("reference", attend_sdpa)


@pytest.mark.parametrize("name,extra", [("flash", "flash"), ("te", "te")])
def test_missing_module_names_the_pip_extra(monkeypatch, name, extra):
    monkeypatch.setattr(registry, "is_installed", lambda n: n != name)
    with pytest.raises(BackendUnavailableError, match=rf"pip install speechlm\[{extra}\]"):
        ensure_registered(name)


def test_flash_and_te_import_errors_are_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    q, k, v = qkv_thd()
    with pytest.raises(BackendUnavailableError, match=r"speechlm\[flash\]"):
        attend_flash(None, q, k, v, None, **thd_kwargs())
    with pytest.raises(BackendUnavailableError, match=r"speechlm\[te\]"):
        attend_te(None, q, k, v, None, **thd_kwargs())


# ---------------------------------------------------------------------------------------------
# Reference and sdpa
# ---------------------------------------------------------------------------------------------


def test_reference_thd_equals_separate_runs_with_gqa_and_gradients():
    q, k, v = (x.requires_grad_() for x in qkv_thd())
    out, weights = attend_reference(None, q, k, v, None, scaling=SCALE, **thd_kwargs())
    assert weights is None and out.shape == (1, T, H, D)
    torch.testing.assert_close(out, separate_runs(q, k, v))
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_reference_delegates_to_the_cp_context():
    seen = {}

    class FakeCP:
        def attention(self, q_THD, k_THD, v_THD, cu_seqlens_local, scale):
            seen.update(q=q_THD.shape, k=k_THD.shape, cu=cu_seqlens_local, scale=scale)
            return torch.zeros_like(q_THD)

    q, k, v = qkv_thd()
    out, _ = attend_reference(None, q, k, v, None, scaling=SCALE, cp_context=FakeCP(), **thd_kwargs())
    assert out.shape == (1, T, H, D) and seen["q"] == (T, H, D) and seen["k"] == (T, G, D)
    assert seen["scale"] == SCALE and seen["cu"].dtype == torch.int32 and torch.equal(seen["cu"], CU)
    with pytest.raises(ValueError, match="needs a THD batch"):
        attend_reference(None, q, k, v, None, cp_context=FakeCP())


def test_reference_bshd_matches_rows_and_left_padding_has_no_nan():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, H, 6, D, generator=g),
        torch.randn(2, G, 6, D, generator=g),
        torch.randn(2, G, 6, D, generator=g),
    )
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = attend_reference(None, q, k, v, right, scaling=SCALE)
    alone = separate_runs(q[:1, :, :4], k[:1, :, :4], v[:1, :, :4], cu=torch.tensor([0, 4]))
    torch.testing.assert_close(out[:1, :4], alone)
    left = right.flip(1)
    out_left, _ = attend_reference(None, q, k, v, left, scaling=SCALE)
    assert torch.isfinite(out_left).all()
    alone = separate_runs(q[:1, :, 2:], k[:1, :, 2:], v[:1, :, 2:], cu=torch.tensor([0, 4]))
    torch.testing.assert_close(out_left[:1, 2:], alone)


def test_reference_uses_one_varlen_call_with_the_micro_batch_meta(monkeypatch):
    """The one-process THD path is one call into parallel.varlen (not one per sequence length), and it
    takes the boundaries SpeechLLM.forward_packed read once per micro-batch instead of reading them."""
    import speechlm.model.attention.reference as reference_mod
    from parallel.varlen import KERNEL_CALLS, build_varlen_meta, varlen_attention

    calls = []

    def spy(q, k, v, meta, **kwargs):
        calls.append((meta, kwargs))
        return varlen_attention(q, k, v, meta, **kwargs)

    monkeypatch.setattr(reference_mod, "varlen_attention", spy)
    q, k, v = qkv_thd()
    kw = thd_kwargs()
    KERNEL_CALLS.clear()
    out, _ = attend_reference(None, q, k, v, None, scaling=SCALE, **kw)
    assert len(calls) == 1 and calls[0][1] == dict(causal=True, scale=SCALE) and KERNEL_CALLS["fwd"] == 1
    assert list(calls[0][0].cu_q) == kw["cu_seq_lens_q"].tolist()
    torch.testing.assert_close(out, separate_runs(q, k, v))
    given = build_varlen_meta(kw["cu_seq_lens_q"])
    attend_reference(None, q, k, v, None, scaling=SCALE, varlen_meta=given, **kw)
    assert calls[1][0] is given


def test_sdpa_rejects_thd_and_matches_reference_on_padded():
    q, k, v = qkv_thd()
    with pytest.raises(ValueError, match="sdpa has no THD path"):
        attend_sdpa(None, q, k, v, None, **thd_kwargs())
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[0, 11:] = False
    a, _ = attend_sdpa(None, q, k, v, mask, scaling=SCALE)
    b, _ = attend_reference(None, q, k, v, mask, scaling=SCALE)
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# Flex (forward on CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_thd_forward_matches_reference_and_caches_block_masks():
    q, k, v = qkv_thd()
    out, _ = attend_flex(None, q, k, v, None, scaling=SCALE, **thd_kwargs())
    torch.testing.assert_close(out, separate_runs(q, k, v), atol=1e-5, rtol=1e-5)
    assert get_document_block_mask(CU, T, q.device) is get_document_block_mask(CU.clone(), T, q.device)
    with pytest.raises(ValueError, match="dropout"):
        attend_flex(None, q, k, v, None, dropout=0.1, **thd_kwargs())


# ---------------------------------------------------------------------------------------------
# Mocked kernels: what we pass to flash-attn, transformer-engine and torch varlen
# ---------------------------------------------------------------------------------------------


def _fake_varlen(calls: list):
    def flash_attn_varlen_func(
        q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal
    ):
        calls.append(
            dict(
                q=q,
                k=k,
                v=v,
                cu_q=cu_seqlens_q,
                cu_k=cu_seqlens_k,
                max_q=max_seqlen_q,
                max_k=max_seqlen_k,
                dropout_p=dropout_p,
                scale=softmax_scale,
                causal=causal,
            )
        )
        return varlen_loop(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=softmax_scale)

    return flash_attn_varlen_func


def test_flash_thd_arguments(monkeypatch):
    calls: list = []
    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_fake_varlen(calls))
    )
    q, k, v = qkv_thd()
    out, _ = attend_flash(None, q, k, v, None, scaling=SCALE, **thd_kwargs(CU.long()))
    (c,) = calls
    assert c["q"].shape == (T, H, D) and c["k"].shape == (T, G, D) and c["v"].shape == (T, G, D)
    assert all(c[x].is_contiguous() for x in ("q", "k", "v"))
    assert c["cu_q"].dtype == torch.int32 and c["cu_q"].device == q.device and torch.equal(c["cu_q"], CU)
    assert (c["max_q"], c["max_k"], c["causal"], c["scale"], c["dropout_p"]) == (7, 7, True, SCALE, 0.0)
    torch.testing.assert_close(out, separate_runs(q, k, v))


def test_flash_bshd_unpads_with_cu_seqlens_from_the_mask(monkeypatch):
    calls: list = []
    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_fake_varlen(calls))
    )
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(2, H, 6, D, generator=g),
        torch.randn(2, G, 6, D, generator=g),
        torch.randn(2, G, 6, D, generator=g),
    )
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = attend_flash(None, q, k, v, mask, scaling=SCALE)
    (c,) = calls
    assert c["cu_q"].tolist() == [0, 4, 10] and c["q"].shape == (10, H, D) and c["max_q"] == 6
    ref, _ = attend_reference(None, q, k, v, mask, scaling=SCALE)
    torch.testing.assert_close(out[mask], ref[mask])
    assert torch.all(out[0, 4:] == 0)


def test_te_thd_arguments(monkeypatch):
    inits: list = []
    calls: list = []

    class FakeDPA(torch.nn.Module):
        def __init__(self, **kw):
            super().__init__()
            inits.append(kw)
            self.kw = kw

        def forward(self, q, k, v, **kw):
            calls.append(dict(q=q, k=k, v=v, training=self.training, **kw))
            out = varlen_loop(
                q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_kv"], causal=True, scale=self.kw["softmax_scale"]
            )
            return out.reshape(q.shape[0], -1)  # TE returns [T, H * D] for thd

    install_te_module(monkeypatch, FakeDPA)
    q, k, v = qkv_thd()
    out, _ = attend_te(None, q, k, v, None, scaling=SCALE, **thd_kwargs())
    attend_te(None, q, k, v, None, scaling=SCALE, **thd_kwargs())
    assert len(inits) == 1  # one core per (heads, groups, head dim, scale, dropout)
    assert inits[0] == dict(
        num_attention_heads=H,
        kv_channels=D,
        num_gqa_groups=G,
        attention_dropout=0.0,
        qkv_format="thd",
        attn_mask_type="padding_causal",
        softmax_scale=SCALE,
    )
    c = calls[0]
    assert c["q"].shape == (T, H, D) and c["k"].shape == (T, G, D)
    assert c["qkv_format"] == "thd" and c["attn_mask_type"] == "padding_causal"
    assert c["cu_seqlens_q"].dtype == torch.int32 and torch.equal(c["cu_seqlens_kv"], CU)
    assert (c["max_seqlen_q"], c["max_seqlen_kv"]) == (7, 7)
    torch.testing.assert_close(out, separate_runs(q, k, v))
    # training mode follows the calling module (dropout is 0 here: TE must still train)
    layer = torch.nn.Linear(1, 1)
    attend_te(layer.train(), q, k, v, None, scaling=SCALE, **thd_kwargs())
    attend_te(layer.eval(), q, k, v, None, scaling=SCALE, **thd_kwargs())
    assert [c["training"] for c in calls[2:]] == [True, False]
    _CORES.clear()


def test_torch_varlen_arguments_and_cpu_refusal(monkeypatch):
    q, k, v = qkv_thd()
    with pytest.raises(BackendUnavailableError, match="CUDA only"):
        attend_torch_varlen(None, q, k, v, None, **thd_kwargs())
    with pytest.raises(ValueError, match="no padded"):
        attend_torch_varlen(None, q, k, v, None)
    calls: list = []

    def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        calls.append(
            dict(q=q.shape, k=k.shape, cu=cu_q, max_q=max_q, scale=scale, window=window_size, gqa=enable_gqa)
        )
        return varlen_loop(q, k, v, cu_q, cu_k, causal=True, scale=scale)

    monkeypatch.setattr(torch_varlen_mod, "check_device", lambda device: None)
    monkeypatch.setattr(torch_varlen_mod, "_import_varlen_attn", lambda: fake_varlen_attn)
    out, _ = attend_torch_varlen(None, q, k, v, None, scaling=SCALE, **thd_kwargs())
    (c,) = calls
    assert c["q"] == (T, H, D) and c["k"] == (T, G, D) and c["cu"].dtype == torch.int32
    assert (c["max_q"], c["scale"], c["window"], c["gqa"]) == (7, SCALE, (-1, 0), True)
    torch.testing.assert_close(out, separate_runs(q, k, v))


def test_torch_varlen_shim_for_torch_2_10_and_2_11_signature(monkeypatch):
    """torch 2.10/2.11's varlen_attn has no enable_gqa: K/V heads are repeated, gradients summed back."""
    q, k, v = (t.requires_grad_() for t in qkv_thd(1))
    calls: list = []

    def old_varlen_attn(
        q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        calls.append(dict(k=k.shape, window=window_size, scale=scale))
        return varlen_loop(q, k, v, cu_q, cu_k, causal=True, scale=scale)

    monkeypatch.setattr(torch_varlen_mod, "check_device", lambda device: None)
    monkeypatch.setattr(torch_varlen_mod, "_import_varlen_attn", lambda: old_varlen_attn)
    out, _ = attend_torch_varlen(None, q, k, v, None, scaling=SCALE, **thd_kwargs())
    (c,) = calls
    assert c["k"] == (T, H, D) and c["window"] == (-1, 0) and c["scale"] == SCALE  # repeated to H heads
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = separate_runs(q2, k2, v2)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad)  # dk/dv are [1, G, T, D]: summed over each group


def test_mocked_flash_through_a_real_llama(monkeypatch):
    """The registry wiring end to end: transformers calls our flash function with the cu_seqlens we pass."""
    from speechlm.config import LLMConfig
    from speechlm.model.llm import build_llm

    calls: list = []
    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_fake_varlen(calls))
    )
    cfg = LLMConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    flash_llm = build_llm(
        cfg,
        vocab_size=40,
        pad_id=0,
        bos_id=2,
        eos_id=3,
        dropout=0.0,
        attn_implementation=ensure_registered("flash"),
    )
    ref_llm = build_llm(
        cfg,
        vocab_size=40,
        pad_id=0,
        bos_id=2,
        eos_id=3,
        dropout=0.0,
        attn_implementation=ensure_registered("reference"),
    )
    ref_llm.load_state_dict(flash_llm.state_dict())
    x = torch.randn(1, T, 32)
    pos = torch.cat([torch.arange(n) for n in (5, 7, 3)])[None]
    kw = dict(inputs_embeds=x, position_ids=pos, **thd_kwargs())
    torch.testing.assert_close(flash_llm(**kw).logits, ref_llm(**kw).logits)
    assert flash_llm.config._attn_implementation == "speechlm_fa"
    assert len(calls) == 2 and calls[0]["q"].shape == (T, 4, 8) and calls[0]["k"].shape == (T, 2, 8)


def test_reference_thd_under_autocast_with_mixed_qkv_dtypes():
    """Under autocast transformers' rotary embedding leaves q/k in fp32 while v is bf16."""
    q, k, v = qkv_thd()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attend_reference(None, q, k, v.bfloat16(), None, scaling=SCALE, **thd_kwargs())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), separate_runs(q, k, v), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", [n for n, b in BACKENDS.items() if not b.cp and b.thd])
def test_backends_without_cp_refuse_a_cp_context(name):
    """Backends without a CP path (reference and te have one) fail loudly rather than attend locally."""
    from speechlm.model.attention.registry import get_backend

    q = torch.randn(1, 2, 8, 4)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="no context-parallel path"):
        get_backend(name).fn(
            None,
            q,
            q,
            q,
            None,
            scaling=0.5,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=8,
            max_length_k=8,
            cp_context=object(),
        )


def test_attention_backend_decorator_applies_the_shared_checks(monkeypatch):
    """One place does what every backend opened with: dtypes, scale, CP and dropout refusals."""
    import torch

    from speechlm.model.attention import registry

    monkeypatch.setattr(registry, "_REGISTRY", {})
    seen: dict = {}

    @registry.attention_backend("torch_varlen", has_dropout=False)  # its capability row: no CP path
    def impl(module, q, k, v, mask, *, scale, dropout, **kwargs):
        seen.update(dtypes={q.dtype, k.dtype, v.dtype}, scale=scale, dropout=dropout, kwargs=sorted(kwargs))
        return q, None

    q, k64 = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    impl(None, q, k64, k64, None, position_ids=None)
    assert seen == {"dtypes": {torch.float32}, "scale": 0.5, "dropout": 0.0, "kwargs": ["position_ids"]}
    impl(None, q, q, q, None, scaling=0.125)
    assert seen["scale"] == 0.125
    assert registry.get_backend("torch_varlen").fn is impl
    with pytest.raises(ValueError, match="no context-parallel path"):
        impl(None, q, q, q, None, cp_context=object())
    with pytest.raises(ValueError, match="no attention dropout"):
        impl(None, q, q, q, None, dropout=0.1)
    with pytest.raises(KeyError, match="backend_caps"):
        registry.attention_backend("nonexistent")
