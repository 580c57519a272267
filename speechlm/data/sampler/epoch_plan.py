"""Epoch plan: duration-bucketed, language-balanced micro-batches for every data-parallel rank.

The sampler yields row indices only (the dataset does the I/O). Every dp rank computes the same
whole-epoch plan from (manifest arrays, parameters, seed, epoch) and takes its own share, so no
communication is needed and CP/TP peers, which pass the same `dp_rank`, get identical batches.

Per epoch, two modes:

temperature (default) -- delivers the temperature mix.
  T1. Target share of language l: n_l^T / sum_k n_k^T (T <= 0: uniform over present languages).
  T2. Counts per language: target_l * epoch_size, rounded by largest remainder so they sum to
      epoch_size. Language l reads its rows as an endless stream of cycles, each cycle a fresh
      seeded random order of its rows; epoch e takes stream positions [e*c_l, (e+1)*c_l). A large
      language is thus sub-sampled without replacement until exhausted, continuing across epochs;
      a small one is repeated, every repetition a new permutation.
  T3. Bucket the drawn rows by duration and shuffle inside each bucket.
  then steps 4-7 below.

exhaustive -- the inherited algorithm, kept exact: every row exactly once per epoch.
  1. Bucket by duration: bucket b holds boundaries[b-1] <= d < boundaries[b].
  2. Language weights w_l = target_l / actual_l with the target of T1.
  3. Inside each bucket order rows by U^(1/w) descending (U uniform per row). Equivalently by
     E/w ascending with E = -log U ~ Exp(1); we draw each (bucket, language) group's E already
     sorted (Renyi: E_(i) = sum_{j<=i} X_j / (m-j+1), X iid Exp(1)) and hand them to a random
     permutation of the group's rows, so a bucket's order is a stable merge of a few sorted runs
     instead of a full float sort. Caveat: steps 5-6 re-sort and shuffle the batches, and every
     row is used once, so the weights do not change the language mix; they only cluster the
     up-weighted languages near the front of each bucket, i.e. into shared batches.
Shared steps:
  4. Greedily pack each bucket's order into micro-batches whose summed cost stays within the
     budget; a single row over budget forms its own batch. Costs are integers (microseconds of
     audio, or thousandths of a token), so the packing is exact and never exceeds the budget.
     The scan is sequential by nature; we vectorise it through next[i], the start of the batch
     after one starting at row i (a sorted search on prefix sums, for all rows at once): the
     batch starts are the orbit 0, next[0], next[next[0]], ..., walked 8 starts at a time with
     pointer doubling (see `pack_greedy`). Exact, no worst case.
  5. Sort batches by len(batch) * max row size (seconds or tokens), descending; drop the cheapest
     tail so the count divides by dp_size; rank r takes batches r, r + W, r + 2W, ...
  6. Trim every rank's list to a multiple of grad_accum (dropping its cheapest), then shuffle it
     with the epoch's generator: one permutation shared by all ranks, so micro-batch j has a
     similar cost on every rank (balanced steps).
  7. Everything is seeded by (seed, epoch): same pair -> same plan.

Token budget (`max_batch_tokens`): see `speechlm.data.sampler.cost`.

This module holds the plan (`EpochPlan`, `build_epoch_plan`); the steps it runs live in
`ordering` (1-3, T1-T3) and `batching` (4-6), the settings in `settings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from speechlm.data.sampler.batching import assign_to_ranks, pack_greedy, trim_and_shuffle
from speechlm.data.sampler.cost import SECOND_UNITS, TOKEN_UNITS, compute_row_sizes, quantize_costs
from speechlm.data.sampler.mix import DatasetMix, mix_groups
from speechlm.data.sampler.ordering import (
    allocate_counts,
    assign_buckets,
    compute_language_targets,
    compute_language_weights,
    draw_temperature_rows,
    make_generator,
    order_by_weighted_keys,
    shuffle_within_buckets,
)
from speechlm.data.sampler.settings import DEFAULT_SETTINGS, SamplerSettings, check_arrays


@dataclasses.dataclass(frozen=True, eq=False)
class EpochPlan:
    """One epoch's micro-batches for all dp ranks.

    `rows` holds manifest row indices with the packed micro-batches back to back (packing order);
    batch b is rows[batch_offsets[b] : batch_offsets[b+1]]. `rank_batches[r]` lists the batch ids
    rank r consumes, in order. Batches not listed there were dropped by the lockstep trims.
    """

    rows: np.ndarray
    batch_offsets: np.ndarray
    rank_batches: np.ndarray
    mode: str
    seed: int
    epoch: int
    manifest_rows: int
    too_long: int = 0  # rows the epoch drew that last longer than max_duration, left out

    @property
    def dp_size(self) -> int:
        return int(self.rank_batches.shape[0])

    @property
    def batches_per_rank(self) -> int:
        return int(self.rank_batches.shape[1])

    def batch(self, rank: int, step: int) -> np.ndarray:
        """Row indices of rank `rank`'s micro-batch number `step` (a view)."""
        b = self.rank_batches[rank, step]
        return self.rows[self.batch_offsets[b] : self.batch_offsets[b + 1]]

    def iter_rank(self, rank: int, start: int = 0) -> Iterator[list[int]]:
        """Rank `rank`'s micro-batches from number `start` on, each a list of ints."""
        for step in range(start, self.batches_per_rank):
            yield self.batch(rank, step).tolist()

    def rank_rows(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank `rank`'s rows flat in consumption order, and offsets (len batches_per_rank + 1)."""
        ids = self.rank_batches[rank]
        lengths = self.batch_offsets[ids + 1] - self.batch_offsets[ids]
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        take = np.repeat(self.batch_offsets[ids] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return self.rows[take], offsets


def draw_epoch_rows(
    lang_codes: np.ndarray,
    lang_counts: np.ndarray,
    n_langs: int,
    s: SamplerSettings,
    epoch: int,
    mix: DatasetMix | None = None,
) -> np.ndarray:
    """T1-T2: this epoch's rows, per language (or per dataset and language with a mix)."""
    total = len(lang_codes) if s.epoch_size is None else s.epoch_size
    if mix is None:
        targets = compute_language_targets(lang_counts, s.temperature)
        counts = allocate_counts(targets, total)
        return draw_temperature_rows(lang_codes, lang_counts, counts, seed=s.seed, epoch=epoch)
    if len(mix.dataset_codes) != len(lang_codes):
        raise ValueError(f"the dataset mix has {len(mix.dataset_codes)} rows, the manifest {len(lang_codes)}")
    groups, group_counts, targets = mix_groups(lang_codes, n_langs, mix, s.temperature)
    counts = allocate_counts(targets, total)
    return draw_temperature_rows(groups, group_counts, counts, seed=s.seed, epoch=epoch)


def drop_too_long(
    rows: np.ndarray, durations: np.ndarray, max_duration: float | None, seg_starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """`rows` without those lasting longer than `max_duration` seconds (None: all kept), the segment
    starts moved to where their segments begin among the kept rows (empty segments vanish), and the
    count left out. `data.max_duration`: long-form clips are planned unless the user sets a limit."""
    if max_duration is None:
        return rows, seg_starts, 0
    keep = durations[rows] <= np.float32(max_duration)
    kept = rows[keep]
    if seg_starts is not None:
        kept_before = np.concatenate(([0], np.cumsum(keep, dtype=np.int64)))
        seg_starts = np.unique(kept_before[seg_starts])
        seg_starts = seg_starts[seg_starts < len(kept)]
    return kept, seg_starts, int(len(rows) - len(kept))


def too_long_message(durations: np.ndarray, max_duration: float | None) -> str:
    """The error of an epoch whose every row lasts longer than `max_duration`."""
    return (
        f"every row of the epoch lasts longer than data.max_duration={max_duration:g} s (the shortest row "
        f"lasts {float(durations.min()):g} s), so nothing is left to train on: raise data.max_duration, or set "
        "it to null to plan every row"
    )


def row_costs(
    durations: np.ndarray, token_lengths: np.ndarray | None, rows: np.ndarray, s: SamplerSettings
) -> tuple[np.ndarray, np.ndarray, int]:
    """Sizes of `rows` in the budget's unit (seconds, or tokens with the length penalty), their
    integer costs and the integer budget that `pack_greedy` compares them with."""
    if s.max_batch_tokens is not None:
        sizes = compute_row_sizes(
            durations[rows],
            None if token_lengths is None else token_lengths[rows],
            max_batch_tokens=s.max_batch_tokens,
            length_penalty=s.length_penalty,
            token_cost=s.token_cost,
        )
        costs, budget = quantize_costs(sizes, s.max_batch_tokens, TOKEN_UNITS)
    else:
        sizes = durations[rows]
        costs, budget = quantize_costs(sizes, float(s.max_batch_duration or 0.0), SECOND_UNITS)
    return sizes, costs, budget


class EpochTooShortError(ValueError):
    """The epoch packs into fewer micro-batches than dp_size * grad_accum: no rank gets an optimizer step."""

    def __init__(self, n_batches: int, message: str) -> None:
        super().__init__(message)
        self.n_batches = n_batches


def build_epoch_plan(
    durations: np.ndarray,
    lang_codes: np.ndarray,
    settings: SamplerSettings = DEFAULT_SETTINGS,
    epoch: int = 0,
    *,
    token_lengths: np.ndarray | None = None,
    n_langs: int | None = None,
    mix: DatasetMix | None = None,
) -> EpochPlan:
    """Plan one epoch for all dp ranks (pure: same inputs -> same plan). See the module docstring.

    `mix` (temperature mode only) weights datasets against each other (`sampler.mix`)."""
    durations, lang_codes, token_lengths, n_langs = check_arrays(
        durations, lang_codes, token_lengths, n_langs
    )
    s = settings.with_buckets(durations)  # sampler.bucket_boundaries=null: estimated from these rows
    s.check(epoch)
    n = len(durations)
    lang_counts = np.bincount(lang_codes, minlength=n_langs)
    seg_starts: np.ndarray | None  # where each bucket starts in `rows` (the packer never spans two)

    if s.mode == "exhaustive":
        if mix is not None:
            raise ValueError(
                "dataset weights (data.input_cfg) need sampler.mode=temperature: exhaustive uses every row once"
            )
        targets = compute_language_targets(lang_counts, s.temperature)
        weights = compute_language_weights(lang_counts, targets)
        buckets = assign_buckets(durations, s.boundaries)
        rng = make_generator(s.seed, "order", epoch)
        rows, seg_starts, _ = order_by_weighted_keys(buckets, lang_codes, weights, rng)
        del buckets
        rows, seg_starts, too_long = drop_too_long(rows, durations, s.max_duration, seg_starts)
    else:
        drawn = draw_epoch_rows(lang_codes, lang_counts, n_langs, s, epoch, mix)
        drawn, _, too_long = drop_too_long(drawn, durations, s.max_duration)
        buckets = assign_buckets(durations[drawn], s.boundaries)
        rng = make_generator(s.seed, "shuffle", epoch)
        rows, seg_starts = shuffle_within_buckets(drawn, buckets, rng)
        del drawn, buckets

    if not len(rows):
        raise ValueError(too_long_message(durations, s.max_duration))
    sizes, costs, budget = row_costs(durations, token_lengths, rows, s)
    starts = pack_greedy(costs, budget, seg_starts)
    del costs
    offsets = np.append(starts, len(rows))
    batch_costs = np.diff(offsets) * np.maximum.reduceat(sizes, starts).astype(np.float64)
    del sizes
    rank_batches = assign_to_ranks(batch_costs, s.dp_size)
    rng = make_generator(s.seed, "ranks", epoch)
    rank_batches = trim_and_shuffle(rank_batches, s.grad_accum, rng)
    if rank_batches.shape[1] == 0:
        raise EpochTooShortError(
            len(starts),
            f"the epoch packs into {len(starts)} micro-batches, fewer than dp_size * grad_accum = "
            f"{s.dp_size * s.grad_accum}, so every rank would get none; lower the batch budget, "
            f"grad_accum or dp_size, or use a larger manifest / epoch_size",
        )
    return EpochPlan(
        rows=rows,
        batch_offsets=offsets,
        rank_batches=rank_batches,
        mode=s.mode,
        seed=s.seed,
        epoch=epoch,
        manifest_rows=n,
        too_long=too_long,
    )
