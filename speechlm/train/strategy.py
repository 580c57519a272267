"""Lightning strategy that builds our (dp_replicate, dp_shard, cp, tp) mesh.

Lightning's `ModelParallelStrategy` knows only dp x tp. We keep everything else it does (process-group
setup under torchrun or its own launcher, FSDP2-aware sharded DCP checkpoints, `configure_model`) and
replace the mesh with the one `parallel.mesh.ParallelDims` describes. Lightning's distributed sampler is
disabled by the Trainer (`use_distributed_sampler=False`): our sampler is built per data-parallel rank.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from parallel.mesh import ParallelDims
from speechlm.model.trainable import train_modes_of
from speechlm.train.checkpoint import load_trained_state
from speechlm.train.lightning_compat import (
    save_checkpoint_one_process,
    set_device_mesh,
    setup_process_group,
)


class SpeechParallelStrategy(ModelParallelStrategy):
    def __init__(
        self, dims: ParallelDims, *, process_group_backend: str | None = None, timeout_s: float = 1800.0
    ):
        super().__init__(
            data_parallel_size=dims.dp,
            tensor_parallel_size=dims.tp,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.dims = dims

    def setup_environment(self) -> None:
        setup_process_group(self)
        if self.world_size != self.dims.world_size:
            raise RuntimeError(
                f"the launcher started {self.world_size} processes but the layout needs {self.dims.world_size} "
                f"({self.dims.describe()})"
            )
        assert self.lightning_module is not None
        set_device_mesh(self, self.lightning_module, self.dims.build_mesh(self.root_device.type))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dims.dp, "rank": self.dims.dp_rank(self.global_rank)}

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | Path,
        storage_options: Any = None,  # Any: Lightning's own signature (a CheckpointIO's options)
    ) -> None:
        """One process writes the same sharded checkpoint without DCP's collectives (see
        `lightning_compat.save_checkpoint_one_process`); several processes go through Lightning."""
        if self.world_size == 1 and storage_options is None:
            save_checkpoint_one_process(checkpoint, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state without the frozen parameters (`speechlm.model.trainable`): a frozen or
        LoRA run's checkpoint holds what trains, its meta.pt a fingerprint of the frozen base."""
        state = super().lightning_module_state_dict()
        frozen = frozen_keys_of(self.lightning_module)
        return {k: v for k, v in state.items() if k not in frozen} if frozen else state

    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the sharded checkpoint into the model (DTensor or plain parameters) and the optimizers.

        DCP's `.metadata` is read with the restricted unpickler (no code runs, `safe_storage_reader`) and
        meta.pt with ``weights_only=True``. Parameters the checkpoint leaves out must be this run's frozen
        ones, with the same fingerprint as when it was saved (`checkpoint.load_trained_state`)."""
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        return load_trained_state(
            self.model,
            self.optimizers,
            path,
            frozen=frozen_keys_of(self.lightning_module),
            fingerprints=train_modes_of(getattr(self.lightning_module, "model", None)).fingerprints,
            strict=self.lightning_module.strict_loading,
        )


def frozen_keys_of(module: object) -> frozenset[str]:
    """The state-dict keys of `module`'s frozen parameters (none for a module that has no such notion)."""
    keys = getattr(module, "frozen_state_keys", None)
    return keys() if callable(keys) else frozenset()
