"""The export of a checkpoint (`speechlm export RUN_OR_CKPT --out DIR`, whose command line is
`speechlm.use.export_cli`): a self-contained directory of a trained model.

What goes in is described in `speechlm.model.exported` (which loads it back with no training code):
the LLM with its LoRA adapters merged (`speechlm.model.trainable.merge_lora`; a model without adapters
is saved as it is) through `save_pretrained` in safetensors, so transformers and the Hugging Face tools
load it as a plain causal LM; beside it the tokenizer with its added tokens (`tokenizer.save`, plus the
Hugging Face form of a SentencePiece tokenizer, `speechlm.use.hf_export`); every other tensor (encoder,
projector, CTC head) in ``speech.safetensors``; one ``speechlm_export.json`` that records the LLM's
real widths (read from its transformers config) and every file's size and SHA-256 (`speechlm.io`),
verified at every load. Files get the modes a plain create gives under the process's umask
(`speechlm.io.apply_umask`: safetensors itself writes 0600).

Atomicity: an existing non-empty ``--out`` is refused. Everything is written into a temporary sibling
``.tmp-export-<name>-<pid>`` whose config is written last, then renamed to ``--out`` in one step. A
process killed (SIGTERM, SIGKILL) before the rename leaves no ``--out`` at all, only the temporary
directory, which `transcribe` refuses (no config, or not the name asked for) and the next export to
the same ``--out`` removes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from speechlm.config import eval_batch_duration, to_dict
from speechlm.errors import OutputError, UsageError
from speechlm.io import apply_umask, sha256_of
from speechlm.model.exported import (
    ENCODER_DIR,
    EXPORT_CONFIG,
    EXPORT_FORMAT,
    LLM_DIR,
    SPEECH_WEIGHTS,
    speech_state_dict,
)
from speechlm.model.llm import LLM_FAMILIES
from speechlm.model.trainable import merge_lora
from speechlm.use.checkpoint import LoadedCheckpoint, load_checkpoint
from speechlm.use.hf_export import write_hf_tokenizer


def export_checkpoint(checkpoint: str | Path, out: Path) -> Path:
    """Write the export of `checkpoint` to `out` (module docstring); returns `out`."""
    check_out_dir(out)
    loaded = load_checkpoint(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    for stale in out.parent.glob(f".tmp-export-{out.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a killed export's leftovers
    try:
        tmp.mkdir()
        write_export(loaded, tmp)
        check_out_dir(out)  # nothing appeared there meanwhile
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(
            f"cannot write the export {out}: {e.strerror or e}; free space or fix the path"
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file: give a directory path that does not exist yet")
    if out.is_dir() and any(out.iterdir()):
        raise OutputError(
            f"--out {out} exists and is not empty: an export is never written over another; give a new "
            "directory or remove that one"
        )


def save_tokenizer(tokenizer: Any, directory: Path) -> Path:
    """Save `tokenizer` (either kind's `save`) into `directory`, which `load_text_tokenizer` then takes."""
    tokenizer.save(directory)
    return directory


def save_hf_form(tokenizer: Any, directory: Path) -> bool:
    """Hugging Face tokenizer files beside the LLM: a pretrained LLM's tokenizer is one already (its
    `save` wrote them); a SentencePiece one is rebuilt and checked (`speechlm.use.hf_export`), or, when
    the rebuilt one gives other ids, left out with a note. Returns whether ``AutoTokenizer`` loads it."""
    if not hasattr(tokenizer, "piece_table"):
        return True

    differs = write_hf_tokenizer(tokenizer, directory)
    if differs is None:
        return True
    print(
        f"note: the SentencePiece tokenizer {tokenizer.path} has no exact Hugging Face form (its ids differ on "
        f"{differs[:60]!r}): the export's llm/ holds sentencepiece.model and sentencepiece.json only, which "
        "speechlm loads (`speechlm.data.tokenizer.load_text_tokenizer`) and AutoTokenizer does not",
        file=sys.stderr,
    )
    return False


def save_encoder_dir(encoder_cfg: Any, encoder: Any, directory: Path) -> None:
    """A pretrained Parakeet/Whisper encoder is rebuilt from its own transformers config: save it (and
    the preprocessor settings) so the export does not depend on the original directory."""
    inner = getattr(encoder, "model", None)
    if encoder_cfg.kind == "nemo" or not hasattr(inner, "save_pretrained"):
        raise UsageError(
            f"model.encoder.kind={encoder_cfg.kind!r} loaded from {encoder_cfg.pretrained} cannot be exported yet "
            "(its architecture lives in the .nemo file); evaluate the checkpoint with `speechlm evaluate` instead"
        )
    assert inner is not None
    inner.save_pretrained(directory, safe_serialization=True)
    pre = Path(encoder_cfg.pretrained) / "preprocessor_config.json"
    if pre.is_file():
        shutil.copyfile(pre, directory / pre.name)


def write_export(loaded: LoadedCheckpoint, tmp: Path) -> None:
    """The export's files into `tmp`, its config last."""
    cfg, model = loaded.cfg, loaded.model
    # LoRA and the trained rows of added tokens merged into a plain transformers copy
    merged = merge_lora(model.llm)
    merged.save_pretrained(tmp / LLM_DIR, safe_serialization=True)
    tok_path = save_tokenizer(loaded.tokenizer, tmp / LLM_DIR)  # beside the LLM, as Hugging Face keeps it
    hf_tokenizer = save_hf_form(loaded.tokenizer, tmp / LLM_DIR)
    if cfg.model.encoder.pretrained:
        save_encoder_dir(cfg.model.encoder, model.encoder, tmp / ENCODER_DIR)
    save_file(speech_state_dict(model), str(tmp / SPEECH_WEIGHTS))
    model_section = to_dict(cfg.model)
    model_section["llm"].pop("family")  # the LLM's own, when it is one model.llm.family names
    model_section["llm"].update(llm_widths(merged.config))  # a pretrained LLM's, not the config's defaults
    model_section["llm"]["pretrained"] = LLM_DIR
    model_section["encoder"]["pretrained"] = ENCODER_DIR if cfg.model.encoder.pretrained else None
    for section in (model_section["llm"], model_section["encoder"]):
        if "train" in section:  # what trained is history: the export is one plain model
            section["train"] = "full"
    apply_umask(tmp)  # safetensors writes 0600 whatever the umask: the export gets a plain create's modes
    written = [f for f in sorted(tmp.rglob("*")) if f.is_file()]
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in written}
    hashes = {str(f.relative_to(tmp)): sha256_of(f) for f in written}  # verified at every load
    config = {
        "format": EXPORT_FORMAT,
        "model": model_section,
        "speech_llm": asdict(loaded.tok),
        "tokenizer": str(tok_path.relative_to(tmp)),
        "hf_tokenizer": hf_tokenizer,  # AutoTokenizer.from_pretrained(llm) gives the tokenizer's ids
        "langs": list(loaded.tokenizer.langs),
        "sample_rate": int(cfg.data.sample_rate),
        "eval_batch_duration": eval_batch_duration(cfg),  # transcribe batches as evaluate does
        "instruction": cfg.data.instruction,
        "source": {"checkpoint": str(Path(loaded.ckpt).resolve()), "step": loaded.step},
        "versions": versions(),
        "files": files,
        "sha256": hashes,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    (tmp / EXPORT_CONFIG).write_text(json.dumps(config, indent=1, ensure_ascii=False))


def llm_widths(hf_config: Any) -> dict[str, Any]:
    """The model.llm keys that describe the LLM's shape, read from its transformers config (the family only
    when it is one `model.llm.family` names; other architectures leave the key out)."""
    widths: dict[str, Any] = {
        "hidden_size": hf_config.hidden_size,
        "num_layers": hf_config.num_hidden_layers,
        "num_heads": hf_config.num_attention_heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "intermediate_size": hf_config.intermediate_size,
        "max_position_embeddings": hf_config.max_position_embeddings,
    }
    if hf_config.model_type in LLM_FAMILIES:
        widths["family"] = hf_config.model_type
    return {k: int(v) if k != "family" else v for k, v in widths.items()}


def versions() -> dict[str, str]:
    out = {}
    for name in ("speechlm", "torch", "transformers", "peft", "safetensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out
