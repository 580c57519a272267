"""Steps 4-6 of the epoch plan: greedy packing into micro-batches, and dealing them to dp ranks.

Packing is exact on integer costs and never lets a batch of two or more rows exceed the budget;
dealing sorts the batches by cost, drops the cheapest tail so every rank gets the same count, a
multiple of grad_accum, and shuffles all ranks alike. See `speechlm.data.sampler.epoch_plan`.

`batch_by_duration` is the decoding batches' packing (evaluation, `speechlm transcribe`): every row
once, shortest first, sequential, cut at a budget of seconds (and of utterances).
"""

from __future__ import annotations

import numpy as np

from speechlm.data.sampler.cost import PIECE_ROWS
from speechlm.data.sampler.ordering import index_dtype


def pack_greedy(
    costs: np.ndarray,
    budget: int,
    segment_starts: np.ndarray | None = None,
    *,
    block: int = 16384,
    jump_log2: int = 3,
    piece_rows: int = PIECE_ROWS,
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
    costs = np.asarray(costs)
    if not np.issubdtype(costs.dtype, np.integer):
        costs = costs.astype(np.int64)  # prefix sums below are int64 whatever the input width
    n = len(costs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if budget <= 0:
        raise ValueError(f"batch budget {budget} must be positive")
    cuts = np.asarray(segment_starts if segment_starts is not None else [], dtype=np.int64)
    bounds = np.unique(np.concatenate(([0, n], cuts[(cuts > 0) & (cuts < n)])))
    idx = index_dtype(n + 1)
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
    # jump = jump[jump], `piece_rows` rows at a time (no 10M-row temporaries): the first doubling into a
    # new array, the others in place, since every jump[i] > i (or = n) and a piece so reads only entries
    # that this doubling has not rewritten yet
    jump = nxt
    for _ in range(jump_log2):
        out = np.empty_like(nxt) if jump is nxt else jump
        for lo in range(0, n + 1, piece_rows):
            out[lo : lo + piece_rows] = jump[jump[lo : lo + piece_rows]]
        jump = out
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


def batch_by_duration(
    durations: np.ndarray, max_seconds: float, max_utterances: int | None = None
) -> list[list[int]]:
    """Row indices sorted by duration (stable), cut into batches of at most `max_seconds` of audio (a
    longer row is a batch of its own) and at most `max_utterances` rows (None: no limit)."""
    order = np.argsort(np.asarray(durations, dtype=np.float64), kind="stable")
    batches: list[list[int]] = []
    cur: list[int] = []
    acc = 0.0
    for i in order.tolist():
        d = float(durations[i])
        if cur and (acc + d > max_seconds or (max_utterances is not None and len(cur) >= max_utterances)):
            batches.append(cur)
            cur, acc = [], 0.0
        cur.append(i)
        acc += d
    if cur:
        batches.append(cur)
    return batches
