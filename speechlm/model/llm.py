"""The decoder LLM: a transformers causal LM, built from `LLMConfig` or loaded from a local directory.

From a config: ``family="llama"`` -> ``LlamaConfig``, ``family="qwen2"`` -> ``Qwen2Config`` (GQA when
``num_kv_heads < num_heads``). Input and output embeddings are untied: with tensor parallelism the
embedding and the LM head are sharded differently, and with FSDP each parameter then has exactly one
owner. A pretrained directory keeps its own choice (``tie_word_embeddings`` of its config).

Always ``use_cache=False`` (training; our greedy decoding recomputes). The attention implementation
is the string from ``speechlm.model.attention.ensure_registered`` (e.g. ``"speechlm_reference"``).
Configs are deep-copied before ``_from_config``, which writes the attention implementation into them.

Tokens added to a pretrained LLM's tokenizer (``<|audio|>``, the language tags:
`speechlm.data.hf_tokenizer`) get embedding rows: the matrices grow to the tokenizer's size when they
are smaller, and the rows of the added ids, input and output embeddings alike, start at the mean of
the rows the pretrained model trained (`init_added_rows`; a tied matrix is set once). Mean rows give
the new tokens logits near the average token's rather than random ones that could dominate the
softmax. The other rows are not touched, nor are rows past the tokenizer (Qwen pads its matrix).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from speechlm.config import LLMConfig
from speechlm.model.finite import check_loaded_weights
from speechlm.model.pretrained_dir import read_llm_dir

LLM_FAMILIES = ("llama", "qwen2")


def build_llm_config(
    llm_cfg: LLMConfig, *, vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int, dropout: float
) -> Any:
    """The transformers config of a from-scratch LLM."""
    from transformers import (  # lazy: transformers (seconds to import; commands that build no model skip it)
        LlamaConfig,
        Qwen2Config,
    )

    if llm_cfg.num_heads % llm_cfg.num_kv_heads:
        raise ValueError(
            f"llm.num_heads={llm_cfg.num_heads} is not a multiple of llm.num_kv_heads={llm_cfg.num_kv_heads}"
        )
    if llm_cfg.hidden_size % llm_cfg.num_heads:
        raise ValueError(
            f"llm.hidden_size={llm_cfg.hidden_size} is not a multiple of llm.num_heads={llm_cfg.num_heads}"
        )
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=llm_cfg.hidden_size,
        intermediate_size=llm_cfg.intermediate_size,
        num_hidden_layers=llm_cfg.num_layers,
        num_attention_heads=llm_cfg.num_heads,
        num_key_value_heads=llm_cfg.num_kv_heads,
        max_position_embeddings=llm_cfg.max_position_embeddings,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        use_cache=False,
    )
    if llm_cfg.family == "llama":
        return LlamaConfig(**common)
    if llm_cfg.family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"llm.family={llm_cfg.family!r} is not known; use one of {', '.join(LLM_FAMILIES)}")


def build_llm(
    llm_cfg: LLMConfig,
    *,
    vocab_size: int,
    pad_id: int,
    bos_id: int | None,
    eos_id: int,
    dropout: float,
    attn_implementation: str,
    added_token_ids: Sequence[int] = (),
) -> Any:
    """Return a ``PreTrainedModel`` (causal LM) in fp32, ``use_cache=False``.

    ``dropout`` is the attention dropout (the only dropout of Llama/Qwen2); the reference, flex and
    torch_varlen backends refuse a nonzero value on THD batches.
    A pretrained model whose vocabulary is smaller than ``vocab_size`` gets its embeddings resized;
    the rows of ``added_token_ids`` start at the mean of the pretrained rows (`init_added_rows`). Only
    added rows may lie past the model's vocabulary: the pre-flight refuses a tokenizer whose own tokens
    do not fit (`speechlm.model.pretrained_dir.check_tokenizer_fits_llm`).
    """
    from transformers import (  # lazy: transformers (seconds to import; commands that build no model skip it)
        AutoConfig,
        AutoModelForCausalLM,
    )

    if llm_cfg.pretrained:
        path = Path(llm_cfg.pretrained)
        read_llm_dir(path)  # a missing dir, config.json or weights, a truncated safetensors: clear errors
        cfg = AutoConfig.from_pretrained(path)
        cfg.use_cache = False
        cfg.attention_dropout = dropout
        model = AutoModelForCausalLM.from_pretrained(
            path, config=cfg, attn_implementation=attn_implementation, dtype=torch.float32
        )

        check_loaded_weights(model, path, "model.llm.pretrained")  # NaN/inf weights: refused, file named
        embeddings: Any = model.get_input_embeddings()
        n_rows = int(embeddings.weight.shape[0])
        if n_rows < vocab_size:
            model.resize_token_embeddings(vocab_size, mean_resizing=False)
        init_added_rows(model, sorted({*added_token_ids, *range(n_rows, vocab_size)}))
    else:
        cfg = build_llm_config(
            llm_cfg, vocab_size=vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id, dropout=dropout
        )
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model


@torch.no_grad()
def init_added_rows(model: Any, ids: Sequence[int]) -> None:
    """Set the input and output embedding rows of ``ids`` to the mean of the other rows (fp32 sums).

    The mean is over every row not in ``ids``: the pretrained vocabulary. A tied output matrix is the
    input one and is set once."""
    if not ids:
        return
    index = torch.tensor(list(ids), dtype=torch.long)
    seen: set[int] = set()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        if weight is None or id(weight) in seen:
            continue
        seen.add(id(weight))
        keep = torch.ones(weight.shape[0], dtype=torch.bool)
        keep[index] = False
        mean = weight[keep].float().mean(dim=0)
        weight[index.to(weight.device)] = mean.to(weight.dtype)
