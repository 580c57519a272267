"""`speechlm export RUN_OR_CKPT --out DIR`: a self-contained directory of a trained model.

What goes in is described in `speechlm.model.exported` (which loads it back with no training code):
the LLM with its LoRA adapters merged (`speechlm.model.trainable.merge_lora`; a model without adapters
is saved as it is) through `save_pretrained` in safetensors, so transformers and the Hugging Face tools
load it as a plain causal LM; the tokenizer with its added tokens (`tokenizer.save`); every other
tensor (encoder, projector, CTC head) in ``speech.safetensors``; one ``speechlm_export.json``.

Atomicity: an existing non-empty ``--out`` is refused. Everything is written into a temporary sibling
``.tmp-export-<name>-<pid>`` whose config is written last, then renamed to ``--out`` in one step. A
process killed (SIGTERM, SIGKILL) before the rename leaves no ``--out`` at all, only the temporary
directory, which `transcribe` refuses (no config, or not the name asked for) and the next export to
the same ``--out`` removes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from speechlm.errors import OutputError, UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a self-contained model directory (LLM with LoRA merged, tokenizer, encoder) for transcribe",
        description="Export a checkpoint as one directory that `speechlm transcribe` (and transformers, for "
        "the LLM) load with no training code and no network.",
    )
    from speechlm.use.transcribe import add_checkpoint_argument

    add_checkpoint_argument(p)
    p.add_argument(
        "--out", required=True, help="the export directory to create (must not exist, or be empty)"
    )
    p.set_defaults(func=run_export_command)


def run_export_command(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, Path(args.out))
    print(f"exported {out}")
    return 0


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file: give a directory path that does not exist yet")
    if out.is_dir() and any(out.iterdir()):
        raise OutputError(
            f"--out {out} exists and is not empty: an export is never written over another; give a new "
            "directory or remove that one"
        )


def export_checkpoint(checkpoint: str | Path, out: Path) -> Path:
    """Write the export of `checkpoint` to `out` (module docstring); returns `out`."""
    from speechlm.use.checkpoint import load_checkpoint

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


def save_tokenizer(tokenizer: Any, directory: Path) -> Path:
    """Save `tokenizer` (either kind's `save`) into `directory`, which `load_text_tokenizer` then takes."""
    tokenizer.save(directory)
    return directory


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


def write_export(loaded: Any, tmp: Path) -> None:
    """The export's files into `tmp`, its config last."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from speechlm.config import eval_batch_duration, to_dict
    from speechlm.model.exported import (
        ENCODER_DIR,
        EXPORT_CONFIG,
        EXPORT_FORMAT,
        LLM_DIR,
        SPEECH_WEIGHTS,
        TOKENIZER_DIR,
        speech_state_dict,
    )
    from speechlm.model.trainable import merge_lora

    cfg, model = loaded.cfg, loaded.model
    # LoRA and the trained rows of added tokens merged into a plain transformers copy
    merge_lora(model.llm).save_pretrained(tmp / LLM_DIR, safe_serialization=True)
    tok_path = save_tokenizer(loaded.tokenizer, tmp / TOKENIZER_DIR)
    if cfg.model.encoder.pretrained:
        save_encoder_dir(cfg.model.encoder, model.encoder, tmp / ENCODER_DIR)
    save_file(speech_state_dict(model), str(tmp / SPEECH_WEIGHTS))
    model_section = to_dict(cfg.model)
    model_section["llm"]["pretrained"] = LLM_DIR
    model_section["encoder"]["pretrained"] = ENCODER_DIR if cfg.model.encoder.pretrained else None
    for section in (model_section["llm"], model_section["encoder"]):
        if "train" in section:  # what trained is history: the export is one plain model
            section["train"] = "full"
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    config = {
        "format": EXPORT_FORMAT,
        "model": model_section,
        "speech_llm": asdict(loaded.tok),
        "tokenizer": str(tok_path.relative_to(tmp)),
        "langs": list(loaded.tokenizer.langs),
        "sample_rate": int(cfg.data.sample_rate),
        "eval_batch_duration": eval_batch_duration(cfg),  # transcribe batches as evaluate does
        "instruction": cfg.data.instruction,
        "source": {"checkpoint": str(Path(loaded.ckpt).resolve()), "step": loaded.step},
        "versions": versions(),
        "files": files,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    (tmp / EXPORT_CONFIG).write_text(json.dumps(config, indent=1, ensure_ascii=False))


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("speechlm", "torch", "transformers", "peft", "safetensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out
