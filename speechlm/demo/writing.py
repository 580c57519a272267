"""The demo corpus written (`speechlm.demo.corpus`): shards synthesized two at a time, stamped, cached.

The corpus is written in the raw-shard layout `speechlm manifest build` reads (data/demo/README.md):
``<out>/<lang>_<NNN>/metadata.parquet``, ``audio_index.parquet`` and ``audio/<segment_id>.flac``, each
language's training utterances in shards of `SHARD_UTTERANCES`, then its held-out shard. Each shard is
synthesized in a fresh process (espeak-ng keeps state). The corpus is written to ``<out>.partial`` and
renamed into place, with `STAMP` (settings, versions, counts, every file's size and the shard tables'
sha256) written last; `cached` finds a complete, undamaged corpus made with the same settings.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from speechlm.demo.synthesis import TARGET_SR, Espeak, espeak_version, flac_bytes, utterance
from speechlm.demo.vocabulary import (
    BAD_ROWS,
    LANG_SHARES,
    VOCAB,
    BadRow,
    CorpusSettings,
    decorate,
    pair_graphs,
    sentence_length,
    walk,
)
from speechlm.errors import OutputError, UsageError
from speechlm.io import sha256_of

GENERATOR_VERSION = 1  # bump when a change alters the bytes for a seed
SHARD_UTTERANCES = 500  # valid training utterances per shard


@dataclass(frozen=True)
class ShardJob:
    name: str  # <lang>_<NNN> or <lang>_heldout
    lang: str
    split: str  # "train" or "val"
    valid: int
    seed: int
    bad: tuple[BadRow, ...] = ()  # the rows of BAD_ROWS in this shard
    pool: int = 0  # distinct training sentences of the language (0: every utterance a new one)


def shard_jobs(settings: CorpusSettings) -> list[ShardJob]:
    """The shards of the corpus: each language's training utterances in shards of `SHARD_UTTERANCES`,
    then its held-out shard; every bad row of `BAD_ROWS` in its named shard (or the language's last one
    when the corpus has fewer shards)."""
    jobs: list[ShardJob] = []
    for lang, share in LANG_SHARES.items():
        total = max(1, round(settings.utterances * share))
        n_shards = -(-total // SHARD_UTTERANCES)
        names = [f"{lang}_{i:03d}" for i in range(n_shards)]
        bad: dict[str, list[BadRow]] = {}
        for b in BAD_ROWS:
            if b.shard.split("_")[0] == lang:
                name = b.shard if b.shard in names else names[-1]
                bad.setdefault(name, []).append(b)
        pool = max(1, round(settings.sentences * share)) if settings.sentences else 0
        for i, name in enumerate(names):
            valid = total // n_shards + (i < total % n_shards)
            jobs.append(ShardJob(name, lang, "train", valid, settings.seed, tuple(bad.get(name, ())), pool))
        if settings.heldout > 0:
            jobs.append(ShardJob(f"{lang}_heldout", lang, "val", settings.heldout, settings.seed))
    return jobs


def write_shard(job: ShardJob, root: str) -> dict[str, Any]:
    """Synthesize one shard into `root`/<name> (runs in a fresh process: espeak-ng keeps state)."""
    tts = Espeak()
    sdir = Path(root) / job.name
    (sdir / "audio").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{job.seed}/{job.name}")
    successors = pair_graphs(job.lang, job.seed)[job.split]
    meta: list[dict[str, Any]] = []
    index: list[dict[str, Any]] = []
    words_seen: list[str] = []
    seconds = 0.0

    def add(seg: str, text: str | None, audio_bytes: bytes | None, dur: float, q: float, lang: str | None):
        meta.append(
            {
                "segment_id": seg,
                "transcription_native": text,
                "duration_s": dur,
                "tx_quality_score": q,
                "segment_language": lang,
                "split": job.split,
            }
        )
        if audio_bytes is not None:
            member = f"audio/{seg}.flac"
            (sdir / member).write_bytes(audio_bytes)
            index.append({"segment_id": seg, "tar_member_name": member})

    sentence_pool: list[list[str]] = []
    if job.pool:  # the language's distinct sentences, the same in each of its shards
        pool_rng = random.Random(f"{job.seed}/{job.lang}/pool")
        sentence_pool = [
            walk(pool_rng, job.lang, sentence_length(pool_rng, job.lang), successors) for _ in range(job.pool)
        ]
    for i in range(job.valid):
        if sentence_pool:
            words = rng.choice(sentence_pool)
        else:
            words = walk(rng, job.lang, sentence_length(rng, job.lang), successors)
        words_seen += words
        text, spoken = decorate(rng, job.lang, words)
        audio = utterance(tts, rng, job.lang, spoken)
        seconds += audio.size / TARGET_SR
        # a few rows leave the language null: the reader falls back to the shard name's prefix
        null_lang = job.split == "train" and i % 17 == 5
        q = round(rng.uniform(0.6, 1.0), 3)
        add(
            f"{job.name}_{i:05d}",
            text,
            flac_bytes(audio),
            audio.size / TARGET_SR,
            q,
            None if null_lang else job.lang,
        )

    for j, b in enumerate(job.bad):
        kind = b.kind
        seg = f"{job.name}_{job.valid + j:05d}"
        text, spoken = decorate(rng, job.lang, walk(rng, job.lang, 4, successors))
        q = float(b.params.get("q", round(rng.uniform(0.6, 1.0), 3)))
        text = b.params.get("text", text)
        if kind == "duplicate":
            meta.append(dict(meta[0]))  # an exact copy of the shard's first row
            continue
        if kind == "long":
            parts: list[Any] = []
            while sum(p.size for p in parts) < b.params["dur"] * TARGET_SR:
                t, s = decorate(rng, job.lang, walk(rng, job.lang, 6, successors))
                parts.append(utterance(tts, rng, job.lang, s))
                text += " " + t
            audio = np.concatenate(parts)[: int(b.params["dur"] * TARGET_SR)]
            data, dur = flac_bytes(audio), audio.size / TARGET_SR
        elif kind == "random_bytes":
            data, dur = b"\0" + rng.randbytes(5999), 2.5
        else:
            audio = utterance(tts, rng, job.lang, spoken)
            if kind == "short":
                audio = audio[: int(b.params["dur"] * TARGET_SR)]
            data, dur = flac_bytes(audio), audio.size / TARGET_SR
            if kind == "truncated_flac":
                data = data[:100]
        add(seg, text, None if kind == "no_audio_index" else data, float(dur), q, job.lang)

    write_shard_tables(sdir, meta, index, split_column=True)
    return {
        "name": job.name,
        "lang": job.lang,
        "split": job.split,
        "valid": job.valid,
        "bad": [b.kind for b in job.bad],
        "seconds": round(seconds, 2),
        "files": len(index),
        "words": words_seen,
    }


def write_shard_tables(
    sdir: Path, meta: list[dict[str, Any]], index: list[dict[str, Any]], *, split_column: bool
) -> None:
    """A shard's ``metadata.parquet`` (with the ``split`` column when asked) and ``audio_index.parquet``."""
    columns = [
        ("segment_id", pa.string()),
        ("transcription_native", pa.string()),
        ("duration_s", pa.float64()),
        ("tx_quality_score", pa.float64()),
        ("segment_language", pa.string()),
    ]
    meta_schema = pa.schema(columns + ([("split", pa.string())] if split_column else []))
    index_schema = pa.schema([("segment_id", pa.string()), ("tar_member_name", pa.string())])
    pq.write_table(pa.Table.from_pylist(meta, schema=meta_schema), sdir / "metadata.parquet")
    pq.write_table(pa.Table.from_pylist(index, schema=index_schema), sdir / "audio_index.parquet")


def _write_shard_star(args: tuple[ShardJob, str]) -> dict[str, Any]:
    return write_shard(*args)


STAMP = "corpus.json"


def stamp_key(settings: CorpusSettings, version: str) -> dict[str, Any]:
    return {
        "generator_version": GENERATOR_VERSION,
        "espeak_ng": version,
        **asdict(settings),
    }


def record_files(root: Path) -> dict[str, Any]:
    """Every file under `root` (the stamp aside) with its size, and the sha256 of the shard tables: what
    `damage` compares a cached corpus with (a stat per file, the small tables read)."""
    files = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    files.pop(STAMP, None)
    tables = {name: sha256_of(root / name) for name in files if name.endswith(".parquet")}
    return {"sizes": files, "tables_sha256": tables}


def damage(out: Path, stamp: dict[str, Any]) -> str | None:
    """Why the corpus in `out` is not what its stamp says was written (a file missing, truncated or
    changed), or None when it is whole."""
    recorded = stamp.get("files")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sizes"), dict):
        return f"{out / STAMP} records no file sizes (written by an older speechlm)"
    for name, size in recorded["sizes"].items():
        path = out / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} when it was written"
    for name, sha in recorded.get("tables_sha256", {}).items():
        if sha256_of(out / name) != sha:
            return f"{out / name} changed since it was written"
    return None


def cached(out: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The stamp of a complete, undamaged corpus in `out` made with `key`, else None (a damaged one is
    named: it is synthesized again)."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or stamp.get("key") != key:
        return None
    why = damage(out, stamp)
    if why is not None:
        print(f"demo corpus: {out} is damaged ({why}): synthesizing it again", flush=True)
        return None
    return stamp


def coverage(shards: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per language: held-out sentences' words, the share of them that occur in training, and the number
    of held-out adjacent pairs seen in training (0 by construction)."""
    out: dict[str, dict[str, Any]] = {}
    for lang in LANG_SHARES:
        train = [w for s in shards if s["lang"] == lang and s["split"] == "train" for w in s["words"]]
        val = [w for s in shards if s["lang"] == lang and s["split"] == "val" for w in s["words"]]
        known = set(train)
        out[lang] = {
            "vocabulary": len(VOCAB[lang]),
            "train_words_used": len(known),
            "heldout_word_tokens": len(val),
            "heldout_word_coverage": round(sum(w in known for w in val) / len(val), 4) if val else None,
        }
    return out


def generate_corpus(
    out: str | os.PathLike[str], settings: CorpusSettings, *, workers: int = 2
) -> dict[str, Any]:
    """Synthesize the corpus into `out` unless an identical one is there; return its stamp (module doc)."""
    out = Path(out)
    version = espeak_version()
    key = stamp_key(settings, version)
    stamp = cached(out, key)
    if stamp is not None:
        print(f"demo corpus: {out} is up to date ({stamp['summary']}), nothing to synthesize", flush=True)
        return stamp
    if out.exists() and not (out / STAMP).is_file() and any(out.iterdir()):
        raise UsageError(
            f"{out} exists and is not a generated demo corpus (no {STAMP}); refusing to replace it: "
            "pass another --corpus folder, or remove it"
        )
    partial = out.with_name(out.name + ".partial")
    try:
        stamp = synthesize(out, partial, settings, key, workers)
    except OSError as e:  # a read-only or full disk: nothing half-written is left under --corpus
        shutil.rmtree(partial, ignore_errors=True)
        raise OutputError(
            f"cannot write the demo corpus --corpus {out} ({e.filename or partial}: {e.strerror or e}); "
            "pass a --corpus folder on a disk you can write to, with room for it"
        ) from None
    print_summary(stamp)
    return stamp


def synthesize(
    out: Path, partial: Path, settings: CorpusSettings, key: dict[str, Any], workers: int
) -> dict[str, Any]:
    """Write the corpus into `partial`, stamp it and rename it to `out` (module doc); its stamp."""
    version = key["espeak_ng"]
    if partial.exists():
        print(f"demo corpus: removing {partial}, left by an interrupted run", flush=True)
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    jobs = shard_jobs(settings)
    n_utts = sum(j.valid + len(j.bad) for j in jobs)
    print(
        f"demo corpus: synthesizing {n_utts} utterances ({settings.utterances} training, {settings.heldout} "
        f"held-out per language, seed {settings.seed}) with libespeak-ng {version} into {out}",
        flush=True,
    )
    start = time.perf_counter()
    shards: list[dict[str, Any]] = []
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(max(1, workers), maxtasksperchild=1) as pool:
        for done in pool.imap(_write_shard_star, [(j, str(partial)) for j in jobs]):
            shards.append(done)
            utts = sum(s["valid"] + len(s["bad"]) for s in shards)
            print(
                f"  {done['name']:<11} {done['valid']:>5} utterances, {done['seconds'] / 60:5.1f} min"
                f"   [{utts}/{n_utts}, {time.perf_counter() - start:.0f} s]",
                flush=True,
            )
    cover = coverage(shards)
    summary = {
        "train_utterances": sum(s["valid"] for s in shards if s["split"] == "train"),
        "heldout_utterances": sum(s["valid"] for s in shards if s["split"] == "val"),
        "bad_rows": sum(len(s["bad"]) for s in shards),
        "train_hours": round(sum(s["seconds"] for s in shards if s["split"] == "train") / 3600, 3),
        "heldout_hours": round(sum(s["seconds"] for s in shards if s["split"] == "val") / 3600, 3),
    }
    stamp = {
        "key": key,
        "summary": summary,
        "coverage": cover,
        "shards": [{k: v for k, v in s.items() if k != "words"} for s in shards],
        "seconds_to_generate": round(time.perf_counter() - start, 1),
    }
    stamp["files"] = record_files(partial)
    (partial / STAMP).write_text(json.dumps(stamp, indent=2, ensure_ascii=False))
    if out.exists():
        shutil.rmtree(out)  # an older generated corpus (it has a stamp): replaced
    partial.rename(out)
    return stamp


def print_summary(stamp: dict[str, Any]) -> None:
    s = stamp["summary"]
    print(
        f"demo corpus: {s['train_utterances']} training utterances ({s['train_hours']:.2f} h), "
        f"{s['heldout_utterances']} held-out ({s['heldout_hours']:.2f} h), {s['bad_rows']} bad rows; "
        f"{stamp['seconds_to_generate']:.0f} s",
        flush=True,
    )
    print(
        "held-out word coverage (share of held-out words that occur in training; no held-out word pair does):"
    )
    for lang, c in stamp["coverage"].items():
        cov = c["heldout_word_coverage"]
        print(
            f"  {lang}  {'-' if cov is None else f'{100 * cov:.1f}%':>6} of {c['heldout_word_tokens']} words"
            f"  ({c['train_words_used']}/{c['vocabulary']} vocabulary words in training)",
            flush=True,
        )


def digest(folder: str | os.PathLike[str]) -> str:
    """sha256 over every file's relative path and bytes (the determinism check)."""
    h = hashlib.sha256()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.name == STAMP:
            continue  # holds the time it took
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()
