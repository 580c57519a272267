"""Weighted dataset mixing inside the temperature plan (`data.input_cfg`).

Without a mix, temperature mode draws each language's share of the epoch, n_l^T / sum_k n_k^T (T1).
With a mix of datasets d with shares s_d (summing to 1, from the weights of `data.input_cfg`), each
(dataset, language) cell is a draw group of its own, with the target share

    target(d, l) = s_d * n_{d,l}^T / sum_k n_{d,k}^T

i.e. the dataset weights decide how much of the epoch each dataset fills, and the language
temperature spreads that share over the dataset's languages as it would for the dataset alone.
Every cell then reads its rows as the same endless stream of seeded cycles as a language does (T2,
`draw_temperature_rows`): a small dataset with a large weight is repeated, each repetition a new
permutation; a large one with a small weight is sub-sampled without replacement across epochs.
Per epoch the counts are exact (largest remainder), and the plan is a pure function of
(seed, epoch), so resume stays exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from speechlm.data.sampler.ordering import compute_language_targets


@dataclasses.dataclass(frozen=True, eq=False)
class DatasetMix:
    """Which dataset each row came from and each dataset's share of an epoch."""

    dataset_codes: np.ndarray  # int [N], index into names
    names: tuple[str, ...]
    shares: tuple[float, ...]  # per dataset, summing to 1

    def __post_init__(self) -> None:
        shares = np.asarray(self.shares, dtype=np.float64)
        if len(shares) != len(self.names) or np.any(shares < 0) or not np.isclose(shares.sum(), 1.0):
            raise ValueError(f"dataset shares {list(self.shares)} must be >= 0 and sum to 1, one per dataset")
        codes = np.asarray(self.dataset_codes)
        if codes.size and (codes.min() < 0 or codes.max() >= len(self.names)):
            raise ValueError(
                f"dataset codes span {codes.min()}..{codes.max()}, outside 0..{len(self.names) - 1}"
            )

    def params(self) -> dict[str, Any]:
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(self.dataset_codes, dtype=np.int32).tobytes())
        return {
            "names": list(self.names),
            "shares": [float(s) for s in self.shares],
            "rows_digest": h.hexdigest(),
        }


def mix_groups(
    lang_codes: np.ndarray, n_langs: int, mix: DatasetMix, temperature: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group code per row, rows per group, target share per group) for the (dataset, language) cells."""
    n_sets = len(mix.names)
    groups = np.asarray(mix.dataset_codes, dtype=np.int64) * n_langs + lang_codes
    counts = np.bincount(groups, minlength=n_sets * n_langs)
    targets = np.zeros(n_sets * n_langs)
    for d in range(n_sets):
        cell = counts[d * n_langs : (d + 1) * n_langs]
        if cell.sum() == 0:
            if mix.shares[d] > 0:
                raise ValueError(f"dataset {mix.names[d]!r} has a share of {mix.shares[d]:.3f} but no rows")
            continue
        targets[d * n_langs : (d + 1) * n_langs] = mix.shares[d] * compute_language_targets(cell, temperature)
    dtype = np.int16 if n_sets * n_langs <= 2**15 else np.int32
    return groups.astype(dtype), counts, targets
