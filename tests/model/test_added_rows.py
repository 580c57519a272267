"""Tokens a run adds to a pretrained LLM (the language tags) keep training under a frozen or LoRA LLM:
`speechlm.model.trainable.AddedTokenRows` (model.llm.train_added_rows, on by default)."""

from __future__ import annotations

import pytest
import torch
from parallel_harness import ADDED_IDS, TOK, build_model, global_steps, run_steps, tiny_config
from trainmodes_helpers import lora_overrides, make_tiny_llm_dir

from speechlm.config import apply_override
from speechlm.model.trainable import merge_lora, trainable_state_dict
from speechlm.train.step import StepContext

TAGS = [i for i in ADDED_IDS if i != TOK.audio_id]


def config(llm_dir, *overrides: str):
    cfg = tiny_config()
    for o in (f"model.llm.pretrained={llm_dir}", *overrides):
        apply_override(cfg, o)
    return cfg


@pytest.fixture(scope="module")
def llm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("added_rows")
    return {
        tied: make_tiny_llm_dir(root / str(tied), vocab_size=TOK.vocab_size, tied=tied)
        for tied in (False, True)
    }


def tag_logits(model) -> torch.Tensor:
    """The LM head's logits of the tags for a few fixed hidden states ([4, len(TAGS)])."""
    hidden = torch.randn(4, model.llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.llm.get_output_embeddings()(hidden)[:, TAGS]


@pytest.mark.parametrize("mode", ["lora", "frozen"])
def test_added_rows_train_under_a_frozen_or_lora_llm_and_tell_the_tags_apart(llm_dirs, mode):
    overrides = lora_overrides() if mode == "lora" else ["model.llm.train=frozen"]
    cfg = config(llm_dirs[False], *overrides)
    model = build_model(cfg)
    emb, head = model.llm.get_input_embeddings().weight, model.llm.get_output_embeddings().weight
    base = emb.detach().clone(), head.detach().clone()
    start = tag_logits(model)
    assert torch.equal(start[:, :1].expand_as(start), start), "added rows start equal (at the mean)"
    assert {p for p in model.added_rows.parameters()} <= {p for p in model.parameters() if p.requires_grad}
    run_steps(model, StepContext(), cfg, global_steps(3, 1))
    assert torch.equal(emb, base[0]) and torch.equal(head, base[1]), "the frozen matrices were written"
    rows = model.added_rows
    assert not torch.equal(rows.emb[1], rows.emb[2]) and not torch.equal(rows.head[1], rows.head[2])
    end = tag_logits(model)
    assert not torch.allclose(end[:, 0], end[:, 1]), "the tags' logits are still equal"
    assert set(trainable_state_dict(model)) >= {"added_rows.emb", "added_rows.head"}
    ids = torch.tensor([[TAGS[0], 9, TAGS[1], 11]])
    with torch.no_grad():
        got = model.llm.get_input_embeddings()(ids)[0]
    assert torch.equal(got[0], rows.emb[0]) and torch.equal(got[2], rows.emb[1])  # rows of TAGS, in order
    assert torch.equal(got[1], emb[9]), "an id the run did not add keeps its pretrained row"


@pytest.mark.parametrize("tied", [False, True])
def test_merge_writes_the_trained_rows_into_the_matrices(llm_dirs, tied):
    cfg = config(llm_dirs[tied], *lora_overrides())
    model = build_model(cfg)
    assert (model.added_rows.head is None) == tied, "a tied LM head has one row set for both sides"
    run_steps(model, StepContext(), cfg, global_steps(2, 1))
    merged = merge_lora(model.llm)
    for module in (merged.get_input_embeddings(), merged.get_output_embeddings()):
        assert not module._forward_hooks, "merge_lora left the rows' hooks on the merged copy"
    assert model.llm.get_input_embeddings()._forward_hooks, "merge_lora changed its input"
    ids = torch.tensor([[TAGS[0], 12, TAGS[2], 30, TAGS[1]]])
    model.llm.eval()
    merged.eval()
    with torch.no_grad():
        ref, out = model.llm(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (out - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))


def test_train_added_rows_false_keeps_them_frozen(llm_dirs):
    model = build_model(config(llm_dirs[False], *lora_overrides(), "model.llm.train_added_rows=false"))
    assert not hasattr(model, "added_rows")
    assert not model.llm.get_input_embeddings()._forward_hooks


def test_no_rows_without_added_tokens_or_for_a_full_llm(llm_dirs):
    assert not hasattr(
        build_model(config(llm_dirs[False], *lora_overrides()), added_token_ids=()), "added_rows"
    )
    assert not hasattr(build_model(config(llm_dirs[False]), added_token_ids=ADDED_IDS), "added_rows")


def test_an_exports_speech_weights_leave_out_the_rows_its_llm_holds_merged(llm_dirs):
    """`speechlm export` saves the LLM with the added rows merged (`merge_lora`) and the rest of the
    model in speech.safetensors: the rows must not be there too (the export would not load)."""
    from speechlm.model.exported import speech_state_dict

    model = build_model(config(llm_dirs[False], *lora_overrides()))
    assert "added_rows.emb" in model.state_dict()
    saved = speech_state_dict(model)
    assert saved and not any(k.startswith(("added_rows.", "llm.")) for k in saved)
