"""The files of a trained checkpoint, read safely: what training's resume and `speechlm evaluate`,
`transcribe` and `export` share (so `speechlm.use` reads checkpoints without importing `speechlm.train`).

Layout of `RUN_DIR/checkpoints/step_000100/` (written by `speechlm.train.checkpoint.save`):

    .metadata, __*_*.distcp   model and optimizer shards (PyTorch Distributed Checkpoint, one per rank)
    meta.pt                   Lightning's loop/scheduler/callback state and our counters: plain
                              containers and tensors only, loaded with `torch.load(weights_only=True)`
    speechlm/data_dp00000.json    the data position of each data-parallel rank (JSON)
    speechlm/rng_rank00000.pt     every rank's own RNG states (tensors only)
    speechlm/config.yaml          the run's config at save time
    complete.json             written last: the step, the size and SHA-256 of every file above

`verify_checkpoint` checks `complete.json` against the files (a missing or truncated file is an error
naming it) and reads `meta.pt` with `weights_only=True` and DCP's `.metadata` with an unpickler that
admits DCP's own classes only, so a checkpoint directory from someone else cannot run code.
`newest_verified` picks a run's newest checkpoint that verifies (the `latest` pointer first);
`load_trained_state` loads the shards into a model (any layout: DCP reshards on load), checking what it
holds against what the model trains and the frozen base's fingerprints.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from speechlm.errors import NonFiniteError, RunDirError
from speechlm.io import sha256_of
from speechlm.model.finite import first_non_finite, non_finite_message

STEP_RE = re.compile(r"^step_(\d{6,})$")
COMPLETE_NAME = "complete.json"
META_NAME = "meta.pt"
DCP_METADATA = ".metadata"  # DCP's index of the shards (a pickle: read with read_dcp_metadata)
RANK_DIR = "speechlm"
CONFIG_NAME = "config.yaml"  # the run's config at save time, compared with the current one on resume
STATE_PREFIX = "state_dict."  # the model's keys in DCP's metadata (optimizers: "optimizer_<i>.")


class CheckpointError(RunDirError, RuntimeError):
    """A checkpoint that is incomplete, truncated, altered or from another setup."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def trash_name(name: str) -> str:
    return f".old-{name}"


def recover_interrupted_resave(path: Path) -> Path:
    """A re-save of `name` killed between its two renames leaves `.old-<name>` and no `<name>`: the old
    checkpoint is whole, so put it back (or, if the folder cannot be written, read it where it is)."""
    trash = path.with_name(trash_name(path.name))
    if path.exists() or not (trash / COMPLETE_NAME).is_file():
        return path
    try:
        os.replace(trash, path)
    except OSError:
        return trash
    return path


def newest_verified(
    ckpt_root: Path, log: Any = print, prefix: str = "resume=auto"
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the `latest` pointer's checkpoint if it verifies, else the newest one that does, or None; the
    (checkpoint, reason) of each one refused before it, newest first). Skips and a fallback are logged
    with `prefix`; what to do when none verifies is the caller's (training and evaluation differ)."""
    pointer = ckpt_root / "latest"
    candidates = [p for _, p in reversed(list_checkpoints(ckpt_root))]
    if pointer.is_file():
        target = ckpt_root / pointer.read_text().strip()
        if target in candidates:
            candidates.remove(target)
            candidates.insert(0, target)
    refused: list[tuple[Path, str]] = []
    for p in candidates:
        try:
            verify_checkpoint(p)
        except CheckpointError as e:
            log(f"{prefix}: skipping {p}: {e}")
            refused.append((p, str(e)))
            continue
        if refused:
            log(f"{prefix}: falling back from {refused[0][0]} to {p}, the newest checkpoint that verifies")
        return p, refused
    return None, refused


def previous_complete(path: Path) -> Path | None:
    """The newest checkpoint next to `path`, older than it, that verifies (None if there is none)."""
    for _, q in reversed(list_checkpoints(path.parent)):
        if q.name >= path.name:
            continue
        try:
            verify_checkpoint(q)
        except CheckpointError:
            continue
        return q
    return None


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check completeness, sizes and SHA-256 against `complete.json`, and read `meta.pt` and DCP's
    `.metadata` with loaders that run no code; return the manifest (CheckpointError names the file)."""
    marker = path / COMPLETE_NAME
    if not marker.is_file():
        raise CheckpointError(f"{path} is incomplete: no {COMPLETE_NAME} (the save was interrupted)")
    try:
        manifest = json.loads(marker.read_text())
        files = dict(manifest["files"])
        hashes = dict(manifest.get("sha256") or {})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{marker} is unreadable ({e}): the checkpoint was altered or truncated"
        ) from None
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint is incomplete")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{f} is {f.stat().st_size} bytes, {size} when saved: the file was truncated or altered"
            )
    for rel, digest in hashes.items():  # checkpoints saved before 2026-11-26 have sizes only
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint is incomplete")
        if sha256_of(f) != digest:
            raise CheckpointError(
                f"{f} does not match the SHA-256 recorded when it was saved: the file was corrupted or altered"
            )
    load_metadata(path)
    if (path / DCP_METADATA).is_file():
        read_dcp_metadata(path / DCP_METADATA)
    return manifest


def load_metadata(path: Path) -> dict[str, Any]:
    """`meta.pt` read with `weights_only=True` (plain containers and tensors only: no code runs)."""
    f = path / META_NAME
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is not what we wrote
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{f} cannot be loaded safely (weights_only=True): {first}; the file was truncated, altered or "
            f"written by another program"
        ) from None


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's `.metadata` holds: its metadata dataclasses, torch sizes, dtypes, layouts
    and memory formats, paths and plain containers. Any other global (a function such as `eval`,
    `os.system`, a class of another module) is refused before it is looked up, so no code runs."""

    DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module in self.DCP_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # a dataclass or enum of DCP's metadata, not a function
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def read_dcp_metadata(f: Path) -> Any:
    """DCP's `.metadata`, unpickled with `_DcpMetadataUnpickler` (CheckpointError names the file)."""
    try:
        with f.open("rb") as fh:
            return _DcpMetadataUnpickler(fh).load()
    except Exception as e:  # noqa: BLE001 - any failure means the file is not what DCP wrote
        raise CheckpointError(
            f"{f} cannot be loaded safely: {e}; the file was altered or written by another program "
            "(it was not unpickled, no code ran)"
        ) from None


def safe_storage_reader(path: Path) -> Any:
    """DCP's FileSystemReader whose `read_metadata` uses `read_dcp_metadata` (no code runs on load)."""
    from torch.distributed.checkpoint import (
        FileSystemReader,  # lazy: DCP (seconds to import; only a save or a load needs it)
    )
    from torch.distributed.checkpoint.metadata import (
        StorageMeta,  # lazy: DCP (seconds to import; only a save or a load needs it)
    )

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(Path(self.path) / DCP_METADATA)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


def load_trained_state(
    model: Any,
    optimizers: list[Any],
    path: Path,
    *,
    frozen: frozenset[str] = frozenset(),
    fingerprints: dict[str, str] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load checkpoint `path` (DCP shards) into `model` (plain or DTensor parameters) and `optimizers`;
    return its meta.pt.

    The checkpoint's model keys are loaded; a key of `model` it lacks must be one of `frozen` (a frozen
    or LoRA run's checkpoint leaves those out), and then the frozen base must be the saved one: the
    fingerprints in meta.pt must equal `fingerprints` (`check_frozen_base`). With `strict`, a trained
    key it lacks, or a key it holds that `model` has not (another train mode or LoRA setting), is an
    error naming the train modes it was saved with. Also for loading a checkpoint outside training
    (`optimizers` empty; `model` the module whose state-dict keys the checkpoint uses)."""
    import torch.distributed.checkpoint as dcp  # lazy: DCP (seconds to import; only a save or a load needs it)
    from torch.distributed.checkpoint.state_dict import (  # lazy: DCP (seconds to import; only a save or a load needs it)
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    meta = load_metadata(path)
    entries = read_dcp_metadata(path / DCP_METADATA).state_dict_metadata
    shapes = {
        k[len(STATE_PREFIX) :]: getattr(v, "size", None)
        for k, v in entries.items()
        if k.startswith(STATE_PREFIX)
    }
    saved = set(shapes)
    state = get_model_state_dict(model)
    absent = set(state) - saved
    mismatch = [f"has no {k}" for k in sorted(absent - frozen)]
    mismatch += [f"holds {k}" for k in sorted(saved - set(state))]
    mismatch += shape_mismatches(shapes, state)
    if mismatch and strict:
        base = (meta.get("speechlm") or {}).get("base") or {}
        was = f"model.llm.train={base.get('llm', 'full')}, model.encoder.train={base.get('encoder', 'full')}"
        raise CheckpointError(
            f"{path} {mismatch[0]} (and {len(mismatch) - 1} more parameters that do not match what this run "
            f"trains): it was saved with {was} (or other LoRA settings); resume with the settings it was "
            f"saved with, or start a new run from it"
        )
    if absent & frozen:
        check_frozen_base(path, meta, fingerprints or {})
    model_state = {"state_dict": {k: v for k, v in state.items() if k in saved}}
    dcp.load(model_state, storage_reader=safe_storage_reader(path))
    model.load_state_dict(model_state["state_dict"], strict=False)  # the absent keys were checked above
    check_finite_state(path, model_state["state_dict"])
    for idx, optimizer in enumerate(optimizers):
        key = f"optimizer_{idx}"
        optim_state = {key: get_optimizer_state_dict(model, optimizer)}
        dcp.load(optim_state, storage_reader=safe_storage_reader(path))
        set_optimizer_state_dict(
            model, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
        )
    return meta


def check_finite_state(path: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose loaded tensors hold a NaN or an infinity (NonFiniteError naming the
    checkpoint and the tensor). Each rank checks what it loaded (its shards); under a process group the
    ranks share their findings, so all of them stop here together, never one waiting for the others."""
    found = first_non_finite(state.items())
    findings: list[Any] = [found]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        findings = [None] * dist.get_world_size()
        dist.all_gather_object(findings, found)
    first = next((f for f in findings if f is not None), None)
    if first is None:
        return
    earlier = previous_complete(path) if path.parent.is_dir() else None
    fix = (
        f"resume from {earlier} (trainer.resume={earlier}), the newest earlier checkpoint that verifies"
        if earlier is not None
        else "no earlier checkpoint of this run verifies: start a new run"
    )
    raise NonFiniteError(non_finite_message(path, first, fix))


def shape_mismatches(saved: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """The keys of both whose saved shape differs from the model's (e.g. another LoRA rank)."""
    out = []
    for k in sorted(set(saved) & set(state)):
        have, want = saved[k], getattr(state[k], "shape", None)
        if have is not None and want is not None and tuple(have) != tuple(want):
            out.append(f"holds {k} of shape {list(have)} (this run's: {list(want)})")
    return out


def check_frozen_base(path: Path, meta: dict[str, Any], fingerprints: dict[str, str]) -> None:
    """Refuse to resume a checkpoint that left out its frozen base (frozen or LoRA run) onto another
    base: the fingerprints of the frozen parts saved in meta.pt must equal this run's."""
    base = (meta.get("speechlm") or {}).get("base") or {}
    saved = base.get("fingerprints") or {}
    if not saved:
        raise CheckpointError(
            f"{path} holds no frozen base reference (no fingerprint in its {META_NAME}) but leaves out "
            "parameters this run keeps frozen; resume it with the train modes it was saved with"
        )
    for part in sorted(set(saved) | set(fingerprints)):
        if saved.get(part) == fingerprints.get(part):
            continue
        where = base.get(f"{part}_pretrained")
        src = f"model.{part}.pretrained={where}" if where else f"the {part} built from the config and seed"
        raise CheckpointError(
            f"{path} was trained on a frozen {part} ({src}, fingerprint {str(saved.get(part))[:12]}) and "
            f"this run's frozen {part} differs (fingerprint {str(fingerprints.get(part))[:12]}): the checkpoint "
            f"holds only the trained parameters, so it cannot be resumed onto another base. Point "
            f"model.{part}.pretrained at the unchanged weights it was saved with (and the same "
            f"model.{part}.train and trainer.seed), or start a new run"
        )


def saved_config(ckpt: Path, run_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The config the checkpoint was trained with: its own copy, else RUN_DIR/config.yaml when the
    checkpoint is one of RUN_DIR's (read before this launch rewrites it). (None, None) if neither."""
    candidates = [ckpt / RANK_DIR / CONFIG_NAME]
    if ckpt.parent.resolve() == (run_dir / "checkpoints").resolve():
        candidates.append(run_dir / CONFIG_NAME)
    for f in candidates:
        if f.is_file():
            try:
                data = yaml.safe_load(f.read_text())
            except (OSError, yaml.YAMLError) as e:
                raise RunDirError(f"{f} cannot be read ({e}): the checkpoint's config was altered") from None
            return (data if isinstance(data, dict) else None), f
    return None, None
