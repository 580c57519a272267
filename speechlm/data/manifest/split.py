"""The train/val split: a stable uniform value per ``segment_id`` (`hash_uniform`) and the
per-language val mask (`split_val`).

``u = splitmix64(fnv1a64(utf8(id)) ^ splitmix64(seed)) / 2**64`` and a row is val when
``u < val_fraction``. The hash runs over byte columns in numpy, so no per-row Python. A row's split
depends only on its id and the seed, so adding shards never moves an existing row between train and
val. Per language: a language with at least 2 rows gets at least one val row (the row of smallest u)
and keeps at least one train row (the row of largest u) when ``0 < val_fraction``; a language with a
single row keeps it in train.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from speechlm.data.manifest.schema import ManifestError

_U64 = np.uint64
_FNV_OFFSET = _U64(0xCBF29CE484222325)
_FNV_PRIME = _U64(0x100000001B3)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def hash_uniform(ids: pa.Array | pa.ChunkedArray, seed: int = 0, *, block: int = 1 << 20) -> np.ndarray:
    """Stable uniform [0, 1) value per string: ``splitmix64(fnv1a64(utf8) ^ len ^ splitmix64(seed))``.

    Vectorised over byte columns: for each byte position j, every string longer than j folds its
    j-th byte into its FNV-1a state; the same id gives the same value on any machine and run.
    """
    chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
    salt = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    out = []
    for chunk in chunks:
        chunk = chunk.cast(pa.large_string())  # int64 offsets, one code path
        if chunk.null_count:
            raise ManifestError("cannot hash null ids: every row needs a segment_id")
        _, offsets_buf, data_buf = chunk.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=len(chunk) + 1, offset=chunk.offset * 8)
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(1, np.uint8)
        data = data if data.size else np.zeros(1, np.uint8)
        for lo in range(0, len(chunk), block):
            starts = offsets[lo : lo + block + 1]
            lengths = np.diff(starts)
            starts = starts[:-1]
            h = np.full(lengths.size, _FNV_OFFSET, dtype=np.uint64)
            for j in range(int(lengths.max(initial=0))):
                active = lengths > j
                byte = data[np.minimum(starts + j, data.size - 1)].astype(np.uint64)
                h = np.where(active, (h ^ byte) * _FNV_PRIME, h)
            out.append(_splitmix64(h ^ lengths.astype(np.uint64) ^ salt))
    h = np.concatenate(out) if out else np.zeros(0, np.uint64)
    return (h >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def split_val(u: np.ndarray, lang_codes: np.ndarray, val_fraction: float) -> np.ndarray:
    """Boolean val mask: ``u < val_fraction``, then per language at least one val row and one train
    row when it has 2+ rows (and the only row of a 1-row language in train)."""
    is_val = u < val_fraction
    if val_fraction <= 0:
        return is_val
    for code in np.unique(lang_codes):
        rows = np.flatnonzero(lang_codes == code)
        if rows.size == 1:
            is_val[rows] = False
            continue
        if not is_val[rows].any():
            is_val[rows[np.argmin(u[rows])]] = True
        if is_val[rows].all():
            is_val[rows[np.argmax(u[rows])]] = False
    return is_val
