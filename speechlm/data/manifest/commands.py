"""The work of `speechlm manifest build | stats | convert` (`speechlm.data.manifest_cli` holds their parsers),
and the texts `speechlm tokenizer train` reads: imported when a command runs, so that pyarrow and the source
readers stay out of `speechlm --help`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speechlm.data.lhotse_adapter import cuts_to_manifest
from speechlm.data.manifest import (
    ManifestError,
    build_manifest,
    format_stats,
    manifest_stats,
    plot_stats,
    read_nemo_manifest,
)
from speechlm.data.manifest.checks import check_utf8
from speechlm.data.manifest.outputs import (
    command_identity,
    owned_outputs,
    prepare_dir,
    prepare_parent,
    write_atomic,
)
from speechlm.data.sources.conversations import read_conversations
from speechlm.data.sources.detect import load_source
from speechlm.data.sources.mmap_cache import open_index
from speechlm.data.sources.report import SourceReport
from speechlm.data.sources.shards import plan_audio


def run_build(args: argparse.Namespace, options: dict[str, float]) -> int:
    """`manifest build`, with `options` the filter flags given (`manifest_cli.HELP_DEFAULTS`' keys)."""
    out = Path(args.out)
    by = command_identity(
        "manifest build",
        args.shards_dir,
        {
            **options,
            "seed": args.seed,
            "skip_bad_shards": args.skip_bad_shards,
            **({"languages": sorted(args.lang)} if args.lang else {}),
        },
    )
    names = ("train.parquet", "val.parquet", "build_report.json")
    with owned_outputs([out / n for n in names], by, overwrite=args.overwrite):
        prepare_dir(args.out)  # an unusable --out fails before any shard is read
        report = build_manifest(
            args.shards_dir,
            args.out,
            seed=args.seed,
            skip_bad_shards=args.skip_bad_shards,
            languages=args.lang,
            **options,
        )
    print(report.format())
    print(f"\nwrote {out / 'train.parquet'}, {out / 'val.parquet'}, {out / 'build_report.json'}")
    return 0


def run_stats(args: argparse.Namespace) -> int:
    if args.plot:
        prepare_parent(args.plot, "--plot")
    stats = manifest_stats(load_source(args.manifest, default_lang=args.lang), where=str(args.manifest))
    print(
        json.dumps(stats, indent=2, ensure_ascii=False)
        if args.json
        else f"{args.manifest}\n{format_stats(stats)}"
    )
    if args.plot:
        fmt = Path(args.plot).suffix[1:] or "png"  # the temporary name has another suffix
        write_atomic(args.plot, lambda tmp: plot_stats(stats, tmp, fmt), "--plot")
        print(f"\nwrote {args.plot}")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    prepare_parent(args.out)
    dropped: dict[str, int] = {}
    try:
        if args.format == "lhotse":
            table = cuts_to_manifest(args.source, default_lang=args.lang, dropped=dropped)
        elif args.format == "conversations":
            table = read_conversations(args.source, report=SourceReport(), default_lang=args.lang)
        else:
            table = read_nemo_manifest(args.source, default_lang=args.lang, dropped=dropped)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not len(table):
        detail = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()))
        raise ManifestError(
            f"{args.source}: no row is left to write (dropped: {detail or 'none'}); fix the transcripts "
            "(every row needs text after cleaning, and a <|xx|> tag, if any, equal to its language)"
        )
    if args.check_audio:
        if "conversation" in table.column_names and table.column("conversation").null_count < len(table):
            raise ManifestError(
                f"{args.source}: --check-audio checks one file per row, but some rows are conversations "
                "whose clips were each found (and their durations read) while converting: leave it out"
            )
        plan_audio(table, None, where=str(args.source))
    write_atomic(args.out, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
    hours = float(sum(table.column("duration").to_numpy())) / 3600
    print(f"wrote {args.out}: {len(table)} rows, {hours:.2f} h")
    if dropped:
        detail = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()))
        print(f"dropped {sum(dropped.values())} rows ({detail})")
    return 0


def read_manifest_text(path: Path) -> tuple[list[str], list[str]]:
    """Return (texts, sorted languages) from the `text` and `lang` columns of a manifest.

    A ``.parquet`` file needs only those two columns; any other manifest the project reads (NeMo
    JSON, Lhotse cuts, a shard folder, ...) goes through the index (`sources.mmap_cache.open_index`).
    A missing or unreadable manifest, a missing column, a null ``lang`` or text that is not UTF-8
    is a ManifestError naming the file (and the row).
    """
    if not path.exists():
        raise ManifestError(
            f"manifest {path} does not exist: pass the train manifest of `speechlm manifest build` "
            "(e.g. OUT/train.parquet) or a NeMo .json / Lhotse cuts file"
        )
    if path.is_file() and path.suffix.lower() == ".parquet":
        try:
            names = pq.read_schema(path).names
            missing = [c for c in ("text", "lang") if c not in names]
            if missing:
                raise ManifestError(
                    f"manifest {path} lacks column(s) {missing} (has {names}): rebuild the manifest"
                )
            table = pq.read_table(path, columns=["text", "lang"])
        except (pa.ArrowException, OSError) as e:
            raise ManifestError(
                f"{path} is not a readable parquet file ({e}); rebuild the manifest"
            ) from None
    else:
        table = open_index(path)
    lang_col = table.column("lang")
    if lang_col.null_count:
        raise ManifestError(
            f"manifest {path}: {lang_col.null_count} row(s) have no lang; fix or rebuild the manifest"
        )
    check_utf8(table.column("text"), f"manifest {path}", "text")
    langs = sorted(str(x) for x in pc.unique(lang_col.cast("string")).to_pylist())
    texts = [t for t in table.column("text").to_pylist() if t]
    return texts, langs
