"""Which rows of the training split an evaluation scores (the row choice of `speechlm.train.evaluate`; its
module docstring says why the training split is scored too; how batches are dealt to the data-parallel
ranks is the evaluator's: `speechlm.use.evaluator.shard_eval_batches`).

`choose_train_rows` apportions N rows over the
(task, language) groups of the training split in the val split's proportions (largest remainders), each
group's rows evenly spread over it; `train_eval_rows` is the final evaluation's N
(`trainer.final_eval_train_utterances`), `periodic_train_rows` the largest such subset that fits in
`trainer.val_train_batches` decoding batches.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from speechlm.config import ExperimentConfig, eval_batch_duration
from speechlm.data.sampler.batching import batch_by_duration
from speechlm.errors import DataError
from speechlm.metrics import DEFAULT_TASK


def row_groups(table: pa.Table) -> np.ndarray:
    """The (task, language) group of each manifest row as "task/lang" (no `task` column, or a null: asr)."""
    langs = [str(x) for x in table.column("lang").to_pylist()]
    tasks = table.column("task").to_pylist() if "task" in table.column_names else [None] * len(langs)
    return np.array([f"{t or DEFAULT_TASK}/{lang}" for t, lang in zip(tasks, langs)], dtype=object)


def apportion(counts: np.ndarray, n: int) -> np.ndarray:
    """`n` split in proportion to `counts` by largest remainders (ties: the earlier group), summing to n."""
    exact = n * counts / max(int(counts.sum()), 1)
    quota = np.floor(exact).astype(np.int64)
    extra = np.argsort(-(exact - quota), kind="stable")[: n - int(quota.sum())]
    quota[extra] += 1
    return quota


def choose_train_rows(train_groups: np.ndarray, val_groups: np.ndarray, n: int) -> list[int]:
    """At most `n` training rows, apportioned over the val split's (task, language) groups in its
    proportions, each group's rows evenly spread over its training rows (module doc); sorted."""
    names, counts = np.unique(val_groups.astype(str), return_counts=True)
    train = train_groups.astype(str)
    chosen = []
    for name, k in zip(names, apportion(counts, n)):
        rows = np.flatnonzero(train == name)
        k = min(int(k), len(rows))
        if k:
            chosen.append(rows[((np.arange(k) + 0.5) * len(rows) / k).astype(np.int64)])
    return sorted(int(r) for r in np.concatenate(chosen)) if chosen else []


def train_eval_rows(cfg: ExperimentConfig, train_table: pa.Table, val_table: pa.Table) -> list[int]:
    """The training rows `final_eval_split=both` scores: `trainer.final_eval_train_utterances` (default: the
    val split's utterances) chosen by `choose_train_rows`."""
    n = cfg.trainer.final_eval_train_utterances or len(val_table)
    train_groups, val_groups = row_groups(train_table), row_groups(val_table)
    return require_rows(choose_train_rows(train_groups, val_groups, n), val_groups)


def require_rows(rows: list[int], val_groups: np.ndarray) -> list[int]:
    """`rows`, or a DataError when no training row shares a (task, language) with the val split."""
    if not rows:
        raise DataError(
            f"no row of the training split has a (task, language) of the val split "
            f"({', '.join(sorted(set(val_groups.astype(str))))}), so there is no training subset to score beside "
            f"it: give a val manifest of the training languages, or turn the training-split scores off "
            f"(trainer.final_eval_split=val, trainer.val_train_batches=0)"
        )
    return rows


def periodic_train_rows(cfg: ExperimentConfig, train_table: pa.Table, val_table: pa.Table) -> list[int]:
    """The training rows each validation decodes (`trainer.val_train_batches` = K): the largest subset
    chosen by `choose_train_rows` whose decoding batches are at most K (a binary search over its size)."""
    k, budget = cfg.trainer.val_train_batches, eval_batch_duration(cfg)
    train_groups, val_groups = row_groups(train_table), row_groups(val_table)
    durations = train_table.column("duration").cast(pa.float32()).to_numpy()  # as build_eval_batches reads

    def choose(m: int) -> list[int]:
        return choose_train_rows(train_groups, val_groups, m)

    def fits(m: int) -> bool:
        return len(batch_by_duration(durations[choose(m)], budget)) <= k

    shortest = float(durations.min()) if len(durations) else 1.0
    lo, hi = 1, min(len(durations), k * (int(budget / max(shortest, 1e-3)) + 1))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return require_rows(choose(lo), val_groups)
