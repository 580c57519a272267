"""The train/val split: a stable uniform value per ``segment_id`` (`hash_uniform`), the values of a
shard's optional ``split`` column (`split_codes`), and the per-language val mask (`split_val`).

``u = splitmix64(fnv1a64(utf8(id)) ^ splitmix64(seed)) / 2**64`` and a row is val when
``u < val_fraction``. The hash runs over byte columns in numpy, so no per-row Python. A row's split
depends only on its id and the seed, so adding shards never moves an existing row between train and
val. Per language: a language with at least 2 rows gets at least one val row (the row of smallest u)
and keeps at least one train row (the row of largest u) when ``0 < val_fraction``; a language with a
single row keeps it in train.

A row whose metadata names its split (``split`` = ``train``, or ``val`` and its aliases ``dev`` and
``validation``) goes there whatever its u, ``val_fraction`` and the per-language rule: that rule only
moves rows the hash placed, and counts the named rows of the language too (a language with named val
rows needs no hashed val row). `check_train_rows` refuses a build whose named rows leave a language
with no train row.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from speechlm.data.manifest.schema import ManifestError

_U64 = np.uint64
_FNV_OFFSET = _U64(0xCBF29CE484222325)
_FNV_PRIME = _U64(0x100000001B3)

# value of the metadata's ``split`` column (stripped, lower-cased) -> code; null -> HASHED
SPLIT_VALUES = {"train": 0, "val": 1, "dev": 1, "validation": 1}
HASHED = -1


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


def split_codes(column: pa.ChunkedArray, ids: pa.ChunkedArray, where: str) -> np.ndarray:
    """Per row of a shard's ``split`` column: 0 train, 1 val, `HASHED` (-1) for null; ManifestError
    naming `where` (the file), the first bad row's segment id and value, and the allowed values for any
    other value (compared stripped and lower-cased; an empty string is not null: an error too)."""
    values = pc.utf8_lower(pc.utf8_trim_whitespace(column.cast(pa.string())))
    names = list(SPLIT_VALUES)
    found = pc.index_in(values, value_set=pa.array(names, pa.string()))
    bad = np.flatnonzero(
        (pc.is_null(found).to_numpy(zero_copy_only=False))
        & pc.is_valid(values).to_numpy(zero_copy_only=False)
    )
    if bad.size:
        row = int(bad[0])
        raise ManifestError(
            f"{where} column 'split' row {row} (segment {ids[row].as_py()}) has value "
            f"{column[row].as_py()!r} ({bad.size} row(s) with a value not allowed); allowed: "
            f"{', '.join(names)} ('dev' and 'validation' mean 'val'), or null to let the hash of "
            "segment_id decide; fix the shard's metadata"
        )
    codes = np.array([SPLIT_VALUES[name] for name in names], dtype=np.int8)
    idx = pc.fill_null(found, -1).to_numpy(zero_copy_only=False)
    return np.where(idx >= 0, codes[np.maximum(idx, 0)], np.int8(HASHED)).astype(np.int8)


def split_val(
    u: np.ndarray, lang_codes: np.ndarray, val_fraction: float, fixed: np.ndarray | None = None
) -> np.ndarray:
    """Boolean val mask: ``u < val_fraction``, then per language at least one val row and one train
    row when it has 2+ rows (and the only row of a 1-row language in train).

    `fixed` (`split_codes` values, optional): rows with code 0/1 are train/val whatever u and
    `val_fraction`; the per-language rule moves only `HASHED` rows, counting the fixed ones (so it
    cannot always hold: see `check_train_rows`). Without fixed rows the mask is the plain hash split."""
    is_val = u < val_fraction
    hashed = np.ones(u.size, bool)
    if fixed is not None:
        hashed = fixed == HASHED
        is_val = np.where(hashed, is_val, fixed == 1)
    if val_fraction <= 0:
        return is_val
    for code in np.unique(lang_codes):
        rows = np.flatnonzero(lang_codes == code)
        free = rows[hashed[rows]]
        if not free.size:
            continue
        if rows.size == 1:
            is_val[rows] = False
            continue
        if not is_val[rows].any():
            is_val[free[np.argmin(u[free])]] = True
        if is_val[rows].all():
            is_val[free[np.argmax(u[free])]] = False
    return is_val


def check_train_rows(is_val: np.ndarray, lang_codes: np.ndarray, lang_names: list[str]) -> None:
    """ManifestError naming every language whose kept rows all went to val by the ``split`` column:
    training would silently lose the language (a language with no val row is fine)."""
    rows = np.bincount(lang_codes, minlength=len(lang_names))
    train = np.bincount(lang_codes[~is_val], minlength=len(lang_names))
    lost = [
        f"{name} ({rows[code]} rows)"
        for code, name in enumerate(lang_names)
        if rows[code] and not train[code]
    ]
    if lost:
        raise ManifestError(
            f"no train row left for language {', '.join(lost)}: the metadata's 'split' column puts every "
            "kept row of it in val, so training would never see the language; mark some of its rows "
            "'train' or leave them null (the hash of segment_id then splits them), or remove the language"
        )
