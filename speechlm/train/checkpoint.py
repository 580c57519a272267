"""Atomic, verifiable checkpoints, and resuming from them.

Layout of `RUN_DIR/checkpoints/step_000100/`:

    .metadata, __*_*.distcp   model and optimizer shards (PyTorch Distributed Checkpoint, one per rank)
    meta.pt                   Lightning's loop/scheduler/callback state and our counters: plain
                              containers and tensors only, loaded with `torch.load(weights_only=True)`
    speechlm/data_dp00000.json    the data position of each data-parallel rank (JSON), written once per
                                  dp rank by the first rank of its dp group (cp rank 0, tp rank 0)
    speechlm/rng_rank00000.pt     every rank's own RNG states (tensors only)
    complete.json             written last: the step, the size and SHA-256 of every file above

Saving: every rank writes into `checkpoints/.tmp-step_000100`; after a barrier rank 0 writes
`complete.json` and renames the directory to `step_000100` (`os.replace`, atomic), then rewrites the
`latest` pointer atomically and only then deletes checkpoints beyond `keep_last`. A process killed at
any moment leaves either a `.tmp-*` directory (never resumed from, removed by the next save) or a
complete checkpoint; the previous good checkpoint is deleted only after a newer one is complete.
The data positions are files of the same directory, listed and hashed in `complete.json`: they are
published by the same rename as the weights, never one without the other.

Loading: `verify_checkpoint` checks `complete.json` against the files (a missing or truncated file is
an error naming it) and reads `meta.pt` with `weights_only=True`, so a checkpoint directory from
someone else cannot run code. `resume=auto` takes the newest checkpoint that verifies and says which
incomplete ones it skipped; an explicit path that does not verify is an error suggesting the previous
checkpoint. `restore_training_state` then gives every rank the data position of its dp rank and its
own RNG states. The position depends on the dp rank only (cp/tp peers train on the same batches), so
a checkpoint resumes exactly under another cp/tp with the same dp size; another dp size cannot
continue the saved data order and is refused, naming `trainer.resume_data=next_epoch`.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speechlm.config import ExperimentConfig
from speechlm.errors import OutputError, RunDirError
from speechlm.io import sha256_of  # noqa: F401 (re-exported: its first home)

STEP_RE = re.compile(r"^step_(\d{6,})$")
COMPLETE_NAME = "complete.json"
META_NAME = "meta.pt"
DCP_METADATA = ".metadata"  # DCP's index of the shards (a pickle: read with read_dcp_metadata)
RANK_DIR = "speechlm"


class CheckpointError(RunDirError, RuntimeError):
    """A checkpoint that is incomplete, truncated, altered or from another setup."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_root: Path, log: Any = print) -> Path | None:
    """The `latest` pointer's checkpoint if it verifies, else the newest one that does (skips are logged).

    None when there is no `step_*` directory; CheckpointError when there are some but none verifies.
    Every rank runs this on the same files and reaches the same answer (nothing here is random)."""
    found, refused = newest_verified(ckpt_root, log)
    if found is None and refused:  # starting over would silently throw the run away (keep_last deletes)
        raise CheckpointError(
            f"resume=auto: none of the {len(refused)} checkpoints in {ckpt_root} can be resumed from (first: "
            f"{refused[0][1]}); checkpoints written before complete.json existed cannot be loaded safely. Start "
            f"over in a new trainer.run_dir, or remove {ckpt_root} to start over in this one"
        )
    return found


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


def resolve_resume(resume: str | None, run_dir: Path, log: Any = print) -> Path | None:
    """`None` → no resume; `auto` → the latest complete checkpoint of the run if any; else a path."""
    if resume is None or resume == "":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir / "checkpoints", log)
    p = Path(resume)
    if not p.is_dir():
        p = recover_interrupted_resave(p)  # `best` killed between its two renames: the old one is whole
    if not p.is_dir():
        raise CheckpointError(
            f"trainer.resume={resume!r}: no checkpoint directory there; use trainer.resume=auto to pick the "
            f"latest checkpoint of trainer.run_dir, or give a path such as {run_dir}/checkpoints/step_000100"
        )
    try:
        verify_checkpoint(p)
    except CheckpointError as e:
        earlier = previous_complete(p)
        hint = (
            f"resume from the previous complete checkpoint, trainer.resume={earlier}"
            if earlier is not None
            else "no earlier complete checkpoint is next to it; start without trainer.resume"
        )
        raise CheckpointError(f"{e}; {hint}") from None
    return p


# --- writing ----------------------------------------------------------------------------------------
CONFIG_NAME = "config.yaml"  # the run's config at save time, compared with the current one on resume


def list_files(root: Path) -> dict[str, int]:
    return {
        str(f.relative_to(root)): f.stat().st_size
        for f in sorted(root.rglob("*"))
        if f.is_file() and f.name != COMPLETE_NAME
    }


def own_files(ckpt_dir: Path, rank: int) -> list[Path]:
    """The files this rank wrote: its DCP shards `__<rank>_*.distcp` and its `speechlm/*_rank<rank>.*`."""
    return sorted([*ckpt_dir.glob(f"__{rank}_*.distcp"), *(ckpt_dir / RANK_DIR).glob(f"*_rank{rank:05d}.*")])


def hash_own_files(ckpt_dir: Path, rank: int, also: list[Path] | None = None) -> None:
    """Each rank hashes what it wrote (`own_files` and `also`: its dp rank's data position) into
    `speechlm/sha256_rank<r>.json`, so the cost is spread over the ranks."""
    files = sorted({*own_files(ckpt_dir, rank), *(also or [])})
    hashes = {str(f.relative_to(ckpt_dir)): sha256_of(f) for f in files}
    (ckpt_dir / RANK_DIR).mkdir(parents=True, exist_ok=True)
    (ckpt_dir / RANK_DIR / f"sha256_rank{rank:05d}.json").write_text(json.dumps(hashes, indent=1))


def collect_hashes(ckpt_dir: Path, files: dict[str, int]) -> dict[str, str]:
    """Every file's SHA-256: the ranks' own (hash_own_files), the rest (.metadata, meta.pt, ...) here."""
    known: dict[str, str] = {}
    for f in sorted((ckpt_dir / RANK_DIR).glob("sha256_rank*.json")):
        known.update(json.loads(f.read_text()))
    return {rel: known.get(rel) or sha256_of(ckpt_dir / rel) for rel in files}


def data_position_name(dp_rank: int) -> str:
    return f"data_dp{dp_rank:05d}.json"


def writes_data_position(dims: Any, rank: int) -> bool:
    """Whether `rank` writes its dp rank's data position: the first rank of each dp group (cp rank 0,
    tp rank 0) does, its cp/tp peers hold the same position (they train on the same batches).
    `dims` None: one process."""
    return dims is None or (dims.cp_rank(rank) == 0 and dims.tp_rank(rank) == 0)


def layout_of(dims: Any) -> dict[str, int] | None:
    """The (dp_replicate, dp_shard, cp, tp) sizes of `dims` as complete.json records them (None: unknown)."""
    if dims is None:
        return None
    return {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp}


def write_rank_state(ckpt_dir: Path, rank: int, data_state: dict[str, Any] | None) -> list[Path]:
    """This rank's RNG states (tensors) and, when given (once per dp rank), the data position of its dp
    rank (JSON, keyed by the state's `dp_rank`), next to the model shards; returns the files written."""
    d = ckpt_dir / RANK_DIR
    d.mkdir(parents=True, exist_ok=True)
    written = [d / f"rng_rank{rank:05d}.pt"]
    torch.save(capture_rng_state(), written[0])
    if data_state is not None:
        written.append(d / data_position_name(int(data_state.get("dp_rank", 0))))
        written[-1].write_text(json.dumps(data_state, indent=1))
    return written


def run_id_of(ckpt: Path) -> str | None:
    """The run (lineage) that wrote `ckpt`, from its complete.json; None for a checkpoint without one."""
    try:
        rid = json.loads((ckpt / COMPLETE_NAME).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None


def rotate_checkpoints(ckpt_root: Path, keep_last: int | None, run_id: str | None) -> list[Path]:
    """Delete this run's `step_*` checkpoints beyond the `keep_last` highest steps; return what was deleted.

    Only checkpoints of this run's lineage are candidates (complete.json `run_id` equal to ours: saved
    by this run, or by the run it resumed from); the one `latest` names is never deleted; `keep_last`
    None or < 1 keeps everything (validation refuses < 1; this is the belt to its braces)."""
    if not keep_last or keep_last < 1 or run_id is None:
        return []
    pointer = ckpt_root / "latest"
    protected = ckpt_root / pointer.read_text().strip() if pointer.is_file() else None
    ours = [p for _, p in list_checkpoints(ckpt_root) if run_id_of(p) == run_id]
    doomed = [p for p in ours[:-keep_last] if p != protected]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


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


def save_checkpoint_atomic(
    trainer: Any,
    ckpt_root: Path,
    name: str,
    *,
    keep_last: int | None = None,
    update_latest: bool = True,
    data_state: dict[str, Any] | None = None,
    run_id: str | None = None,
    layout: dict[str, int] | None = None,
) -> Path:
    """Save through `trainer.save_checkpoint` into a temp dir, then rename on rank 0 (all ranks call).

    `data_state`: the data position of this rank's dp rank, given by the first rank of each dp group
    only (`writes_data_position`; None on its cp/tp peers); `layout`: the run's `layout_of(dims)`,
    recorded in complete.json (the RNG states are restored only into the same layout). A full disk (or any OS error while
    writing) removes the temp dir and raises OutputError naming the checkpoint and the previous one,
    which is kept."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from speechlm.train.faults import fault_point

    strategy = trainer.strategy
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp-{name}"
    final = ckpt_root / name
    if strategy.is_global_zero:
        recover_interrupted_resave(final)
        if tmp.exists():
            shutil.rmtree(tmp)
    strategy.barrier("speechlm_ckpt_pre")
    try:
        trainer.save_checkpoint(str(tmp), weights_only=False)  # full state: optimizer, loops, callbacks
        written = write_rank_state(tmp, strategy.global_rank, data_state)
        hash_own_files(tmp, strategy.global_rank, written)
    except (Exception, CheckpointException) as e:
        err = save_failed(e, ckpt_root, tmp, final, strategy.is_global_zero)
        if err is None:
            raise
        raise err from e
    fault_point("save", trainer.global_step)  # the fault-injection harness kills here
    strategy.barrier("speechlm_ckpt_saved")
    if strategy.is_global_zero:
        try:
            config = ckpt_root.parent / CONFIG_NAME
            if config.is_file():
                shutil.copyfile(config, tmp / RANK_DIR / CONFIG_NAME)
            files = list_files(tmp)
            manifest = {
                "step": trainer.global_step,
                "world_size": strategy.world_size,
                "layout": layout,
                "run_id": run_id,
                "files": files,
                "sha256": collect_hashes(tmp, files),
            }
            (tmp / COMPLETE_NAME).write_text(json.dumps(manifest, indent=1))
        except OSError as e:
            raise save_failed(e, ckpt_root, tmp, final, True) from e  # type: ignore[misc]
        publish(tmp, final)
        if update_latest:
            write_text_atomic(ckpt_root / "latest", name)
        rotate_checkpoints(ckpt_root, keep_last, run_id)
        for p in ckpt_root.glob(".tmp-*"):
            if p != tmp:
                shutil.rmtree(p, ignore_errors=True)
    strategy.barrier("speechlm_ckpt_done")
    return final


def publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. Re-saving a name (`best`): the old one goes to `.old-<name>` first, so a
    kill between the two renames leaves a complete `.old-<name>`, which every reader takes for `<name>`
    (recover_interrupted_resave); it is deleted only once the new one is in place."""
    if not final.exists():
        os.replace(tmp, final)
        return
    trash = final.with_name(trash_name(final.name))
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(final, trash)
    os.replace(tmp, final)
    shutil.rmtree(trash, ignore_errors=True)


def save_failed(
    e: BaseException, ckpt_root: Path, tmp: Path, final: Path, remove: bool
) -> OutputError | None:
    """An OS error while writing a checkpoint (disk full, permission): remove the temp dir, keep the rest."""
    os_error = e if isinstance(e, OSError) else _find_os_error(e)
    if os_error is None:
        return None  # not an I/O failure: a bug, let it through
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    pointer = ckpt_root / "latest"
    kept = pointer.read_text().strip() if pointer.is_file() else None
    previous = (
        f"the previous checkpoint {ckpt_root / kept} is kept and trainer.resume=auto continues from it"
        if kept
        else "no earlier checkpoint exists"
    )
    return OutputError(
        f"cannot write checkpoint {final}: {os_error.strerror or os_error} ({tmp} removed); {previous}. "
        f"Free space under {ckpt_root} (or fix its permissions) and resume with trainer.resume=auto"
    )


def _find_os_error(e: BaseException) -> OSError | None:
    """The OSError inside an exception that wraps it (DCP's CheckpointException keeps per-rank failures)."""
    seen: set[int] = set()
    stack: list[Any] = [e]
    while stack:
        x = stack.pop()
        if id(x) in seen or x is None:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        if isinstance(x, BaseException):
            stack += [x.__cause__, x.__context__, *x.args]
            failures = getattr(x, "failures", None)
            if isinstance(failures, dict):
                stack += list(failures.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return None


# --- reading ----------------------------------------------------------------------------------------
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
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(Path(self.path) / DCP_METADATA)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


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


STATE_PREFIX = "state_dict."  # the model's keys in DCP's metadata (optimizers: "optimizer_<i>.")


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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
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
    import torch.distributed as dist

    from speechlm.errors import NonFiniteError
    from speechlm.model.finite import first_non_finite, non_finite_message

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


def _read_json(f: Path) -> dict[str, Any]:
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}): the checkpoint was altered") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{f} holds no data position (a JSON object): the checkpoint was altered")
    return data


def read_data_position(path: Path, dp_rank: int) -> dict[str, Any] | None:
    """The data position of `dp_rank` in checkpoint `path` (None if it has none).

    Checkpoints saved before positions were keyed by dp rank hold one `data_rankRRRRR.json` per
    process, each naming its `dp_rank`: the first one of `dp_rank` is taken (its peers hold the same)."""
    f = path / RANK_DIR / data_position_name(dp_rank)
    if f.is_file():
        return _read_json(f)
    for legacy in sorted((path / RANK_DIR).glob("data_rank*.json")):
        state = _read_json(legacy)
        if state.get("dp_rank", 0) == dp_rank:
            return state
    return None


def saved_dp_size(path: Path) -> int | None:
    """The number of data-parallel ranks `path` was saved with, from its data positions (None: none)."""
    files = sorted((path / RANK_DIR).glob("data_dp*.json")) or sorted(
        (path / RANK_DIR).glob("data_rank*.json")
    )
    for f in files:
        size = _read_json(f).get("dp_size")
        if isinstance(size, int):
            return size
    return None


def read_rng_state(path: Path, rank: int) -> dict[str, Any] | None:
    f = path / RANK_DIR / f"rng_rank{rank:05d}.pt"
    if not f.is_file():
        return None
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f} cannot be loaded safely (weights_only=True): {e}") from None


def restore_training_state(
    ckpt: Path,
    loader: Any,
    module: Any,
    *,
    resume_data: str,
    rank: int,
    world_size: int,
    dims: Any = None,
) -> tuple[int, dict[str, int]]:
    """Give this rank the data position of its dp rank and its RNG states from `ckpt`; return
    (global step, position).

    `resume_data="exact"` continues the data after the last trained micro-batch and needs the saved
    dp size (any cp/tp); `"next_epoch"` starts the epoch after the saved one in this run's layout.
    The RNG states are per process and belong to its place in the layout: they come back only into
    the saved layout (`dims`; the same number of processes for a checkpoint that has no layout),
    elsewhere every rank keeps the run's seeding."""
    meta = load_metadata(ckpt)
    complete = json.loads((ckpt / COMPLETE_NAME).read_text())
    saved_world = complete.get("world_size", world_size)
    saved_layout, layout = complete.get("layout"), layout_of(dims)
    same_layout = saved_layout == layout if saved_layout and layout else saved_world == world_size
    dp_rank = loader.dp_rank if resume_data == "exact" else 0  # next_epoch takes the saved epoch only
    state = read_data_position(ckpt, dp_rank)
    if state is None:
        raise missing_position(ckpt, dp_rank, loader.sampler.dp_size)
    try:
        loader.restore(state, next_epoch=resume_data == "next_epoch")
    except ValueError as e:
        raise CheckpointError(
            f"cannot continue the data order of {ckpt}: {e}\nTo resume the model and optimizer into this layout "
            f"anyway, add trainer.resume_data=next_epoch (the data restarts at the next epoch)"
        ) from None
    module.pending_rng = read_rng_state(ckpt, rank) if same_layout else None
    return int(meta.get("global_step", 0)), dict(loader.consumed)


def missing_position(ckpt: Path, dp_rank: int, dp_size: int) -> CheckpointError:
    """The error for a checkpoint without a data position for `dp_rank`: saved with this dp size, the
    entry was lost (an altered checkpoint); saved with another, the data order cannot continue."""
    saved = saved_dp_size(ckpt)
    f = ckpt / RANK_DIR / data_position_name(dp_rank)
    if saved == dp_size:
        return CheckpointError(
            f"{ckpt} has no data position for dp rank {dp_rank} ({f} is missing) although it was saved with "
            f"{saved} data-parallel ranks: the checkpoint was altered. Resume from an earlier checkpoint, or "
            f"add trainer.resume_data=next_epoch to resume the model and optimizer (the data restarts at the "
            f"next epoch)"
        )
    was = f"saved with {saved} data-parallel ranks" if saved is not None else "it holds no data position"
    return CheckpointError(
        f"{ckpt} has no data position for dp rank {dp_rank} ({was}, this run has {dp_size}); add "
        f"trainer.resume_data=next_epoch to resume the model and optimizer into this layout (the data "
        f"restarts at the next epoch)"
    )


# --- RNG states as tensors and plain values (weights_only-safe) ---------------------------------------
def capture_rng_state() -> dict[str, Any]:
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any] | None) -> None:
    if not state:
        return
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_run(
    cfg: ExperimentConfig,
    ckpt: Path | None,
    loader: Any,
    module: Any,
    trainer: Any,
    metrics: Any,
    *,
    rank: int,
    world_size: int,
) -> Path | None:
    """Restore this rank's data position and RNG state from `ckpt` (resolved and checked by
    run_dir.prepare_run_dir; the weights, optimizer and loops are restored by `trainer.fit(ckpt_path=...)`),
    adopt its lineage for rotation, and trim `metrics.jsonl` and the CSV log to the restored step.
    Returns `ckpt` (None: a fresh start)."""
    from speechlm.train.lightning_compat import set_fit_max_steps

    t = cfg.trainer
    step, pos = 0, None  # type: tuple[int, dict[str, int] | None]
    if ckpt is not None:
        step, pos = restore_training_state(
            ckpt,
            loader,
            module,
            resume_data=t.resume_data,
            rank=rank,
            world_size=world_size,
            dims=module.dims,
        )
    adopt_lineage(trainer, run_id_of(ckpt) if ckpt is not None else None)
    if pos is not None and rank == 0:
        metrics.truncate_after(step)
        for logger in getattr(trainer, "loggers", []):
            if hasattr(logger, "truncate_after"):
                logger.truncate_after(step)
        print(f"resuming from {ckpt} (optimizer step {step}, epoch {pos['epoch']}, "
              f"micro-batch {pos['position']} of it; data: {t.resume_data})")  # fmt: skip
    if t.validate_only:
        # evaluation only: restore the checkpoint (if any) through fit, with no optimizer step to take
        set_fit_max_steps(trainer, step if ckpt is not None else 0)
    if ckpt is None and rank == 0:
        if metrics.path.is_file() and metrics.path.read_text(errors="replace").strip():
            print(
                f"note: no checkpoint to resume from; {metrics.path} starts over (its steps were not saved)"
            )
        metrics.truncate_after(0)  # a fresh run starts a fresh history (prepare_run_dir checked it is ours)
    return ckpt


def adopt_lineage(trainer: Any, run_id: str | None) -> str:
    """Give the checkpoint-saving callbacks this run's id: the resumed checkpoint's, or a new one."""
    rid = run_id or uuid.uuid4().hex
    for cb in getattr(trainer, "callbacks", []):
        if hasattr(cb, "run_id"):
            cb.run_id = rid
    return rid
