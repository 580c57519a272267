"""A trained checkpoint as a one-process model: what `speechlm evaluate` and `speechlm export` start from.

`resolve_checkpoint(RUN_OR_CKPT)`: a checkpoint directory (it has ``complete.json``) is verified and
taken as it is; a run directory gives its latest complete checkpoint (`newest_verified`: the
``latest`` pointer if it verifies, else the newest one that does). A checkpoint that does not verify
is refused naming the file and what is wrong (an interrupted save, a truncated or missing file) and
what to do: the earlier checkpoint that verifies, by path, or restoring the file or training again. The config is the one saved with
the checkpoint (``speechlm/config.yaml`` inside it, else the run's ``config.yaml``), so the model is
rebuilt exactly as it was trained, and the tokenizer is the one that config names.

`load_checkpoint_weights` reads the model's tensors from the checkpoint's DCP shards into a plain
one-process `TrainedModule` (no process group, whatever layout wrote them; DCP reshards on load)
through `speechlm.use.checkpoint_files.load_trained_state`, as a resume does: a checkpoint of a frozen or
LoRA run keeps what trains and leaves the frozen base to ``model.llm.pretrained`` /
``model.encoder.pretrained`` (rebuilt from there when the module is built, and checked against the
fingerprint the checkpoint holds). A trainable tensor it lacks is a CheckpointError naming it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speechlm.config import ExperimentConfig, load_config
from speechlm.data import run_inputs
from speechlm.data.run_inputs import RUN_TOKENIZER_DIR, TokenizerInfo, tokenizer_info
from speechlm.data.tokenizer import load_text_tokenizer
from speechlm.errors import DataError
from speechlm.model.build import build_speech_llm, frozen_state_keys
from speechlm.model.pretrained_dir import read_llm_dir
from speechlm.model.trainable import train_modes_of
from speechlm.use.checkpoint_files import (
    COMPLETE_NAME,
    STEP_RE,
    CheckpointError,
    load_trained_state,
    newest_verified,
    previous_complete,
    saved_config,
    verify_checkpoint,
)


@dataclass
class LoadedCheckpoint:
    """A checkpoint rebuilt in this process: its directory, step, config, tokenizer and module."""

    ckpt: Path
    step: int
    cfg: ExperimentConfig
    tokenizer: Any
    tok: TokenizerInfo
    module: Any  # a TrainedModule (or training's SpeechLLMModule), eval mode, weights loaded

    @property
    def model(self) -> Any:
        return self.module.model


class TrainedModule(nn.Module):
    """A checkpoint's model outside training: the run's `SpeechLLM` as ``model`` (so its parameters carry
    the names training saved them under, ``model.<name>``), the step context evaluation sets, and the
    device it lives on."""

    def __init__(self, cfg: ExperimentConfig, tok: TokenizerInfo):
        super().__init__()
        self.cfg, self.tok = cfg, tok
        self.model = build_speech_llm(cfg.model, tok)
        self.step_ctx: Any = None  # speechlm evaluate sets its EvalContext

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def frozen_state_keys(self) -> frozenset[str]:
        """The state-dict keys of the frozen parameters (left out of checkpoints)."""
        return frozen_state_keys(self.model)


def resolve_checkpoint(path: str | Path, log: Any = print) -> Path:
    """The checkpoint directory `path` names: itself (verified), or a run dir's latest complete one.

    A damaged checkpoint is refused with what is wrong with it and what to do to use the model (a
    checkpoint that verifies, by path; or train again), never with training's resume advice: evaluating
    or exporting deletes nothing and resumes nothing."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"{p} does not exist: give a run directory or one of its checkpoints/step_* dirs"
        )
    if (p / COMPLETE_NAME).is_file() or (STEP_RE.match(p.name) and p.parent.name == "checkpoints"):
        try:
            verify_checkpoint(p)
        except CheckpointError as e:
            raise unusable_checkpoint(p, str(e), previous_complete(p)) from None
        return p
    if (p / "checkpoints").is_dir():
        found, refused = newest_verified(p / "checkpoints", log, prefix="checkpoint")
        if found is not None:
            return found
        if refused:
            raise unusable_checkpoint(refused[0][0], refused[0][1], None, others=len(refused) - 1)
    raise CheckpointError(
        f"{p} is neither a checkpoint (no {COMPLETE_NAME}) nor a run directory with a complete checkpoint "
        f"under {p / 'checkpoints'}: give a run directory (trainer.run_dir) or a checkpoints/step_* dir"
    )


def unusable_checkpoint(ckpt: Path, reason: str, earlier: Path | None, others: int = 0) -> CheckpointError:
    """The error of a checkpoint that does not verify, for a command that only reads it (module doc)."""
    more = (
        f"; the {others} other checkpoint(s) of the run do not verify either (listed above)" if others else ""
    )
    if earlier is not None:
        advice = f"give the earlier checkpoint {earlier} (it verifies) by its path instead"
    else:
        advice = (
            "no other checkpoint of this run verifies: restore the damaged file from a copy of the run, or train "
            "again (`speechlm train` into a new trainer.run_dir)"
        )
    return CheckpointError(
        f"checkpoint {ckpt} cannot be used: {reason}{more}. What to do: {advice}. Nothing in the run directory "
        "was changed"
    )


def checkpoint_config_file(ckpt: Path) -> Path:
    """The file of the config `ckpt` was trained with (its own copy, else its run dir's config.yaml)."""
    _, source = saved_config(ckpt, ckpt.parent.parent)
    if source is None:
        raise CheckpointError(
            f"{ckpt} holds no config (speechlm/config.yaml) and {ckpt.parent.parent / 'config.yaml'} does not "
            "exist: the model cannot be rebuilt; copy the run's config.yaml next to its checkpoints folder"
        )
    return source


def checkpoint_config(ckpt: Path) -> ExperimentConfig:
    """The config `ckpt` was trained with (its own copy, else its run dir's config.yaml)."""
    return load_config(checkpoint_config_file(ckpt))


def check_pretrained_parts(cfg: ExperimentConfig, ckpt: Path) -> None:
    """The pretrained directories the model of `ckpt` is rebuilt from (model.llm.pretrained,
    model.encoder.pretrained) are still where the run found them and whole: a frozen or LoRA checkpoint
    does not hold its base. Refused before anything is built, naming the path and the config to edit."""

    def refuse(key: str, path: str, why: str) -> None:
        raise DataError(
            f"checkpoint {ckpt} was trained on {key}={path}, which its model is rebuilt from, but {why}. Put "
            f"that directory back at {path}, or set {key} in {checkpoint_config_file(ckpt)} to where it is "
            "now (a frozen or LoRA checkpoint's fingerprint then checks that it is the same model)"
        )

    llm = cfg.model.llm.pretrained
    if llm and not Path(llm).is_dir():
        refuse("model.llm.pretrained", llm, "it is not a directory here (moved or removed?)")
    if llm:
        try:
            read_llm_dir(llm)
        except DataError as e:
            refuse("model.llm.pretrained", llm, f"it cannot be loaded: {e}")
    encoder = cfg.model.encoder.pretrained
    if encoder and not Path(encoder).exists():
        refuse("model.encoder.pretrained", encoder, "it does not exist here (moved or removed?)")


def checkpoint_tokenizer(cfg: ExperimentConfig, ckpt: Path) -> Any:
    """The tokenizer `ckpt` was trained with: the run's saved copy (RUN/tokenizer, written by a run whose
    tokenizer got tokens added: their ids depend on the run's languages), else the one its config names."""
    run_copy = ckpt.parent.parent / RUN_TOKENIZER_DIR
    if run_copy.is_dir():
        return load_text_tokenizer(run_copy)
    path, kind = run_inputs.tokenizer_source(cfg)
    if kind != "sentencepiece":  # the ids of the tokens the run added live only in its saved copy
        raise CheckpointError(
            f"{run_copy} does not exist: the run of {ckpt} used {path}'s tokenizer with tokens it added "
            "(<|audio|>, language tags), whose ids only that copy records; copy the run's tokenizer/ folder "
            "next to its checkpoints folder"
        )
    return run_inputs.load_tokenizer(path)


def load_checkpoint(
    path: str | Path, *, device: str | torch.device = "cpu", log: Any = print
) -> LoadedCheckpoint:
    """Resolve `path`, rebuild the model of its config with its tokenizer, load the weights (eval mode)."""

    ckpt = resolve_checkpoint(path, log)
    cfg = checkpoint_config(ckpt)
    check_pretrained_parts(cfg, ckpt)
    tokenizer = checkpoint_tokenizer(cfg, ckpt)
    tok = tokenizer_info(cfg, tokenizer)
    torch.manual_seed(cfg.trainer.seed)  # the values of any tensor the checkpoint does not hold
    module = TrainedModule(cfg, tok)
    load_checkpoint_weights(module, ckpt)
    module.to(torch.device(device))
    module.eval()
    step = int(json.loads((ckpt / COMPLETE_NAME).read_text()).get("step") or 0)
    return LoadedCheckpoint(ckpt, step, cfg, tokenizer, tok, module)


def load_checkpoint_weights(module: Any, ckpt: Path) -> None:
    """Read `module`'s tensors that `ckpt` holds from its DCP shards (one process, no process group),
    as a resume does (`load_trained_state`): a frozen or LoRA run's checkpoint leaves out the frozen
    base, which must then be the one it was trained on (fingerprints); a trained tensor it lacks, or one
    it holds that the config's model has not, is a CheckpointError."""
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        load_trained_state(
            module,
            [],
            ckpt,
            frozen=module.frozen_state_keys(),
            fingerprints=train_modes_of(module.model).fingerprints,
        )
