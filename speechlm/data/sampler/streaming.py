"""The streaming epoch plan: shards read front to back, for filesystems where random reads are slow.

Indexed mode (`epoch_plan.build_epoch_plan`) draws rows in any order and reads each clip by
position; on a network filesystem that is one random read per clip. Streaming mode plans the epoch
so that every reader walks its shards sequentially, the WeNet/webdataset way, but still as a pure
function of the index (no I/O), so it keeps lockstep and exact resume:

1. Rows: temperature mode draws this epoch's rows per language (and dataset, with a mix) exactly as
   indexed mode does (`draw_epoch_rows`), so the mix of an epoch is the same; exhaustive mode takes
   every row once.
2. Streams: the shards (one code per tar; rows with no shard of their own get one each) are
   shuffled per epoch and dealt to dp_size x streams_per_rank streams, each next shard to the
   stream with the least audio so far; stream s belongs to rank s // streams_per_rank. Inside a
   stream the rows follow the shard order, then their byte offset: sequential reads.
3. Shuffle buffer: each row moves by a random key in [0, shuffle_buffer) positions (sort by
   position + U(0, B)): no row moves further than B rows, which is what a reader holding a buffer
   of B clips can deliver (WeNet's shuffle buffer mixes the same way).
4. Sort buffer: windows of sort_buffer rows are sorted by duration and packed to the same budget as
   indexed mode (seconds or tokens, `pack_greedy`), so the padding and the batch sizes stay close
   to indexed mode's; the micro-batches of a window are then shuffled.
5. Lockstep: a rank's streams are interleaved round-robin (micro-batch k from stream k mod W, so the
   DataLoader's worker k mod W reads its own shards). Every rank keeps the same count, a multiple
   of grad_accum: ranks with more give their last micro-batches to ranks with fewer, and fewer than
   dp_size x grad_accum micro-batches are left out of the epoch, as in indexed mode.

Exact: every drawn row is in exactly one micro-batch of the epoch except those left out in step 5;
no duplicates within an epoch (beyond temperature mode's repeats); resume recomputes the plan and
continues at the next micro-batch without reading what was consumed. Approximate: the mix of
languages inside a buffer window (the epoch's totals are exact) and the balance of streams (whole
shards, dealt greedily).
"""

from __future__ import annotations

import heapq

import numpy as np

from speechlm.data.sampler.batching import pack_greedy
from speechlm.data.sampler.epoch_plan import (
    EpochPlan,
    EpochTooShortError,
    draw_epoch_rows,
    drop_too_long,
    row_costs,
    too_long_message,
)
from speechlm.data.sampler.mix import DatasetMix
from speechlm.data.sampler.ordering import make_generator
from speechlm.data.sampler.settings import SamplerSettings, check_arrays


def _deal_shards(shard_secs: np.ndarray, n_streams: int) -> np.ndarray:
    """Stream of each shard (in the given order): the stream with the least audio so far."""
    heap = [(0.0, s) for s in range(n_streams)]
    out = np.empty(len(shard_secs), np.int64)
    for k, secs in enumerate(shard_secs.tolist()):
        total, s = heapq.heappop(heap)
        out[k] = s
        heapq.heappush(heap, (total + secs, s))
    return out


def _balance(per_rank: list[list[int]], grad_accum: int) -> np.ndarray:
    """Equal counts (a multiple of grad_accum) per rank: surplus tails move to ranks short of it."""
    dp = len(per_rank)
    total = sum(len(b) for b in per_rank)
    keep = total // (dp * grad_accum) * grad_accum
    pool: list[int] = []
    for batches in per_rank:
        pool.extend(batches[keep:])
        del batches[keep:]
    for batches in per_rank:
        need = keep - len(batches)
        batches.extend(pool[:need])
        del pool[:need]
    return np.asarray(per_rank, dtype=np.int64).reshape(dp, keep)


def build_streaming_plan(
    durations: np.ndarray,
    lang_codes: np.ndarray,
    shard_codes: np.ndarray,
    shard_positions: np.ndarray,
    settings: SamplerSettings,
    epoch: int = 0,
    *,
    token_lengths: np.ndarray | None = None,
    n_langs: int | None = None,
    streams_per_rank: int = 1,
    shuffle_buffer: int = 2000,
    sort_buffer: int = 500,
    mix: DatasetMix | None = None,
) -> EpochPlan:
    """Plan one streaming epoch for all dp ranks (pure; see the module docstring, whose steps 1-5 are
    `epoch_rows`, `order_by_stream`, `shuffle_in_streams`, `pack_windows` and `deal_to_ranks`).

    `shard_codes[i]` is row i's shard (any int; -1: a shard of its own) and `shard_positions[i]`
    its place inside that shard (byte offset or row number).
    """
    durations, lang_codes, token_lengths, n_langs = check_arrays(
        durations, lang_codes, token_lengths, n_langs
    )
    s = settings.with_buckets(durations)
    s.check(epoch)
    if streams_per_rank < 1 or shuffle_buffer < 1 or sort_buffer < 1:
        raise ValueError(
            f"streams_per_rank={streams_per_rank}, shuffle_buffer={shuffle_buffer} and sort_buffer={sort_buffer} "
            "must all be >= 1"
        )
    n = len(durations)
    codes = np.asarray(shard_codes, np.int64).copy()
    lonely = codes < 0
    codes[lonely] = codes.max(initial=-1) + 1 + np.arange(int(lonely.sum()))
    positions = np.asarray(shard_positions, np.int64)
    if codes.shape != (n,) or positions.shape != (n,):
        raise ValueError(f"shard_codes and shard_positions need one entry per row ({n})")

    rows, _, too_long = drop_too_long(
        epoch_rows(lang_codes, n_langs, s, epoch, mix), durations, s.max_duration
    )
    if not len(rows):
        raise ValueError(too_long_message(durations, s.max_duration))
    n_streams = s.dp_size * streams_per_rank
    rows, stream, starts = order_by_stream(rows, codes, positions, durations, n_streams, s.seed, epoch)
    rows = shuffle_in_streams(rows, stream, starts, shuffle_buffer, s.seed, epoch)
    rows, offsets, batch_stream, batch_order = pack_windows(
        rows, stream, starts, durations, token_lengths, s, epoch, sort_buffer
    )
    rank_batches = deal_to_ranks(batch_order, batch_stream, s.dp_size, streams_per_rank, s.grad_accum)
    if rank_batches.shape[1] == 0:
        raise EpochTooShortError(
            len(batch_stream),
            f"the streaming epoch packs into {len(batch_stream)} micro-batches, fewer than dp_size * grad_accum = "
            f"{s.dp_size * s.grad_accum}; lower the batch budget, grad_accum or dp_size, or use more data",
        )
    return EpochPlan(
        rows=rows,
        batch_offsets=offsets,
        rank_batches=rank_batches,
        mode=f"streaming-{s.mode}",
        seed=s.seed,
        epoch=epoch,
        manifest_rows=n,
        too_long=too_long,
    )


def epoch_rows(
    lang_codes: np.ndarray, n_langs: int, s: SamplerSettings, epoch: int, mix: DatasetMix | None
) -> np.ndarray:
    """1. This epoch's rows: temperature mode's draw (as indexed mode draws), or every row once."""
    if s.mode == "temperature":
        lang_counts = np.bincount(lang_codes, minlength=n_langs)
        return draw_epoch_rows(lang_codes, lang_counts, n_langs, s, epoch, mix).astype(np.int64)
    if mix is not None:
        raise ValueError(
            "dataset weights (data.input_cfg) need sampler.mode=temperature: exhaustive uses every row once"
        )
    return np.arange(len(lang_codes), dtype=np.int64)


def order_by_stream(
    rows: np.ndarray,
    codes: np.ndarray,
    positions: np.ndarray,
    durations: np.ndarray,
    n_streams: int,
    seed: int,
    epoch: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """2. Shards shuffled and dealt to streams; (rows in stream, shard, offset order, their stream,
    where each stream starts)."""
    shard_ids, shard_of_row = np.unique(codes[rows], return_inverse=True)
    rng = make_generator(seed, "stream-shards", epoch)
    shard_rank = np.empty(len(shard_ids), np.int64)
    shard_rank[rng.permutation(len(shard_ids))] = np.arange(len(shard_ids))
    secs = np.bincount(shard_of_row, weights=durations[rows], minlength=len(shard_ids))
    stream_by_rank = _deal_shards(secs[np.argsort(shard_rank)], n_streams)
    stream = stream_by_rank[shard_rank][shard_of_row]
    order = np.lexsort((positions[rows], shard_rank[shard_of_row], stream))
    rows, stream = rows[order], stream[order]
    return rows, stream, np.searchsorted(stream, np.arange(n_streams + 1))


def _place_in_stream(n_rows: int, starts: np.ndarray) -> np.ndarray:
    """Each row's position inside its stream (the rows are grouped by stream, `starts` their bounds)."""
    return np.arange(n_rows) - np.repeat(starts[:-1], np.diff(starts))


def shuffle_in_streams(
    rows: np.ndarray, stream: np.ndarray, starts: np.ndarray, shuffle_buffer: int, seed: int, epoch: int
) -> np.ndarray:
    """3. A bounded-displacement shuffle inside each stream: no row moves more than `shuffle_buffer`."""
    rng = make_generator(seed, "stream-buffer", epoch)
    keys = _place_in_stream(len(rows), starts) + rng.uniform(0.0, float(shuffle_buffer), len(rows))
    return rows[np.lexsort((keys, stream))]


def pack_windows(
    rows: np.ndarray,
    stream: np.ndarray,
    starts: np.ndarray,
    durations: np.ndarray,
    token_lengths: np.ndarray | None,
    s: SamplerSettings,
    epoch: int,
    sort_buffer: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """4. Windows of `sort_buffer` rows sorted by duration and packed to the budget; (rows in packed order,
    micro-batch offsets, each micro-batch's stream, the micro-batches shuffled within each window)."""
    window = _place_in_stream(len(rows), starts) // sort_buffer
    order = np.lexsort((durations[rows], window, stream))
    rows, window = rows[order], window[order]
    seg = np.flatnonzero(np.diff(stream * (window.max(initial=0) + 1) + window, prepend=-1))
    _, costs, budget = row_costs(durations, token_lengths, rows, s)
    batch_starts = pack_greedy(costs, budget, seg)
    batch_stream = stream[batch_starts]
    rng = make_generator(s.seed, "stream-batches", epoch)
    batch_order = np.lexsort((rng.random(len(batch_starts)), window[batch_starts], batch_stream))
    return rows, np.append(batch_starts, len(rows)), batch_stream, batch_order


def deal_to_ranks(
    batch_order: np.ndarray, batch_stream: np.ndarray, dp_size: int, streams_per_rank: int, grad_accum: int
) -> np.ndarray:
    """5. Per rank, its streams interleaved round-robin, then the counts balanced: [dp_size, per rank]."""
    per_stream: list[list[int]] = [[] for _ in range(dp_size * streams_per_rank)]
    for b in batch_order.tolist():
        per_stream[int(batch_stream[b])].append(b)
    per_rank: list[list[int]] = []
    for r in range(dp_size):
        mine = per_stream[r * streams_per_rank : (r + 1) * streams_per_rank]
        longest = max((len(x) for x in mine), default=0)
        per_rank.append([x[k] for k in range(longest) for x in mine if k < len(x)])
    return _balance(per_rank, grad_accum)
