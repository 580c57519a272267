"""Steps 1-3 of the epoch plan: which rows an epoch uses, and their order inside each duration bucket.

Duration buckets (step 1), the temperature targets and weights of the languages (step 2), then
either the exhaustive order by weighted random keys (step 3) or the temperature mode's draws from
each language's endless stream of cycles, shuffled inside each bucket (T2-T3). The random streams
(`make_generator`) are shared with the later steps. See `speechlm.data.sampler.epoch_plan`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from speechlm.data.sampler.settings import check_bucket_boundaries

# independent random streams, each seeded by SeedSequence([seed, stream id, epoch or language, cycle])
RANDOM_STREAMS = {
    "order": 1, "shuffle": 2, "ranks": 3, "cycle": 4,
    "stream-shards": 5, "stream-buffer": 6, "stream-batches": 7,
}  # fmt: skip


def make_generator(seed: int, stream: str, a: int, b: int = 0) -> np.random.Generator:
    """Generator of one random stream: "order", "shuffle", "ranks" (a = epoch), "cycle" (a = language, b = cycle)."""
    return np.random.default_rng(np.random.SeedSequence([seed, RANDOM_STREAMS[stream], a, b]))


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
    group = bucket_ids.astype(key_dtype(n_groups)) * n_langs + lang_codes.astype(key_dtype(n_groups))
    grouped: np.ndarray = np.argsort(group, kind="stable").astype(index_dtype(n))
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
    by_lang = group_rows(lang_codes, lang_counts)
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
    sizes = np.bincount(bucket_ids)
    order = rows[group_rows(bucket_ids, sizes)]
    ends = np.cumsum(sizes)
    for start, end in zip((ends - sizes).tolist(), ends.tolist()):
        rng.shuffle(order[start:end])  # one bucket at a time: smaller, cache-friendlier shuffles
    return order, (ends - sizes)[sizes > 0].astype(np.int64)


def group_rows(codes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices grouped by code (ascending), in row order inside a group: a stable argsort built
    one code at a time, so no int64 index of every row is ever held (10M rows: 40 MB, not 80 + 40)."""
    out = np.empty(len(codes), dtype=index_dtype(len(codes)))
    start = 0
    for code, count in enumerate(np.asarray(counts).tolist()):
        if count:
            out[start : start + count] = np.flatnonzero(codes == code)
            start += count
    return out


def index_dtype(n: int) -> np.dtype:
    """int32 row indices where they fit (half the memory of int64)."""
    return np.dtype(np.int32 if n < 2**31 else np.int64)


def key_dtype(n_values: int) -> np.dtype:
    """int16 where it fits: numpy's stable argsort is a radix sort for 16-bit keys, ~2x faster."""
    return np.dtype(np.int16 if n_values <= 2**15 else np.int32)
