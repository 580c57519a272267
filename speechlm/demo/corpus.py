"""The demo corpus synthesized at demo time: thousands of utterances in five languages, with a held-out split.

`speechlm demo` (and ``speechlm demo corpus``) speaks sentences drawn from the demo vocabularies (`VOCAB`,
47-50 common words per language in the native script) with libespeak-ng through ctypes. The library and its
voice data come inside the ``espeakng-loader`` wheel (espeak-ng 1.52; GPL-3.0-or-later, loaded at run
time, never linked into speechlm), so nothing is installed with apt.

Every utterance gets its own voice variant (`VARIANTS`: the language's voice with one of espeak's male
and female variants), speaking rate, pitch and pitch range, a random gain and light white noise (SNR
20-40 dB), and is written as 16 kHz mono 16-bit FLAC into the raw-shard layout `speechlm manifest build`
reads (data/demo/README.md): ``<out>/<lang>_<NNN>/metadata.parquet``, ``audio_index.parquet`` and
``audio/<segment_id>.flac``.

**The held-out split tests generalisation.** For each language the ordered word pairs are split once,
by the seed, into training pairs and held-out pairs (`HELDOUT_PAIR_FRACTION` of them). A training
sentence is a random walk over training pairs only, a held-out sentence a walk over held-out pairs only,
so no held-out sentence, and no pair of adjacent words in one, occurs in training; every word still
occurs in both (the coverage is counted and printed). Held-out rows live in their own shards
(``<lang>_heldout``) and carry ``split = "val"`` in their metadata (training rows ``"train"``), so the
manifest build puts exactly them in ``val.parquet``.

**Bad rows.** The training shards carry the same deliberately bad rows as the bundled corpus
(`BAD_ROWS`: too short, too long, low quality, blank/null text, missing index entry, duplicate id,
undecodable audio), which the manifest build and the loader must drop and count.

**Deterministic and cached.** Texts, voices, rates, pitches, noise and bad rows depend only on the seed;
the audio bytes also on the espeak-ng build, which the pinned ``espeakng-loader`` version fixes. espeak-ng
keeps state from one utterance to the next inside a process, so each shard is synthesized in a fresh
process (two at a time). The corpus is written to ``<out>.partial`` and renamed into place, with
``corpus.json`` (settings, versions, counts) written last: a second run with the same settings finds
it and synthesizes nothing; an interrupted run (SIGTERM, SIGKILL, a full disk) leaves only the
``.partial`` folder, which the next run removes and rebuilds; a write that fails (a read-only or full
disk) removes it and is an OutputError naming the path (exit 4). ``corpus.json`` records every file's
size and the sha256 of the shard tables: a cached corpus with a file missing, truncated or changed is
named and synthesized again (an audio file changed in place at the same size is not detected; the
loader drops it as undecodable). A folder that is not a generated corpus (no ``corpus.json``) is never
overwritten.

The modules: `vocabulary` (the words, sentences, bad rows and settings), `synthesis` (libespeak-ng, one
utterance at a time), `writing` (the shards, the stamp, the cache); this one is the command line.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from speechlm.demo.vocabulary import LANG_SHARES, CorpusSettings
from speechlm.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = CorpusSettings()
    p.add_argument(
        "--utterances", type=int, default=d.utterances, help="valid training utterances (default %(default)s)"
    )
    p.add_argument(
        "--heldout",
        type=int,
        default=d.heldout,
        help="held-out utterances per language (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of texts, voices and noise (default %(default)s)"
    )
    p.add_argument(
        "--sentences",
        type=int,
        default=d.sentences,
        help="distinct training sentences over all languages, each spoken several times in different voices; "
        "0: every training utterance is a new sentence (default %(default)s)",
    )


def settings_of(args: argparse.Namespace) -> CorpusSettings:
    if args.utterances < len(LANG_SHARES) or args.heldout < 0:
        raise UsageError(
            f"--utterances {args.utterances} --heldout {args.heldout}: give at least {len(LANG_SHARES)} training "
            "utterances (one per language) and 0 or more held-out ones"
        )
    return CorpusSettings(
        utterances=args.utterances,
        heldout=args.heldout,
        seed=args.seed,
        sentences=args.sentences,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speechlm demo corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="data/demo_corpus", help="output folder (default %(default)s)")
    add_arguments(p)
    args = p.parse_args(argv)
    from speechlm.demo.writing import generate_corpus  # lazy: soundfile, soxr, pyarrow (CLI start-up)

    generate_corpus(args.corpus, settings_of(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
