"""Lightning strategy that builds our (dp_replicate, dp_shard, cp, tp) mesh.

Lightning's `ModelParallelStrategy` knows only dp x tp. We keep everything else it does (process-group
setup under torchrun or its own launcher, FSDP2-aware sharded DCP checkpoints, `configure_model`) and
replace the mesh with the one `parallel.mesh.ParallelDims` describes. Lightning's distributed sampler is
disabled by the Trainer (`use_distributed_sampler=False`): our sampler is built per data-parallel rank.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from parallel.mesh import ParallelDims


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
        self._setup_distributed()
        if self.world_size != self.dims.world_size:
            raise RuntimeError(
                f"the launcher started {self.world_size} processes but the layout needs {self.dims.world_size} "
                f"({self.dims.describe()})"
            )
        self._device_mesh = self.dims.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dims.dp, "rank": self.dims.dp_rank(self.global_rank)}
