"""The sampler's inputs, validated: the frozen `SamplerSettings` and the manifest arrays.

`SamplerSettings` holds everything an epoch plan depends on besides the arrays, the epoch and the
dp rank; `SamplerSettings.from_config` is the one place a `SamplerConfig` becomes settings.
`check_arrays` validates and normalises the manifest arrays (durations, language codes, text tokens).
Every check raises ValueError naming the value and what to use instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from speechlm.data.sampler.cost import TokenCostModel

DEFAULT_BUCKET_BOUNDARIES = (3.0, 5.0, 8.0, 12.0, 16.0)  # SamplerSettings' own default (tests, benchmarks)
DEFAULT_NUM_BUCKETS = 30  # sampler.bucket_boundaries=null: this many buckets estimated from the data
MODES = ("temperature", "exhaustive")


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """Everything an epoch plan depends on besides the manifest arrays and the epoch number.

    `dp_rank` is not a setting: a plan covers all dp ranks, and the sampler takes its rank as an
    explicit argument. `max_batch_tokens`, when set, replaces `max_batch_duration`; `epoch_size`
    (temperature mode only; None: the manifest's row count) is how many utterances an epoch draws.
    `bucket_boundaries=None` means `num_buckets` boundaries estimated from the durations
    (`with_buckets`, which every planner calls first). `max_duration` (seconds, None: no limit) leaves
    longer rows out of every epoch (`drop_too_long`). Construction only turns `bucket_boundaries`
    into a tuple; `check(epoch)` validates.
    """

    dp_size: int = 1
    grad_accum: int = 1
    mode: str = "temperature"
    temperature: float = 0.3
    max_batch_duration: float | None = 90.0
    max_batch_tokens: int | None = None
    length_penalty: float = 0.0
    bucket_boundaries: tuple[float, ...] | None = DEFAULT_BUCKET_BOUNDARIES
    epoch_size: int | None = None
    token_cost: TokenCostModel = TokenCostModel()
    seed: int = 0
    num_buckets: int = DEFAULT_NUM_BUCKETS
    max_duration: float | None = None  # data.max_duration: longer rows are left out of the plan

    def __post_init__(self) -> None:
        if self.bucket_boundaries is not None:
            object.__setattr__(self, "bucket_boundaries", tuple(self.bucket_boundaries))

    @property
    def boundaries(self) -> tuple[float, ...]:
        """The bucket boundaries of settings that have them (after `with_buckets`)."""
        if self.bucket_boundaries is None:
            raise ValueError(
                "bucket_boundaries=None: estimate them from the durations first (SamplerSettings.with_buckets)"
            )
        return self.bucket_boundaries

    def with_buckets(self, durations: np.ndarray) -> SamplerSettings:
        """These settings with their bucket boundaries: the given ones, or, when None, `num_buckets`
        equal-duration quantiles of `durations` (`estimate_bucket_boundaries`)."""
        if self.bucket_boundaries is not None:
            return self
        if not 1 <= self.num_buckets <= 127:
            raise ValueError(f"num_buckets={self.num_buckets} must be in 1..127")
        if self.max_duration is not None:  # the buckets of the rows that are planned
            durations = np.asarray(durations)[np.asarray(durations) <= self.max_duration]
        return dataclasses.replace(
            self, bucket_boundaries=estimate_bucket_boundaries(durations, self.num_buckets)
        )

    @classmethod
    def from_config(
        cls,
        sampler_cfg: Any,
        *,
        dp_size: int,
        grad_accum: int,
        projector_stack: int = 2,
        token_cost: TokenCostModel | None = None,
    ) -> SamplerSettings:
        """From a `speechlm.config.SamplerConfig` (duck-typed, so data/ does not import config).

        `token_cost` (`build.token_cost_of`: the encoder's) wins over the default model with `projector_stack`.
        """
        fields = ("mode", "temperature", "max_batch_duration", "max_batch_tokens", "length_penalty",
                  "bucket_boundaries", "epoch_size", "seed")  # fmt: skip
        return cls(
            dp_size=dp_size, grad_accum=grad_accum,
            token_cost=token_cost or TokenCostModel(projector_stack=projector_stack),
            num_buckets=getattr(sampler_cfg, "num_buckets", DEFAULT_NUM_BUCKETS),
            **{name: getattr(sampler_cfg, name) for name in fields},
        )  # fmt: skip

    def for_rows(self, n_rows: int) -> SamplerSettings:
        """The settings as the stateful sampler plans and saves them, for a manifest of `n_rows`.

        The token budget drops the seconds; in temperature mode a missing (or 0) `epoch_size`
        becomes `n_rows`, exhaustive mode drops it; numbers become floats.
        """
        temperature_mode = self.mode == "temperature"
        return dataclasses.replace(
            self,
            temperature=float(self.temperature),
            max_batch_duration=None if self.max_batch_tokens is not None else self.max_batch_duration,
            length_penalty=float(self.length_penalty),
            bucket_boundaries=tuple(float(b) for b in self.boundaries),
            epoch_size=(self.epoch_size or n_rows) if temperature_mode else None,
        )

    def check(self, epoch: int = 0) -> None:
        """Raise ValueError naming the first invalid setting (or epoch) and saying what to use instead."""
        if self.mode not in MODES:
            raise ValueError(
                f"mode={self.mode!r}: use 'temperature' (delivers the language mix) or 'exhaustive'"
            )
        if self.dp_size < 1 or self.grad_accum < 1:
            raise ValueError(f"dp_size={self.dp_size} and grad_accum={self.grad_accum} must both be >= 1")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature={self.temperature} must be a finite number (T <= 0 means uniform)")
        duration, tokens = self.max_batch_duration, self.max_batch_tokens
        if tokens is None and not (duration and duration > 0):
            raise ValueError(f"max_batch_duration={duration}: give seconds > 0 or set max_batch_tokens")
        if tokens is not None and tokens < 1:
            raise ValueError(f"max_batch_tokens={tokens} must be >= 1 (or None for a duration budget)")
        if self.max_duration is not None and not (math.isfinite(self.max_duration) and self.max_duration > 0):
            raise ValueError(
                f"max_duration={self.max_duration} must be a number of seconds > 0 (or None: no limit)"
            )
        if self.length_penalty < 0:
            raise ValueError(f"length_penalty={self.length_penalty} must be >= 0")
        check_bucket_boundaries(self.boundaries)
        if self.epoch_size is not None and self.epoch_size < 1:
            raise ValueError(
                f"epoch_size={self.epoch_size} must be >= 1 (or None for the manifest's row count)"
            )
        tc = self.token_cost
        if (
            min(tc.audio_frames_per_second, tc.encoder_subsampling, tc.projector_stack) <= 0
            or tc.prompt_tokens < 0
        ):
            raise ValueError(f"{tc} must have positive rates and factors and prompt_tokens >= 0")
        if self.seed < 0 or epoch < 0:
            raise ValueError(f"seed={self.seed} and epoch={epoch} must be non-negative integers")


DEFAULT_SETTINGS = SamplerSettings()  # the defaults of build_epoch_plan and the sampler


def check_bucket_boundaries(boundaries: Sequence[float]) -> np.ndarray:
    """The boundaries as float64 edges; ValueError unless strictly increasing and at most 126."""
    edges = np.asarray(boundaries, dtype=np.float64)
    if edges.ndim != 1 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"bucket_boundaries={list(boundaries)} must be strictly increasing seconds")
    if len(edges) > 126:
        raise ValueError(f"bucket_boundaries has {len(edges)} entries; use at most 126")
    return edges


def check_arrays(
    durations: Any, lang_codes: Any, token_lengths: Any = None, n_langs: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Validate and normalise the manifest arrays (float32 seconds, int32 codes, int64 tokens)."""
    dur = np.ascontiguousarray(durations, dtype=np.float32)
    codes = np.ascontiguousarray(lang_codes)
    if dur.ndim != 1 or len(dur) == 0:
        raise ValueError(f"durations must be a non-empty 1-D array, got shape {dur.shape}")
    if codes.shape != dur.shape:
        raise ValueError(
            f"lang_codes has shape {codes.shape} but durations has {dur.shape}; one code per row"
        )
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"lang_codes must be integers (indices into lang_names), got dtype {codes.dtype}")
    bad = ~np.isfinite(dur) | (dur < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"durations[{i}] = {dur[i]} is not a finite, non-negative number of seconds; fix the manifest row"
        )
    lo, hi = int(codes.min()), int(codes.max())
    if n_langs is None:
        n_langs = hi + 1
    if lo < 0 or hi >= n_langs:
        raise ValueError(
            f"lang_codes span {lo}..{hi}, outside 0..{n_langs - 1} (one code per name in lang_names)"
        )
    codes = codes.astype(np.int32, copy=False)
    tokens = None
    if token_lengths is not None:
        tokens = np.ascontiguousarray(token_lengths, dtype=np.int64)
        if tokens.shape != dur.shape:
            raise ValueError(f"token_lengths has shape {tokens.shape} but durations has {dur.shape}")
        if tokens.min() < 0:
            i = int(np.argmin(tokens))
            raise ValueError(f"token_lengths[{i}] = {tokens[i]} is negative; text token counts must be >= 0")
    return dur, codes, tokens, int(n_langs)


def estimate_bucket_boundaries(durations: np.ndarray, num_buckets: int) -> tuple[float, ...]:
    """`num_buckets - 1` boundaries (seconds, to the millisecond) that split `durations` into buckets of
    equal total duration: boundary k is the shortest duration at which the durations up to it (sorted)
    add up to k/num_buckets of the total, as Lhotse's `estimate_duration_buckets` (what NeMo trains
    with) places them. Equal boundaries (many utterances of one length) merge, so there may be fewer.

    Vectorised and O(rows): durations are counted per millisecond (a million rows at a time, so 10M
    rows need no wide temporaries), and the running total of those counts gives the quantiles; the
    result is the same on every rank for the same durations."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets} must be >= 1")
    d = np.asarray(durations, dtype=np.float32)
    if num_buckets == 1 or not len(d):
        return ()
    top = int(np.ceil(float(d.max()) * 1000)) + 1
    counts = np.zeros(top + 1, np.int64)
    for lo in range(0, len(d), 1 << 20):
        ms = np.rint(d[lo : lo + (1 << 20)] * np.float32(1000)).astype(np.int32)
        counts += np.bincount(np.clip(ms, 0, top), minlength=top + 1)
    seconds_up_to = np.cumsum(counts * np.arange(top + 1, dtype=np.float64))  # ms x rows, per ms
    total = seconds_up_to[-1]
    if total <= 0:
        return ()
    targets = total * np.arange(1, num_buckets) / num_buckets
    ms_edges = np.searchsorted(seconds_up_to, targets, side="left") + 1  # first ms past each target
    present = np.flatnonzero(counts)  # an edge past the longest row would only open an empty bucket
    ms_edges = np.unique(ms_edges[(ms_edges > present[0]) & (ms_edges <= present[-1])])
    return tuple(float(m) / 1000 for m in ms_edges)
