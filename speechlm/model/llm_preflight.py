"""The LLM's pre-flight checks that need the model's architecture: LoRA target modules named against a
skeleton of the LLM (built on the meta device, no weights), and `check_pretrained_llm`, what train and
validate run before anything is loaded (`speechlm.model.pretrained_dir` reads the files; this module
builds on `speechlm.model.llm`, which itself reads the directory through `pretrained_dir`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from speechlm.errors import UsageError
from speechlm.model.llm import build_llm_config
from speechlm.model.pretrained_dir import check_tokenizer_fits_llm, read_llm_dir


# --- LoRA target modules -------------------------------------------------------------------------
def module_names(llm: Any) -> tuple[set[str], list[str]]:
    """(the last part of every module name of `llm`, the sorted names of its linear layers)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in llm.named_modules()}
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in llm.named_modules() if isinstance(m, nn.Linear)})
    return names, linear


def lora_target_problem(targets: Sequence[str], llm: Any) -> str | None:
    """The message for the `targets` that name no module of `llm`, or None when every one does."""
    names, linear = module_names(llm)
    missing = [t for t in targets if t not in names]
    if not missing:
        return None
    return (
        f"model.llm.lora.target_modules: {', '.join(missing)} name no module of the LLM "
        f"({type(llm).__name__}); its linear layers are: {', '.join(linear)}; set "
        "model.llm.lora.target_modules to some of those"
    )


def skeleton_llm(llm_cfg: Any, config: dict[str, Any] | None) -> Any:
    """The LLM built on the meta device with one decoder layer (module names only, no memory): from the
    pretrained directory's config.json, else from the sizes in `llm_cfg`."""
    from transformers import (  # lazy: transformers (seconds to import; commands that build no model skip it)
        AutoConfig,
        AutoModelForCausalLM,
    )

    if config is not None:
        hf_cfg = AutoConfig.for_model(**copy.deepcopy(config))
    else:
        hf_cfg = build_llm_config(llm_cfg, vocab_size=8, pad_id=0, bos_id=None, eos_id=0, dropout=0.0)
    for cfg in (hf_cfg, getattr(hf_cfg, "text_config", None)):
        if cfg is not None and getattr(cfg, "num_hidden_layers", None):
            cfg.num_hidden_layers = 1  # every layer has the same module names
            if isinstance(getattr(cfg, "layer_types", None), list):
                cfg.layer_types = cfg.layer_types[:1]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")


def check_lora_targets(llm_cfg: Any, config: dict[str, Any] | None) -> None:
    """`model.llm.train=lora`: every target module names a module of the LLM (UsageError, exit 2).

    An architecture this transformers cannot build from its config alone (a quantized checkpoint, custom
    code) is left to `inject_lora`, which raises the same UsageError once the model is loaded."""
    try:
        skeleton = skeleton_llm(llm_cfg, config)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError, RuntimeError):
        return
    problem = lora_target_problem(list(llm_cfg.lora.target_modules), skeleton)
    if problem:
        raise UsageError(problem)


# --- what train and validate run ------------------------------------------------------------------
def check_pretrained_llm(cfg: Any, tokenizer: Any = None) -> None:
    """The pre-flight of the LLM (`speechlm.preflight.checks`): model.llm.pretrained's files are whole, `tokenizer`
    (the run's Hugging Face tokenizer; None: not checked) is that LLM's, and with model.llm.train=lora
    every target module names a module of the LLM. Nothing is loaded but config.json and the headers."""
    llm_cfg = cfg.model.llm
    config = None
    if llm_cfg.pretrained:
        config = read_llm_dir(llm_cfg.pretrained)
        if tokenizer is not None:
            key = f"data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer else "the LLM's own"
            check_tokenizer_fits_llm(tokenizer, config, llm_cfg.pretrained, key=key)
    if llm_cfg.train == "lora":
        check_lora_targets(llm_cfg, config)
