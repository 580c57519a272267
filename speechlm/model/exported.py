"""An export directory (`speechlm export`) loaded back into a `SpeechLLM`, with no training code.

Layout (every path relative to the directory; `speechlm.use.export` writes it):

    speechlm_export.json   the one config: format version, the model section (encoder, projector,
                           LLM, with ``llm.pretrained: llm``), the SpeechLLM's token ids and prompt
                           (``speech_llm``), the tokenizer's path and languages, the sample rate,
                           the source checkpoint and step, and the versions that wrote it
    llm/                   the decoder LLM, LoRA merged, `save_pretrained` in safetensors (config.json,
                           model.safetensors, generation_config.json): loads with AutoModelForCausalLM;
                           beside it, as Hugging Face keeps them, the text tokenizer with its added
                           tokens (``AutoTokenizer.from_pretrained(llm)``: the pretrained LLM's tokenizer
                           files, or the SentencePiece model's conversion, `speechlm.use.hf_export`) and
                           speechlm's own copy (``speechlm_tokenizer.json``, or ``sentencepiece.model`` /
                           ``.json``), which the config's ``tokenizer`` names
    encoder/               only for a pretrained Parakeet/Whisper encoder: its config and preprocessor
    speech.safetensors     every other tensor of the model: encoder, projector, CTC head

Exports written before the tokenizer moved beside the LLM have it in ``tokenizer/``; the config's
``tokenizer`` says where, and they load as before.

`speechlm_export.json` is written last and the directory is renamed into place whole, so a directory
without it is an interrupted export and is refused here. Its ``files`` records every other file's size
and ``sha256`` its SHA-256: both are verified at every load (`read_export_config`: sizes first, then
the hashes, streamed by `speechlm.io.sha256_of` at about 1.5 GB/s, so seconds for a multi-GB LLM), so
a file altered in place (same size: NaN weights) is refused naming it. An export written before the
hashes were recorded is checked by size only. Loading reads local files only (no hub
access: ``HF_HUB_OFFLINE`` is set while the LLM loads) and imports nothing of ``speechlm.train`` (nor,
being model code, of ``speechlm.data``: the caller loads the tokenizer from `ExportedModel.tokenizer_path`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from speechlm.config import ModelConfig, from_dict
from speechlm.errors import RunDirError
from speechlm.io import sha256_of
from speechlm.model.speech_llm import SpeechLLM
from speechlm.packing.prompt import PromptFormat

EXPORT_CONFIG = "speechlm_export.json"
EXPORT_FORMAT = 1
LLM_DIR = "llm"
ENCODER_DIR = "encoder"
SPEECH_WEIGHTS = "speech.safetensors"
LLM_PREFIX = "llm."  # the LLM's tensors in SpeechLLM's state dict (saved under llm/, not speech.safetensors)


class ExportError(RunDirError):
    """An export directory that cannot be loaded (interrupted, altered, or of another format)."""


@dataclass
class ExportedModel:
    """An export directory's model (eval mode) and config; its tokenizer is at `tokenizer_path` (model code
    does not read text: `speechlm.data.tokenizer.load_text_tokenizer` loads it)."""

    path: Path
    model: Any  # speechlm.model.speech_llm.SpeechLLM
    config: dict[str, Any]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.config["tokenizer"]

    @property
    def sample_rate(self) -> int:
        return int(self.config["sample_rate"])

    @property
    def langs(self) -> list[str]:
        return list(self.config["langs"])


def is_export_dir(path: str | Path) -> bool:
    return (Path(path) / EXPORT_CONFIG).is_file()


ADDED_ROWS_PREFIX = "added_rows."  # trained rows of added tokens: the export's llm/ holds them merged


def speech_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of `model`'s state dict outside the LLM (and its added-token rows, which the
    exported LLM holds merged), contiguous on the CPU (for safetensors)."""
    return {
        k: v.detach().to("cpu").contiguous().clone()
        for k, v in model.state_dict().items()
        if not k.startswith((LLM_PREFIX, ADDED_ROWS_PREFIX))
    }


def read_export_config(path: Path) -> dict[str, Any]:
    f = path / EXPORT_CONFIG
    if not f.is_file():
        raise ExportError(
            f"{path} is not a speechlm export: it has no {EXPORT_CONFIG} (an interrupted `speechlm export` "
            "leaves none) and no run or checkpoint directory either; export again with `speechlm export "
            "RUN_OR_CKPT --out DIR`, or give the run directory"
        )
    try:
        config = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{f} cannot be read ({e}): the export was altered; export again") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise ExportError(
            f"{f}: export format {config.get('format') if isinstance(config, dict) else None!r} is not "
            f"{EXPORT_FORMAT}, the one this speechlm reads; export again with this version"
        )
    for rel, size in dict(config.get("files", {})).items():
        g = path / rel
        if not g.is_file() or g.stat().st_size != size:
            raise ExportError(f"{g} is missing or not the size it was exported with: the export was altered")
    for rel, digest in dict(config.get("sha256") or {}).items():  # exports before 2026-11-28: sizes only
        g = path / rel
        if not g.is_file() or sha256_of(g) != digest:
            raise ExportError(
                f"{g} does not match the SHA-256 recorded when it was exported: the file was corrupted or "
                "altered in place; export again from the checkpoint (`speechlm export RUN_OR_CKPT --out DIR`)"
            )
    return config


def build_speech_llm(model_section: dict[str, Any], speech_llm: dict[str, Any], root: Path) -> Any:
    """The SpeechLLM an export describes, its LLM loaded from ``root/llm`` (other weights: random)."""
    section = json.loads(json.dumps(model_section))
    section["llm"]["pretrained"] = str(root / LLM_DIR)
    enc = section["encoder"]
    enc["pretrained"] = str(root / ENCODER_DIR) if enc.get("pretrained") else None
    model_cfg = from_dict(ModelConfig, section, str(root / EXPORT_CONFIG), "model.")
    kwargs = dict(speech_llm)
    if isinstance(kwargs.get("prompt"), dict):  # TokenizerInfo's PromptFormat, saved as a JSON object
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in kwargs["prompt"].items()
        }
        kwargs["prompt"] = PromptFormat(**fields)
    if "added_token_ids" in kwargs:  # llm/ holds the trained rows of the added tokens: no re-initialisation
        kwargs["added_token_ids"] = ()
    return SpeechLLM(model_cfg, **kwargs)


def load_exported(path: str | Path, *, device: str | torch.device = "cpu") -> ExportedModel:
    """Build the model of export `path` and load its weights (eval mode, on `device`)."""
    root = Path(path)
    config = read_export_config(root)
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # local files only, whatever the environment says
    try:
        model = build_speech_llm(config["model"], config["speech_llm"], root)
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before
    weights = load_file(str(root / SPEECH_WEIGHTS))
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith(LLM_PREFIX)]
    if missing or result.unexpected_keys:
        raise ExportError(
            f"{root / SPEECH_WEIGHTS} does not fit the model {EXPORT_CONFIG} describes (missing: "
            f"{missing[:5]}, unexpected: {result.unexpected_keys[:5]}): the export was altered; export again"
        )
    model.to(torch.device(device))
    model.eval()
    return ExportedModel(root, model, config)
