"""speechlm tar shards: writing, the cached offset index, positional reads, and what bad tars do.

Covers: `speechlm shards write` packs the audio bytes unchanged and the dataset returns the very same
samples as from the extracted files; the offset index is cached with a fingerprint (a rewritten tar is
re-scanned); a stale offset, a truncated tar, a missing member and a missing shard are dropped and
counted with the shard named (or stop with an error naming it); an interrupted write is refused; a
compressed tar is refused; a read-only shard folder caches its index elsewhere.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from speechlm.cli import main
from speechlm.data.dataset import DroppedSample, Sample, SpeechDataset
from speechlm.data.manifest import ManifestError
from speechlm.data.sources.detect import detect_source_type, load_source
from speechlm.data.sources.members import MemberError, MemberReader
from speechlm.data.sources.report import SourceReport
from speechlm.data.sources.shards import read_shards, write_shards
from speechlm.data.sources.tar_index import TarIndexError, scan_tar, tar_member_index
from speechlm.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def shards(demo_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "train"
    argv = ["shards", "write", demo_data["train"], "--out", str(out), "--shard-size", "40"]
    assert (
        main([*argv, "--skip-bad-audio"]) == 0
    )  # the demo's random-bytes FLAC (en_001_00056) is not audio: left out
    return out


def _copy_shards(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if not f.name.endswith(".idx.parquet"):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_shards_give_the_same_samples_as_extracted_files(demo_data, shards):
    tok = Tokenizer(demo_data["tok"])
    extracted = SpeechDataset(demo_data["train"], tok)
    packed = SpeechDataset(str(shards), tok)
    assert detect_source_type(shards) == "speechlm_shards"
    assert len(extracted) == 221 and len(packed) == 220  # en_001_00056, not audio, is not packed
    assert len(list(shards.glob("shard-*.tar"))) == 6  # 220 rows in shards of 40
    ids = load_source(demo_data["train"]).column("segment_id").to_pylist()
    at = {s: i for i, s in enumerate(load_source(shards).column("segment_id").to_pylist())}
    dropped = 0
    for i in range(len(extracted)):
        if ids[i] == "en_001_00056":
            continue
        a, b = extracted[i], packed[at[ids[i]]]
        if isinstance(a, DroppedSample):  # the demo corpus holds corrupt FLACs on purpose
            assert isinstance(b, DroppedSample) and (a.reason, b.reason) == ("undecodable", "undecodable")
            dropped += 1
            continue
        assert isinstance(a, Sample) and isinstance(b, Sample)
        assert torch_equal(a.audio, b.audio) and torch_equal(a.tokens, b.tokens)
        assert (a.lang, a.duration) == (b.lang, b.duration)
    assert dropped >= 1
    table = load_source(shards)
    assert table.column("segment_id").to_pylist() == [s for s in ids if s != "en_001_00056"]


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_members_hold_the_audio_bytes_unchanged(demo_data, shards):
    table = load_source(demo_data["train"])
    first = table.column("audio_filepath")[0].as_py()
    with tarfile.open(shards / "shard-000000.tar") as tf:
        member = tf.getmembers()[0]
        assert member.name == Path(first).name  # SEGMENT_ID.flac
        assert tf.extractfile(member).read() == Path(first).read_bytes()


def test_batched_reads_keep_the_sampler_order(demo_data, shards):
    ds = SpeechDataset(str(shards), Tokenizer(demo_data["tok"]))
    rows = [200, 3, 150, 4, 77]
    got = ds.__getitems__(rows)
    assert [s.index for s in got] == rows


def test_offset_index_is_cached_and_a_rewritten_tar_is_rescanned(tmp_path):
    tar = tmp_path / "a.tar"
    _write_tar(tar, {"x.wav": b"1" * 700, "y.wav": b"2" * 10})
    first = tar_member_index(tar)
    cache = tmp_path / "a.tar.idx.parquet"
    assert cache.is_file() and first.names == ["x.wav", "y.wav"]
    assert tar_member_index(tar).names == first.names  # from the cache
    _write_tar(tar, {"y.wav": b"2" * 10, "z.wav": b"3" * 3000})  # different size: the fingerprint changes
    again = tar_member_index(tar)
    assert again.names == ["y.wav", "z.wav"]
    assert again.offsets[0] == 512


def test_read_only_folder_caches_the_index_elsewhere(tmp_path, monkeypatch):
    tar = tmp_path / "ro" / "a.tar"
    tar.parent.mkdir()
    _write_tar(tar, {"x.wav": b"1" * 100})
    real_write = __import__("speechlm.data.sources.tar_index", fromlist=["_write_cache"])._write_cache
    attempts: list[Path] = []

    def write(path, scan, fp):  # the data folder refuses writes (read-only mount or full disk)
        attempts.append(path)
        return False if path.parent == tar.parent else real_write(path, scan, fp)

    monkeypatch.setattr("speechlm.data.sources.tar_index._write_cache", write)
    scan = tar_member_index(tar, cache_dir=tmp_path / "cache")
    assert scan.names == ["x.wav"]
    assert [p.parent for p in attempts] == [tar.parent, tmp_path / "cache"]
    assert list((tmp_path / "cache").glob("a.tar.*.idx.parquet"))


def test_stale_offsets_are_refused_not_decoded(demo_data, shards, tmp_path):
    """A tar rewritten with its members in another order but the same size: only the header check sees it."""
    copy = _copy_shards(shards, tmp_path / "stale")
    tar = copy / "shard-000000.tar"
    size = tar.stat().st_size
    with tarfile.open(tar) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    members[0], members[1] = members[1], members[0]
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as tf:
        for m, data in members:
            tf.addfile(m, __import__("io").BytesIO(data))
    os.truncate(tar, size) if tar.stat().st_size > size else None
    assert tar.stat().st_size == size  # same size: the index is not re-scanned
    ds = SpeechDataset(str(copy), Tokenizer(demo_data["tok"]))
    got = ds[0]
    assert isinstance(got, DroppedSample) and got.reason == "stale_index"
    assert "shard-000000.tar" in got.path
    with pytest.raises(MemberError, match="offset index is stale"):
        row = load_source(copy).slice(1, 1).to_pylist()[0]
        MemberReader().read(
            row["tar_path"], row["audio_filepath"], row["offset"], row["nbytes"], row["header_bytes"]
        )


def test_truncated_shard_drops_its_lost_rows_and_names_the_shard(demo_data, shards, tmp_path, caplog):
    copy = _copy_shards(shards, tmp_path / "trunc")
    tar = copy / "shard-000001.tar"
    os.truncate(tar, tar.stat().st_size // 2)
    report = SourceReport()
    table = read_shards(copy, report)
    lost = report.dropped[str(tar)]["truncated_shard"]
    assert 10 < lost < 40 and len(table) == 220 - lost
    ds = SpeechDataset(table, Tokenizer(demo_data["tok"]))
    reasons = {ds[i].reason for i in range(len(ds)) if isinstance(ds[i], DroppedSample)}
    assert reasons <= {"undecodable"}  # the demo's one corrupt FLAC, nothing from the cut tar
    with caplog.at_level("WARNING"):
        load_source(copy)
    assert "shard-000001.tar" in caplog.text and "truncated_shard" in caplog.text


def test_truncation_after_loading_is_dropped_at_read_time(demo_data, shards, tmp_path):
    copy = _copy_shards(shards, tmp_path / "late")
    ds = SpeechDataset(str(copy), Tokenizer(demo_data["tok"]))
    tar = copy / "shard-000005.tar"
    os.truncate(tar, 1024)  # cut while training runs
    got = ds[len(ds) - 1]
    assert (
        isinstance(got, DroppedSample) and got.reason == "truncated_shard" and "shard-000005.tar" in got.path
    )


def test_missing_member_is_dropped_and_counted(demo_data, shards, tmp_path):
    copy = _copy_shards(shards, tmp_path / "missing")
    tar = copy / "shard-000002.tar"
    with tarfile.open(tar) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as tf:
        for m, data in members[1:]:
            tf.addfile(m, __import__("io").BytesIO(data))
    report = SourceReport()
    table = read_shards(copy, report)
    assert report.dropped == {str(tar): {"missing_member": 1}}
    assert members[0][0].name not in table.column("audio_filepath").to_pylist()
    ds = SpeechDataset(table, Tokenizer(demo_data["tok"]))
    assert all(ds[i].reason == "undecodable" for i in range(len(ds)) if isinstance(ds[i], DroppedSample))


def test_missing_shard_stops_with_its_name(shards, tmp_path):
    copy = _copy_shards(shards, tmp_path / "gone")
    (copy / "shard-000003.tar").unlink()
    with pytest.raises(ManifestError, match="shard-000003.tar.*does not exist"):
        load_source(copy)


def test_interrupted_write_is_refused(demo_data, tmp_path, monkeypatch):
    out = tmp_path / "half"
    calls = {"n": 0}
    real = __import__("speechlm.data.sources.shards", fromlist=["write_one_tar"]).write_one_tar

    def dies_on_third(path, members):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(path, members)

    monkeypatch.setattr("speechlm.data.sources.shards.write_one_tar", dies_on_third)
    with pytest.raises(OSError, match="No space"):
        write_shards(load_source(demo_data["train"]), out, shard_size=40, skip_bad_audio=True)
    assert not (out / "index.parquet").exists()
    with pytest.raises(ManifestError, match="interrupted; run it again"):
        load_source(out)
    monkeypatch.undo()
    write_shards(
        load_source(demo_data["train"]), out, shard_size=40, skip_bad_audio=True
    )  # a rerun completes it
    assert len(load_source(out)) == 220


def test_compressed_or_foreign_tar_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "x.tar"
    bad.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(TarIndexError, match="x.tar is not a readable uncompressed tar"):
        scan_tar(bad)
    gz = tmp_path / "y.tar"
    with tarfile.open(gz, "w:gz") as tf:
        info = tarfile.TarInfo("a.wav")
        info.size = 3
        tf.addfile(info, __import__("io").BytesIO(b"abc"))
    with pytest.raises(TarIndexError, match="not .tar.gz"):
        scan_tar(gz)


def test_write_refuses_a_manifest_with_missing_audio(demo_data, tmp_path):
    table = load_source(demo_data["train"])
    paths = table.column("audio_filepath").to_pylist()
    paths[5] = "/nonexistent/clip.flac"
    broken = table.set_column(2, "audio_filepath", pa.array(paths, pa.string()))
    with pytest.raises(ManifestError, match="row 5 .*does not exist"):
        write_shards(broken, tmp_path / "o", shard_size=100)


def test_long_and_non_ascii_member_names_are_read(tmp_path):
    names = {"हिन्दी_1.wav": b"a" * 10, "x" * 150 + ".wav": b"b" * 600}
    tar = tmp_path / "n.tar"
    _write_tar(tar, names)
    scan = scan_tar(tar)
    reader = MemberReader()
    for j, name in enumerate(scan.names):
        data = reader.read(
            str(tar), name, int(scan.offsets[j]), int(scan.sizes[j]), int(scan.header_bytes[j])
        )
        assert data == names[name]
    assert np.all(scan.header_bytes > 512)  # pax headers in front of both


def _write_tar(path: Path, members: dict[str, bytes]) -> None:
    import io

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_index_is_memory_mapped_and_keyed_by_the_source(demo_data, shards, tmp_path):
    from speechlm.data.sources.mmap_cache import open_index

    cache = tmp_path / "cache"
    before = pa.total_allocated_bytes()
    table = open_index(demo_data["train"], cache_dir=cache)
    ds = SpeechDataset(table, Tokenizer(demo_data["tok"]))
    # texts, ids and paths are not copied into arrow's memory pool: they are pages of the cache file
    texts = sum(len(t.encode()) for t in table.column("text").to_pylist())
    assert pa.total_allocated_bytes() - before < texts // 4
    assert table.drop_columns(["text_chars"]) == load_source(demo_data["train"])
    assert table.column("text_chars").to_pylist() == [len(t) for t in table.column("text").to_pylist()]
    assert isinstance(ds[0], Sample)
    assert len(list(cache.glob("train.parquet.*.arrow"))) == 1
    assert open_index(demo_data["train"], cache_dir=cache) == table  # reused
    assert len(list(cache.glob("*.arrow"))) == 1
    sharded = open_index(shards, cache_dir=cache)
    assert (
        sharded.drop_columns(["text_chars"]) == load_source(shards) and len(list(cache.glob("*.arrow"))) == 2
    )


def test_index_cache_follows_a_changed_manifest_and_survives_a_full_disk(demo_data, tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from speechlm.data.sources import mmap_cache

    src = tmp_path / "m.parquet"
    table = load_source(demo_data["train"])
    pq.write_table(table, src)
    cache = tmp_path / "cache"
    assert len(mmap_cache.open_index(src, cache_dir=cache)) == 221
    pq.write_table(table.slice(0, 100), src)  # edited: a new fingerprint, a new cache file
    os.utime(src, ns=(1, 1))
    assert len(mmap_cache.open_index(src, cache_dir=cache)) == 100

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    cached = max(cache.glob("m.parquet.*.arrow"), key=lambda p: p.stat().st_mtime_ns)
    cached.write_bytes(cached.read_bytes()[:1000])  # damaged on disk (not by us: writes are atomic)
    assert len(mmap_cache.open_index(src, cache_dir=cache)) == 100  # rebuilt

    monkeypatch.setattr(mmap_cache, "_write_ipc", full)
    pq.write_table(table.slice(0, 50), src)
    os.utime(src, ns=(2, 2))
    assert len(mmap_cache.open_index(src, cache_dir=cache)) == 50  # from memory, with a warning
    assert not list(cache.glob(".*.tmp*"))


@pytest.mark.parametrize("kind", ["speechlm", "nemo"])
def test_both_tar_set_writers_share_one_skeleton_that_cleans_up_a_failed_tar(demo_data, tmp_path, kind):
    """`write_shards` and `write_nemo_tarred` go through `speechlm.data.sources.shards`' skeleton: a tar
    whose write fails (a full disk mid-tar) leaves no temporary, the set has no final file, the error is a
    ShardWriteError naming the tar, and a rerun completes the set."""
    import speechlm.io as io_module
    from speechlm.data.sources import shards
    from speechlm.data.sources.nemo_tarred import MANIFEST_NAME, write_nemo_tarred

    write, final = (
        (write_shards, shards.INDEX_NAME) if kind == "speechlm" else (write_nemo_tarred, MANIFEST_NAME)
    )
    out = tmp_path / kind
    calls = {"n": 0}
    real_replace = io_module.os.replace

    def full_at_second_tar(src, dst):
        if str(dst).endswith(".tar"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    table = load_source(demo_data["train"])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(io_module.os, "replace", full_at_second_tar)
        with pytest.raises(shards.ShardWriteError, match=r"cannot write \S*[-_]0*1\.tar: No space"):
            write(table, out, shard_size=60, skip_bad_audio=True)
    assert not (out / final).exists()
    assert not [p.name for p in out.rglob(".*")]  # no temporary left, under any name
    write(table, out, shard_size=60, skip_bad_audio=True)  # a rerun completes the set
    assert (out / final).is_file() and len(load_source(out)) == 220
