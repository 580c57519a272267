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

Token budget (`max_batch_tokens`): per row, audio tokens = ceil(ceil(d * fps / subsampling) /
projector_stack), plus text tokens, plus `prompt_tokens`; cost = tokens + length_penalty * tokens^2
(the quadratic term charges long rows for attention, whose work grows with length squared).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

DEFAULT_BUCKET_BOUNDARIES = (3.0, 5.0, 8.0, 12.0, 16.0)
MODES = ("temperature", "exhaustive")
SECOND_UNITS = 1_000_000  # duration costs are integer microseconds
TOKEN_UNITS = 1_000  # token costs are integer thousandths of a token
# independent random streams, each seeded by SeedSequence([seed, stream id, epoch or language, cycle])
RANDOM_STREAMS = {"order": 1, "shuffle": 2, "ranks": 3, "cycle": 4}
STATE_VERSION = 1


def make_generator(seed: int, stream: str, a: int, b: int = 0) -> np.random.Generator:
    """Generator of one random stream: "order", "shuffle", "ranks" (a = epoch), "cycle" (a = language, b = cycle)."""
    return np.random.default_rng(np.random.SeedSequence([seed, RANDOM_STREAMS[stream], a, b]))


# ---------------------------------------------------------------------------------------------
# token cost model


@dataclasses.dataclass(frozen=True)
class TokenCostModel:
    """Tokens one utterance puts into the LLM: audio after encoder + projector, text, prompt."""

    audio_frames_per_second: float = 100.0
    encoder_subsampling: int = 8
    projector_stack: int = 2
    prompt_tokens: int = 4

    def count_tokens(self, durations: np.ndarray, text_tokens: np.ndarray | None = None) -> np.ndarray:
        """Tokens per row (int64): ceil(ceil(d * fps / subsampling) / stack) + text + prompt."""
        frames = np.ceil(np.asarray(durations, dtype=np.float64) * self.audio_frames_per_second)
        encoded = np.ceil(frames / self.encoder_subsampling)
        tokens = np.ceil(encoded / self.projector_stack).astype(np.int64)
        tokens += self.prompt_tokens
        if text_tokens is not None:
            tokens += np.asarray(text_tokens, dtype=np.int64)
        return tokens


def compute_row_sizes(
    durations: np.ndarray,
    token_lengths: np.ndarray | None,
    *,
    max_batch_tokens: int | None,
    length_penalty: float,
    token_cost: TokenCostModel,
) -> np.ndarray:
    """What the budget counts per row (float64): seconds, or tokens + penalty * tokens^2."""
    if max_batch_tokens is None:
        return np.asarray(durations, dtype=np.float64)
    tokens = token_cost.count_tokens(durations, token_lengths).astype(np.float64)
    if length_penalty:
        tokens += length_penalty * tokens * tokens
    return tokens


def quantize_costs(sizes: np.ndarray, budget: float, units: int) -> tuple[np.ndarray, int]:
    """Integer costs (rounded up) and budget (rounded down), so sums are exact and never exceed."""
    scaled = np.array(sizes, dtype=np.float64)
    scaled *= units
    np.ceil(scaled, out=scaled)
    return scaled.astype(np.int64), int(math.floor(budget * units))


# ---------------------------------------------------------------------------------------------
# settings


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """Everything an epoch plan depends on besides the manifest arrays and the epoch number.

    `dp_rank` is not a setting: a plan covers all dp ranks, and the sampler takes its rank as an
    explicit argument. `max_batch_tokens`, when set, replaces `max_batch_duration`; `epoch_size`
    (temperature mode only; None: the manifest's row count) is how many utterances an epoch draws.
    Construction only turns `bucket_boundaries` into a tuple; `check(epoch)` validates.
    """

    dp_size: int = 1
    grad_accum: int = 1
    mode: str = "temperature"
    temperature: float = 0.3
    max_batch_duration: float | None = 90.0
    max_batch_tokens: int | None = None
    length_penalty: float = 0.0
    bucket_boundaries: tuple[float, ...] = DEFAULT_BUCKET_BOUNDARIES
    epoch_size: int | None = None
    token_cost: TokenCostModel = TokenCostModel()
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_boundaries", tuple(self.bucket_boundaries))

    @classmethod
    def from_config(
        cls, sampler_cfg: Any, *, dp_size: int, grad_accum: int, projector_stack: int = 2
    ) -> SamplerSettings:
        """From a `speechlm.config.SamplerConfig` (duck-typed, so data/ does not import config)."""
        fields = ("mode", "temperature", "max_batch_duration", "max_batch_tokens", "length_penalty",
                  "bucket_boundaries", "epoch_size", "seed")  # fmt: skip
        return cls(
            dp_size=dp_size, grad_accum=grad_accum, token_cost=TokenCostModel(projector_stack=projector_stack),
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
            bucket_boundaries=tuple(float(b) for b in self.bucket_boundaries),
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
        if self.length_penalty < 0:
            raise ValueError(f"length_penalty={self.length_penalty} must be >= 0")
        check_bucket_boundaries(self.bucket_boundaries)
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


# ---------------------------------------------------------------------------------------------
# steps 1-3: buckets, language targets, per-bucket order


def check_bucket_boundaries(boundaries: Sequence[float]) -> np.ndarray:
    """The boundaries as float64 edges; ValueError unless strictly increasing and at most 126."""
    edges = np.asarray(boundaries, dtype=np.float64)
    if edges.ndim != 1 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"bucket_boundaries={list(boundaries)} must be strictly increasing seconds")
    if len(edges) > 126:
        raise ValueError(f"bucket_boundaries has {len(edges)} entries; use at most 126")
    return edges


def assign_buckets(durations: np.ndarray, boundaries: Sequence[float]) -> np.ndarray:
    """Step 1: bucket id per row (int8); bucket b holds boundaries[b-1] <= d < boundaries[b]."""
    edges = check_bucket_boundaries(boundaries)
    durations = np.asarray(durations, dtype=np.float32)
    buckets = np.zeros(len(durations), dtype=np.int8)
    for edge in edges:  # a few compares beat a binary search per row; float64 edges, exact as bisect
        buckets += durations >= edge
    return buckets


def compute_language_targets(lang_counts: np.ndarray, temperature: float) -> np.ndarray:
    """Step 2: target share per language, n_l^T / sum_k n_k^T; T <= 0 gives uniform shares.

    Languages without rows get 0. T = 1 is the natural mix; T -> 0 flattens it.
    """
    counts = np.asarray(lang_counts, dtype=np.float64)
    present = counts > 0
    if not present.any():
        raise ValueError("no language has any rows; the manifest is empty")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature={temperature} must be a finite number (T <= 0 means uniform)")
    powered = np.zeros_like(counts)
    powered[present] = 1.0 if temperature <= 0 else counts[present] ** temperature
    return powered / powered.sum()


def compute_language_weights(lang_counts: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Step 2: per-language sample weight w_l = target_l / actual_l (0 where no rows)."""
    counts = np.asarray(lang_counts, dtype=np.float64)
    actual = counts / counts.sum()
    weights = np.zeros_like(counts)
    present = counts > 0
    weights[present] = targets[present] / actual[present]
    return weights


def allocate_counts(targets: np.ndarray, total: int) -> np.ndarray:
    """Round target * total to integers summing exactly to total (largest remainder; ties: lower id)."""
    exact = np.asarray(targets, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    short = int(total - counts.sum())
    if short > 0:
        remainder = np.where(exact > 0, exact - counts, -1.0)  # a zero target never gets a row
        order = np.argsort(-remainder, kind="stable")
        counts[order[:short]] += 1
    return counts


def order_by_weighted_keys(
    bucket_ids: np.ndarray,
    lang_codes: np.ndarray,
    lang_weights: np.ndarray,
    rng: np.random.Generator,
    *,
    return_keys: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Step 3 (exhaustive): rows ordered by bucket, then by U^(1/w) descending inside a bucket.

    Returns (order, bucket_starts, keys): `order` holds row indices, `bucket_starts` the positions
    in `order` where each non-empty bucket begins, and `keys` (only when asked) the Exp(1) draw E
    of every row, i.e. U = exp(-E), for checking against a per-row implementation.
    """
    n = len(bucket_ids)
    n_langs = len(lang_weights)
    n_groups = (int(bucket_ids.max()) + 1) * n_langs
    group = bucket_ids.astype(_key_dtype(n_groups)) * n_langs + lang_codes.astype(_key_dtype(n_groups))
    grouped: np.ndarray = np.argsort(group, kind="stable").astype(_index_dtype(n))
    sizes = np.bincount(group, minlength=n_groups)
    del group
    keys = np.empty(n, dtype=np.float64) if return_keys else None
    order = np.empty(n, dtype=grouped.dtype)
    bucket_starts = []
    start = 0
    for b in range(len(sizes) // n_langs):
        b_size = int(sizes[b * n_langs : (b + 1) * n_langs].sum())
        if b_size == 0:
            continue
        runs_rows, runs_keys = [], []
        pos = start
        for lang in range(n_langs):
            m = int(sizes[b * n_langs + lang])
            if m == 0:
                continue
            rows = grouped[pos : pos + m]
            pos += m
            perm = rows[rng.permutation(m)]
            e_sorted = np.cumsum(rng.standard_exponential(m) / np.arange(m, 0, -1, dtype=np.float64))
            if keys is not None:
                keys[perm] = e_sorted
            e_sorted /= lang_weights[lang]
            runs_rows.append(perm)
            runs_keys.append(e_sorted)
        merged = np.argsort(np.concatenate(runs_keys), kind="stable")
        order[start : start + b_size] = np.concatenate(runs_rows)[merged]
        bucket_starts.append(start)
        start += b_size
    return order, np.asarray(bucket_starts, dtype=np.int64), keys


def draw_temperature_rows(
    lang_codes: np.ndarray, lang_counts: np.ndarray, draw_counts: np.ndarray, *, seed: int, epoch: int
) -> np.ndarray:
    """T2: this epoch's rows, `draw_counts[l]` of language l, from its endless stream of cycles.

    Epoch e takes positions [e * c_l, (e + 1) * c_l) of language l's stream. A whole cycle inside
    that range contributes every row once; a partial one the rows whose rank in the cycle's random
    order falls in range (found with a partial sort, not a full permutation). The rows come back
    grouped by language, not shuffled: the caller shuffles inside buckets anyway.
    """
    n = len(lang_codes)
    codes = lang_codes.astype(_key_dtype(len(lang_counts)), copy=False)
    by_lang: np.ndarray = np.argsort(codes, kind="stable").astype(_index_dtype(n))
    out = np.empty(int(draw_counts.sum()), dtype=by_lang.dtype)
    filled = 0
    lang_start = 0
    for lang, (n_l, c_l) in enumerate(zip(lang_counts.tolist(), draw_counts.tolist())):
        rows = by_lang[lang_start : lang_start + n_l]
        lang_start += n_l
        if c_l == 0:
            continue
        a, b = epoch * c_l, (epoch + 1) * c_l  # stream positions of this epoch
        for cycle in range(a // n_l, (b - 1) // n_l + 1):
            lo, hi = max(a - cycle * n_l, 0), min(b - cycle * n_l, n_l)
            piece = (
                rows if lo == 0 and hi == n_l else rows[_select_cycle_ranks(n_l, lo, hi, seed, lang, cycle)]
            )
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
    return out


def _select_cycle_ranks(n: int, lo: int, hi: int, seed: int, lang: int, cycle: int) -> np.ndarray:
    """Mask of the items whose rank in the cycle's random order is in [lo, hi).

    The order sorts random 64-bit keys whose low bits are replaced by the item's index, so keys
    are distinct and the same ranks are found in every epoch that touches this cycle.
    """
    bits = max(1, (n - 1).bit_length())
    keys = make_generator(seed, "cycle", lang, cycle).bit_generator.random_raw(n)
    keys = (keys >> np.uint64(bits) << np.uint64(bits)) | np.arange(n, dtype=np.uint64)
    kth = [k for k in (lo, hi) if 0 < k < n]
    cut = np.partition(keys, kth) if kth else keys
    inside = np.ones(n, dtype=bool)
    if lo > 0:
        inside &= keys >= cut[lo]
    if hi < n:
        inside &= keys < cut[hi]
    return inside


def shuffle_within_buckets(
    rows: np.ndarray, bucket_ids: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """T3: rows grouped by bucket (ascending), uniformly shuffled inside each; plus bucket starts."""
    order = rows[np.argsort(bucket_ids, kind="stable")]
    sizes = np.bincount(bucket_ids)
    ends = np.cumsum(sizes)
    for start, end in zip((ends - sizes).tolist(), ends.tolist()):
        rng.shuffle(order[start:end])  # one bucket at a time: smaller, cache-friendlier shuffles
    return order, (ends - sizes)[sizes > 0].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# step 4: greedy packing


def pack_greedy(
    costs: np.ndarray,
    budget: int,
    segment_starts: np.ndarray | None = None,
    *,
    block: int = 16384,
    jump_log2: int = 3,
) -> np.ndarray:
    """Step 4: start positions of the greedy micro-batches over `costs` (int64, in order).

    A batch closes when the next row would push its sum over `budget`; a row over budget is a
    batch of its own; a batch never spans a segment start. Returns int64 start positions (first 0).

    Vectorised in two parts. (a) next[i], the start of the batch that follows a batch starting at
    row i, for every row at once: with P the prefix sums of a segment, next[i] = max(i + 1,
    last j with P[j] - P[i] <= budget), a sorted search done block by block in a small window of P
    so it stays in cache. (b) The batch starts are the orbit 0, next[0], next[next[0]], ...;
    pointer doubling gives next^(2^jump_log2), a Python walk visits every 2^jump_log2-th start,
    and jump_log2 vectorised gathers fill in the starts between.
    """
    costs = np.asarray(costs, dtype=np.int64)
    n = len(costs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if budget <= 0:
        raise ValueError(f"batch budget {budget} must be positive")
    cuts = np.asarray(segment_starts if segment_starts is not None else [], dtype=np.int64)
    bounds = np.unique(np.concatenate(([0, n], cuts[(cuts > 0) & (cuts < n)])))
    idx = _index_dtype(n + 1)
    nxt: np.ndarray = np.empty(n + 1, dtype=idx)
    nxt[n] = n
    steps = np.arange(1, block + 1, dtype=np.int64)
    for s0, s1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        m = s1 - s0
        prefix = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(costs[s0:s1], out=prefix[1:])
        for i0 in range(0, m, block):
            i1 = min(i0 + block, m)
            query = prefix[i0:i1] + budget
            window_end = int(np.searchsorted(prefix, query[-1], side="right"))
            last = np.searchsorted(prefix[i0:window_end], query, side="right") - 1
            np.maximum(last, steps[: i1 - i0], out=last)  # a row over budget still advances by one
            nxt[s0 + i0 : s0 + i1] = last + (s0 + i0)
    jump = nxt
    for _ in range(jump_log2):
        jump = jump[jump]
    coarse = []
    jump_at = jump.data  # a memoryview: indexing it gives Python ints, fast in the walk below
    pos = 0
    while pos < n:
        coarse.append(pos)
        pos = jump_at[pos]
    rows: list[np.ndarray] = [np.asarray(coarse, dtype=idx)]
    for _ in range((1 << jump_log2) - 1):
        rows.append(nxt[rows[-1]])
    starts = np.stack(rows, axis=1).reshape(-1)
    return starts[starts < n].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# steps 5-6: balance over ranks, lockstep trim, shuffle


def assign_to_ranks(batch_costs: np.ndarray, dp_size: int) -> np.ndarray:
    """Step 5: sort batches by cost (descending, stable), drop the tail, deal round-robin.

    Returns [dp_size, per_rank] batch ids; row r is rank r's list (batches r, r+W, ...).
    """
    order = np.argsort(-np.asarray(batch_costs, dtype=np.float64), kind="stable")
    per_rank = len(order) // dp_size
    return order[: per_rank * dp_size].reshape(per_rank, dp_size).T.copy()


def trim_and_shuffle(rank_batches: np.ndarray, grad_accum: int, rng: np.random.Generator) -> np.ndarray:
    """Step 6: keep a multiple of grad_accum per rank (its most costly), shuffle all ranks alike."""
    per_rank = rank_batches.shape[1] // grad_accum * grad_accum
    perm = rng.permutation(per_rank)
    return rank_batches[:, :per_rank][:, perm]


# ---------------------------------------------------------------------------------------------
# the plan


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


def build_epoch_plan(
    durations: np.ndarray,
    lang_codes: np.ndarray,
    settings: SamplerSettings = SamplerSettings(),
    epoch: int = 0,
    *,
    token_lengths: np.ndarray | None = None,
    n_langs: int | None = None,
) -> EpochPlan:
    """Plan one epoch for all dp ranks (pure: same inputs -> same plan). See the module docstring."""
    durations, lang_codes, token_lengths, n_langs = check_arrays(
        durations, lang_codes, token_lengths, n_langs
    )
    s = settings
    s.check(epoch)
    n = len(durations)
    lang_counts = np.bincount(lang_codes, minlength=n_langs)
    targets = compute_language_targets(lang_counts, s.temperature)

    if s.mode == "exhaustive":
        weights = compute_language_weights(lang_counts, targets)
        buckets = assign_buckets(durations, s.bucket_boundaries)
        rng = make_generator(s.seed, "order", epoch)
        rows, seg_starts, _ = order_by_weighted_keys(buckets, lang_codes, weights, rng)
        del buckets
    else:
        draw_counts = allocate_counts(targets, n if s.epoch_size is None else s.epoch_size)
        drawn = draw_temperature_rows(lang_codes, lang_counts, draw_counts, seed=s.seed, epoch=epoch)
        buckets = assign_buckets(durations[drawn], s.bucket_boundaries)
        rng = make_generator(s.seed, "shuffle", epoch)
        rows, seg_starts = shuffle_within_buckets(drawn, buckets, rng)
        del drawn, buckets

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
    starts = pack_greedy(costs, budget, seg_starts)
    del costs
    offsets = np.append(starts, len(rows))
    batch_costs = np.diff(offsets) * np.maximum.reduceat(sizes, starts).astype(np.float64)
    del sizes
    rank_batches = assign_to_ranks(batch_costs, s.dp_size)
    rng = make_generator(s.seed, "ranks", epoch)
    rank_batches = trim_and_shuffle(rank_batches, s.grad_accum, rng)
    if rank_batches.shape[1] == 0:
        raise ValueError(
            f"the epoch packs into {len(starts)} micro-batches, fewer than dp_size * grad_accum = "
            f"{s.dp_size * s.grad_accum}, so every rank would get none; lower the batch budget, "
            f"grad_accum or dp_size, or use a larger manifest / epoch_size"
        )
    return EpochPlan(
        rows=rows,
        batch_offsets=offsets,
        rank_batches=rank_batches,
        mode=s.mode,
        seed=s.seed,
        epoch=epoch,
        manifest_rows=n,
    )


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


def _index_dtype(n: int) -> np.dtype:
    return np.dtype(np.int32 if n < 2**31 else np.int64)


def _key_dtype(n_values: int) -> np.dtype:
    """int16 where it fits: numpy's stable argsort is a radix sort for 16-bit keys, ~2x faster."""
    return np.dtype(np.int16 if n_values <= 2**15 else np.int32)


# ---------------------------------------------------------------------------------------------
# the stateful wrapper used as a DataLoader batch_sampler


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
        settings: SamplerSettings = SamplerSettings(),
        *,
        token_lengths: np.ndarray | None = None,
        dp_rank: int = 0,
        epoch: int = 0,
    ) -> None:
        n_langs = len(lang_names) if lang_names is not None else None
        self._durations, self._lang_codes, self._token_lengths, self._n_langs = check_arrays(
            durations, lang_codes, token_lengths, n_langs
        )
        self.settings = settings.for_rows(len(self._durations))
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
            "bucket_boundaries": list(s.bucket_boundaries),
            "epoch_size": s.epoch_size,
            "token_cost": dataclasses.asdict(s.token_cost),
        }  # dp_size, seed and mode are checked at the top level of the state
        self.fingerprint = fingerprint_manifest(
            self._durations, self._lang_codes, self._token_lengths, self.lang_names
        )
        self.epoch = epoch
        self.position = 0
        self._plan: EpochPlan | None = None
        self._generation = 0  # bumped by set_epoch/seek/load_state_dict: stale iterators stop

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
        if self._plan is None or self._plan.epoch != self.epoch:
            self._plan = build_epoch_plan(
                self._durations, self._lang_codes, self.settings, self.epoch,
                token_lengths=self._token_lengths, n_langs=self._n_langs,
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
                raise ValueError(
                    f"sampler state mismatch in '{key}': saved {state.get(key)!r}, current {current[key]!r}; "
                    f"resume with the same {key} or start without loading the sampler state"
                )
        saved_params = state.get("params", {})
        for key, value in current["params"].items():
            if saved_params.get(key) != value:
                raise ValueError(
                    f"sampler state mismatch in 'params.{key}': saved {saved_params.get(key)!r}, current "
                    f"{value!r}; resume with the same setting or start without loading the sampler state"
                )
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"sampler state has position={position}; it must be >= 0")
        self.epoch, self.position = int(state["epoch"]), position
        self._generation += 1
