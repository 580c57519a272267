"""Atomic, verifiable checkpoints, and resuming from them: `paths` (which checkpoint a launch resumes),
`save` (the atomic save), `rng` (RNG states as tensors), `restore` (data position, RNG, lineage); the
files of a checkpoint and their safe reading are `speechlm.use.checkpoint_files`, shared with
evaluate/transcribe/export. The names below are re-exported here for the callers.

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

from speechlm.io import sha256_of
from speechlm.train.checkpoint.paths import (
    data_position_name,
    latest_checkpoint,
    layout_of,
    resolve_resume,
    run_id_of,
    writes_data_position,
)
from speechlm.train.checkpoint.restore import (
    adopt_lineage,
    missing_position,
    read_data_position,
    read_rng_state,
    restore_training_state,
    resume_run,
    saved_dp_size,
)
from speechlm.train.checkpoint.rng import capture_rng_state, restore_rng_state
from speechlm.train.checkpoint.save import (
    collect_hashes,
    hash_own_files,
    list_files,
    own_files,
    publish,
    rotate_checkpoints,
    save_checkpoint_atomic,
    save_failed,
    write_rank_state,
)
from speechlm.use.checkpoint_files import (
    COMPLETE_NAME,
    CONFIG_NAME,
    DCP_METADATA,
    META_NAME,
    RANK_DIR,
    STATE_PREFIX,
    STEP_RE,
    CheckpointError,
    check_finite_state,
    check_frozen_base,
    list_checkpoints,
    load_metadata,
    load_trained_state,
    newest_verified,
    previous_complete,
    read_dcp_metadata,
    recover_interrupted_resave,
    safe_storage_reader,
    shape_mismatches,
    step_dir_name,
    trash_name,
    verify_checkpoint,
)

__all__ = [
    "COMPLETE_NAME",
    "CONFIG_NAME",
    "CheckpointError",
    "DCP_METADATA",
    "META_NAME",
    "RANK_DIR",
    "STATE_PREFIX",
    "STEP_RE",
    "adopt_lineage",
    "capture_rng_state",
    "check_finite_state",
    "check_frozen_base",
    "collect_hashes",
    "data_position_name",
    "hash_own_files",
    "latest_checkpoint",
    "layout_of",
    "list_checkpoints",
    "list_files",
    "load_metadata",
    "load_trained_state",
    "missing_position",
    "newest_verified",
    "own_files",
    "previous_complete",
    "publish",
    "read_data_position",
    "read_dcp_metadata",
    "read_rng_state",
    "recover_interrupted_resave",
    "resolve_resume",
    "restore_rng_state",
    "restore_training_state",
    "resume_run",
    "rotate_checkpoints",
    "run_id_of",
    "safe_storage_reader",
    "save_checkpoint_atomic",
    "save_failed",
    "saved_dp_size",
    "sha256_of",
    "shape_mismatches",
    "step_dir_name",
    "trash_name",
    "verify_checkpoint",
    "write_rank_state",
    "writes_data_position",
]
