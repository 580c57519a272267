"""Lhotse cuts files as a data source, offsets and multi-cut recordings included.

A cuts file is what ``CutSet.to_file`` writes: JSON lines (``.jsonl``) or a JSON array (``.json``,
the form of Lhotse's own test fixtures), either optionally gzipped (``.gz``). The conversion is
`speechlm.data.lhotse_adapter.cuts_to_manifest`: a cut trains on its supervised span
(`speechlm.data.lhotse_span`), and a span over part of its recording becomes a file segment
(``start`` locator column, `duration` seconds read from there), so several cuts of one long
recording are several rows over the same file. Multi-channel, URL/memory/command sources, cuts
without supervision (unless they carry prompt fields) and supervisions that overlap or leave their
cut stop the load with the adapter's errors.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa

from speechlm.data.lhotse_adapter import cuts_to_manifest
from speechlm.data.sources.detect import register_source
from speechlm.data.sources.report import SourceReport


@register_source("lhotse_cuts")
def read_lhotse_cuts(
    path: str | os.PathLike[str], *, report: SourceReport, default_lang: str | None = None, **_: Any
) -> pa.Table:
    return cuts_to_manifest(path, default_lang=default_lang)
