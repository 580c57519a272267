"""Training manifests: shard build, filters, split, report, errors, readers, stats, CLI."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st

from speechlm.data import manifest as m
from speechlm.data.manifest import (
    DROP_REASONS,
    MANIFEST_SCHEMA,
    ManifestError,
    build_manifest,
    hash_uniform,
    manifest_arrays,
    manifest_stats,
    plot_stats,
    read_nemo_manifest,
    split_val,
)
from speechlm.data.sources.detect import load_source
from speechlm.data.text import clean_text

SR = 16000


def write_audio(path: Path, seconds: float = 0.05) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(SR * seconds)) / SR
    sf.write(path, (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), SR)


def row(
    seg: str, text: str = "नमस्ते दुनिया।", duration: Any = 2.0, quality: Any = 0.9, lang: Any = None
) -> dict:
    return {
        "segment_id": seg,
        "transcription_native": text,
        "duration_s": duration,
        "tx_quality_score": quality,
        "segment_language": lang,
    }


def make_shard(
    root: Path,
    name: str,
    rows: list[dict],
    *,
    indexed: list[str] | None = None,
    legacy_tar: str | None = None,
    audio: bool = True,
) -> Path:
    """Write <root>/<name>/{metadata,audio_index}.parquet (+ tiny FLAC files) in the raw shard layout."""
    shard = root / name
    shard.mkdir(parents=True)
    meta = pa.table(
        {
            "segment_id": pa.array([r["segment_id"] for r in rows], pa.string()),
            "transcription_native": pa.array([r["transcription_native"] for r in rows], pa.string()),
            "duration_s": pa.array([r["duration_s"] for r in rows], pa.float64()),
            "tx_quality_score": pa.array([r["tx_quality_score"] for r in rows], pa.float64()),
            "segment_language": pa.array([r["segment_language"] for r in rows], pa.string()),
        }
    )
    pq.write_table(meta, shard / "metadata.parquet")
    ids = [r["segment_id"] for r in rows] if indexed is None else indexed
    members = [f"{i}.flac" for i in ids]
    index = {"segment_id": pa.array(ids, pa.string()), "tar_member_name": pa.array(members, pa.string())}
    audio_dir = shard
    if legacy_tar is not None:
        index["tar_path"] = [legacy_tar] * len(ids)
        audio_dir = Path(os.path.dirname(legacy_tar if os.path.isabs(legacy_tar) else shard / legacy_tar))
    pq.write_table(pa.table(index), shard / "audio_index.parquet")
    if audio:
        for member in members:
            write_audio(audio_dir / member)
    return shard


def read_split(out: Path) -> tuple[pa.Table, pa.Table]:
    return load_source(out / "train.parquet"), load_source(out / "val.parquet")


def all_rows(out: Path) -> dict[str, dict]:
    train, val = read_split(out)
    return {r["segment_id"]: r for r in train.to_pylist() + val.to_pylist()}


# ------------------------------------------------------------------------------------------- build
def test_build_writes_schema_paths_and_tagged_text(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    make_shard(shards, "hi_000", [row(f"h{i}", "नमस्ते, दुनिया। [laugh]") for i in range(6)])
    make_shard(shards, "bn_000", [row(f"b{i}", "আমি বাংলায় গান গাই।", lang="bn") for i in range(4)])
    report = build_manifest(shards, tmp_path / "out", val_fraction=0.25)

    train, val = read_split(tmp_path / "out")
    assert train.schema.equals(MANIFEST_SCHEMA) and val.schema.equals(MANIFEST_SCHEMA)
    # the parquet keeps the dictionary types without a cast
    assert pq.read_schema(tmp_path / "out" / "train.parquet").field("lang").type == pa.dictionary(
        pa.int8(), pa.string()
    )
    rows = all_rows(tmp_path / "out")
    assert len(rows) == 10 == report.total_kept and report.rows_read == 10
    assert rows["h0"]["text"] == "<|hi|> नमस्ते दुनिया" and rows["b3"]["text"] == "<|bn|> আমি বাংলায় গান গাই"
    for r in rows.values():
        assert os.path.isabs(r["audio_filepath"]) and os.path.isfile(r["audio_filepath"])
        assert r["source"] == "shards" and r["shard_id"] in ("hi_000", "bn_000")
        assert r["duration"] == pytest.approx(2.0)
    saved = json.loads((tmp_path / "out" / "build_report.json").read_text())
    assert saved["kept"] == report.kept and saved["total_kept"] == 10


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (row("x", duration=0.2), "too_short"),
        (row("x", duration=25.0), "too_long"),
        (row("x", duration=float("nan")), "invalid_duration"),
        (row("x", duration=None), "invalid_duration"),
        (row("x", duration=-1.0), "invalid_duration"),
        (row("x", quality=0.1), "low_quality"),
        (row("x", quality=None), "low_quality"),
        (row("x", text=None), "empty_text"),
        (row("x", text="   "), "empty_text"),
        (row("x", text="। ॥ ... [noise] <unk>"), "empty_after_cleaning"),
        (row("x", lang="Hi ndi"), "missing_language"),
    ],
)
def test_each_filter_drops_and_reports(tmp_path: Path, bad: dict, reason: str) -> None:
    make_shard(tmp_path / "s", "hi_000", [row("a"), row("b"), bad])
    report = build_manifest(tmp_path / "s", tmp_path / "out")
    assert set(all_rows(tmp_path / "out")) == {"a", "b"}
    expected_lang = m.UNKNOWN_LANG if reason == "missing_language" else "hi"
    assert report.dropped == {reason: {expected_lang: 1}}


def test_filter_bounds_are_inclusive_and_configurable(tmp_path: Path) -> None:
    rows = [row("lo", duration=1.0), row("hi", duration=3.0), row("q", quality=0.7), row("mid", duration=2.0)]
    make_shard(tmp_path / "s", "hi_000", rows)
    report = build_manifest(
        tmp_path / "s", tmp_path / "out", min_duration=1.0, max_duration=3.0, min_quality=0.7
    )
    assert set(all_rows(tmp_path / "out")) == {"lo", "hi", "q", "mid"} and report.total_dropped == 0
    report = build_manifest(
        tmp_path / "s", tmp_path / "out2", min_duration=1.5, max_duration=2.5, min_quality=0.8
    )
    assert set(all_rows(tmp_path / "out2")) == {"mid"}
    assert report.dropped == {"too_short": {"hi": 1}, "too_long": {"hi": 1}, "low_quality": {"hi": 1}}


def test_language_falls_back_to_the_shard_prefix(tmp_path: Path) -> None:
    make_shard(
        tmp_path / "s", "hi_007", [row("n", lang=None), row("blank", lang="  "), row("bn", lang=" BN ")]
    )
    make_shard(tmp_path / "s", "nolang", [row("orphan", lang=None), row("tagged", lang="ta")])
    report = build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.0)
    rows = all_rows(tmp_path / "out")
    assert {k: r["lang"] for k, r in rows.items()} == {"n": "hi", "blank": "hi", "bn": "bn", "tagged": "ta"}
    assert rows["bn"]["text"].startswith("<|bn|> ")
    assert report.dropped == {"missing_language": {m.UNKNOWN_LANG: 1}}


def test_lang_keeps_only_the_languages_asked_for(tmp_path: Path) -> None:
    """`manifest build --lang xx`: a recipe for one language (docs/pretrained.md: Whisper tiny.en on English)."""
    from speechlm.cli import main

    make_shard(tmp_path / "s", "hi_000", [row(f"h{i}") for i in range(6)])
    make_shard(tmp_path / "s", "bn_000", [row(f"b{i}", "আমি বাংলায় গান গাই।", lang=" BN ") for i in range(4)])
    report = build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.0, languages=["bn"])
    assert set(all_rows(tmp_path / "out")) == {f"b{i}" for i in range(4)}
    assert report.dropped == {"other_language": {"hi": 6}}
    assert report.settings["languages"] == ["bn"]
    with pytest.raises(
        ManifestError, match=r"--lang ta: no row of that language in the shards \(their languages: bn, hi\)"
    ):
        build_manifest(tmp_path / "s", tmp_path / "out2", languages=["ta"])
    assert (
        main(["manifest", "build", str(tmp_path / "s"), "--out", str(tmp_path / "cli"), "--lang", "hi"]) == 0
    )
    assert set(all_rows(tmp_path / "cli")) == {f"h{i}" for i in range(6)}


def test_inner_join_on_segment_id(tmp_path: Path) -> None:
    # metadata a,b,c; index has c, a, a (duplicate entry), z (no metadata): b has no audio
    shard = make_shard(tmp_path / "s", "hi_000", [row("a"), row("b"), row("c")], indexed=["c", "a", "a", "z"])
    report = build_manifest(tmp_path / "s", tmp_path / "out")
    rows = all_rows(tmp_path / "out")
    assert set(rows) == {"a", "c"}
    assert rows["a"]["audio_filepath"] == str(shard.resolve() / "a.flac")
    assert report.dropped == {"no_audio_index": {"hi": 1}}


def test_empty_index_with_untyped_columns(tmp_path: Path) -> None:
    # pyarrow writes an empty list as type null; such a shard simply has no audio
    shard = make_shard(tmp_path / "s", "hi_000", [row("a")], audio=False)
    make_shard(tmp_path / "s", "hi_001", [row("b")], audio=False)
    pq.write_table(pa.table({"segment_id": [], "tar_member_name": []}), shard / "audio_index.parquet")
    report = build_manifest(tmp_path / "s", tmp_path / "out")
    assert set(all_rows(tmp_path / "out")) == {"b"} and report.dropped == {"no_audio_index": {"hi": 1}}


def test_duplicates_keep_the_first_kept_copy(tmp_path: Path) -> None:
    make_shard(
        tmp_path / "s", "bn_000", [row("d", text="first"), row("d", text="second"), row("e", duration=0.1)]
    )
    make_shard(tmp_path / "s", "hi_000", [row("d", text="third"), row("e", text="kept")])
    report = build_manifest(tmp_path / "s", tmp_path / "out")
    rows = all_rows(tmp_path / "out")
    assert rows["d"]["text"] == "<|bn|> first" and rows["d"]["shard_id"] == "bn_000"
    # the first "e" was too short: the later copy is not a duplicate of anything kept
    assert rows["e"]["text"] == "<|hi|> kept"
    assert report.dropped == {"duplicate": {"bn": 1, "hi": 1}, "too_short": {"bn": 1}}


def test_report_counts_add_up_and_format(tmp_path: Path) -> None:
    rows = [row(f"k{i}") for i in range(8)] + [row("s", duration=0.1), row("q", quality=0.0), row("k0")]
    make_shard(tmp_path / "s", "hi_000", rows, indexed=[f"k{i}" for i in range(8)] + ["s", "q"])
    make_shard(
        tmp_path / "s", "ta_000", [row("t1", "தமிழ்"), row("t2", "", lang="ta"), row("t3", "x", duration=30)]
    )
    report = build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.3)
    assert report.rows_read == 14 == report.total_kept + report.total_dropped
    assert report.kept["hi"]["train"] + report.kept["hi"]["val"] == 8 and report.kept["ta"] == {
        "train": 1,
        "val": 0,
    }
    assert report.dropped == {
        "too_short": {"hi": 1},
        "low_quality": {"hi": 1},
        "duplicate": {"hi": 1},
        "empty_text": {"ta": 1},
        "too_long": {"ta": 1},
    }
    assert report.dropped_count("duplicate") == 1 and report.dropped_count("too_long", "hi") == 0
    assert report.kept_hours["hi"] == pytest.approx(8 * 2.0 / 3600, abs=1e-4)
    text = report.format()
    for reason in DROP_REASONS:
        assert reason in text
    assert "shards read 2, failed 0; rows read 14, kept 9" in text


_TEXTS = ["नमस्ते।", "hello, world", "", "   ", None, "। [noise]", "<unk>", "তামিল"]
_LANGS = [None, "", "hi", "BN", "bad lang"]


def reference_reason(r: dict, indexed: set[str], shard_lang: str | None) -> str | None:
    """The build rules, one row at a time, as documented (duplicates handled by the caller)."""
    lang = (r["segment_language"] or "").strip().lower() or shard_lang
    duration, quality, text = r["duration_s"], r["tx_quality_score"], r["transcription_native"]
    if r["segment_id"] not in indexed:
        return "no_audio_index"
    if lang is None or lang == "bad lang":
        return "missing_language"
    if duration is None or not math.isfinite(duration) or duration < 0:
        return "invalid_duration"
    if duration < 0.5:
        return "too_short"
    if duration > 20.0:
        return "too_long"
    if quality is None or not quality >= 0.5:
        return "low_quality"
    if text is None or not text.strip():
        return "empty_text"
    if not clean_text(text):
        return "empty_after_cleaning"
    return None


_ROW = st.builds(
    row,
    st.sampled_from([f"id{i}" for i in range(8)]),
    st.sampled_from(_TEXTS),
    st.one_of(st.none(), st.sampled_from([0.2, 0.5, 3.0, 20.0, 25.0, -1.0, float("nan")])),
    st.one_of(st.none(), st.sampled_from([0.0, 0.49, 0.5, 0.9])),
    st.sampled_from(_LANGS),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(_ROW, min_size=1, max_size=12), st.lists(_ROW, min_size=1, max_size=6), st.data())
def test_build_matches_a_row_by_row_reference(
    first: list[dict], second: list[dict], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = [("hi_000", first, "hi"), ("nolang", second, None)]
        expected_kept: dict[str, str] = {}
        expected_drops: dict[str, int] = {}
        for name, rows, shard_lang in shards:
            ids = sorted({r["segment_id"] for r in rows})
            indexed = data.draw(st.lists(st.sampled_from(ids), unique=True), label=f"indexed {name}")
            make_shard(root / "s", name, rows, indexed=indexed, audio=False)
            for r in rows:
                why = reference_reason(r, set(indexed), shard_lang)
                if why is None and r["segment_id"] in expected_kept:
                    why = "duplicate"
                if why is None:
                    expected_kept[r["segment_id"]] = name
                else:
                    expected_drops[why] = expected_drops.get(why, 0) + 1
        try:
            report = build_manifest(root / "s", root / "out")
        except ManifestError as e:
            assert not expected_kept and "passed the filters" in str(e)
            return
        assert report.rows_read == len(first) + len(second) == report.total_kept + report.total_dropped
        assert {reason: report.dropped_count(reason) for reason in report.dropped} == expected_drops
        assert {k: r["shard_id"] for k, r in all_rows(root / "out").items()} == expected_kept


# ------------------------------------------------------------------------------------------- split
def test_split_is_deterministic_per_language_and_stable(tmp_path: Path) -> None:
    shards = tmp_path / "s"
    for lang, n in [("hi", 1200), ("bn", 800), ("ta", 2), ("te", 1)]:
        make_shard(shards, f"{lang}_000", [row(f"{lang}_{i:05d}") for i in range(n)], audio=False)
    a = build_manifest(shards, tmp_path / "a", val_fraction=0.1, seed=3)
    b = build_manifest(shards, tmp_path / "b", val_fraction=0.1, seed=3)
    build_manifest(shards, tmp_path / "c", val_fraction=0.1, seed=4)
    val_a = set(read_split(tmp_path / "a")[1].column("segment_id").to_pylist())
    val_b = set(read_split(tmp_path / "b")[1].column("segment_id").to_pylist())
    val_c = set(read_split(tmp_path / "c")[1].column("segment_id").to_pylist())
    assert val_a == val_b and a.kept == b.kept and val_a != val_c
    for lang, n in [("hi", 1200), ("bn", 800)]:
        assert abs(a.kept[lang]["val"] / n - 0.1) < 0.03, a.kept
    assert a.kept["ta"] == {"train": 1, "val": 1}  # >= 2 rows: at least one val row and one train row
    assert a.kept["te"] == {"train": 1, "val": 0}  # a single row stays in train
    # adding a shard never moves an existing row between train and val
    make_shard(shards, "hi_001", [row(f"new_{i}") for i in range(300)], audio=False)
    build_manifest(shards, tmp_path / "d", val_fraction=0.1, seed=3)
    val_d = set(read_split(tmp_path / "d")[1].column("segment_id").to_pylist())
    assert val_d - {s for s in val_d if s.startswith("new_")} == val_a
    # val_fraction 0: everything in train
    zero = build_manifest(shards, tmp_path / "z", val_fraction=0.0)
    assert sum(c["val"] for c in zero.kept.values()) == 0


def test_hash_uniform_is_pinned_and_uniform() -> None:
    ids = pa.array([f"seg_{i:09d}" for i in range(20000)])
    u = hash_uniform(ids, seed=0)
    assert u.dtype == np.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs((u < 0.05).mean() - 0.05) < 0.01
    # chunking, slicing and string flavour do not change the values
    chunked = pa.chunked_array([ids.slice(0, 7), ids.slice(7)])
    assert np.array_equal(hash_uniform(chunked, seed=0), u)
    assert np.array_equal(hash_uniform(ids.cast(pa.large_string()).slice(5, 10), seed=0), u[5:15])
    # the documented formula, in plain Python; pinned: a change here reshuffles every existing split
    some = ["seg_000000001", "", "नमस्ते", "x" * 300]
    for seed in (0, 7, 2**40):
        assert hash_uniform(pa.array(some), seed=seed).tolist() == [reference_uniform(s, seed) for s in some]
    assert hash_uniform(pa.array(some[:3]), seed=0).round(6).tolist() == [0.916374, 0.355987, 0.976498]


def reference_uniform(text: str, seed: int) -> float:
    """``splitmix64(fnv1a64(utf8) ^ len ^ splitmix64(seed)) >> 11`` / 2**53, one string at a time."""
    mask = (1 << 64) - 1

    def splitmix64(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    data = text.encode("utf-8")
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & mask
    return (splitmix64(h ^ len(data) ^ splitmix64(seed)) >> 11) / 2**53


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.999999), st.integers(0, 3)), max_size=40), st.floats(0.01, 0.99))
def test_split_val_guarantees(rows: list[tuple[float, int]], fraction: float) -> None:
    u = np.array([r[0] for r in rows], dtype=np.float64)
    codes = np.array([r[1] for r in rows], dtype=np.int64)
    is_val = split_val(u, codes, fraction)
    for code in set(codes.tolist()):
        mask = codes == code
        if mask.sum() >= 2:
            assert is_val[mask].any() and not is_val[mask].all()
        else:
            assert not is_val[mask].any()


# ------------------------------------------------------------------------------------------ errors
def test_missing_column_names_shard_and_column(tmp_path: Path) -> None:
    shard = make_shard(tmp_path / "s", "hi_000", [row("a")])
    pq.write_table(
        pq.read_table(shard / "metadata.parquet").drop_columns(["tx_quality_score"]),
        shard / "metadata.parquet",
    )
    with pytest.raises(ManifestError) as err:
        build_manifest(tmp_path / "s", tmp_path / "out")
    msg = str(err.value)
    assert str(shard) in msg and "'tx_quality_score'" in msg and "--skip-bad-shards" in msg


def test_wrong_type_names_shard_and_column(tmp_path: Path) -> None:
    shard = make_shard(tmp_path / "s", "hi_000", [row("a")])
    meta = pq.read_table(shard / "metadata.parquet")
    meta = meta.set_column(2, "duration_s", pa.array(["2.0"]))
    pq.write_table(meta, shard / "metadata.parquet")
    with pytest.raises(ManifestError, match=r"hi_000.*'duration_s' has type string, expected a number"):
        build_manifest(tmp_path / "s", tmp_path / "out")


def test_unreadable_parquet_and_missing_index_are_all_listed(tmp_path: Path) -> None:
    good = make_shard(tmp_path / "s", "hi_000", [row("a"), row("b")])
    corrupt = make_shard(tmp_path / "s", "bn_000", [row("c")])
    (corrupt / "metadata.parquet").write_bytes(b"this is not parquet")
    no_index = make_shard(tmp_path / "s", "ta_000", [row("d")])
    (no_index / "audio_index.parquet").unlink()
    with pytest.raises(ManifestError) as err:
        build_manifest(tmp_path / "s", tmp_path / "out")
    msg = str(err.value)
    assert "2 of 3 shards" in msg
    assert str(corrupt / "metadata.parquet") in msg and "not a readable parquet" in msg
    assert str(no_index / "audio_index.parquet") in msg and "is missing" in msg
    assert str(good) + ":" not in msg
    assert not (tmp_path / "out").exists()

    report = build_manifest(tmp_path / "s", tmp_path / "out", skip_bad_shards=True)
    assert set(report.failed_shards) == {str(corrupt), str(no_index)} and report.total_kept == 2
    assert "failed shards (2, skipped)" in report.format()
    saved = json.loads((tmp_path / "out" / "build_report.json").read_text())
    assert set(saved["failed_shards"]) == {str(corrupt), str(no_index)}


def test_null_segment_id_and_bad_options(tmp_path: Path) -> None:
    shard = make_shard(tmp_path / "s", "hi_000", [row("a")])
    meta = pq.read_table(shard / "metadata.parquet")
    pq.write_table(
        meta.set_column(0, "segment_id", pa.array([None], pa.string())), shard / "metadata.parquet"
    )
    with pytest.raises(ManifestError, match="'segment_id' has 1 null"):
        build_manifest(tmp_path / "s", tmp_path / "out")
    with pytest.raises(ManifestError, match="val_fraction"):
        build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=1.0)
    with pytest.raises(ManifestError, match="does not exist"):
        build_manifest(tmp_path / "nowhere", tmp_path / "out")


def test_nothing_kept_is_an_error_with_the_report(tmp_path: Path) -> None:
    make_shard(tmp_path / "s", "hi_000", [row("a", duration=0.1)])
    with pytest.raises(ManifestError, match="no row .* passed the filters"):
        build_manifest(tmp_path / "s", tmp_path / "out")
    assert (tmp_path / "out" / "build_report.json").is_file()


# ----------------------------------------------------------------------------------- legacy layout
def test_legacy_tar_path_layout(tmp_path: Path) -> None:
    rel = make_shard(tmp_path / "s", "hi_000", [row("a"), row("b")], legacy_tar="tars/part_0.tar")
    outside = tmp_path / "elsewhere" / "part_9.tar"
    make_shard(tmp_path / "s", "bn_000", [row("c")], legacy_tar=str(outside))
    build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.0)
    rows = all_rows(tmp_path / "out")
    assert rows["a"]["audio_filepath"] == str(rel.resolve() / "tars" / "a.flac")
    assert rows["c"]["audio_filepath"] == str(outside.parent / "c.flac")
    assert all(os.path.isfile(r["audio_filepath"]) for r in rows.values())


def test_legacy_layout_mixed_null_tar_path(tmp_path: Path) -> None:
    shard = make_shard(tmp_path / "s", "hi_000", [row("a"), row("b")])
    index = pa.table(
        {"segment_id": ["a", "b"], "tar_member_name": ["a.flac", "b.flac"], "tar_path": [None, "sub/x.tar"]}
    )
    pq.write_table(index, shard / "audio_index.parquet")
    build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.0)
    rows = all_rows(tmp_path / "out")
    assert rows["a"]["audio_filepath"] == str(shard.resolve() / "a.flac")
    assert rows["b"]["audio_filepath"] == str(shard.resolve() / "sub" / "b.flac")


# ----------------------------------------------------------------------------------------- readers
def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in lines) + "\n"
    )
    return path


def test_read_nemo_manifest(tmp_path: Path) -> None:
    (tmp_path / "wav").mkdir()
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"audio_filepath": "wav/a.wav", "duration": 1.5, "text": "Hello, world!", "lang": "en"},
            {"audio_filepath": "/abs/b.wav", "duration": 2, "text": "<|hi|> नमस्ते।"},
            "",
            {"audio_filepath": "wav/c.wav", "duration": 3.0, "text": "বাংলা", "id": "utt-c"},
        ],
    )
    table = read_nemo_manifest(path, default_lang="bn")
    assert table.schema.equals(MANIFEST_SCHEMA)
    rows = table.to_pylist()
    assert [r["segment_id"] for r in rows] == ["wav/a.wav", "/abs/b.wav", "utt-c"]
    assert rows[0]["audio_filepath"] == str(tmp_path.resolve() / "wav" / "a.wav")
    assert rows[1]["audio_filepath"] == "/abs/b.wav"
    assert [r["text"] for r in rows] == ["<|en|> Hello world", "<|hi|> नमस्ते", "<|bn|> বাংলা"]
    assert [r["lang"] for r in rows] == ["en", "hi", "bn"]
    assert {r["source"] for r in rows} == {"nemo"} and rows[0]["shard_id"] == "train.jsonl"
    assert load_source(path, default_lang="bn").equals(table)


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (
            [
                '{"audio_filepath": "a.wav", "duration": 1, "text": "x", "lang": "en"}',
                '{"audio_filepath": "b.wav",',
            ],
            r"bad\.jsonl:2: not valid JSON",
        ),
        (['{"audio_filepath": "a.wav", "duration": 1, "text": "x"}'], r"bad\.jsonl:1: no language"),
        (['{"audio_filepath": "a.wav", "text": "x", "lang": "en"}'], r"bad\.jsonl:1: missing key 'duration'"),
        (
            ['{"audio_filepath": "a.wav", "duration": "1", "text": "x", "lang": "en"}'],
            r":1: 'duration' must be",
        ),
        (['{"audio_filepath": "a.wav", "duration": 1, "offset": 3.0, "text": "x", "lang": "en"}'], "offset"),
        (["[1, 2]"], "expected a JSON object"),
    ],
)
def test_read_nemo_manifest_errors(tmp_path: Path, lines: list[str], match: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ManifestError, match=match):
        read_nemo_manifest(path)


def test_load_manifest_checks_schema(tmp_path: Path) -> None:
    make_shard(tmp_path / "s", "hi_000", [row("a"), row("b")], audio=False)
    build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.0)
    table = load_source(tmp_path / "out" / "train.parquet")
    pq.write_table(table.drop_columns(["text", "lang"]), tmp_path / "broken.parquet")
    with pytest.raises(ManifestError, match=r"broken\.parquet is missing column 'text', 'lang'"):
        load_source(tmp_path / "broken.parquet")
    plain = table.set_column(5, "lang", table.column("lang").cast(pa.string()))  # plain strings are cast
    pq.write_table(plain, tmp_path / "plain.parquet")
    assert load_source(tmp_path / "plain.parquet").equals(table)
    bad_type = table.set_column(3, "duration", pa.array(["x", "y"]))
    pq.write_table(bad_type, tmp_path / "badtype.parquet")
    with pytest.raises(ManifestError, match="column 'duration' has type string"):
        load_source(tmp_path / "badtype.parquet")
    (tmp_path / "garbage.parquet").write_bytes(b"nope")
    with pytest.raises(ManifestError, match="not a readable parquet"):
        load_source(tmp_path / "garbage.parquet")
    with pytest.raises(ManifestError, match="unknown manifest format"):
        load_source(tmp_path / "x.csv")


def test_cuts_to_manifest(tmp_path: Path) -> None:
    from lhotse import CutSet, Recording, SupervisionSegment

    from speechlm.data.lhotse_adapter import cuts_to_manifest

    cuts = []
    for name, text, lang in [("a", "नमस्ते, दुनिया।", "hi"), ("b", "Hello there!", "EN")]:
        wav = tmp_path / f"{name}.wav"
        write_audio(wav, 0.5)
        rec = Recording.from_file(wav)
        cut = rec.to_cut()
        cut.supervisions = [
            SupervisionSegment(
                id=f"sup-{name}",
                recording_id=rec.id,
                start=0.0,
                duration=rec.duration,
                text=text,
                language=lang,
            )
        ]
        cuts.append(cut)
    cutset = CutSet.from_cuts(cuts)
    table = cuts_to_manifest(cutset)
    assert table.schema.equals(MANIFEST_SCHEMA)
    rows = table.to_pylist()
    assert [r["text"] for r in rows] == ["<|hi|> नमस्ते दुनिया", "<|en|> Hello there"]
    assert [r["lang"] for r in rows] == ["hi", "en"] and {r["source"] for r in rows} == {"lhotse"}
    assert rows[0]["audio_filepath"] == str(tmp_path / "a.wav") and rows[0]["duration"] == pytest.approx(0.5)

    path = tmp_path / "cuts.jsonl.gz"
    cutset.to_file(path)
    assert cuts_to_manifest(path).column("segment_id").to_pylist() == [c.id for c in cuts]

    from lhotse.utils import fastcopy

    seg = cuts[0].truncate(
        duration=0.25
    )  # a segment of its file that its supervision covers: read from start
    seg.supervisions = [fastcopy(seg.supervisions[0], duration=0.25)]
    part = cuts_to_manifest(CutSet.from_cuts([seg]))
    assert part.column("start").to_pylist() == [0.0] and part.column("duration").to_pylist() == [0.25]
    # cut in the middle of its supervision, which Lhotse keeps whole: the text holds words the cut lacks
    with pytest.raises(ManifestError, match="holds words the cut's audio lacks"):
        cuts_to_manifest(CutSet.from_cuts([cuts[0].truncate(duration=0.25)]))
    assert "start" not in table.column_names  # whole-file cuts need no locator


# ----------------------------------------------------------------------------------- arrays, stats
def test_manifest_arrays_and_stats(tmp_path: Path) -> None:
    rows = [row(f"h{i}", "क" * 5, duration=1.0 + i) for i in range(4)]
    make_shard(tmp_path / "s", "hi_000", rows, audio=False)
    make_shard(tmp_path / "s", "bn_000", [row("b0", "ক", duration=2.5)], audio=False)
    build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.0)
    table = load_source(tmp_path / "out" / "train.parquet")
    arr = manifest_arrays(table)
    assert arr.durations.dtype == np.float32 and arr.lang_codes.dtype == np.int16
    assert arr.text_lengths.dtype == np.int32 and arr.lang_names == ["bn", "hi"] and len(arr) == 5
    by_id = dict(zip(table.column("segment_id").to_pylist(), range(5)))
    assert arr.text_lengths[by_id["h0"]] == len("<|hi|> ") + 5 and arr.lang_codes[by_id["b0"]] == 0
    # chunked input with different dictionaries per chunk decodes the same
    halves = pa.concat_tables([table.slice(0, 2), table.slice(2)])
    assert np.array_equal(manifest_arrays(halves).lang_codes, arr.lang_codes)

    stats = manifest_stats(table)
    assert stats["utterances"] == 5 and stats["hours"] == pytest.approx(
        (1 + 2 + 3 + 4 + 2.5) / 3600, abs=1e-4
    )
    assert stats["languages"]["hi"]["utterances"] == 4 and stats["languages"]["bn"]["max_duration_s"] == 2.5
    assert sum(stats["histogram"]["counts"]) == 5 and stats["histogram"]["bin_edges_s"][0] == 0.0
    # bins of 0.25 s (0.1 s would need 41 bins), the longest clip inside the last one
    assert stats["histogram"]["bin_edges_s"][-2:] == [4.0, 4.25] and stats["histogram"]["counts"][-1] == 1
    plot_stats(stats, tmp_path / "stats.png")
    assert (tmp_path / "stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------- CLI
def test_cli_build_stats_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from speechlm.cli import main

    make_shard(tmp_path / "s", "hi_000", [row(f"h{i}") for i in range(5)] + [row("short", duration=0.1)])
    out = tmp_path / "out"
    assert (
        main(
            [
                "manifest",
                "build",
                str(tmp_path / "s"),
                "--out",
                str(out),
                "--val-fraction",
                "0.2",
                "--min-quality",
                "0.3",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "too_short" in printed and "wrote" in printed
    assert json.loads((out / "build_report.json").read_text())["settings"]["min_quality"] == 0.3

    assert main(["manifest", "stats", str(out / "train.parquet"), "--plot", str(tmp_path / "p.png")]) == 0
    printed = capsys.readouterr().out
    assert "utterances" in printed and (tmp_path / "p.png").is_file()

    nemo = write_jsonl(
        tmp_path / "n.jsonl", [{"audio_filepath": "a.wav", "duration": 1.0, "text": "hi there"}]
    )
    assert main(["manifest", "convert", str(nemo), "--out", str(tmp_path / "n.parquet"), "--lang", "en"]) == 0
    assert load_source(tmp_path / "n.parquet").column("text").to_pylist() == ["<|en|> hi there"]
    capsys.readouterr()

    (tmp_path / "s" / "hi_000" / "audio_index.parquet").write_bytes(b"junk")
    assert main(["manifest", "build", str(tmp_path / "s"), "--out", str(tmp_path / "o2")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 1 of 1 shards") and "audio_index.parquet" in err and "Traceback" not in err
    assert main(["manifest", "convert", str(nemo), "--out", str(tmp_path / "x.parquet")]) == 1
    assert "n.jsonl:1: no language" in capsys.readouterr().err


def test_cli_help_defaults_match_the_library() -> None:
    from speechlm.data.manifest_cli import HELP_DEFAULTS

    assert HELP_DEFAULTS == {
        "min_duration": m.DEFAULT_MIN_DURATION,
        "max_duration": m.DEFAULT_MAX_DURATION,
        "min_quality": m.DEFAULT_MIN_QUALITY,
        "val_fraction": m.DEFAULT_VAL_FRACTION,
    }
