"""`speechlm manifest build` with a predefined ``split`` column in metadata.parquet (issue 24): named rows go
to their split, null rows to the hash split exactly as without the column, bad values name shard and segment,
a language left without train rows is an error, and the report counts rows placed by column and by hash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speechlm.data.manifest import ManifestError, build_manifest, hash_uniform, split_val
from speechlm.data.manifest.split import HASHED, split_codes


def write_shard(root: Path, name: str, ids: list[str], split: Any = None, **columns: list[Any]) -> Path:
    """<root>/<name>/metadata.parquet and audio_index.parquet for rows `ids` (2 s, quality 1, a short text);
    `split`: None (no column), a pa.Array, or a list of values for a string column."""
    shard = root / name
    shard.mkdir(parents=True)
    meta = {
        "segment_id": pa.array(ids, pa.string()),
        "transcription_native": pa.array(columns.get("text", ["a short sentence"] * len(ids)), pa.string()),
        "duration_s": pa.array(columns.get("duration", [2.0] * len(ids)), pa.float64()),
        "tx_quality_score": pa.array([1.0] * len(ids), pa.float64()),
        "segment_language": pa.array([None] * len(ids), pa.string()),
    }
    if split is not None:
        meta["split"] = split if isinstance(split, pa.Array) else pa.array(split, pa.string())
    pq.write_table(pa.table(meta), shard / "metadata.parquet")
    index = {"segment_id": ids, "tar_member_name": [f"{i}.flac" for i in ids]}
    pq.write_table(pa.table(index), shard / "audio_index.parquet")
    return shard


def sides(out: Path) -> dict[str, str]:
    """segment_id -> "train" / "val" of a built manifest."""
    return {
        seg: name
        for name in ("train", "val")
        for seg in pq.read_table(out / f"{name}.parquet").column("segment_id").to_pylist()
    }


def test_named_rows_go_to_their_split_and_null_rows_to_the_hash(tmp_path: Path) -> None:
    ids = [f"hi_{i:03d}" for i in range(40)]
    named = {"hi_000": "val", "hi_001": "Dev", "hi_002": " validation ", "hi_003": "TRAIN", "hi_004": "train"}
    write_shard(tmp_path / "s", "hi_000", ids, [named.get(i) for i in ids])
    build_manifest(tmp_path / "s", tmp_path / "out", val_fraction=0.3, seed=5)
    got = sides(tmp_path / "out")
    assert {seg: got[seg] for seg in named} == {
        "hi_000": "val",
        "hi_001": "val",
        "hi_002": "val",
        "hi_003": "train",
        "hi_004": "train",
    }
    # the named rows go where they say whatever their hash: some of them hash to the other side
    u = dict(zip(ids, hash_uniform(pa.array(ids), seed=5)))
    assert any(u[s] >= 0.3 for s in ("hi_000", "hi_001", "hi_002")) or any(
        u[s] < 0.3 for s in ("hi_003", "hi_004")
    )
    # the null rows: u < val_fraction (this language has val rows by the column, so nothing is moved)
    assert {s: got[s] for s in ids[5:]} == {s: "val" if u[s] < 0.3 else "train" for s in ids[5:]}
    # val_fraction 0 puts every hashed row in train but keeps the named val rows
    build_manifest(tmp_path / "s", tmp_path / "zero", val_fraction=0.0)
    zero = sides(tmp_path / "zero")
    assert sorted(s for s, side in zero.items() if side == "val") == ["hi_000", "hi_001", "hi_002"]


def test_null_split_builds_byte_for_byte_what_no_column_builds(tmp_path: Path) -> None:
    ids = {lang: [f"{lang}_{i:04d}" for i in range(n)] for lang, n in (("hi", 300), ("ta", 2), ("te", 1))}
    root = tmp_path / "s"
    for lang, seg in ids.items():
        write_shard(root, f"{lang}_000", seg)
    built = {}
    for variant, split in (("none", None), ("null_str", pa.string()), ("null_type", pa.null())):
        for lang, seg in ids.items():  # the same shard paths: audio_filepath is absolute
            meta = root / f"{lang}_000" / "metadata.parquet"
            table = pq.read_table(meta).drop_columns(
                [c for c in ("split",) if c in pq.read_schema(meta).names]
            )
            if split is not None:
                table = table.append_column("split", pa.nulls(len(seg), split))
            pq.write_table(table, meta)
        build_manifest(root, tmp_path / variant, val_fraction=0.1, seed=2)
        built[variant] = [(tmp_path / variant / f"{name}.parquet").read_bytes() for name in ("train", "val")]
    assert built["null_str"] == built["none"] and built["null_type"] == built["none"]
    # the hash split with its per-language rule, unchanged
    assert sides(tmp_path / "none")["te_0000"] == "train"
    assert sorted(sides(tmp_path / "none")[s] for s in ids["ta"]) == ["train", "val"]


def test_bad_split_values_name_every_shard_file_segment_and_the_allowed_values(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_shard(root, "hi_000", ["h0", "h1", "h2"], ["train", "test", "test"])
    write_shard(root, "ta_000", ["t0", "t1"], [None, ""])
    write_shard(root, "bn_000", ["b0", "b1"], ["train", None])
    with pytest.raises(ManifestError) as err:
        build_manifest(root, tmp_path / "out")
    msg = str(err.value)
    assert "2 of 3 shards" in msg
    assert f"{root / 'hi_000' / 'metadata.parquet'} column 'split' row 1 (segment h1) has value 'test'" in msg
    assert "2 row(s)" in msg
    assert f"{root / 'ta_000' / 'metadata.parquet'} column 'split' row 1 (segment t1) has value ''" in msg
    assert "allowed: train, val, dev, validation" in msg and "or null" in msg
    report = build_manifest(root, tmp_path / "out", skip_bad_shards=True)
    assert sorted(Path(p).name for p in report.failed_shards) == ["hi_000", "ta_000"]
    assert set(sides(tmp_path / "out")) == {"b0", "b1"}


def test_a_split_column_that_is_not_a_string_is_a_bad_shard(tmp_path: Path) -> None:
    write_shard(tmp_path / "s", "hi_000", ["h0", "h1"], pa.array([0, 1], pa.int64()))
    with pytest.raises(ManifestError, match=r"hi_000.*'split' has type int64, expected a string"):
        build_manifest(tmp_path / "s", tmp_path / "out")


def test_a_language_left_without_train_rows_is_an_error_and_without_val_rows_is_fine(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_shard(root, "hi_000", [f"h{i}" for i in range(6)], ["train"] * 6)  # no val row: fine
    write_shard(root, "ta_000", ["t0", "t1", "t2"], ["val", "dev", "val"])
    with pytest.raises(ManifestError, match=r"no train row left for language ta \(3 rows\).*'split' column"):
        build_manifest(root, tmp_path / "out", val_fraction=0.5)
    assert not (tmp_path / "out" / "train.parquet").exists()
    # one hashed row of the language is enough: the per-language rule moves it to train
    (root / "ta_000" / "metadata.parquet").unlink()
    pq.write_table(
        pa.table(
            {
                "segment_id": ["t0", "t1", "t2"],
                "transcription_native": ["a short sentence"] * 3,
                "duration_s": [2.0] * 3,
                "tx_quality_score": [1.0] * 3,
                "segment_language": pa.nulls(3, pa.string()),
                "split": ["val", "val", None],
            }
        ),
        root / "ta_000" / "metadata.parquet",
    )
    report = build_manifest(root, tmp_path / "out", val_fraction=0.99)
    assert report.kept == {"hi": {"train": 6, "val": 0}, "ta": {"train": 1, "val": 2}}
    assert sides(tmp_path / "out")["t2"] == "train"


def test_filters_and_dedup_come_first_and_the_kept_copy_keeps_its_split(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_shard(
        root, "hi_000", ["a", "b", "c", "d"], ["val", "val", "train", None], duration=[2.0, 0.1, 2.0, 2.0]
    )
    write_shard(root, "hi_001", ["a", "c"], ["train", "val"])  # duplicates: the first kept copy wins
    report = build_manifest(root, tmp_path / "out", val_fraction=0.5)
    got = sides(tmp_path / "out")
    u_d = hash_uniform(pa.array(["d"]), seed=0)[0]
    assert got == {"a": "val", "c": "train", "d": "val" if u_d < 0.5 else "train"}  # b too short; d: the hash
    assert report.dropped_count("too_short") == 1 and report.dropped_count("duplicate") == 2


def test_report_counts_rows_placed_by_column_and_by_hash(tmp_path: Path) -> None:
    root = tmp_path / "s"
    write_shard(root, "hi_000", [f"h{i}" for i in range(10)], ["train"] * 3 + ["val"] * 2 + [None] * 5)
    write_shard(root, "bn_000", [f"b{i}" for i in range(4)])
    report = build_manifest(root, tmp_path / "out", val_fraction=0.2)
    hashed_hi = sum(
        1
        for s, side in sides(tmp_path / "out").items()
        if s in {f"h{i}" for i in range(5, 10)} and side == "val"
    )
    assert report.split_source["hi"] == {
        "column": {"train": 3, "val": 2},
        "hash": {"train": 5 - hashed_hi, "val": hashed_hi},
    }
    assert report.split_source["bn"]["column"] == {"train": 0, "val": 0}
    assert report.split_source["bn"]["hash"] == report.kept["bn"]
    saved = json.loads((tmp_path / "out" / "build_report.json").read_text())
    assert saved["split_source"] == report.split_source
    table = report.format()
    assert "kept   train  val  hours  by column  by hash" in table
    lines = table.splitlines()
    kept = lines[lines.index("  kept   train  val  hours  by column  by hash") + 1 :]
    kept = kept[: kept.index("")]
    assert [line.split()[-2:] for line in kept] == [["0", "4"], ["5", "5"], ["5", "9"]]


def test_cli_prints_the_placement_columns(tmp_path: Path) -> None:
    write_shard(tmp_path / "s", "hi_000", ["h0", "h1", "h2"], ["val", "train", None])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "speechlm",
            "manifest",
            "build",
            str(tmp_path / "s"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "by column  by hash" in done.stdout
    assert any(line.split() == ["hi", "2", "1", "0.00", "2", "1"] for line in done.stdout.splitlines()), (
        done.stdout
    )


def test_split_codes_maps_values_and_nulls() -> None:
    col = pa.chunked_array([pa.array(["train", None, "VAL", " dev", "validation"])])
    ids = pa.chunked_array([pa.array(["a", "b", "c", "d", "e"])])
    assert split_codes(col, ids, "m.parquet").tolist() == [0, HASHED, 1, 1, 1]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 0.999999), st.integers(0, 3), st.sampled_from([HASHED, 0, 1])), max_size=40
    ),
    st.floats(0.01, 0.99),
)
def test_split_val_never_moves_a_named_row(rows: list[tuple[float, int, int]], fraction: float) -> None:
    u = np.array([r[0] for r in rows], dtype=np.float64)
    codes = np.array([r[1] for r in rows], dtype=np.int64)
    fixed = np.array([r[2] for r in rows], dtype=np.int8)
    is_val = split_val(u, codes, fraction, fixed)
    named = fixed != HASHED
    assert np.array_equal(is_val[named], fixed[named] == 1)
    for code in set(codes.tolist()):
        mine = codes == code
        hashed = mine & ~named
        if mine.sum() >= 2 and hashed.any():  # the rule holds where a hashed row can make it hold
            assert is_val[mine].any() and not is_val[mine].all()
        elif mine.sum() == 1 and hashed.any():
            assert not is_val[mine].any()
    # with no named row it is the plain hash split
    plain = np.full(u.size, HASHED, np.int8)
    assert np.array_equal(split_val(u, codes, fraction, plain), split_val(u, codes, fraction))
