"""Row checks shared by the data tools: durations that are not a positive, finite number of seconds
(`bad_duration_rows`, `check_durations`) and string columns that are not valid UTF-8 (`check_utf8`).
Each raises `ManifestError` naming where (file, column, row, segment) and what to do. The tolerance
rule for claimed against real durations is `schema.duration_mismatch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from speechlm.data.manifest.schema import ManifestError


def bad_duration_rows(durations: np.ndarray) -> np.ndarray:
    """Indices of the durations that are not a finite number of seconds above 0 (NaN, Inf, <= 0)."""
    d = np.asarray(durations, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.flatnonzero(~np.isfinite(d) | (d <= 0))


def check_durations(table: pa.Table, where: str) -> None:
    """Raise ManifestError naming the first row of `table` whose duration is NaN, Inf or <= 0."""
    bad = bad_duration_rows(table.column("duration").to_numpy())
    if bad.size:
        row = int(bad[0])
        seg = table.column("segment_id")[row].as_py()
        value = table.column("duration")[row].as_py()
        raise ManifestError(
            f"{where} row {row} (segment {seg}): duration {value} is not a positive, finite number of "
            f"seconds ({bad.size} row(s) like this); fix these rows (the audio file's real length) "
            "or remove them from the manifest"
        )


def check_utf8(
    column: pa.ChunkedArray | pa.Array, where: str, name: str, ids: Sequence[str] | None = None
) -> None:
    """Raise ManifestError naming `where`, the column and the first row whose string is not UTF-8.

    Parquet string columns are not validated on read, so a writer that put raw bytes there gives a
    UnicodeDecodeError only when a row is turned into Python; this finds it first (one vectorised
    validation per chunk, a per-row scan only of a chunk that fails).
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    start = 0
    for chunk in chunks:
        if pa.types.is_dictionary(chunk.type):
            chunk = chunk.dictionary.take(chunk.indices)
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            values = chunk.cast(pa.binary()).to_pylist()
            bad = [i for i, v in enumerate(values) if v is not None and not _is_utf8(v)]
            if bad:
                row = start + bad[0]
                seg = f" (segment {ids[row]})" if ids is not None else ""
                raise ManifestError(
                    f"{where} column {name!r} row {row}{seg} is not valid UTF-8 ({values[bad[0]][:40]!r}; "
                    f"{len(bad)} row(s) like this); re-export the text as UTF-8 or remove the row"
                ) from None
            raise
        start += len(chunk)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
