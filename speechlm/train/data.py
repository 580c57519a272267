"""Training data glue: manifest → sampler (per data-parallel rank) → DataLoader → optimizer steps.

`StepLoader` groups the sampler's micro-batches into optimizer steps of `grad_accum` micro-batches (the
sampler guarantees every rank the same count, a multiple of `grad_accum`) and tags each step with the
sampler position it leaves behind.

It is the one owner of the data position. The DataLoader (and Lightning's fetcher) read ahead, so the
sampler's own position runs ahead of training; the module therefore calls `mark_consumed(position)` for
every step it trains on, and `state_dict()` reports that consumed position together with the layout
(dp rank and size, grad_accum), the seed, the sampler settings and the manifest fingerprint. A
checkpoint stores this state once per dp rank as JSON (cp/tp peers hold the same one; see
`speechlm/train/checkpoint/`); `restore(state)` continues at the next unconsumed micro-batch of the
saved epoch, and later epochs start at position 0 as in an uninterrupted run.
"""

from __future__ import annotations

import copy
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from speechlm.data.dataset import Batch, Collator, SpeechDataset, build_dataloader
from speechlm.data.drops import drop_advice, drop_listing, drop_reasons
from speechlm.data.local_decode import LocalCollator, Planner
from speechlm.data.sampler.stateful import DurationBucketBatchSampler
from speechlm.errors import DataError


@dataclass  # not frozen: Lightning's batch transfer (apply_to_collection) rebuilds dataclasses
class StepBatch:
    micro_batches: list[Any]
    position: dict[str, int]  # {"epoch": e, "position": micro-batches consumed in epoch e after this step}
    dropped: dict[str, int] = field(default_factory=dict)
    # a data error found on this rank (too much of a micro-batch unreadable): the step is not trained,
    # every rank learns of it in the step's agreement and raises it (module.SpeechLLMModule._agree_step)
    error: str | None = None
    # seconds this rank waited for the loader to produce these micro-batches (step metric data_wait_s)
    data_wait_s: float = 0.0

    def rows_digest(self) -> str:
        """Short digest of the manifest rows this rank consumed in this step (to compare runs)."""
        rows = [i for b in self.micro_batches for i in b.indices]
        return f"{zlib.crc32(','.join(map(str, rows)).encode()):08x}"

    @property
    def audio_seconds(self) -> float:
        return float(sum(float(b.durations.sum()) for b in self.micro_batches if len(b)))


class StepLoader:
    """Iterable of `StepBatch` over one epoch at a time; the next `iter()` continues with the next epoch."""

    def __init__(
        self,
        sampler: DurationBucketBatchSampler,
        dataset: SpeechDataset,
        *,
        grad_accum: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        dp_rank: int = 0,
        max_dropped_fraction: float = 1.0,
        collate_fn: Any = None,
    ):
        self._sampler = sampler  # ours alone: see the `sampler` property
        self.dataset = dataset
        self.grad_accum = grad_accum
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.dp_rank = dp_rank  # loader seeds differ per dp rank and agree among CP/TP peers
        self.consumed = {"epoch": sampler.epoch, "position": sampler.position}
        self.max_dropped_fraction = max_dropped_fraction
        self._active: Any = None  # the open epoch iterator (one at a time: see close())
        # None: `Collator` (every clip decoded); `speechlm.data.local_decode.LocalCollator`: this rank's only
        self.collate_fn = collate_fn

    def decode_local(self, planner: Planner) -> None:
        """Decode on this rank only the clips ``planner`` says its encoder reads (``data.decode_local``:
        `speechlm.data.local_decode`; ``planner`` a `speechlm.model.clip_planner.ClipPlanner`)."""
        if getattr(self.dataset, "renderer", None) is None:
            raise ValueError("decode_local reads rows as conversations: the dataset needs the run's renderer")
        self.dataset.defer_audio = True
        self.collate_fn = LocalCollator(self.dataset.tokenizer.pad_id, planner)

    def redecode(self, step: StepBatch) -> StepBatch:
        """``step`` with its micro-batches read again from their sampler rows, every clip decoded (today's
        `Collator`): what every rank does, at the same step, when a clip failed to decode on the one rank
        that read it (`speechlm.data.local_decode`; agreed in the step's all-reduce, `module._agree_step`).
        The rows, drops and checks are then those of decoding everything, identical on every rank."""
        full = copy.copy(self.dataset)
        full.defer_audio = False
        collate = Collator(self.dataset.tokenizer.pad_id)
        first = int(step.position["position"]) - len(step.micro_batches)
        out, dropped = [], dict[str, int]()
        for k, mb in enumerate(step.micro_batches):
            if mb.source_rows is not None:
                device = mb.audio.device
                mb = collate(full.__getitems__(mb.source_rows)).to(device)
            check_dropped_fraction(
                mb, self.max_dropped_fraction, epoch=step.position["epoch"], position=first + k
            )
            for r, n in mb.dropped.items():
                dropped[r] = dropped.get(r, 0) + n
            out.append(mb)
        return replace(step, micro_batches=out, dropped=dropped)

    @property
    def sampler(self) -> Any:
        """The epoch plan, as others see it. Lightning calls `loader.sampler.set_epoch(its epoch count)`
        at the start of each of its epochs; the StepLoader owns the data position, and Lightning's
        count can differ from ours (a run stopped by SIGTERM before its step, with the epoch's last
        batch already fetched, is resumed by Lightning as if that epoch had ended), so that call is
        ignored here (`tests/train/test_faults.py::test_sigterm_during_validation_still_saves_a_checkpoint`)."""
        return _EpochOwnedSampler(self._sampler)

    def mark_consumed(self, position: dict[str, int]) -> None:
        """Record the position a trained step leaves behind (what a checkpoint must resume after)."""
        self.consumed = {"epoch": int(position["epoch"]), "position": int(position["position"])}

    def state_dict(self) -> dict[str, Any]:
        """The data pipeline's resumable state (JSON-safe): the consumed position and what it depends on."""
        state = self._sampler.state_dict()
        state.update(self.consumed)
        state["dp_rank"] = self.dp_rank
        state["loader_seed"] = self.seed
        return state

    def restore(self, state: dict[str, Any], *, next_epoch: bool = False) -> None:
        """Continue after the consumed position of `state` (ValueError if it belongs to another setup).

        With `next_epoch`, only the epoch is taken: the data restarts at position 0 of the epoch after the
        saved one, in this run's layout (the way to resume into another dp size)."""
        if next_epoch:
            self._sampler.set_epoch(int(state["epoch"]) + 1)
        else:
            if state.get("dp_rank") != self.dp_rank:
                raise ValueError(
                    f"data state of dp rank {state.get('dp_rank')} loaded on dp rank {self.dp_rank}"
                )
            if state.get("loader_seed") != self.seed:
                raise ValueError(
                    f"data state mismatch in 'loader_seed': saved {state.get('loader_seed')!r}, current {self.seed!r}"
                )
            self._sampler.load_state_dict(state)
        self.consumed = {"epoch": self._sampler.epoch, "position": self._sampler.position}

    # No `__len__`, on purpose: Lightning reads a loader's length once, when fit starts, and ends every
    # epoch after that many steps. After a mid-epoch resume the first epoch is shorter than the others
    # (and temperature-mode epochs differ slightly in size), so each epoch ends when its iterator does.

    def __iter__(self) -> Iterator[StepBatch]:
        """The next epoch's steps. The previous epoch's iterator, if still open (training stopped in it),
        is closed first: its DataLoader and worker processes go with it."""
        self.close()
        self._active = self._epoch_steps()
        return self._active

    def close(self) -> None:
        """Close the open epoch iterator (and its DataLoader workers); the data position is kept."""
        active, self._active = getattr(self, "_active", None), None
        if active is not None:
            active.close()

    def _epoch_steps(self) -> Iterator[StepBatch]:
        if self._sampler.remaining() == 0:
            self._sampler.set_epoch(self._sampler.epoch + 1)
        epoch = self._sampler.epoch
        pos = self._sampler.position
        batches = list(self._sampler)  # index lists of the rest of this epoch (small: ints only)
        # one loader per epoch, its workers not persistent: they exit when the epoch's iterator ends (or
        # is closed), so epochs never leave workers behind
        loader = build_dataloader(
            self.dataset,
            batches,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=False,
            seed=self.seed + 1000 * epoch + 1_000_003 * self.dp_rank,
            collate_fn=self.collate_fn,
        )
        buf: list[Any] = []
        wait = 0.0
        for b, waited in _timed(loader):
            wait += waited
            try:
                check_dropped_fraction(b, self.max_dropped_fraction, epoch=epoch, position=pos)
            except DroppedDataError as e:
                # not raised here: the other ranks would wait for this one in the next collective. The
                # step carries the error and every rank raises it at the same step (module._agree_step).
                yield StepBatch([*buf, b], {"epoch": epoch, "position": pos}, error=str(e), data_wait_s=wait)
                return
            buf.append(b)
            pos += 1
            if len(buf) == self.grad_accum:
                dropped: dict[str, int] = {}
                for mb in buf:
                    for k, v in mb.dropped.items():
                        dropped[k] = dropped.get(k, 0) + v
                yield StepBatch(buf, {"epoch": epoch, "position": pos}, dropped, data_wait_s=wait)
                buf, wait = [], 0.0
        self._sampler.set_epoch(epoch + 1)


def _timed(items: Iterable[Any]) -> Iterator[tuple[Any, float]]:
    """(item, seconds the iterator took to produce it) for each item of `items`."""
    it = iter(items)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        yield item, time.perf_counter() - t0


class _EpochOwnedSampler:
    """A sampler whose `set_epoch` does nothing; everything else is the wrapped sampler's."""

    def __init__(self, inner: DurationBucketBatchSampler):
        self._inner = inner

    def set_epoch(self, epoch: int) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._inner)


class DroppedDataError(DataError, RuntimeError):
    """Too much of a micro-batch could not be read: training on the rest would be training on almost nothing."""


def check_dropped_fraction(batch: Batch, limit: float, *, epoch: int, position: int) -> None:
    """Raise DroppedDataError naming the rows when more than `limit` of the micro-batch's samples were
    dropped (each with its reason, and advice that fits the reasons)."""
    n_dropped = sum(batch.dropped.values())
    total = n_dropped + len(batch)
    if n_dropped == 0 or n_dropped <= limit * total:
        return
    raise DroppedDataError(
        f"{n_dropped} of {total} samples of micro-batch {position} (epoch {epoch}) were dropped "
        f"({drop_reasons(batch.dropped)}), more than data.max_dropped_fraction={limit}:\n  "
        f"{drop_listing(batch.dropped_files)}\nTo go on: "
        f"{drop_advice(batch.dropped)}; or raise data.max_dropped_fraction"
    )


def resolve_path(p: str | None, base: Path | None = None) -> Path | None:
    if p is None:
        return None
    path = Path(p)
    if not path.is_absolute() and base is not None and not path.exists():
        path = base / path
    return path
