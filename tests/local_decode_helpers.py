"""A demo manifest with a clip whose header reads and whose decode fails (`speechlm.data.local_decode` tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import soundfile as sf

from speechlm.data.sources.detect import load_source


def nan_clip_table(demo_data: dict, tmp_path: Path) -> pa.Table:
    """The demo table whose row 0's audio is a float WAV holding a NaN: its header reads, its decode fails."""
    table = load_source(demo_data["train"])
    bad = tmp_path / "nan.wav"
    x = np.zeros(int(float(table.column("duration")[0].as_py()) * 16000), np.float32)
    x[100] = np.nan
    sf.write(bad, x, 16000, subtype="FLOAT")
    paths = table.column("audio_filepath").to_pylist()
    paths[0] = str(bad)
    cols = {n: table.column(n) for n in table.column_names}
    cols["audio_filepath"] = pa.chunked_array([pa.array(paths, table.column("audio_filepath").type)])
    for n in ("tar_path", "member_offset", "member_nbytes", "header_bytes", "offset"):
        if n in cols:  # row 0 is a plain file now
            vals = cols[n].to_pylist()
            vals[0] = None
            cols[n] = pa.chunked_array([pa.array(vals, cols[n].type)])
    return pa.table(cols, metadata=table.schema.metadata)
