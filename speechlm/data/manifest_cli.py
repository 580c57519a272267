"""`speechlm manifest ...`: build a training manifest from shards, print its statistics, convert.

    speechlm manifest build SHARDS_DIR --out OUT_DIR [--min-duration S] [--max-duration S]
                            [--min-quality Q] [--val-fraction F] [--seed N] [--skip-bad-shards] [--overwrite]
    speechlm manifest stats MANIFEST [--plot FILE.png] [--json]
    speechlm manifest convert NEMO_JSONL --out FILE.parquet [--lang xx] [--format nemo|lhotse|conversations]
        [--check-audio]

Each subcommand returns 0 on success, 1 with a one-paragraph error (no traceback) when the data
is unusable (`ManifestError`), 4 when an output (`--out`, `--plot`) cannot be written (`OutputError`);
outputs are written under a temporary name and renamed. `build` replaces only what it wrote itself
with the same inputs (`speechlm.data.manifest.outputs.owned_outputs`; `--overwrite`: what any speechlm
command wrote), never a file of yours. Rows a converter drops (empty text, a tag
that disagrees with the language) are counted and printed. The work is in
`speechlm.data.manifest.commands`, imported when a command runs (pyarrow stays out of `speechlm --help`).
"""

from __future__ import annotations

import argparse
import sys

# shown in --help without importing pyarrow; tests check them against speechlm.data.manifest.DEFAULT_*
HELP_DEFAULTS = {"min_duration": 0.5, "max_duration": 20.0, "min_quality": 0.5, "val_fraction": 0.05}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``manifest`` and its subcommands on the top-level `speechlm` parser."""
    parser = subparsers.add_parser("manifest", help="build, inspect and convert training manifests")
    parser.set_defaults(func=lambda args: _print_help(parser))
    sub = parser.add_subparsers(dest="manifest_command", metavar="SUBCOMMAND")

    build = sub.add_parser("build", help="shards (metadata + audio index parquet) -> train/val parquet")
    build.add_argument("shards_dir", metavar="SHARDS_DIR", help="folder with one sub-folder per shard")
    build.add_argument("--out", required=True, metavar="OUT_DIR", help="where train/val.parquet go")
    build.add_argument(
        "--min-duration",
        type=float,
        metavar="S",
        help=f"drop clips shorter than S seconds (default {HELP_DEFAULTS['min_duration']})",
    )
    build.add_argument(
        "--max-duration",
        type=float,
        metavar="S",
        help=f"drop clips longer than S seconds (default {HELP_DEFAULTS['max_duration']})",
    )
    build.add_argument(
        "--min-quality",
        type=float,
        metavar="Q",
        help=f"drop rows with tx_quality_score < Q (default {HELP_DEFAULTS['min_quality']})",
    )
    build.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="fraction of each language held out for validation, among the rows whose metadata has no "
        f"'split' value (default {HELP_DEFAULTS['val_fraction']})",
    )
    build.add_argument(
        "--seed", type=int, default=0, metavar="N", help="salt of the train/val hash (default 0)"
    )
    build.add_argument(
        "--lang",
        action="append",
        metavar="xx",
        help="keep only rows of this language (repeat for several; default: every language); the others "
        "are counted as other_language in the report",
    )
    build.add_argument(
        "--skip-bad-shards",
        action="store_true",
        help="build without unusable shards (listed in the report) instead of failing",
    )
    add_overwrite_argument(build)
    build.set_defaults(func=run_build)

    stats = sub.add_parser("stats", help="hours and utterances per language, duration histogram")
    stats.add_argument(
        "manifest",
        metavar="MANIFEST",
        help=".parquet manifest, NeMo .json/.jsonl, Lhotse cuts file (any form CutSet.to_file "
        "writes; prints the seconds no supervision covers), or a shard folder",
    )
    stats.add_argument("--plot", metavar="FILE.png", help="also save a plot")
    stats.add_argument("--lang", metavar="xx", help="language of NeMo lines without one")
    stats.add_argument("--json", action="store_true", help="print the statistics as JSON")
    stats.set_defaults(func=run_stats)

    convert = sub.add_parser("convert", help="NeMo JSON lines (or Lhotse cuts) -> manifest parquet")
    convert.add_argument(
        "source",
        metavar="NEMO_JSONL",
        help="NeMo manifest, a Lhotse cuts file (.json/.jsonl, optionally .gz) with --format lhotse, or with --format conversations NeMo "
        "multimodal-conversation / ShareGPT JSON(L) or its tarred folder (docs/data.md)",
    )
    convert.add_argument("--out", required=True, metavar="FILE.parquet", help="output manifest")
    convert.add_argument("--lang", metavar="xx", help="language of lines (cuts) that have none")
    convert.add_argument(
        "--format",
        choices=("nemo", "lhotse", "conversations"),
        default="nemo",
        help="input format (default nemo)",
    )
    convert.add_argument(
        "--check-audio",
        action="store_true",
        help="read every audio file's header: refuse a missing or non-audio file, or a duration far "
        "from the file's (the checks of `speechlm shards write`)",
    )
    convert.set_defaults(func=run_convert)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _fail(error: Exception) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 1


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace outputs another speechlm command (or other settings) wrote there; files speechlm did not "
        "write are never replaced",
    )


def run_build(args: argparse.Namespace) -> int:
    from speechlm.data.manifest import commands  # lazy: pyarrow (CLI start-up)

    return commands.run_build(
        args, {k: getattr(args, k) for k in HELP_DEFAULTS if getattr(args, k) is not None}
    )


def run_stats(args: argparse.Namespace) -> int:
    from speechlm.data.manifest import commands  # lazy: pyarrow (CLI start-up)

    return commands.run_stats(args)


def run_convert(args: argparse.Namespace) -> int:
    from speechlm.data.manifest import commands  # lazy: pyarrow (CLI start-up)

    return commands.run_convert(args)
