"""`speechlm shards write`: pack a manifest's audio into tar shards (ours or a NeMo tarred dataset).

    speechlm shards write MANIFEST --out DIR [--shard-size N] [--format speechlm|nemo] [--skip-bad-audio]

The result can be passed wherever a manifest is accepted (`data.train_manifest=DIR`,
`speechlm plan --manifest DIR`). Returns 0; 1 with a one-paragraph error naming the row and its
resolved audio path (missing file, not audio, a duration NaN/Inf/<= 0 or far from the audio
header's); 4 when --out is a file, holds a finished shard set or other files (never overwritten).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("shards", help="pack a manifest's audio into tar shards")
    parser.set_defaults(func=lambda args: (parser.print_help(), 0)[1])
    sub = parser.add_subparsers(dest="shards_command", metavar="SUBCOMMAND")
    write = sub.add_parser("write", help="MANIFEST -> tar shards + index (speechlm or NeMo tarred format)")
    write.add_argument("manifest", metavar="MANIFEST", help="a training manifest (.parquet or NeMo .json)")
    write.add_argument("--out", required=True, metavar="DIR", help="folder for the tars and their index")
    write.add_argument(
        "--shard-size", type=int, default=1000, metavar="N", help="utterances per tar (default 1000)"
    )
    write.add_argument(
        "--format",
        choices=("speechlm", "nemo"),
        default="speechlm",
        help="speechlm: index.parquet + shard-NNNNNN.tar; nemo: a NeMo tarred dataset (default speechlm)",
    )
    write.add_argument(
        "--skip-bad-audio",
        action="store_true",
        help="leave out rows whose file is not audio or whose duration is far from the manifest's "
        "(counted and listed) instead of stopping",
    )
    write.set_defaults(func=run_write)


def run_write(args: argparse.Namespace) -> int:
    from speechlm.data.sources import detect, nemo_tarred, shards  # lazy: pyarrow, soundfile (CLI start-up)

    table = detect.load_source(args.manifest)
    base = Path(args.manifest).resolve().parent
    skipped: list[tuple[int, str, str, str]] = []
    options = {
        "shard_size": args.shard_size,
        "base_dir": base,
        "skip_bad_audio": args.skip_bad_audio,
        "where": str(args.manifest),
    }
    if args.format == "nemo":
        where = nemo_tarred.write_nemo_tarred(table, args.out, skipped=skipped, **options)
    else:
        where = shards.write_shards(table, args.out, skipped=skipped, **options)
    if skipped:
        print(shards.format_skipped(skipped))
    print(
        f"wrote {len(table) - len(skipped)} utterances to {args.out} ({where.name}); train from it with data.train_manifest={args.out}"
    )
    return 0
