"""Per-row access to where a row's audio is (`LOCATOR_SCHEMA`), without copying the columns.

A memory-mapped index (`mmap_cache`) comes in chunks of about a million rows. `IntColumn` keeps one
zero-copy numpy view per chunk and finds a row's chunk by binary search, so a rank's locator columns
cost no private memory at all: their pages are read from the cache file when a clip is loaded.
Only columns with nulls (plain-file rows mixed with tar members) are copied, with the nulls filled.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from speechlm.data.sources.members import MemberReader


class IntColumn:
    """Row -> number over a chunked Arrow column (zero-copy views; nulls become `fill`)."""

    def __init__(self, col: pa.ChunkedArray | pa.Array, fill: float | int = 0) -> None:
        if isinstance(col, pa.Array):
            col = pa.chunked_array([col])
        if col.null_count:
            col = pa.chunked_array([col.fill_null(fill).combine_chunks()])
        self._views = [c.to_numpy(zero_copy_only=False) for c in col.chunks if len(c)]
        self._starts = np.cumsum([0] + [len(v) for v in self._views])

    def __getitem__(self, i: int) -> int | float:
        if len(self._views) == 1:
            return self._views[0][i].item()  # type: ignore[no-any-return]
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._views[k][i - int(self._starts[k])].item()  # type: ignore[no-any-return]


class RowLocators:
    """The locator columns of a manifest table: tar member (path, offset, size, header) or segment."""

    def __init__(self, table: pa.Table) -> None:
        names = table.column_names
        self.reader = MemberReader()
        self._tar_codes: IntColumn | None = None
        self._tars: list[str] = []
        if "tar_path" in names:
            col = table.column("tar_path")
            if not pa.types.is_dictionary(col.type):
                col = pc.dictionary_encode(col)
            dictionaries = {tuple(c.dictionary.to_pylist()) for c in col.chunks}
            if len(dictionaries) > 1:  # chunks with their own dictionaries: unify them once
                col = pa.chunked_array([col.combine_chunks()])
            self._tars = col.chunk(0).dictionary.to_pylist() if col.num_chunks else []
            self._tar_codes = IntColumn(
                pa.chunked_array([c.indices for c in col.chunks], col.type.index_type), -1
            )
            self.offset = IntColumn(table.column("offset"))
            self.nbytes = IntColumn(table.column("nbytes"))
            self.header_bytes = IntColumn(table.column("header_bytes"))
        self._start: IntColumn | None = None
        if "start" in names and table.column("start").null_count < len(table):
            self._start = IntColumn(table.column("start"), float("nan"))
            self._duration = IntColumn(table.column("duration"))

    def tar(self, i: int) -> str | None:
        if self._tar_codes is None:
            return None
        code = int(self._tar_codes[i])
        return None if code < 0 else self._tars[code]

    def start_of(self, i: int) -> float | None:
        if self._start is None:
            return None
        start = float(self._start[i])
        return None if np.isnan(start) else start

    def duration_of(self, i: int) -> float:
        return float(self._duration[i])

    def sort_key(self, i: int) -> tuple[int, int]:
        """Reads of a micro-batch sorted by this key go shard by shard, front to back."""
        if self._tar_codes is None:
            return (0, 0)
        return (int(self._tar_codes[i]), int(self.offset[i]))
