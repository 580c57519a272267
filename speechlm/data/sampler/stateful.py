"""The stateful sampler: one dp rank's micro-batches, epoch after epoch, resumable from a checkpoint.

`DurationBucketBatchSampler` wraps the pure `build_epoch_plan` with a position (micro-batches
handed out in the current epoch) and a `state_dict()` that records the layout, the settings and a
fingerprint of the manifest, so a resume on another setup or manifest is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from speechlm.data.sampler.epoch_plan import EpochPlan, build_epoch_plan
from speechlm.data.sampler.mix import DatasetMix
from speechlm.data.sampler.settings import DEFAULT_SETTINGS, SamplerSettings, check_arrays
from speechlm.data.sampler.streaming import build_streaming_plan
from speechlm.errors import UsageError


@dataclasses.dataclass(frozen=True, eq=False)
class StreamingLayout:
    """Where each row sits in the shards, for the streaming read mode (`sampler.streaming`)."""

    shard_codes: np.ndarray  # int [N], -1: a row with no shard of its own
    shard_positions: np.ndarray  # int64 [N], byte offset (or row number) inside the shard
    streams_per_rank: int = 1  # one per DataLoader worker
    shuffle_buffer: int = 2000
    sort_buffer: int = 500

    def params(self) -> dict[str, Any]:
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(self.shard_codes, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.shard_positions, dtype=np.int64).tobytes())
        return {
            "streams_per_rank": self.streams_per_rank,
            "shuffle_buffer": self.shuffle_buffer,
            "sort_buffer": self.sort_buffer,
            "shards_digest": h.hexdigest(),
        }


STATE_VERSION = 1

# the setting behind each key of a sampler state, named in the message when a resume finds it changed
SETTING_OF_KEY = {
    "dp_size": "the data-parallel size (parallel.dp_replicate x parallel.dp_shard)",
    "seed": "sampler.seed",
    "mode": "sampler.mode",
    "manifest": "the training data (data.train_manifest / data.input_cfg: its rows changed)",
    "grad_accum": "trainer.grad_accum",
    "temperature": "sampler.temperature",
    "max_batch_duration": "sampler.max_batch_duration",
    "max_batch_tokens": "sampler.max_batch_tokens",
    "length_penalty": "sampler.length_penalty",
    "bucket_boundaries": "sampler.bucket_boundaries",
    "epoch_size": "sampler.epoch_size",
    "token_cost": "sampler.max_batch_tokens / sampler.length_penalty (the token cost)",
    "streaming": "data.read_mode (streaming or indexed)",
    "streaming.streams_per_rank": "data.num_workers (one stream per DataLoader worker)",
    "streaming.shuffle_buffer": "data.shuffle_buffer",
    "streaming.sort_buffer": "data.sort_buffer",
    "streaming.shards_digest": "the tar shards of the training data (their rows or order changed)",
    "mix": "data.input_cfg (a weighted mix or none)",
    "mix.names": "data.input_cfg (the datasets' names)",
    "mix.shares": "data.input_cfg (the datasets' weights)",
    "mix.rows_digest": "data.input_cfg (the datasets' rows changed)",
    "max_duration": "data.max_duration",
}


class SamplerStateError(UsageError, ValueError):
    """A saved sampler state that this run's settings cannot continue; the message names the setting."""


def _mismatch(key: str, saved: Any, current: Any) -> SamplerStateError:
    """The error for `key` (``params.streaming`` ...), naming the setting of the first differing subkey."""
    name = key.removeprefix("params.")
    if key.startswith("params.") and isinstance(saved, dict) and isinstance(current, dict):
        sub = next((k for k in current if saved.get(k) != current[k]), None)
        sub = sub or next((k for k in saved if k not in current), None)
        if sub is not None:
            key, name = f"{key}.{sub}", f"{name}.{sub}"
            saved, current = saved.get(sub), current.get(sub)
    setting = SETTING_OF_KEY.get(name) or SETTING_OF_KEY.get(name.split(".")[0], name)
    return SamplerStateError(
        f"sampler state mismatch in '{key}': saved {saved!r}, current {current!r}; the checkpoint was "
        f"written with another {setting}: resume with the setting it was saved with, or start a new run"
    )


def fingerprint_manifest(
    durations: np.ndarray,
    lang_codes: np.ndarray,
    token_lengths: np.ndarray | None = None,
    lang_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Rows and a blake2b digest of the arrays the plan reads: refuses resuming on another manifest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(durations, dtype=np.float32).tobytes())
    h.update(np.ascontiguousarray(lang_codes, dtype=np.int32).tobytes())
    if token_lengths is not None:
        h.update(np.ascontiguousarray(token_lengths, dtype=np.int64).tobytes())
    if lang_names is not None:
        h.update("\x00".join(lang_names).encode())
    return {"rows": len(durations), "digest": h.hexdigest()}


class DurationBucketBatchSampler:
    """Iterable of micro-batches (lists of manifest row indices) for one data-parallel rank.

    Pass it to a DataLoader as `batch_sampler`. `dp_rank` and `settings.dp_size` are the
    data-parallel coordinates only: CP and TP peers pass the same dp_rank and get identical batches.
    Every rank gets the same number of micro-batches per epoch, a multiple of grad_accum.

    Position and epochs: `position` counts micro-batches handed out in the current epoch;
    `iter()` yields from there to the end of the epoch. `len()` is the full epoch's count for this
    rank (the same on every rank; it may differ slightly between epochs) and `remaining()` what is
    left of it. Once an epoch is used up, the next `iter()` moves on to the next epoch by itself.
    `set_epoch(e)` with a new e starts epoch e at position 0; with the current epoch it keeps the
    position (so Lightning's set_epoch after a resume does not rewind). `seek(epoch, position)`
    jumps anywhere, e.g. to the last micro-batch a checkpoint actually trained on.
    """

    def __init__(
        self,
        durations: np.ndarray,
        lang_codes: np.ndarray,
        lang_names: Sequence[str] | None = None,
        settings: SamplerSettings = DEFAULT_SETTINGS,
        *,
        token_lengths: np.ndarray | None = None,
        dp_rank: int = 0,
        epoch: int = 0,
        streaming: StreamingLayout | None = None,
        mix: DatasetMix | None = None,
    ) -> None:
        n_langs = len(lang_names) if lang_names is not None else None
        self._durations, self._lang_codes, self._token_lengths, self._n_langs = check_arrays(
            durations, lang_codes, token_lengths, n_langs
        )
        self.settings = settings.with_buckets(self._durations).for_rows(len(self._durations))
        self.settings.check(epoch)
        dp_size = self.settings.dp_size
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in 0..{dp_size - 1} (dp_size={dp_size})")
        self.dp_rank = dp_rank
        self.lang_names = list(lang_names) if lang_names is not None else None
        s = self.settings
        # the settings as they go into state_dict(): plain lists, dicts and numbers. Saved checkpoints
        # compare these keys one by one, so keep them (and their order, for identical JSON).
        self.params: dict[str, Any] = {
            "grad_accum": s.grad_accum,
            "temperature": s.temperature,
            "max_batch_duration": s.max_batch_duration,
            "max_batch_tokens": s.max_batch_tokens,
            "length_penalty": s.length_penalty,
            "bucket_boundaries": list(s.boundaries),
            "epoch_size": s.epoch_size,
            "token_cost": dataclasses.asdict(s.token_cost),
        }  # dp_size, seed and mode are checked at the top level of the state
        self.streaming = streaming
        if streaming is not None:  # only then: checkpoints of indexed runs keep their keys
            if len(streaming.shard_codes) != len(self._durations):
                raise ValueError(
                    f"streaming layout has {len(streaming.shard_codes)} rows, the manifest {len(self._durations)}"
                )
            self.params["streaming"] = streaming.params()
        self.mix = mix
        if mix is not None:
            self.params["mix"] = mix.params()
        if s.max_duration is not None:  # only then: checkpoints made without a limit keep their keys
            self.params["max_duration"] = float(s.max_duration)
        self.epoch = epoch
        self.position = 0
        self._plan: EpochPlan | None = None
        self._generation = 0  # bumped by set_epoch/seek/load_state_dict: stale iterators stop

    @functools.cached_property
    def fingerprint(self) -> dict[str, Any]:
        """`fingerprint_manifest` of the arrays planned, taken on first use (`state_dict`): hashing 10M
        rows takes a tenth of a second that `speechlm plan`, which saves no state, does not spend."""
        return fingerprint_manifest(self._durations, self._lang_codes, self._token_lengths, self.lang_names)

    @property
    def dp_size(self) -> int:
        return self.settings.dp_size

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def grad_accum(self) -> int:
        return self.settings.grad_accum

    @property
    def plan(self) -> EpochPlan:
        """The current epoch's plan (built on first use, cached)."""
        if (self._plan is None or self._plan.epoch != self.epoch) and self.streaming is not None:
            st = self.streaming
            self._plan = build_streaming_plan(
                self._durations, self._lang_codes, st.shard_codes, st.shard_positions, self.settings,
                self.epoch, token_lengths=self._token_lengths, n_langs=self._n_langs,
                streams_per_rank=st.streams_per_rank, shuffle_buffer=st.shuffle_buffer, sort_buffer=st.sort_buffer,
                mix=self.mix,
            )  # fmt: skip
        elif self._plan is None or self._plan.epoch != self.epoch:
            self._plan = build_epoch_plan(
                self._durations, self._lang_codes, self.settings, self.epoch,
                token_lengths=self._token_lengths, n_langs=self._n_langs, mix=self.mix,
            )  # fmt: skip
        return self._plan

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches this rank gets in the current epoch (the same on every rank)."""
        return self.plan.batches_per_rank

    def set_epoch(self, epoch: int) -> None:
        """Switch to `epoch` at position 0; a call with the current epoch keeps the position."""
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0
            self._generation += 1

    def _roll_over(self) -> None:
        if self.position >= self.plan.batches_per_rank:
            self.set_epoch(self.epoch + 1)

    def seek(self, epoch: int, position: int) -> None:
        """Continue at micro-batch `position` (0-based count already consumed) of epoch `epoch`."""
        self.set_epoch(epoch)
        if not 0 <= position <= self.plan.batches_per_rank:
            raise ValueError(
                f"position={position} is outside 0..{self.plan.batches_per_rank}, the micro-batches "
                f"per rank of epoch {epoch}; was the checkpoint made with another sampler setup?"
            )
        self.position = position
        self._generation += 1

    def remaining(self) -> int:
        """Micro-batches of the current epoch not yet handed out (0 once it is used up)."""
        return self.plan.batches_per_rank - self.position

    def __len__(self) -> int:
        return self.plan.batches_per_rank

    def __iter__(self) -> Iterator[list[int]]:
        self._roll_over()
        generation = self._generation
        plan = self.plan
        while self.position < plan.batches_per_rank and generation == self._generation:
            batch = plan.batch(self.dp_rank, self.position).tolist()
            self.position += 1  # counted when handed out, so state_dict() after next() includes it
            yield batch

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Resumable state. With DataLoader prefetching, pass `position` = micro-batches trained on."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position if position is None else int(position),
            "seed": self.seed,
            "dp_size": self.dp_size,
            "mode": self.settings.mode,
            "manifest": dict(self.fingerprint),
            "params": dict(self.params),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the next unconsumed micro-batch; refuse state from another layout or manifest."""
        current = self.state_dict()
        for key in ("version", "dp_size", "seed", "mode", "manifest"):
            if state.get(key) != current[key]:
                raise _mismatch(key, state.get(key), current[key])
        saved_params = state.get("params", {})
        for key in (*current["params"], *(k for k in saved_params if k not in current["params"])):
            if saved_params.get(key) != current["params"].get(key):
                raise _mismatch(f"params.{key}", saved_params.get(key), current["params"].get(key))
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"sampler state has position={position}; it must be >= 0")
        self.epoch, self.position = int(state["epoch"]), position
        self._generation += 1
