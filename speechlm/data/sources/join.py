"""Joining index rows to tar members by name, and attaching the tar locator columns to a table.

Every tar-based reader (NeMo tarred, Lhotse Shar) knows, for each row, which tar holds its audio
and under which member name (or key); the byte offsets come from the tar itself (`tar_member_index`,
scanned once and cached with a fingerprint), never from a file that could have gone stale. A row
whose member is not in its tar is dropped and counted against that tar in the `SourceReport`:
``truncated_shard`` when the tar ends early, ``missing_member`` otherwise. A tar that is missing or
not a tar at all stops the load with a `ManifestError` naming it: a whole shard is not a few bad
clips, and training on without it would silently change the corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from speechlm.data.manifest.schema import LOCATOR_SCHEMA, MANIFEST_SCHEMA, ManifestError
from speechlm.data.sources.report import SourceReport
from speechlm.data.sources.tar_index import TarIndexError, TarScan, tar_member_index

TAR_LOCATORS = ("tar_path", "offset", "nbytes", "header_bytes")
KeyMap = Callable[[TarScan], dict[str, int]]  # a tar's members -> {row key: member position}


def members_by_name(scan: TarScan) -> dict[str, int]:
    return {name: j for j, name in enumerate(scan.names)}


def scan_or_fail(tar: Path, what: str) -> TarScan:
    """`tar_member_index(tar)`, with an unreadable or missing tar turned into a ManifestError."""
    if not tar.is_file():
        raise ManifestError(f"tar {tar} ({what}) does not exist: restore it or remove its rows")
    try:
        return tar_member_index(tar)
    except TarIndexError as e:
        raise ManifestError(f"{e} (listed in {what})") from None


@dataclass
class MemberLocations:
    """Where each row's member is: per-row arrays, and `keep` False for rows whose member is gone."""

    names: list[str]
    offsets: np.ndarray  # int64 [N]
    sizes: np.ndarray  # int64 [N]
    headers: np.ndarray  # uint16 [N]
    keep: np.ndarray  # bool [N]


def locate_members(
    tars: Sequence[Path],
    codes: np.ndarray,
    keys: Sequence[str],
    report: SourceReport,
    *,
    what: str,
    key_map: KeyMap = members_by_name,
) -> MemberLocations:
    """Find row i's member (key `keys[i]`, in tar `tars[codes[i]]`) in that tar's scanned index.

    `key_map` turns a tar's member list into {key: position}; by default the key is the member name.
    Drops go to `report` (a `SourceReport`); `what` names the index file in errors.
    """
    n = len(keys)
    names = [""] * n
    offsets = np.zeros(n, np.int64)
    sizes = np.zeros(n, np.int64)
    headers = np.zeros(n, np.uint16)
    keep = np.ones(n, bool)
    for k in np.unique(codes).tolist():
        scan = scan_or_fail(tars[k], what)
        where = key_map(scan)
        reason = "truncated_shard" if scan.truncated_bytes else "missing_member"
        for r in np.flatnonzero(codes == k).tolist():
            j = where.get(keys[r])
            if j is None:
                keep[r] = False
                report.drop(str(tars[k]), reason)
                continue
            names[r] = scan.names[j]
            offsets[r], sizes[r], headers[r] = scan.offsets[j], scan.sizes[j], scan.header_bytes[j]
    return MemberLocations(names, offsets, sizes, headers, keep)


def with_tar_locators(
    manifest: pa.Table,
    codes: np.ndarray,
    tars: Sequence[Path | str],
    offsets: np.ndarray,
    sizes: np.ndarray,
    headers: np.ndarray,
    keep: np.ndarray | None = None,
) -> pa.Table:
    """`manifest` (MANIFEST_SCHEMA, audio_filepath = member names) + absolute tar locators, kept rows only."""
    abs_tars = pa.array([str(Path(t).resolve()) for t in tars], pa.string())
    table = pa.Table.from_arrays(
        [manifest.column(f.name).cast(f.type) for f in MANIFEST_SCHEMA]
        + [
            pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), abs_tars),
            pa.array(offsets, pa.int64()),
            pa.array(sizes, pa.int64()),
            pa.array(headers, pa.uint16()),
        ],
        schema=pa.schema(list(MANIFEST_SCHEMA) + [LOCATOR_SCHEMA.field(c) for c in TAR_LOCATORS]),
    )
    if keep is not None and not keep.all():
        table = table.filter(pa.array(keep))
    return table
