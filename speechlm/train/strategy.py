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
from speechlm.train.lightning_compat import (
    has_dtensor_modules,
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

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """One process writes the same sharded checkpoint without DCP's collectives (see
        `lightning_compat.save_checkpoint_one_process`); several processes go through Lightning."""
        if self.world_size == 1 and storage_options is None:
            save_checkpoint_one_process(checkpoint, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's DCP loader insists on DTensor parameters; one process has none (no FSDP/TP), so
        the same sharded format is read here with torch's state-dict helpers, which take plain modules."""
        from speechlm.train.checkpoint import (
            DCP_METADATA,
            load_metadata,
            read_dcp_metadata,
            safe_storage_reader,
        )

        if has_dtensor_modules(self.model):
            # meta.pt holds plain containers and tensors only (train/checkpoint.py); DCP's .metadata is a
            # pickle that Lightning's loader unpickles: read it first with the restricted unpickler, which
            # refuses any code in it (verify_checkpoint did too, before the model was built)
            read_dcp_metadata(Path(checkpoint_path) / DCP_METADATA)
            return super().load_checkpoint(checkpoint_path, weights_only=True)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None
        model_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(model_state, storage_reader=safe_storage_reader(path))
        assert self.lightning_module is not None
        self.model.load_state_dict(model_state["state_dict"], strict=self.lightning_module.strict_loading)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optim_state, storage_reader=safe_storage_reader(path))
            set_optimizer_state_dict(
                self.model,
                optimizer,
                optim_state_dict=optim_state[key],
                options=StateDictOptions(cpu_offload=True),
            )
        return load_metadata(path)
