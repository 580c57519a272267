"""Helpers of the training-mode tests (frozen / LoRA LLM, frozen encoder): a tiny random pretrained LLM
directory, and the smoke run arguments that train from it."""

from __future__ import annotations

from pathlib import Path


def make_tiny_llm_dir(
    path: Path, *, vocab_size: int, seed: int = 0, hidden: int = 32, tied: bool = False
) -> Path:
    """A random tiny LlamaForCausalLM saved with ``save_pretrained`` (safetensors) into `path`: what
    ``model.llm.pretrained`` loads. Its sizes fit configs/smoke.yaml's LLM (hidden 32, 2 layers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,  # SmolLM2 and small Qwen models tie the LM head to the embedding
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def lora_overrides(rank: int = 4, dropout: float = 0.0) -> list[str]:
    return ["model.llm.train=lora", f"model.llm.lora.rank={rank}", f"model.llm.lora.dropout={dropout}"]


def sentencepiece_on_pretrained() -> list[str]:
    """The override that lets these tests train a random pretrained LLM directory (no tokenizer of its
    own) with the demo corpus' SentencePiece tokenizer, where the config has one: the pretrained-
    tokenizer work of issue 22 refuses that pairing unless it is asked for."""
    from speechlm.config import leaf_keys

    key = "data.allow_sentencepiece_with_pretrained"
    return [f"{key}=true"] if key in leaf_keys() else []
