"""Checks on the committed demo corpus in data/demo/shards (no espeak-ng needed)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

SHARD_ROOT = Path(__file__).resolve().parents[2] / "data" / "demo" / "shards"

META_COLUMNS = {
    "segment_id": pa.string(),
    "transcription_native": pa.string(),
    "duration_s": pa.float64(),
    "tx_quality_score": pa.float64(),
    "segment_language": pa.string(),
}
INDEX_COLUMNS = {"segment_id": pa.string(), "tar_member_name": pa.string()}

# the manifest build's default filters, as documented in data/demo/README.md
MIN_DUR, MAX_DUR, MIN_QUALITY = 0.5, 20.0, 0.5


def _shards() -> list[Path]:
    return sorted(p for p in SHARD_ROOT.iterdir() if p.is_dir())


def _read_columns(path: Path, expected: dict[str, pa.DataType]) -> list[dict]:
    table = pq.read_table(path)
    for name, dtype in expected.items():
        assert name in table.column_names, f"{path}: missing column {name}"
        assert table.schema.field(name).type == dtype, f"{path}: {name} is {table.schema.field(name).type}"
    return table.to_pylist()


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """All metadata rows joined (inner) with the audio index, annotated with shard and language."""
    out = []
    for shard in _shards():
        meta = _read_columns(shard / "metadata.parquet", META_COLUMNS)
        index = {
            r["segment_id"]: r["tar_member_name"]
            for r in _read_columns(shard / "audio_index.parquet", INDEX_COLUMNS)
        }
        shard_lang = shard.name.split("_")[0]
        for r in meta:
            r = dict(r, shard=shard.name, member=index.get(r["segment_id"]))
            r["lang"] = r["segment_language"] or shard_lang
            out.append(r)
    return out


def _passes_filters(r: dict) -> bool:
    text = r["transcription_native"]
    return (
        r["member"] is not None
        and text is not None
        and text.strip() != ""
        and r["tx_quality_score"] >= MIN_QUALITY
        and MIN_DUR <= r["duration_s"] <= MAX_DUR
    )


@pytest.fixture(scope="module")
def decoded(rows) -> tuple[list[dict], list[dict]]:
    """(decodable, undecodable) among rows passing the manifest filters, first occurrence of each id."""
    seen: set[str] = set()
    ok, broken = [], []
    for r in rows:
        if not _passes_filters(r) or r["segment_id"] in seen:
            continue
        seen.add(r["segment_id"])
        path = SHARD_ROOT / r["shard"] / r["member"]
        assert path.is_file(), f"missing audio file {path}"
        try:
            audio, sr = sf.read(str(path), always_2d=True)
        except Exception:  # noqa: BLE001 - any decode failure counts
            broken.append(r)
            continue
        ok.append(dict(r, sr=sr, channels=audio.shape[1], n=audio.shape[0]))
    return ok, broken


def test_layout():
    shards = _shards()
    assert len(shards) >= 5
    for shard in shards:
        lang, _, num = shard.name.partition("_")
        assert lang.isalpha() and num.isdigit(), shard.name
        assert (shard / "metadata.parquet").is_file()
        assert (shard / "audio_index.parquet").is_file()
        for r in pq.read_table(shard / "audio_index.parquet").to_pylist():
            assert not r["tar_member_name"].startswith("/")
            assert (shard / r["tar_member_name"]).is_file(), r
    assert (SHARD_ROOT.parent / "README.md").is_file()


def test_segment_ids_and_null_languages(rows):
    ids = [r["segment_id"] for r in rows]
    counts = Counter(ids)
    dups = [k for k, v in counts.items() if v > 1]
    assert len(dups) == 1, dups  # exactly one deliberately duplicated id
    for r in rows:
        assert r["segment_id"].startswith(r["shard"] + "_")
    assert any(r["segment_language"] is None for r in rows), "a few rows should leave the language null"


def test_deliberately_bad_rows_present(rows):
    assert any(r["duration_s"] < MIN_DUR and r["member"] for r in rows)
    assert any(r["duration_s"] > MAX_DUR and r["member"] for r in rows)
    assert any(r["tx_quality_score"] < MIN_QUALITY for r in rows)
    texts = [r["transcription_native"] for r in rows]
    assert None in texts
    assert "" in texts
    assert any(t is not None and t != "" and t.strip() == "" for t in texts)
    assert any(r["member"] is None for r in rows)
    for r in rows:
        assert 0.0 <= r["tx_quality_score"] <= 1.0


def test_valid_audio_and_skew(decoded):
    ok, broken = decoded
    assert len(broken) >= 2, "at least two undecodable audio files are expected"
    for r in ok:
        dur = r["n"] / r["sr"]
        assert r["sr"] == 16000, r
        assert r["channels"] == 1, r
        assert 1.0 <= dur <= 8.0, r
        assert abs(dur - r["duration_s"]) <= 0.05, r
    per_lang = Counter(r["lang"] for r in ok)
    assert len(per_lang) >= 5, per_lang
    assert max(per_lang.values()) >= 8 * min(per_lang.values()), per_lang
    assert 200 <= sum(per_lang.values()) <= 260, per_lang


def test_long_row_has_real_long_audio(rows):
    long_rows = [r for r in rows if r["duration_s"] > MAX_DUR and r["member"]]
    for r in long_rows:
        info = sf.info(str(SHARD_ROOT / r["shard"] / r["member"]))
        assert info.duration > MAX_DUR
