"""Lhotse cuts files (``.jsonl.gz`` / ``.jsonl``) as a data source, offsets and multi-cut recordings included.

The conversion is `speechlm.data.lhotse_adapter.cuts_to_manifest`: a cut over part of its recording
becomes a file segment (``start`` locator column, `duration` seconds read from there), so several
cuts of one long recording are several rows over the same file. Multi-channel, URL/memory/command
sources and cuts with other than one supervision stop the load with the adapter's errors.
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
