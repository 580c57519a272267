"""`speechlm demo`: the Quick start's main job on a demo corpus synthesized here.

synthesize the corpus (thousands of utterances in five languages with a held-out split whose sentences
never occur in training, `speechlm.demo.corpus`; cached, so a second run reuses it) → build the manifest
→ train the tokenizer → print the epoch plan → train `configs/demo.yaml` on transcription → print the
held-out and the training-split WER per language (eval.json and learning_curve.png in the run directory).
`--with-ast` adds the translation task (speech to English gloss on the hi/bn/ta/te clips,
`speechlm.demo.tasks`) and trains the ASR + AST mix, printing BLEU/chrF beside WER.
Each step is the same command a user would run by hand; they are printed before they run.

`speechlm demo corpus [--corpus DIR] [--utterances N] [--heldout N] [--seed S]` only synthesizes the corpus.
`--shards data/demo/shards` trains on the small bundled corpus instead (231 utterances, the tests' corpus).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from speechlm.cli import main as speechlm_main
from speechlm.demo import corpus as demo_corpus
from speechlm.demo.vocabulary import CorpusSettings
from speechlm.errors import run_guarded

REPO = Path(__file__).resolve().parents[2]
DEMO_VOCAB_SIZE = 300  # docs/training.md, the demo: what the tokenizer's size does to 10 CPU minutes


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="build, plan and train on the bundled demo corpus (the Quick start)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--shards",
        default=None,
        help="raw shard folder to build the manifest from instead of the synthesized corpus (e.g. the small "
        "bundled data/demo/shards)",
    )
    p.add_argument(
        "--corpus",
        default="data/demo_corpus",
        help="where the synthesized corpus goes, and is found again by a second run (default: %(default)s)",
    )
    demo_corpus.add_arguments(p)
    p.add_argument(
        "--out", default="data/demo_manifest", help="manifest and tokenizer directory (default: %(default)s)"
    )
    p.add_argument(
        "--config",
        default=str(REPO / "configs/demo.yaml"),
        help="training config; its data paths are replaced by the ones built in --out "
        "(default: configs/demo.yaml)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEMO_VOCAB_SIZE,
        help="pieces of the demo's tokenizer (default: %(default)s, about one piece per character: the CTC head "
        "leaves its blank plateau within 250 steps, where 500 pieces took 450-600 and whole words over 1,800)",
    )
    p.add_argument("--no-train", action="store_true", help="stop after printing the plan")
    p.add_argument(
        "--with-ast",
        action="store_true",
        help="add the translation task and train the ASR + AST mix (the default of issue 23; in 10 CPU minutes "
        "two tasks leave transcription far behind: docs/training.md)",
    )
    p.add_argument(
        "--asr-only",
        action="store_true",
        help="transcription only: the default since issue 24 (kept for scripts)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides for the training config; `speechlm demo corpus ...` only synthesizes the corpus",
    )
    p.set_defaults(func=run_demo)


def _run(argv: list[str]) -> int:
    print("\n$ speechlm " + " ".join(argv), flush=True)
    return speechlm_main(argv)


def demo_outputs(out: Path, mix_file: str | None) -> list[Path]:
    """The files the demo writes in `--out` (manifest, tokenizer; with AST, `mix_file` given, the task
    manifests and the mix)."""
    names = ["train.parquet", "val.parquet", "build_report.json"]
    names += [f"tokenizer{suffix}" for suffix in (".model", ".vocab", ".json")]
    if mix_file is not None:
        names += ["ast_train.parquet", "ast_val.parquet", "val_tasks.parquet", mix_file]
    return [out / n for n in names]


def run_demo(args: argparse.Namespace) -> int:
    from speechlm.data.manifest.outputs import check_replaceable, owned_outputs  # lazy: pyarrow (CLI)
    from speechlm.demo import tasks, writing  # lazy: pyarrow, soundfile, soxr (CLI start-up)

    corpus_only = args.overrides == ["corpus"]  # `speechlm demo corpus [--corpus ...]` (an override has "=")
    out = Path(args.out)
    with_ast = args.with_ast and not args.asr_only
    outputs = demo_outputs(out, tasks.MIX_FILE if with_ast else None)
    if not corpus_only:
        # before any work: a file of the user's in --out is never replaced; what speechlm wrote there
        # (an earlier demo, a manifest build) is, so the sub-commands below run with --overwrite
        check_replaceable(outputs, "demo", overwrite=True)
    shards = args.shards
    if shards is None or corpus_only:
        settings = demo_corpus.settings_of(args)
        print(
            f"\n$ speechlm demo corpus --corpus {args.corpus} --utterances {settings.utterances} "
            f"--heldout {settings.heldout} --seed {settings.seed}",
            flush=True,
        )
        rc = run_guarded(lambda: writing.generate_corpus(args.corpus, settings) is None)
        if rc or corpus_only:
            return rc
        shards = args.corpus
    rc = _run(["manifest", "build", shards, "--out", str(out), "--overwrite"])
    if rc:
        return rc
    rc = _run(
        [
            "tokenizer",
            "train",
            "--manifest",
            str(out / "train.parquet"),
            "--out",
            str(out / "tokenizer"),
            "--vocab-size",
            str(args.vocab_size),
            "--overwrite",
        ]
    )
    if rc:
        return rc
    if not with_ast:
        data = [f"data.train_manifest={out / 'train.parquet'}", f"data.val_manifest={out / 'val.parquet'}"]
        plan_data = ["--manifest", str(out / "train.parquet")]
    else:

        def write_tasks() -> int:
            with owned_outputs(outputs[-4:], "demo --with-ast", overwrite=True):
                return tasks.main([str(out)])

        print(f"\n$ python -m speechlm.demo.tasks {out}", flush=True)
        rc = run_guarded(write_tasks)
        if rc:
            return rc
        # the ASR + AST mix trains; validation and the final evaluation score both tasks
        data = [
            "data.train_manifest=null",
            f"data.input_cfg={out / tasks.MIX_FILE}",
            f"data.val_manifest={out / 'val_tasks.parquet'}",
        ]
        plan_data = ["--input-cfg", str(out / tasks.MIX_FILE)]
    rc = _run(["plan", "--config", args.config, *plan_data])
    if rc or args.no_train:
        return rc
    overrides = [
        # a second `speechlm demo` moves the first run aside (RUN_DIR.old-<time>, printed), never deletes it
        "trainer.overwrite=true",
        *data,
        f"data.tokenizer={out / 'tokenizer.model'}",
        *args.overrides,
    ]
    rc = _run(["train", args.config, *overrides])
    if rc or with_ast:
        return rc
    # the CTC head alone on the held-out split, beside the final table's LLM-alone and joint WERs
    from speechlm.config.load import load_config  # lazy: the config loader (CLI start-up)

    run_dir = load_config(args.config, overrides).trainer.run_dir
    return _run(["evaluate", str(run_dir), "--manifest", str(out / "val.parquet"), "--ctc-weight", "1"])


if __name__ == "__main__":
    sys.exit(
        run_demo(
            argparse.Namespace(
                shards=None,
                corpus="data/demo_corpus",
                utterances=CorpusSettings().utterances,
                heldout=CorpusSettings().heldout,
                seed=CorpusSettings().seed,
                sentences=CorpusSettings().sentences,
                out="data/demo_manifest",
                vocab_size=DEMO_VOCAB_SIZE,
                config=str(REPO / "configs/demo.yaml"),
                no_train=False,
                asr_only=False,
                with_ast=False,
                overrides=[],
            )
        )
    )
