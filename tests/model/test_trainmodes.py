"""What trains (model.llm.train full/frozen/lora, model.encoder.train full/frozen), in one process.

The model is the layout tests' tiny SpeechLLM (tests/parallel_harness.py) on a random pretrained LLM
directory (tests/trainmodes_helpers.py); steps run through `run_optimizer_step`, as training does.
"""

from __future__ import annotations

import pytest
import torch
from parallel_harness import ADDED_IDS, TOK, build_model, global_steps, run_steps, tiny_config
from trainmodes_helpers import lora_overrides, make_tiny_llm_dir

from speechlm.config import apply_override
from speechlm.model.trainable import (
    merge_lora,
    train_modes_of,
    trainable_state_dict,
)
from speechlm.train.schedule import build_optimizer
from speechlm.train.step import StepContext


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return make_tiny_llm_dir(tmp_path_factory.mktemp("tiny_llm"), vocab_size=TOK.vocab_size)


def config(llm_dir, *overrides: str):
    cfg = tiny_config()
    for o in (f"model.llm.pretrained={llm_dir}", *overrides):
        apply_override(cfg, o)
    return cfg


def built(cfg):
    return build_model(cfg)  # the harness applies the train modes, as SpeechLLMModule does


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(before: dict[str, torch.Tensor], model) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


STEPS = global_steps(3, 1)


def trained(cfg):
    """(model, names of the parameters that changed) after the 3 optimizer steps of STEPS."""
    model = built(cfg)
    before = snapshot(model)
    run_steps(model, StepContext(), cfg, STEPS)
    return model, changed(before, model)


def test_frozen_llm_is_bit_identical_after_steps_and_has_no_optimizer_state(llm_dir):
    cfg = config(llm_dir, "model.llm.train=frozen")
    model, moved = trained(cfg)
    assert not {n for n in moved if n.startswith("llm.")}, "a frozen LLM parameter changed"
    for prefix in ("encoder.", "projector.", "ctc_head.", "added_rows."):
        assert any(n.startswith(prefix) for n in moved), f"{prefix} did not train"
    opt, _ = build_optimizer(model, cfg)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in in_opt for p in model.llm.parameters())


def test_lora_trains_only_adapters_projector_encoder(llm_dir):
    model, moved = trained(config(llm_dir, *lora_overrides()))
    names = [n for n, _ in model.llm.named_parameters()]
    assert any(".q_proj.lora_A." in n for n in names) and any(".down_proj.lora_B." in n for n in names)
    assert "llm.model.layers.0.self_attn.q_proj.base_layer.weight" in train_modes_of(model).frozen
    llm_moved = {n for n in moved if n.startswith("llm.")}
    assert llm_moved and all(".lora_A." in n or ".lora_B." in n for n in llm_moved), llm_moved
    for prefix in ("encoder.", "projector.", "ctc_head.", "added_rows."):
        assert any(n.startswith(prefix) for n in moved), f"{prefix} did not train"


def test_frozen_encoder_keeps_its_weights_and_runs_without_autograd(llm_dir):
    cfg = config(llm_dir, "model.encoder.train=frozen")
    model, moved = trained(cfg)
    assert not {n for n in moved if n.startswith("encoder.")}
    assert all(p.grad is None for p in model.encoder.parameters())
    assert any(n.startswith("llm.") for n in moved) and any(n.startswith("projector.") for n in moved)
    opt, _ = build_optimizer(model, cfg)
    assert [len(g["params"]) for g in opt.param_groups if g["name"] == "encoder"] == [0]


def test_full_mode_changes_nothing(llm_dir):
    """model.llm.train=full (the default): every parameter trains, nothing is recorded as frozen."""
    cfg = config(llm_dir)
    model = built(cfg)
    assert all(p.requires_grad for p in model.parameters())
    assert train_modes_of(model).frozen == frozenset() and train_modes_of(model).fingerprints == {}
    assert set(trainable_state_dict(model)) == set(model.state_dict())


def test_trainable_state_dict_leaves_out_the_frozen_base(llm_dir):
    model = built(config(llm_dir, *lora_overrides()))
    state = trainable_state_dict(model)
    assert not any(".base_layer." in k or "embed_tokens" in k or "lm_head" in k for k in state)
    assert any(".lora_B." in k for k in state) and any(k.startswith("encoder.") for k in state)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    kept = sum(v.numel() for v in state.values())
    assert kept == sum(v.numel() for v in model.state_dict().values()) - frozen
    llm_kept = sum(v.numel() for k, v in state.items() if k.startswith("llm."))
    assert llm_kept < frozen / 4, "the LLM's share of a LoRA checkpoint must be much smaller than its base"


def test_fingerprint_names_the_base_and_ignores_lora_targets(llm_dir, tmp_path):
    a = built(config(llm_dir, "model.llm.train=frozen"))
    b = built(config(llm_dir, *lora_overrides(), "model.llm.lora.target_modules=[q_proj,v_proj]"))
    c = built(config(llm_dir, *lora_overrides()))
    fa, fb, fc = (train_modes_of(m).fingerprints["llm"] for m in (a, b, c))
    assert fa == fb == fc, "the same base weights must give the same fingerprint whatever is adapted"
    other = make_tiny_llm_dir(tmp_path / "other", vocab_size=TOK.vocab_size, seed=1)
    assert train_modes_of(built(config(other, "model.llm.train=frozen"))).fingerprints["llm"] != fa


def test_unknown_lora_target_is_an_error_naming_the_layers(llm_dir):
    with pytest.raises(ValueError, match=r"target_modules: qkv_proj name no module.*q_proj"):
        built(config(llm_dir, *lora_overrides(), "model.llm.lora.target_modules=[qkv_proj]"))


def test_lora_with_zero_adapters_gives_the_base_logits_through_the_packed_path(llm_dir):
    """A LoRA model whose adapters are still zero (lora_B = 0 at init) computes the base model's logits
    exactly on the THD path: the attention backend receives the same q/k/v and the extra keyword
    arguments (cu_seq_lens_q, varlen_meta, cp_context, logits_to_keep) pass through unchanged."""
    base = build_model(config(llm_dir), added_token_ids=ADDED_IDS)  # the same rows at the mean
    lora = built(config(llm_dir, *lora_overrides()))
    batch = STEPS[0][0]
    torch.manual_seed(0)
    got = []
    for model in (base, lora):
        model.load_state_dict(base.state_dict(), strict=False)  # same encoder/projector weights
        model.eval()
        with torch.no_grad():
            got.append(model(batch).ce_sum)
    assert torch.equal(got[0], got[1])


def test_merged_lora_logits_equal_the_unmerged_model(llm_dir):
    cfg = config(llm_dir, *lora_overrides())
    model = built(cfg)
    run_steps(model, StepContext(), cfg, STEPS[:2])  # adapters move away from zero
    assert any(p.abs().sum() > 0 for n, p in model.llm.named_parameters() if ".lora_B." in n)
    merged = merge_lora(model.llm)
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    assert set(merged.state_dict()) == set(build_model(config(llm_dir)).llm.state_dict())
    ids = torch.randint(0, TOK.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    model.llm.eval()
    merged.eval()
    with torch.no_grad():
        ref = model.llm(input_ids=ids).logits
        out = merged(input_ids=ids).logits
    assert (out - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))
    assert any(".lora_A." in n for n, _ in model.llm.named_parameters()), "merge_lora changed its input"


def test_lora_dropout_is_active_in_training_on_a_pretrained_llm(llm_dir):
    """from_pretrained returns an eval-mode model; the adapters' dropout must still be on in training
    (model.llm.lora.dropout is not silently ignored)."""
    model = built(config(llm_dir, *lora_overrides(dropout=0.5)))
    drops = [m for n, m in model.llm.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and all(m.training and m.p == 0.5 for m in drops)


def save_trainable(model, ckpt) -> None:
    """A checkpoint as training writes it (DCP shards of the trained state, meta.pt with the base)."""
    import torch.distributed.checkpoint as dcp

    modes = train_modes_of(model)
    dcp.save({"state_dict": trainable_state_dict(model)}, checkpoint_id=ckpt, no_dist=True)
    torch.save({"speechlm": {"base": modes.as_record()}}, ckpt / "meta.pt")


def load_into(model, ckpt):
    from speechlm.train.checkpoint import load_trained_state

    modes = train_modes_of(model)
    return load_trained_state(model, [], ckpt, frozen=modes.frozen, fingerprints=modes.fingerprints)


def test_trained_state_loads_onto_the_same_base_and_is_refused_elsewhere(llm_dir, tmp_path):
    from speechlm.train.checkpoint import CheckpointError

    cfg = config(llm_dir, *lora_overrides())
    model = built(cfg)
    run_steps(model, StepContext(), cfg, STEPS[:1])
    save_trainable(model, tmp_path / "ckpt")
    torch.manual_seed(99)
    fresh = built(cfg)
    load_into(fresh, tmp_path / "ckpt")
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    other = make_tiny_llm_dir(tmp_path / "other", vocab_size=TOK.vocab_size, seed=1)
    with pytest.raises(CheckpointError, match=r"frozen llm .*differs.*model\.llm\.pretrained"):
        load_into(built(config(other, *lora_overrides())), tmp_path / "ckpt")
    for mode in (["model.llm.train=frozen"], [], [*lora_overrides(rank=2)]):
        with pytest.raises(CheckpointError, match=r"saved with model\.llm\.train=lora"):
            load_into(built(config(llm_dir, *mode)), tmp_path / "ckpt")


def test_greedy_decoding_of_a_lora_model_with_kv_cache_equals_the_recompute_oracle(llm_dir):
    """Evaluation decodes through peft's adapted layers with the batched KV cache: the same ids as the
    prefix-recompute oracle."""
    cfg = config(llm_dir, *lora_overrides())
    model = built(cfg)
    run_steps(model, StepContext(), cfg, STEPS[:1])
    batch = STEPS[0][0]
    cached = model.generate_greedy(batch.audio, batch.audio_lens, max_new_tokens=6, use_cache=True)
    oracle = model.generate_greedy(batch.audio, batch.audio_lens, max_new_tokens=6, use_cache=False)
    assert cached == oracle and any(len(h) > 0 for h in cached)


def test_a_tied_lm_head_is_left_out_under_both_names_and_loads_back(tmp_path):
    """A pretrained LLM whose LM head is its embedding (SmolLM2, small Qwen): the frozen matrix is left
    out of the checkpoint under both state-dict names, and the load gives the tied model back."""
    tied = make_tiny_llm_dir(tmp_path / "tied", vocab_size=TOK.vocab_size, tied=True)
    cfg = config(tied, *lora_overrides())
    model = built(cfg)
    assert model.llm.lm_head.weight is model.llm.get_input_embeddings().weight
    assert {"llm.lm_head.weight", "llm.model.embed_tokens.weight"} <= train_modes_of(model).frozen
    assert not any("lm_head" in k or "embed_tokens" in k for k in trainable_state_dict(model))
    run_steps(model, StepContext(), cfg, STEPS[:1])
    save_trainable(model, tmp_path / "ckpt")
    torch.manual_seed(7)
    fresh = built(cfg)
    load_into(fresh, tmp_path / "ckpt")
    assert fresh.llm.lm_head.weight is fresh.llm.get_input_embeddings().weight
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
