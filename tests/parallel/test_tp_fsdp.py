"""TP plan, FSDP2 and `parallelize` on a tiny transformers Llama, against a single-process reference.

Letters: B batch, T tokens, H heads, D head dim, V vocab.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import BACKENDS, device_for, skip_unless_backend, to_cpu
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from parallel.fsdp import clip_grad_norm_, default_mp_policy
from parallel.mesh import ParallelDims
from parallel.parallelize import parallelize
from parallel.testing import run_distributed
from parallel.tp import apply_tp, check_tp_heads

ATTN = "speechlm_test_probe"  # a custom attention function, like our backends (no mask is built)
N_BATCHES, B, T, V = 4, 2, 8, 64
LR = 0.5
MAX_NORM = 1.0  # the reference gradient norm is ~1.67, so clipping is active in (c)


def probe_attention(
    module: nn.Module,
    q_BHTD: Tensor,
    k_BGTD: Tensor,
    v_BGTD: Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention that records the head counts it receives (local heads under TP)."""
    seen = getattr(module, "seen_heads", [])
    module.seen_heads = [*seen, (q_BHTD.shape[1], k_BGTD.shape[1])]
    out_BHTD = F.scaled_dot_product_attention(
        q_BHTD, k_BGTD, v_BGTD, is_causal=True, scale=scaling, enable_gqa=True
    )
    return out_BHTD.transpose(1, 2).contiguous(), None


def build_llm(family: str = "llama") -> nn.Module:
    """Tiny fp32 decoder, GQA 4:2; Qwen2 also has q/k/v biases (sharded with their weights)."""
    AttentionInterface.register(ATTN, probe_attention)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    cfg = config_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        attn_implementation=ATTN,
    )
    torch.manual_seed(0)
    return model_cls(cfg)


def batches() -> Tensor:
    """[N_BATCHES, B, T] token ids; batch i goes to data-parallel rank i."""
    return torch.randint(0, V, (N_BATCHES, B, T), generator=torch.Generator().manual_seed(1))


def blocks_fn(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def tp_fn(model: nn.Module, tp_mesh: Any) -> None:
    apply_tp(model, tp_mesh)


def full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def grads_of(model: nn.Module) -> dict[str, Tensor | None]:
    return {k: full(v.grad) for k, v in _named_params(model).items()}


def params_of(model: nn.Module) -> dict[str, Tensor | None]:
    return {k: full(v) for k, v in _named_params(model).items()}


def _named_params(model: nn.Module) -> dict[str, Tensor]:
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.named_parameters()}


def reference(dp_batches: list[int], *, step: bool = False, family: str = "llama") -> dict[str, Any]:
    """One process: mean of the per-batch losses over `dp_batches` (equal token counts per batch)."""
    model = build_llm(family)
    ids = batches()
    losses = [model(input_ids=ids[i], labels=ids[i], use_cache=False).loss for i in dp_batches]
    out: dict[str, Any] = {"logits": model(input_ids=ids[0], use_cache=False).logits.detach()}
    loss = torch.stack(losses).mean()
    loss.backward()
    out.update(loss=loss.detach(), grads=grads_of(model))
    if step:
        out["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        torch.optim.SGD(model.parameters(), lr=LR).step()
        out["params"] = params_of(model)
    return out


# ----------------------------------------------------------------------------------------------- (a) TP


def _tp_checks(rank: int, world_size: int) -> dict[str, Any]:
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for family in ("llama", "qwen2"):
        ref_state = build_llm(family).state_dict()
        model = build_llm(family)
        model.load_state_dict(ref_state)
        apply_tp(model, tp_mesh)
        ids = batches()[0]
        res = model(input_ids=ids, labels=ids, use_cache=False)
        res.loss.backward()
        attn = model.model.layers[0].self_attn
        out[family] = {
            "logits": res.logits.detach(),
            "loss": res.loss.detach(),
            "grads": grads_of(model),
            "seen_heads": attn.seen_heads,
            "q_is_dtensor": isinstance(attn.q_proj.weight, DTensor),
            "local_q_rows": attn.q_proj.weight.to_local().shape[0],
        }
    return out


def _two_rank_worker(rank: int, world_size: int) -> dict[str, Any]:
    """One spawn for (a) and (b): spawning ranks that import transformers is the expensive part."""
    return {"tp": _tp_checks(rank, world_size), "fsdp": _fsdp_checks(rank, world_size)}


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    return run_distributed(_two_rank_worker, 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_matches_unsharded(two_rank_results: list[dict[str, Any]], family: str) -> None:
    ref = reference([0], family=family)
    for got in (r["tp"][family] for r in two_rank_results):
        assert got["q_is_dtensor"] and got["local_q_rows"] == 2 * 8  # 2 of 4 heads, head dim 8
        assert got["seen_heads"] == [(2, 1)]  # the attention function got the local heads (GQA 4:2 -> 2:1)
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        for key, want in ref["grads"].items():
            torch.testing.assert_close(got["grads"][key], want, rtol=1e-5, atol=1e-6, msg=key)


# -------------------------------------------------------------------------------------------- (b) FSDP2

# (name, ParallelDims kwargs, activation checkpointing): each layout puts rank r on batch r.
FSDP_LAYOUTS = [
    ("fsdp_dp_shard", {"dp_shard": 2}, False),
    ("fsdp_cp", {"dp_shard": 1, "cp": 2}, True),  # CP ranks shard the weights too (dp_shard_cp)
    ("hsdp_replicate", {"dp_replicate": 2, "dp_shard": 1}, False),
]


def _fsdp_checks(rank: int, world_size: int) -> dict[str, Any]:
    ids = batches()[rank]
    out = {}
    for name, kwargs, ac in FSDP_LAYOUTS:
        dims = ParallelDims(world_size=world_size, **kwargs)
        dims.build_mesh("cpu")
        model = build_llm()
        state_keys = set(model.state_dict())
        parallelize(
            model, dims, blocks_fn=blocks_fn, tp_fn=None, activation_checkpointing=ac, device_type="cpu"
        )
        assert set(model.state_dict()) == state_keys  # checkpoint wrappers do not rename state
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        out[name] = {"loss": loss.detach(), "grads": grads_of(model)}
    return out


@pytest.mark.multiproc
def test_fsdp2_averages_gradients_over_dp_shard_cp_and_replicas(
    two_rank_results: list[dict[str, Any]],
) -> None:
    results = [r["fsdp"] for r in two_rank_results]
    ref = reference([0, 1])
    for name, _, _ in FSDP_LAYOUTS:
        torch.testing.assert_close((results[0][name]["loss"] + results[1][name]["loss"]) / 2, ref["loss"])
        for got in results:  # FSDP2 averages: the gradient of the mean loss, on every rank
            for key, want in ref["grads"].items():
                torch.testing.assert_close(
                    got[name]["grads"][key], want, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}"
                )


# ------------------------------------------------------------------------------------- (c) TP x FSDP2


def _tp_fsdp_worker(rank: int, world_size: int, backend: str = "gloo") -> dict[str, Any]:
    device = device_for(backend, rank)
    dims = ParallelDims(world_size=world_size, tp=2)  # dp_shard = 2
    dims.build_mesh(device.type)
    model = build_llm().to(device)
    parallelize(
        model, dims, blocks_fn=blocks_fn, tp_fn=tp_fn, activation_checkpointing=True, device_type=device.type
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids = batches()[dims.dp_rank(rank)].to(device)  # TP peers share a batch
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    norm = clip_grad_norm_(
        model.parameters(), MAX_NORM
    )  # grads on two meshes: (dp_shard_cp, tp) and dp_shard_cp
    opt.step()
    q = model.model.layers[0].self_attn.q_proj.weight
    return to_cpu(
        {
            "loss": loss.detach(),
            "norm": norm,
            "params": params_of(model),
            "q_mesh_dims": q.device_mesh.mesh_dim_names,
        }
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_x_fsdp2_one_step_matches_single_process(backend: str) -> None:
    skip_unless_backend(backend, 4)
    results = run_distributed(_tp_fsdp_worker, 4, backend, backend)
    ref = reference([0, 1], step=True)
    losses = [r["loss"] for r in results]
    torch.testing.assert_close(losses[0], losses[1])  # TP peers compute the same loss
    torch.testing.assert_close((losses[0] + losses[2]) / 2, ref["loss"])
    for got in results:
        assert got["q_mesh_dims"] == ("dp_shard_cp", "tp")  # 2-D parameters: FSDP over TP
        torch.testing.assert_close(got["norm"], ref["norm"], rtol=1e-5, atol=1e-6)
        for key, want in ref["params"].items():
            torch.testing.assert_close(got["params"][key], want, rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------------------------------- no processes


def test_heads_not_divisible_by_tp_is_a_clear_error() -> None:
    check_tp_heads(4, 2, 2)
    with pytest.raises(ValueError, match=r"4 query heads and 2 key/value heads, and tp=3.*\[1, 2\]"):
        check_tp_heads(4, 2, 3)
    fake_mesh = SimpleNamespace(size=lambda: 4)  # apply_tp checks before touching the mesh
    with pytest.raises(ValueError, match="tp=4"):
        apply_tp(build_llm(), fake_mesh)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model.layers"):
        apply_tp(nn.Linear(2, 2), fake_mesh)  # type: ignore[arg-type]


def test_parallelize_single_process_only_checkpoints() -> None:
    dims = ParallelDims(world_size=1)
    model = build_llm()
    ids = batches()[0]
    want = model(input_ids=ids, labels=ids, use_cache=False).loss
    parallelize(
        model, dims, blocks_fn=blocks_fn, tp_fn=None, activation_checkpointing=True, device_type="cpu"
    )
    assert type(model.model.layers[0]).__name__ == "CheckpointWrapper"
    torch.testing.assert_close(model(input_ids=ids, labels=ids, use_cache=False).loss, want)
    assert default_mp_policy("cpu") is None
    assert default_mp_policy("cuda").param_dtype == torch.bfloat16


def test_clip_grad_norm_matches_torch_on_plain_tensors() -> None:
    params = [nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    for norm_type in (2.0, float("inf")):
        got = clip_grad_norm_(params, 0.5, norm_type)
        want = torch.nn.utils.clip_grad_norm_(copies, 0.5, norm_type)
        torch.testing.assert_close(got, want)
        for c, p in zip(copies, params):
            torch.testing.assert_close(p.grad, c.grad)


def _mesh_warnings(rank: int, world_size: int) -> list[str]:
    import warnings

    from parallel.parallelize import select_fsdp_mesh

    seen = []
    for kwargs in ({"dp_shard": 2}, {"dp_shard": 1, "cp": 2}, {"dp_replicate": 2, "dp_shard": 1}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dims = ParallelDims(world_size=world_size, **kwargs)
            dims.build_mesh("cpu")
            mesh = select_fsdp_mesh(dims)
            assert mesh is not None and mesh.size() == 2
            assert mesh.mesh_dim_names == (
                ("dp_replicate", "dp_shard_cp") if "dp_replicate" in kwargs else ("dp_shard_cp",)
            )
        seen += [str(w.message) for w in caught]
    # the last step above creates groups of one rank each: without this, a rank that is done first tears
    # down the store (rank 0 hosts it) while the other still registers its group there
    dist.barrier()
    return seen


@pytest.mark.multiproc
def test_the_fsdp_mesh_comes_without_the_flattened_slice_deprecation_warning() -> None:
    """torch warns once per rank ("Slicing a flattened dim from root mesh will be deprecated") when a
    flattened dim is sliced back out of the root mesh; `ParallelDims.flat_mesh` keeps the flattened meshes."""
    for seen in run_distributed(_mesh_warnings, 2):
        assert not [m for m in seen if "flattened dim" in m], seen
