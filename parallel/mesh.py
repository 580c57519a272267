"""`ParallelDims`: the one object that owns the parallel layout.

Axes, outermost first: `dp_replicate` (pure replication, HSDP's outer axis), `dp_shard` (FSDP2),
`cp` (context parallel), `tp` (tensor parallel, innermost so TP peers are neighbours, e.g. one node).
Global rank g maps to coordinates in row-major order:

    g = ((r_rep * dp_shard + r_shard) * cp + r_cp) * tp + r_tp

Flattened sub-meshes the rest of the code asks for:
- `dp`          = dp_replicate x dp_shard: the sampler's data-parallel ranks (CP/TP peers share a batch);
- `dp_shard_cp` = dp_shard x cp: where FSDP2 shards parameters (CP ranks hold the same weights);
- `dp_cp`       = dp_replicate x dp_shard x cp: the ranks the loss normaliser and gradients sum over.

The rank arithmetic is pure (tested without a process group); `build_mesh` creates the DeviceMesh and
`collectives(rank)` the one object through which the training step, evaluation and the counts talk to
the other ranks. torch is imported only inside those two: the validator reads `resolve_dp_shard` from
here without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from parallel.cp_placement import cp_degrees  # standard library only, like this module


class LayoutError(ValueError):
    """The requested layout does not fit the world size."""


def resolve_dp_shard(world_size: int, dp_replicate: int, dp_shard: int, cp: int, tp: int) -> int | None:
    """dp_shard as configured, -1 meaning the rest: ``world_size // (dp_replicate * cp * tp)``.

    None when it cannot be resolved: a configured value below 1 (other than -1), or -1 with a product
    dp_replicate*cp*tp below 1 or not dividing the world size. `ParallelDims` raises `LayoutError` there;
    the validator reports it as a finding.
    """
    if dp_shard != -1:
        return dp_shard if dp_shard >= 1 else None
    rest = dp_replicate * cp * tp
    if rest < 1 or world_size % rest:
        return None
    return world_size // rest


class ParallelSizes(Protocol):
    """The sizes a layout is built from: the config's `parallel` section (speechlm.config), duck-typed."""

    @property
    def dp_replicate(self) -> int: ...
    @property
    def dp_shard(self) -> int: ...
    @property
    def cp_size(self) -> int: ...
    @property
    def tp_size(self) -> int: ...


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left
    cp: int = 1
    tp: int = 1
    _mesh: Any = field(default=None, compare=False, repr=False)
    _flat: Any = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == -1:
            resolved = resolve_dp_shard(self.world_size, self.dp_replicate, -1, self.cp, self.tp)
            if resolved is None:
                rest = self.dp_replicate * self.cp * self.tp
                raise LayoutError(
                    f"world size {self.world_size} is not divisible by dp_replicate*cp*tp = "
                    f"{self.dp_replicate}*{self.cp}*{self.tp} = {rest}; change --cp-size/--tp-size or the "
                    f"number of processes"
                )
            object.__setattr__(self, "dp_shard", resolved)
        prod = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if prod != self.world_size:
            raise LayoutError(
                f"dp_replicate*dp_shard*cp*tp = {self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp} = "
                f"{prod} != world size {self.world_size}; set parallel.dp_shard=-1 to fill the rest"
            )

    @classmethod
    def from_config(cls, world_size: int, parallel: ParallelSizes) -> ParallelDims:
        """The layout of `world_size` processes that the config's `parallel` section asks for."""
        return cls(world_size, parallel.dp_replicate, parallel.dp_shard, parallel.cp_size, parallel.tp_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def fully_sharded(self) -> bool:
        """Whether FSDP2 shards the model (over `dp_shard_cp`, or HSDP with `dp_replicate`): dp*cp > 1."""
        return self.dp_cp > 1

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world size {self.world_size}")
        r_tp = rank % self.tp
        r_cp = (rank // self.tp) % self.cp
        r_shard = (rank // (self.tp * self.cp)) % self.dp_shard
        r_rep = rank // (self.tp * self.cp * self.dp_shard)
        return {"dp_replicate": r_rep, "dp_shard": r_shard, "cp": r_cp, "tp": r_tp}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def cp_rank(self, rank: int) -> int:
        return self.coords(rank)["cp"]

    def tp_rank(self, rank: int) -> int:
        return self.coords(rank)["tp"]

    def peers(self, rank: int, axis: str) -> list[int]:
        """Global ranks that differ from `rank` only along `axis` (in axis order)."""
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}
        c = self.coords(rank)
        out = []
        for i in range(sizes[axis]):
            cc = dict(c, **{axis: i})
            out.append(
                ((cc["dp_replicate"] * self.dp_shard + cc["dp_shard"]) * self.cp + cc["cp"]) * self.tp
                + cc["tp"]
            )
        return out

    def cp_subgroup_ranks(self) -> list[tuple[int, list[int]]]:
        """Every aligned CP sub-group that hybrid CP degrees use (`parallel.cp_placement.cp_degrees`, the
        degrees between 1 and cp), as (degree, global ranks), in the one global order in which every rank
        must create them (``torch.distributed.new_group`` is collective over the whole world): degree
        descending, then each CP group in rank order (every dp coordinate and tp rank), then its aligned
        blocks ``[k·d, k·d + d)`` of CP ranks. Empty at cp = 1 and cp = 2 (the CP group is the only one)."""
        out = []
        for d in reversed(cp_degrees(self.cp)[1:-1]):
            for g in range(0, self.world_size, self.cp * self.tp):  # each (dp_replicate, dp_shard) block
                for r_tp in range(self.tp):
                    cp_group = [g + r_cp * self.tp + r_tp for r_cp in range(self.cp)]
                    out += [(d, cp_group[lo : lo + d]) for lo in range(0, self.cp, d)]
        return out

    def build_cp_subgroups(self, rank: int) -> dict[int, Any]:
        """Create every group of `cp_subgroup_ranks` (all ranks call this once, at mesh setup, in the same
        order) and return rank's own, by degree (its aligned sub-group of each degree)."""
        import torch.distributed as dist  # lazy: torch (CLI start-up reads ParallelDims)

        mine = {}
        for d, ranks in self.cp_subgroup_ranks():
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[d] = group
        return mine

    def collectives(self, rank: int, device: Any = "cpu") -> Any:
        """Rank `rank`'s `parallel.collectives.Collectives`: the step's, evaluation's and the counts'
        collectives, with the roles this layout gives the rank (no process group is needed to build it)."""
        from parallel.collectives import Collectives  # lazy: torch (CLI start-up reads ParallelDims)

        c = self.coords(rank)
        return Collectives(
            rank=rank,
            world_size=self.world_size,
            dp_rank=self.dp_rank(rank),
            dp_size=self.dp,
            primary=c["cp"] == 0 and c["tp"] == 0,
            shard_primary=c["tp"] == 0,
            device=device,
        )

    def build_mesh(self, device_type: str) -> Any:
        """Create the 4-D DeviceMesh with named axes and the flattened `dp`, `dp_shard_cp`, `dp_cp`."""
        from torch.distributed.device_mesh import init_device_mesh  # lazy: torch (CLI start-up)

        mesh = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"),
        )
        # the flattened meshes are kept here: slicing a flattened dim back out of the root mesh is
        # deprecated (torch warns once per rank), so `flat_mesh` hands these out instead
        flat = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        if self.dp_replicate > 1 and hasattr(flat["dp_cp"], "_unflatten"):
            # HSDP's 2-D mesh, unflattened from dp_cp (no slice of the root)
            flat["dp_replicate,dp_shard_cp"] = flat["dp_cp"]._unflatten(
                0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp")
            )
        elif self.dp_replicate > 1:  # a torch without _unflatten: the slice (and its warning)
            flat["dp_replicate,dp_shard_cp"] = mesh["dp_replicate", "dp_shard_cp"]
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_flat", flat)
        return mesh

    def flat_mesh(self, *names: str) -> Any:
        """A flattened mesh of `build_mesh` (``"dp"``, ``"dp_shard_cp"``, ``"dp_cp"``), or HSDP's 2-D
        ``("dp_replicate", "dp_shard_cp")`` when dp_replicate > 1."""
        key = ",".join(names)
        if key not in self._flat:
            raise KeyError(f"no flattened mesh {names}; build_mesh keeps {sorted(self._flat)}")
        return self._flat[key]

    @property
    def mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def describe(self) -> str:
        return (
            f"world={self.world_size} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
            f"cp={self.cp} tp={self.tp}"
        )
