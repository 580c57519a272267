"""GPU test kit for ONE CUDA GPU (`pytest -m gpu`); every test skips cleanly where CUDA is absent.

Letters: B batch, H query heads, G key/value heads, T packed tokens, S padded length, L block length,
D head dim, N sequences.

What it proves on the device, each against an fp64 reference computed on the same GPU:
- the attention kernels with log-sum-exp that ring/all-gather CP is built on (`attn_fwd_lse`,
  `attn_bwd`): bf16, fp16 and fp32, causal and not, GQA, head dims 64/128/256, odd lengths;
- the varlen interface's CUDA kernels (`torch_varlen`, and `flash` / `flash3` where flash-attn 2 / 3 is
  installed, else skipped with the reason): out, (H, T) LSE and gradients per sequence;
- every installed attention backend on THD and (where it has one) padded BSHD, forward and backward,
  against per-sequence attention;
- the CP schedule simulated on one GPU: each sequence cut into 2*cp chunks, rank r holding chunks r and
  2cp-1-r, each rank's queries attending the K/V of every rank step by step (causal on the diagonal,
  full below it, skipped above) and the partial results merged by LSE; forward and backward equal one
  unsplit causal call, for cp = 2, 4, 8; the same for all-gather CP's two varlen calls per rank;
- 3 optimizer steps of a small speech LLM on CUDA (fp32, and bf16 autocast) against the same steps on CPU.
NCCL ring attention across processes needs >= 2 GPUs: `tests/train/test_torchrun_smoke.py` (marked `gpu`)
covers it where they exist.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# max abs error allowed against fp64, relative to the reference's max abs value
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-4}
LENS = [37, 1, 130, 77, 5, 251]  # no multiple of 8 or 32, one single-token sequence


def close(a: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, floor: float = 1e-6) -> None:
    """``floor``: the smallest scale the error is measured against (a reference that is zero in exact
    arithmetic, e.g. dq of a one-token sequence, leaves only the kernel's rounding, of the operands' size)."""
    err = (a.double() - ref.double()).abs().max().item()
    scale = max(ref.double().abs().max().item(), floor)
    assert err <= TOL[dtype] * scale * 4, f"{what}: max error {err:.3g} vs scale {scale:.3g} ({dtype})"


def ref_attention(q_BHLD, k_BGLD, v_BGLD, causal: bool, scale: float) -> torch.Tensor:
    """fp64 attention with GQA by repetition (query head h uses K/V head h // (H/G))."""
    rep = q_BHLD.shape[1] // k_BGLD.shape[1]
    q, k, v = (
        x.double() for x in (q_BHLD, k_BGLD.repeat_interleave(rep, 1), v_BGLD.repeat_interleave(rep, 1))
    )
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def randn(*shape, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)


# ------------------------------------------------------------------------------------------------
# kernels with LSE
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("kernel", ["torch_varlen", "flash", "flash3"])
def test_varlen_kernel_of_the_interface_against_fp64(kernel, dtype, causal, heads):
    """A CUDA kernel of `parallel.varlen` (torch's flash varlen ops, flash-attn 2, flash-attn 3): out,
    the (H, T) LSE and the gradients against fp64 per sequence, GQA passed natively, one call for the
    whole pack."""
    from parallel.varlen import (
        VARLEN_KERNELS,
        _cuda_capability,
        build_varlen_meta,
        select_varlen_kernel,
        varlen_bwd,
        varlen_fwd,
    )

    if kernel not in VARLEN_KERNELS:
        pytest.skip(f"varlen kernel {kernel!r} is not registered here (flash-attn 2 / 3 not installed)")
    hopper = _cuda_capability(torch.device(DEV))[0] == 9
    if kernel == "flash3" and not hopper:
        pytest.skip("flash-attn 3 runs on compute capability 9.x (Hopper)")
    preferred = [
        n for n in ("flash3", "flash", "torch_varlen") if n in VARLEN_KERNELS and (hopper or n != "flash3")
    ]
    assert select_varlen_kernel(DEV, dtype) == preferred[0]
    H, G, D = heads[0], heads[1], 64
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    meta = build_varlen_meta(cu, device=DEV)
    q = randn(cu[-1], H, D, dtype=dtype, seed=1).requires_grad_()
    k = randn(cu[-1], G, D, dtype=dtype, seed=2).requires_grad_()
    v = randn(cu[-1], G, D, dtype=dtype, seed=3).requires_grad_()
    scale = D**-0.5
    out, lse = varlen_fwd(q, k, v, meta, causal=causal, scale=scale, kernel=kernel)
    assert lse.shape == (H, cu[-1]) and lse.dtype == torch.float32
    dout = randn(*out.shape, dtype=dtype, seed=4)
    dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, meta, causal=causal, scale=scale, kernel=kernel)
    refs = []
    for a, b in zip(cu, cu[1:]):
        qs, ks, vs = (x[a:b].detach().double().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))
        ref = ref_attention(qs, ks, vs, causal, scale)
        ref.backward(dout[a:b].double().transpose(0, 1)[None])
        refs.append((a, b, ref, qs.grad, ks.grad, vs.grad))
    # each gradient's error is measured against the pack's largest reference value of that gradient: the
    # one-token sequence's dq is exactly 0 (softmax over one key), leaving only fp16/bf16 rounding
    floors = [max(r[i].abs().max().item() for r in refs) for i in (3, 4, 5)]
    for a, b, ref, gq, gk, gv in refs:
        close(out[a:b].transpose(0, 1)[None], ref, dtype, f"out [{a}:{b}]")
        close(dq[a:b].transpose(0, 1)[None], gq, dtype, f"dq [{a}:{b}]", floors[0])
        close(dk[a:b].transpose(0, 1)[None], gk, dtype, f"dk [{a}:{b}]", floors[1])
        close(dv[a:b].transpose(0, 1)[None], gv, dtype, f"dv [{a}:{b}]", floors[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_kernel_with_lse_against_fp64(dtype, head_dim, causal, heads):
    from parallel.attention_ops import attn_bwd, attn_fwd_lse

    h, g = heads
    length = 77
    q = randn(2, h, length, head_dim, dtype=dtype, seed=1)
    k = randn(2, g, length, head_dim, dtype=dtype, seed=2)
    v = randn(2, g, length, head_dim, dtype=dtype, seed=3)
    scale = head_dim**-0.5
    out, lse = attn_fwd_lse(q, k, v, causal=causal, scale=scale)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, h, length)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = ref_attention(qd, kd, vd, causal, scale)
    close(out, ref, dtype, "out")
    rep = h // g
    s = (qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(length, length, dtype=torch.bool, device=DEV).triu(1), -math.inf)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1).detach(), atol=5e-2, rtol=1e-2)
    dout = randn(2, h, length, head_dim, dtype=dtype, seed=4)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, causal=causal, scale=scale)
    ref.backward(dout.double())
    for name, a, b in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dv, vd.grad)):
        assert a.shape == b.shape, name
        close(a, b, dtype, name)


# ------------------------------------------------------------------------------------------------
# backends: THD and padded BSHD, forward and backward, against per-sequence attention
# ------------------------------------------------------------------------------------------------


def thd_inputs(dtype, h=8, g=2, d=64):
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    t = int(cu[-1])
    q = randn(1, h, t, d, dtype=dtype, seed=11).requires_grad_()
    k = randn(1, g, t, d, dtype=dtype, seed=12).requires_grad_()
    v = randn(1, g, t, d, dtype=dtype, seed=13).requires_grad_()
    return q, k, v, cu


def per_sequence_reference(q, k, v, cu, scale):
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        outs.append(ref_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], True, scale))
    return torch.cat(outs, 2).transpose(1, 2)  # [1, T, H, D]


THD_BACKENDS = ["reference", "torch_varlen", "flex"]  # sdpa has no THD path (it refuses cu_seqlens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", THD_BACKENDS)
def test_backend_thd_forward_backward(name, dtype):
    from speechlm.model.attention import get_backend

    fn = get_backend(name).fn
    q, k, v, cu = thd_inputs(dtype)
    scale = 64**-0.5
    mx = max(LENS)
    out, _ = fn(None, q, k, v, None, scaling=scale, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=mx,
                max_length_k=mx)  # fmt: skip
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = per_sequence_reference(qd, kd, vd, cu, scale)
    close(out, ref, dtype, f"{name} out")
    dout = randn(*out.shape, dtype=dtype, seed=5)
    out.backward(dout)
    ref.backward(dout.double())
    for tag, a, b in (("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        close(a, b, dtype, f"{name} {tag}")


@pytest.mark.parametrize("name", ["reference", "sdpa", "flex"])
def test_backend_padded_bshd_forward_backward(name):
    from speechlm.model.attention import get_backend

    dtype = torch.bfloat16
    fn = get_backend(name).fn
    lens = [37, 130, 5]
    b, s, h, g, d = len(lens), max(lens), 8, 2, 64
    mask_BS = torch.arange(s, device=DEV)[None] < torch.tensor(lens, device=DEV)[:, None]
    q = randn(b, h, s, d, dtype=dtype, seed=21).requires_grad_()
    k = randn(b, g, s, d, dtype=dtype, seed=22).requires_grad_()
    v = randn(b, g, s, d, dtype=dtype, seed=23).requires_grad_()
    scale = d**-0.5
    out_BSHD, _ = fn(None, q, k, v, mask_BS, scaling=scale)
    dout = randn(*out_BSHD.shape, dtype=dtype, seed=24) * mask_BS[:, :, None, None]
    out_BSHD.backward(dout)
    for i, n in enumerate(lens):
        qd, kd, vd = (x[i : i + 1, :, :n].detach().double().requires_grad_() for x in (q, k, v))
        ref = ref_attention(qd, kd, vd, True, scale).transpose(1, 2)
        close(out_BSHD[i : i + 1, :n], ref, dtype, f"{name} row {i} out")
        ref.backward(dout[i : i + 1, :n].double())
        close(q.grad[i : i + 1, :, :n], qd.grad, dtype, f"{name} row {i} dq")
        close(k.grad[i : i + 1, :, :n], kd.grad, dtype, f"{name} row {i} dk")


# ------------------------------------------------------------------------------------------------
# the CP schedule, all ranks simulated on one GPU
# ------------------------------------------------------------------------------------------------


def simulate_cp_attention(q_BHLD, k_BGLD, v_BGLD, dout_BHLD, cp: int, scale: float):
    """Causal attention of one sequence split as CP splits it, every rank's ring steps run in turn.

    Chunk c of 2*cp lives on rank min(c, 2cp-1-c). At ring step s rank r holds the K/V of rank
    (r - s) mod cp. A query chunk i attends key chunk j causally if i == j, fully if j < i, not at all if
    j > i; partials merge by LSE; the backward runs each block with the merged (out, lse), summing dq
    over blocks and sending each block's dk/dv back to the chunk it came from.
    """
    from parallel.attention_ops import attn_bwd, attn_fwd_lse, merge_partials

    n_chunks = 2 * cp
    qs, ks, vs, ds = (x.chunk(n_chunks, dim=2) for x in (q_BHLD, k_BGLD, v_BGLD, dout_BHLD))
    owned = {r: (r, n_chunks - 1 - r) for r in range(cp)}
    out = [None] * n_chunks
    lse = [None] * n_chunks
    blocks: list[tuple[int, int, bool]] = []
    for r in range(cp):
        for step in range(cp):
            src = (r - step) % cp
            for i in owned[r]:
                for j in owned[src]:
                    if j > i:
                        continue
                    causal = i == j
                    o, l_ = attn_fwd_lse(qs[i], ks[j], vs[j], causal=causal, scale=scale)
                    if out[i] is None:
                        out[i], lse[i] = o.float(), l_
                    else:
                        out[i], lse[i] = merge_partials(out[i], lse[i], o.float(), l_)
                    blocks.append((i, j, causal))
    dq = [torch.zeros_like(x, dtype=torch.float32) for x in qs]
    dk = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
    dv = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
    for i, j, causal in blocks:
        o = out[i].to(q_BHLD.dtype)
        a, b, c = attn_bwd(ds[i], qs[i], ks[j], vs[j], o, lse[i], causal=causal, scale=scale)
        dq[i] += a.float()
        dk[j] += b.float()
        dv[j] += c.float()
    return (torch.cat(out, 2), torch.cat(dq, 2), torch.cat(dk, 2), torch.cat(dv, 2), len(blocks))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_schedule_on_one_gpu_equals_one_unsplit_call(cp):
    dtype = torch.bfloat16
    length = 2 * cp * 24  # legal CP length: a multiple of 2*cp
    q = randn(1, 8, length, 64, dtype=dtype, seed=31)
    k = randn(1, 2, length, 64, dtype=dtype, seed=32)
    v = randn(1, 2, length, 64, dtype=dtype, seed=33)
    dout = randn(1, 8, length, 64, dtype=dtype, seed=34)
    scale = 0.125
    out, dq, dk, dv, n_blocks = simulate_cp_attention(q, k, v, dout, cp, scale)
    assert n_blocks == 2 * cp * (2 * cp + 1) // 2  # every causal pair of chunks once, no more
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = ref_attention(qd, kd, vd, True, scale)
    ref.backward(dout.double())
    close(out, ref, dtype, "out")
    for tag, a, b in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dv, vd.grad)):
        close(a, b, dtype, tag)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_allgather_cp_on_one_gpu_equals_one_unsplit_call(cp, dtype):
    """All-gather CP attention's varlen calls (`plan_allgather`: the local pair's causal diagonal, every
    sequence's prefix in one call) for all cp ranks on one GPU, through the kernel the varlen interface
    picks for the device and dtype (torch's flash varlen, or flash-attn's), against fp64."""
    from parallel.allgather_attention import simulate_allgather_attention
    from parallel.varlen import KERNEL_CALLS, select_varlen_kernel

    cu = [0]
    for n in (1, 3, 2, 7, 1):  # chunk sizes in units of 2*cp: one sequence of exactly 2*cp tokens
        cu.append(cu[-1] + 2 * cp * n)
    T, scale = cu[-1], 0.125
    q, dout = randn(T, 8, 64, dtype=dtype, seed=41), randn(T, 8, 64, dtype=dtype, seed=44)
    k, v = randn(T, 2, 64, dtype=dtype, seed=42), randn(T, 2, 64, dtype=dtype, seed=43)
    KERNEL_CALLS.clear()
    out, (dq, dk, dv) = simulate_allgather_attention(q, k, v, cu, cp, dout, scale)
    assert KERNEL_CALLS == {"fwd": 2 * cp, "bwd": 2 * cp}, select_varlen_kernel(DEV, dtype)
    ref_out = torch.empty(T, 8, 64, dtype=torch.float64, device=DEV)
    grads = [torch.empty(x.shape, dtype=torch.float64, device=DEV) for x in (q, k, v)]
    for a, b in zip(cu, cu[1:]):
        qd, kd, vd = (x[a:b].double().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))
        ref = ref_attention(qd, kd, vd, True, scale)
        ref.backward(dout[a:b].double().transpose(0, 1)[None])
        ref_out[a:b] = ref.detach()[0].transpose(0, 1)
        for g, x in zip(grads, (qd, kd, vd)):
            g[a:b] = x.grad[0].transpose(0, 1)
    close(out, ref_out, dtype, "out")
    for tag, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        close(got, want, dtype, tag)


# ------------------------------------------------------------------------------------------------
# training steps: CUDA against CPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_three_training_steps_cuda_match_cpu(precision):
    """Same model, data and seed: losses of 3 optimizer steps on CUDA vs CPU fp32.

    fp32 on CUDA: relative 1e-3 (TF32 is off; kernels differ in summation order). bf16 autocast:
    relative 3e-2 per step (bf16 has 8 bits of mantissa; the loss is a mean over ~100 tokens)."""
    from parallel_harness import build_model, global_steps, tiny_config

    from speechlm.train.precision import decide_precision
    from speechlm.train.schedule import build_optimizer
    from speechlm.train.step import StepContext, run_optimizer_step

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def run(device: str, autocast: bool) -> list[float]:
        cfg = tiny_config()
        model = build_model(cfg).to(device)
        policy = decide_precision(
            "bf16" if autocast else "32", device.split(":")[0], fully_sharded=False, bf16_supported=True
        )
        ctx = StepContext(precision=policy)  # bf16: autocast (no FSDP here)
        opt, sched = build_optimizer(model, cfg)
        losses = []
        for step, micro in enumerate(global_steps(3, 1)):
            micro = [b.to(device) for b in micro]
            res = run_optimizer_step(model, micro, ctx, opt, sched, cfg, step=step)
            losses.append(res["loss"])
        return losses

    cpu = run("cpu", False)
    gpu = run(DEV, precision == "bf16")
    rel = 1e-3 if precision == "32" else 3e-2
    for step, (a, b) in enumerate(zip(cpu, gpu)):
        assert b == pytest.approx(a, rel=rel), f"step {step}: cuda {b} vs cpu {a}"


# ------------------------------------------------------------------------------------------------
# flex: one compile serves every pack length
# ------------------------------------------------------------------------------------------------


def test_flex_over_ten_pack_lengths_compiles_a_bounded_number_of_graphs():
    """A static compile recompiled per length and, past dynamo's limit of 8, fell back to unfused flex."""
    import warnings

    from torch._dynamo.utils import counters

    from speechlm.model.attention import get_backend

    fn = get_backend("flex").fn
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            lens = [37 + 13 * i, 101, 5 + i]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
            t = int(cu[-1])
            q = randn(1, 8, t, 64, dtype=torch.bfloat16, seed=i).requires_grad_()
            k = randn(1, 2, t, 64, dtype=torch.bfloat16, seed=i + 1).requires_grad_()
            v = randn(1, 2, t, 64, dtype=torch.bfloat16, seed=i + 2).requires_grad_()
            out, _ = fn(None, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                        max_length_q=max(lens), max_length_k=max(lens))  # fmt: skip
            out.float().sum().backward()
            qd, kd, vd = (x.detach().double() for x in (q, k, v))
            close(out, per_sequence_reference(qd, kd, vd, cu, 0.125), torch.bfloat16, f"length {t}")
    unfused = [w for w in caught if "without torch.compile" in str(w.message)]
    assert not unfused, "flex fell back to the unfused kernel (recompile limit reached)"
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 6, f"{graphs} graphs compiled for 10 pack lengths"
