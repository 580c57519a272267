"""Training manifests: one parquet row per utterance, built from raw shards, NeMo or Lhotse.

One concern per module:
- `schema`: `MANIFEST_SCHEMA` (the columns and their types), `ManifestError`, and
  `build_manifest_table`, which assembles columns into that schema;
- `load`: `read_parquet_manifest` (a parquet manifest checked against the schema; any path goes
  through `speechlm.data.sources.detect.load_source`),
  `manifest_arrays` / `ManifestArrays` (per-row numbers as flat numpy arrays), and the checked
  reading of shard parquet files;
- `build`: `build_manifest`, raw shards -> ``train.parquet``, ``val.parquet`` and
  ``build_report.json`` (shard listing and reading, filters, text cleaning);
- `report`: `BuildReport` and `DROP_REASONS`, what a build kept and dropped;
- `split`: the train/val split: a shard's optional ``split`` column (`split_codes`, `SPLIT_VALUES`),
  else a stable hash of ``segment_id`` (`hash_uniform`, `split_val`);
- `nemo`: `read_nemo_manifest`;
- `stats`: `manifest_stats`, `format_stats`, `plot_stats`;
- `checks`: row checks the data tools share (`check_durations`: NaN/Inf/<= 0; `check_utf8`);
- `outputs`: output folders and files of the data tools (`OutputError` naming the path, written
  under a temporary name and renamed).

Imports run one way: nemo uses schema; load uses schema; split uses schema; build uses
schema, load, report and split; stats uses load and report. None of them imports torch.
"""

from speechlm.data.manifest.build import (
    DEFAULT_MAX_DURATION,
    DEFAULT_MIN_DURATION,
    DEFAULT_MIN_QUALITY,
    DEFAULT_VAL_FRACTION,
    INDEX_COLUMNS,
    INDEX_OPTIONAL_COLUMNS,
    METADATA_COLUMNS,
    METADATA_OPTIONAL_COLUMNS,
    build_manifest,
    clean_text_column,
    list_shards,
    shard_language,
)
from speechlm.data.manifest.load import (
    NOT_NULL_COLUMNS,
    ManifestArrays,
    manifest_arrays,
    read_parquet_manifest,
)
from speechlm.data.manifest.nemo import read_nemo_manifest
from speechlm.data.manifest.report import DROP_REASONS, UNKNOWN_LANG, BuildReport
from speechlm.data.manifest.schema import (
    LOCATOR_SCHEMA,
    MANIFEST_SCHEMA,
    Column,
    ManifestError,
    build_manifest_table,
)
from speechlm.data.manifest.split import SPLIT_VALUES, hash_uniform, split_codes, split_val
from speechlm.data.manifest.stats import format_stats, manifest_stats, plot_stats

__all__ = [
    "DEFAULT_MAX_DURATION",
    "DEFAULT_MIN_DURATION",
    "DEFAULT_MIN_QUALITY",
    "DEFAULT_VAL_FRACTION",
    "DROP_REASONS",
    "INDEX_COLUMNS",
    "INDEX_OPTIONAL_COLUMNS",
    "LOCATOR_SCHEMA",
    "MANIFEST_SCHEMA",
    "METADATA_COLUMNS",
    "METADATA_OPTIONAL_COLUMNS",
    "NOT_NULL_COLUMNS",
    "SPLIT_VALUES",
    "UNKNOWN_LANG",
    "BuildReport",
    "Column",
    "ManifestArrays",
    "ManifestError",
    "build_manifest",
    "build_manifest_table",
    "clean_text_column",
    "format_stats",
    "hash_uniform",
    "list_shards",
    "manifest_arrays",
    "manifest_stats",
    "plot_stats",
    "read_nemo_manifest",
    "read_parquet_manifest",
    "shard_language",
    "split_codes",
    "split_val",
]
