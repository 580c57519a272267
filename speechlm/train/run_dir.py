"""The run dir before anything heavy is built: usable, not another run's, and a resume that matches.

`prepare_run_dir` runs on every rank right after the inputs are checked and before the model is built:

1. `RUN_DIR` and `RUN_DIR/checkpoints` must be directories (or absent) that can be written
   (RunDirError / OutputError), so a run never trains steps it cannot save.
2. `trainer.resume` is resolved and verified (checkpoint.resolve_resume), once per launch: an explicit
   path by the pre-flight (`resolve_explicit_resume`), `auto` here.
3. A new run (no `trainer.resume`, `resume=auto` that found no checkpoint, or a `resume=PATH` outside
   `RUN_DIR/checkpoints`) refuses a run dir that holds another run (`holds_run`), unless
   `trainer.overwrite=true`, which moves that run aside to `RUN_DIR.old-<UTC time>` (never deletes it).
4. A resume compares the checkpoint's saved config with this one (`compare_resume_config`): changes
   that alter the optimisation are refused with the fix, the others are applied and listed.

A run dir "holds a run" when it has any of: a `metrics.jsonl` with at least one record, an
`eval.json`, or a checkpoint directory under `checkpoints/` (`step_*`, `best`, or `.old-best`). What a
launch that died before its first step leaves (`config.yaml`, an empty `metrics.jsonl`, `csv/`, `tb/`,
`checkpoints/.tmp-*`, a `latest` pointer with no checkpoint) does not count: such a dir is reused.
With `resume=auto` and no checkpoint, `metrics.jsonl` does not count either: a launch killed before its
first checkpoint saved nothing to continue, and its requeued launch starts over (with a note).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speechlm.config import ExperimentConfig, to_dict
from speechlm.errors import OutputError, RunDirError
from speechlm.train.checkpoint import (
    COMPLETE_NAME,
    list_checkpoints,
    resolve_resume,
    trash_name,
)
from speechlm.train.schedule import decoder_lr_lambda, encoder_lr_lambda
from speechlm.use.checkpoint_files import saved_config

# keys that may change on resume: they do not change what the optimiser does with the data it is given
HARMLESS_PREFIXES = (
    "trainer.run_dir",
    "trainer.max_minutes",
    "trainer.log_every",
    "trainer.val_every",
    "trainer.val_max_batches",
    "trainer.val_train_batches",
    "trainer.eval_batch_duration",
    "trainer.ckpt_every",
    "trainer.keep_last",
    "trainer.best_metric",
    "trainer.early_stopping_patience",
    "trainer.resume",
    "trainer.resume_data",
    "trainer.validate_only",
    "trainer.final_eval_split",
    "trainer.final_eval_train_utterances",
    "trainer.eval_metrics",
    "trainer.eval_normalize",
    "trainer.eval_cer_langs",
    "trainer.overwrite",
    "data.num_workers",
    "data.val_manifest",
    "data.max_dropped_fraction",
    "model.attention_backend",
    "parallel.",  # a new layout is checked by the data state (exact) or accepted by resume_data=next_epoch
)
# how this launch was asked to start: different on every resume, not worth a line
QUIET_KEYS = ("trainer.resume", "trainer.overwrite")
# keys that only change the data plan: accepted with trainer.resume_data=next_epoch
DATA_PLAN_PREFIXES = ("data.", "sampler.")


def holds_run(run_dir: Path, *, count_metrics: bool = True) -> list[str]:
    """What in `run_dir` belongs to an earlier run (empty: the dir can be used by a new run).

    `count_metrics=False` (resume=auto found no checkpoint): the logged steps of a launch killed before
    its first checkpoint are lost anyway, and a requeued job must be able to start again."""
    found = []
    metrics = run_dir / "metrics.jsonl"
    if count_metrics and metrics.is_file() and metrics.read_text(errors="replace").strip():
        found.append(str(metrics))
    if (run_dir / "eval.json").exists():
        found.append(str(run_dir / "eval.json"))
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        names = [p.name for _, p in list_checkpoints(ckpts)]
        names += [n for n in ("best", trash_name("best")) if (ckpts / n).is_dir()]
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            found.append(f"{ckpts}/ ({shown})")
    return found


def check_run_dir(run_dir: Path) -> None:
    """trainer.run_dir and its checkpoints folder are directories (or can be created) and are writable."""
    for path in (run_dir, run_dir / "checkpoints"):
        what = "trainer.run_dir" if path == run_dir else "the checkpoints folder of trainer.run_dir"
        if path.is_symlink() and not path.exists():
            raise RunDirError(
                f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist; create that "
                "folder, remove the link, or choose another trainer.run_dir"
            )
        if path.exists():
            if not path.is_dir():
                raise RunDirError(
                    f"{what} {path} exists and is not a directory; remove or rename that file, or choose "
                    "another trainer.run_dir"
                )
            if not os.access(path, os.W_OK | os.X_OK):
                raise RunDirError(
                    f"{what} {path} is not writable by this user; fix its permissions or choose another "
                    "trainer.run_dir"
                )
            continue
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise RunDirError(
                f"{what} {path} cannot be created: {parent} is not a directory; choose another trainer.run_dir"
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise RunDirError(
                f"{what} {path} cannot be created: {parent} is not writable by this user; choose another "
                "trainer.run_dir"
            )
        return  # nothing below a folder still to be created can be in the way


def is_explicit_resume(resume: str | None) -> bool:
    """Whether trainer.resume names a checkpoint (not unset, not `auto`)."""
    return resume not in (None, "", "auto")


def resolve_explicit_resume(resume: str | None, run_dir: Path) -> Path | None:
    """An explicit trainer.resume path, resolved and verified before the model is built (RunDirError /
    CheckpointError): the launch's one resolution of it, which `prepare_run_dir` takes. None for no
    resume and for `auto`, which `prepare_run_dir` resolves where the run resumes (it may legitimately
    find nothing)."""
    if not is_explicit_resume(resume):
        return None
    try:
        return resolve_resume(resume, run_dir, log=lambda _m: None)
    except FileNotFoundError as e:  # resolve_resume's "no checkpoint directory there"
        raise RunDirError(str(e)) from None


def check_writable(run_dir: Path) -> None:
    """RUN_DIR and RUN_DIR/checkpoints are directories (or can be made) that this process can write."""
    for d in (run_dir, run_dir / "checkpoints"):
        if d.exists() and not d.is_dir():
            raise RunDirError(
                f"{d} is a file, not a directory: the run could not save its logs or checkpoints there. "
                f"Move the file away, or choose another trainer.run_dir"
            )
    base = run_dir
    while not base.exists():  # the nearest existing folder must let us create the run dir
        base = base.parent
    target = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else base
    if not os.access(target, os.W_OK | os.X_OK):
        raise OutputError(
            f"{target} is not writable by this user: the run could not save its logs or checkpoints. "
            f"Fix its permissions, or choose another trainer.run_dir"
        )


def move_aside(run_dir: Path) -> Path:
    """Rename `run_dir` to `run_dir.old-<UTC time>` (a new name if that exists); return the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while dest.exists():
        dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
        n += 1
    os.replace(run_dir, dest)
    return dest


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def lr_multipliers(flat: dict[str, Any], step: int) -> tuple[float, float]:
    """(decoder, encoder) LR multipliers of the 0-based optimizer step `step` under a flattened config."""
    kw = dict(
        warmup_steps=int(flat["optim.warmup_steps"]),
        max_steps=int(flat["trainer.max_steps"]),
        min_lr_ratio=float(flat["optim.min_lr_ratio"]),
    )
    enc = encoder_lr_lambda(
        step,
        unfreeze_step=int(flat["optim.unfreeze_step"]),
        encoder_warmup_steps=int(flat["optim.encoder_warmup_steps"]),
        **kw,  # type: ignore[arg-type]
    )
    return decoder_lr_lambda(step, **kw), enc  # type: ignore[arg-type]


def schedule_change(old: dict[str, Any], new: dict[str, Any], step: int) -> str | None:
    """None if the steps trained so far (0 .. step-1) had the same learning rates under `new` (a new
    max_steps then only changes the steps still to come, as if the run had had it from the start);
    else where they part, with the learning rate the next step would get under each."""
    for s in range(step):
        if lr_multipliers(old, s) != lr_multipliers(new, s):
            lr = float(new["optim.lr"])
            was, now = lr * lr_multipliers(old, step)[0], lr * lr_multipliers(new, step)[0]
            return (
                f"the learning rate of step {step + 1} would be {now:.3g} instead of {was:.3g} (the schedules "
                f"part at step {s + 1}, before the checkpoint)"
            )
    return None


def compare_resume_config(
    saved: dict[str, Any],
    current: dict[str, Any],
    *,
    validate_only: bool,
    resume_data: str,
    step: int | None = None,
) -> tuple[list[str], list[str]]:
    """(refused, applied): each 'key: old -> new' of the keys whose value differs.

    Refused: what changes the optimisation of the resumed run (optim.*, model.*, trainer.max_steps,
    trainer.grad_accum, trainer.seed, trainer.precision, ...), and data.* / sampler.* unless
    `resume_data=next_epoch` (a new data plan from the next epoch). A new trainer.max_steps is applied
    when the steps trained so far had the same learning rates under it (`schedule_change`, needs
    `step`), so the LR does not jump. Evaluation only (`validate_only`) refuses only model.*."""
    old, new = flatten(saved), flatten(current)
    refused, applied = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b or key in QUIET_KEYS:
            continue
        line = f"{key}: {a!r} -> {b!r}"
        if key.startswith(HARMLESS_PREFIXES):
            applied.append(line)
        elif validate_only and not key.startswith("model."):
            applied.append(line)
        elif key.startswith(DATA_PLAN_PREFIXES) and resume_data == "next_epoch":
            applied.append(line)
        elif key == "trainer.max_steps" and step is not None:
            try:
                jump = schedule_change(old, new, step)
            except (KeyError, TypeError, ValueError):  # a saved config without these keys
                jump = "the saved config does not give the schedule"
            if jump is None:
                applied.append(f"{line} (the {step} steps trained so far had the same learning rates)")
            else:
                refused.append(f"{line} ({jump})")
        else:
            refused.append(line)
    return refused, applied


def check_resume_config(
    cfg: ExperimentConfig, ckpt: Path, run_dir: Path, log: Callable[[str], object] = print
) -> None:
    saved, source = saved_config(ckpt, run_dir)
    if saved is None:
        log(f"note: {ckpt} has no saved config; the changes since it was saved cannot be checked")
        return
    t = cfg.trainer
    step = json.loads((ckpt / COMPLETE_NAME).read_text()).get("step")
    refused, applied = compare_resume_config(
        saved,
        to_dict(cfg),
        validate_only=t.validate_only,
        resume_data=t.resume_data,
        step=step if isinstance(step, int) else None,
    )
    if refused:
        data_only = all(line.startswith(DATA_PLAN_PREFIXES) for line in refused)
        fix = (
            "restore these values, or add trainer.resume_data=next_epoch to continue the weights with the "
            "new data plan from the next epoch"
            if data_only
            else "restore these values to continue this run, or start a new run (another trainer.run_dir, "
            "without trainer.resume) to train with them"
        )
        raise RunDirError(
            f"cannot resume {ckpt} with a config that changes the optimisation ({source} holds the saved one): "
            + "; ".join(refused)
            + f". {fix}"
        )
    if applied:
        log(f"resume: config changes applied (saved in {source}): " + "; ".join(applied))


def prepare_run_dir(
    cfg: ExperimentConfig, run_dir: Path, rank: int, *, resolved: Path | None = None
) -> Path | None:
    """Steps 1-4 of the module docstring; returns the verified checkpoint to resume, or None.

    `resolved`: an explicit trainer.resume already resolved by the pre-flight (`resolve_explicit_resume`),
    taken as it is; trainer.resume=auto (or an explicit path not resolved yet) is resolved here."""
    t = cfg.trainer
    log = print if rank == 0 else (lambda _m: None)
    check_writable(run_dir)
    if resolved is not None and is_explicit_resume(t.resume):
        ckpt: Path | None = resolved
    else:
        ckpt = resolve_resume(t.resume, run_dir, log)
    in_lineage = ckpt is not None and ckpt.parent.resolve() == (run_dir / "checkpoints").resolve()
    if not in_lineage:
        found = holds_run(run_dir, count_metrics=t.resume != "auto")
        if found and getattr(t, "overwrite", False):
            if rank == 0:  # the other ranks write nothing to the run dir before rank 0 does
                dest = move_aside(run_dir)
                print(f"trainer.overwrite=true: moved the earlier run {run_dir} to {dest} (nothing deleted)")
        elif found and t.resume == "auto":
            raise RunDirError(
                f"trainer.resume=auto: trainer.run_dir={run_dir} holds a run ({'; '.join(found)}) but no "
                f"checkpoint to continue it from (was trainer.ckpt_every 0?). Choose another trainer.run_dir, "
                f"or add trainer.overwrite=true to move that run aside to {run_dir}.old-<UTC time> and start "
                f"a new one (nothing is deleted)"
            )
        elif found:
            raise RunDirError(
                f"trainer.run_dir={run_dir} holds another run ({'; '.join(found)}). To continue it, add "
                f"trainer.resume=auto; to start a new run, choose another trainer.run_dir, or add "
                f"trainer.overwrite=true to move the earlier run aside to {run_dir}.old-<UTC time> "
                f"(nothing is deleted)"
            )
    if ckpt is not None:
        check_resume_config(cfg, ckpt, run_dir, log)
    return ckpt
