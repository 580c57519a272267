"""Every data format read back from the demo corpus gives the extracted manifest's samples and plan.

Each format is built from the demo manifest (`demo_data`): ours (`speechlm shards write`), a NeMo
tarred dataset, a Lhotse Shar folder written by Lhotse's own SharWriter, a Lhotse cuts file whose cuts
are segments of long recordings (offsets, several cuts per file), and WeNet lists in raw and shard
mode. Reading each one must give, row for row, the same `Sample`s (audio bit-identical, same tokens)
and the same epoch plan as the extracted-file manifest. Formats that decode or inspect the audio
while being written or indexed (Shar, cuts, WeNet) cannot hold the demo's two broken clips; their
reference is the manifest without those rows.

Then bad data per tar format: a missing member, a truncated tar, a member renamed in a rewritten tar
(both when the fingerprint shows the change and when a stale cache hides it).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import soundfile as sf

from speechlm.data.dataset import DroppedSample, Sample, SpeechDataset
from speechlm.data.manifest import ManifestError
from speechlm.data.sources.detect import SOURCE_READERS, _import_readers, detect_source_type, load_source
from speechlm.data.sources.report import SourceReport
from speechlm.data.text import split_lang_tag

REPO = Path(__file__).resolve().parents[2]
BROKEN = {"en_001_00056", "hi_000_00032"}  # the demo's two undecodable clips (no header / lost sync)


def _untagged(text: str) -> str:
    return split_lang_tag(text)[1]


def write_shar(rows: list[dict], out: Path) -> None:
    from lhotse import Recording, SupervisionSegment
    from lhotse.shar import SharWriter

    out.mkdir(parents=True)
    with SharWriter(str(out), fields={"recording": "flac"}, shard_size=64) as writer:
        for r in rows:
            rec = Recording.from_file(r["audio_filepath"], recording_id=r["segment_id"])
            cut = rec.to_cut()
            cut.supervisions = [
                SupervisionSegment(
                    r["segment_id"], rec.id, 0.0, rec.duration, text=_untagged(r["text"]), language=r["lang"]
                )
            ]
            writer.write(cut)


def write_long_recording_cuts(rows: list[dict], out: Path) -> Path:
    """The clips of each demo shard concatenated into one FLAC; one cut per clip, at its offset."""
    from lhotse import CutSet, Recording, SupervisionSegment
    from lhotse.utils import fastcopy

    out.mkdir(parents=True)
    by_shard: dict[str, list[dict]] = {}
    for r in rows:
        by_shard.setdefault(r["shard_id"], []).append(r)
    cuts = {}
    for shard, group in by_shard.items():
        clips = [sf.read(r["audio_filepath"], dtype="int16")[0] for r in group]
        long = out / f"{shard}.flac"
        sf.write(long, np.concatenate(clips), 16000, subtype="PCM_16")
        rec = Recording.from_file(long)
        start = 0
        for r, clip in zip(group, clips):
            cut = rec.to_cut().truncate(offset=start / 16000, duration=len(clip) / 16000)
            sup = SupervisionSegment(
                r["segment_id"], rec.id, 0.0, cut.duration, text=_untagged(r["text"]), language=r["lang"]
            )
            cuts[r["segment_id"]] = fastcopy(cut, id=r["segment_id"], supervisions=[sup])
            start += len(clip)
    path = out / "cuts.jsonl.gz"
    CutSet.from_cuts([cuts[r["segment_id"]] for r in rows]).to_file(path)
    return path


def write_wenet(rows: list[dict], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True)
    raw = out / "raw.list"
    raw.write_text(
        "".join(
            json.dumps(
                {
                    "key": r["segment_id"],
                    "wav": r["audio_filepath"],
                    "txt": _untagged(r["text"]),
                    "lang": r["lang"],
                },
                ensure_ascii=False,
            )
            + "\n"
            for r in rows
        ),
        encoding="utf-8",
    )
    tars = []
    for k in range(0, len(rows), 64):
        tars.append(f"shard_{k // 64}.tar")
        with tarfile.open(out / tars[-1], "w") as tf:
            for r in rows[k : k + 64]:
                parts = [
                    (".flac", Path(r["audio_filepath"]).read_bytes()),
                    (".txt", _untagged(r["text"]).encode()),
                    (".lang", r["lang"].encode()),
                ]
                for suffix, data in parts:
                    info = tarfile.TarInfo(r["segment_id"] + suffix)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    shard = out / "shard.list"
    shard.write_text("\n".join(tars) + "\n")
    return raw, shard


@pytest.fixture(scope="module")
def formats(demo_data, tmp_path_factory) -> dict[str, Path]:
    from speechlm.data.sources.nemo_tarred import write_nemo_tarred
    from speechlm.data.sources.shards import write_shards

    root = tmp_path_factory.mktemp("formats")
    table = load_source(demo_data["train"])
    rows = table.to_pylist()
    good = [r for r in rows if r["segment_id"] not in BROKEN]
    # issue 20: a file that is not audio is never packed (the writers read each header first)
    write_shards(table, root / "ours", shard_size=64, skip_bad_audio=True)
    write_nemo_tarred(table, root / "nemo", shard_size=64, skip_bad_audio=True)
    write_shar(good, root / "shar")
    cuts = write_long_recording_cuts(good, root / "cuts")
    raw, shard = write_wenet(rows, root / "wenet")
    return {
        "_tok": Path(demo_data["tok"]),
        "speechlm_shards": root / "ours",
        "nemo_tarred": root / "nemo",
        "lhotse_shar": root / "shar",
        "lhotse_cuts": cuts,
        "wenet_raw": raw,
        "wenet_shard": shard,
    }


def _tokenizer(demo_data):
    from speechlm.data.tokenizer import Tokenizer

    return Tokenizer(demo_data["tok"])


def _plan(table: pa.Table) -> list[list[int]]:
    from speechlm.config import load_config
    from speechlm.data.sampler.build import build_sampler

    cfg = load_config(REPO / "configs/smoke.yaml")
    return [list(b) for b in build_sampler(cfg, table, dp_rank=0, dp_size=1)]


@pytest.mark.parametrize(
    "kind", ["speechlm_shards", "nemo_tarred", "lhotse_shar", "lhotse_cuts", "wenet_raw", "wenet_shard"]
)
def test_format_gives_the_extracted_manifests_samples_and_plan(kind, formats, demo_data):
    path = formats[kind]
    assert detect_source_type(path) == ("wenet" if kind.startswith("wenet") else kind)
    table = load_source(path)
    full = load_source(demo_data["train"])
    ids = table.column("segment_id").to_pylist()
    ref = full.filter(pc.is_in(full.column("segment_id"), pa.array(ids)))
    assert ref.column("segment_id").to_pylist() == ids  # same rows, same order
    lost = set(full.column("segment_id").to_pylist()) - set(ids)
    # what a format cannot hold: the clip with no header where the header is read while writing
    # (tars, skip_bad_audio) or indexing (WeNet); both broken clips where the writer decodes (Shar, cuts)
    expected_lost = {
        "speechlm_shards": {"en_001_00056"},
        "nemo_tarred": {"en_001_00056"},
        "wenet_raw": {"en_001_00056"},
        "wenet_shard": {"en_001_00056"},
    }.get(kind, BROKEN)
    assert lost == expected_lost
    for col in ("duration", "text", "lang"):
        assert table.column(col).to_pylist() == ref.column(col).to_pylist(), col
    if kind == "lhotse_cuts":
        assert pc.min(table.column("start")).as_py() == 0.0 and pc.max(table.column("start")).as_py() > 10
    tok = _tokenizer(demo_data)
    ds, ds_ref = SpeechDataset(table, tok), SpeechDataset(ref, tok)
    for i in range(len(table)):
        a, b = ds[i], ds_ref[i]
        if isinstance(b, DroppedSample):
            assert isinstance(a, DroppedSample) and a.reason == b.reason == "undecodable", ids[i]
            continue
        assert isinstance(a, Sample), (ids[i], a)
        assert a.audio.dtype == b.audio.dtype and np.array_equal(a.audio.numpy(), b.audio.numpy()), ids[i]
        assert a.tokens.tolist() == b.tokens.tolist() and a.lang == b.lang and a.duration == b.duration
    batches = list(ds.__getitems__(list(range(min(8, len(ds))))))  # grouped reads keep the batch order
    assert [s.index for s in batches] == list(range(len(batches)))
    assert _plan(table) == _plan(ref)


def test_nemo_tarred_layout_options_and_braces(formats, demo_data):
    from speechlm.data.sources.nemo_tarred import expand_braces

    assert expand_braces("a/audio__OP_0..2_CL_.tar") == ["a/audio_0.tar", "a/audio_1.tar", "a/audio_2.tar"]
    assert expand_braces("x{08..10}_{a,b}") == ["x08_a", "x08_b", "x09_a", "x09_b", "x10_a", "x10_b"]
    assert expand_braces("{2..0}{x}") == ["2{x}", "1{x}", "0{x}"]
    nemo = formats["nemo_tarred"]
    first = json.loads((nemo / "tarred_audio_manifest.json").read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"audio_filepath", "duration", "text", "lang", "shard_id"}
    assert not first["text"].startswith("<|") and "/" not in first["audio_filepath"]
    assert sorted(p.name for p in (nemo / "sharded_manifests").iterdir()) == [
        f"manifest_{k}.json" for k in range(4)
    ]
    assert not list(nemo.glob(".*.tmp*"))
    folder = load_source(nemo)
    by_options = load_source(
        nemo / "sharded_manifests/manifest__OP_0..3_CL_.json",
        "nemo_tarred",
        manifest_filepath=str(nemo / "sharded_manifests/manifest__OP_0..3_CL_.json"),
        tarred_audio_filepaths=str(nemo / "audio_{0..3}.tar"),
    )
    assert by_options.equals(folder)
    with pytest.raises(ManifestError, match="expands to 2 tars"):
        load_source(
            nemo,
            "nemo_tarred",
            manifest_filepath=str(nemo / "tarred_audio_manifest.json"),
            tarred_audio_filepaths=str(nemo / "audio__OP_0..1_CL_.tar"),
        )


def test_manifest_convert_lhotse_keeps_offsets(formats, tmp_path):
    from speechlm.cli import main

    out = tmp_path / "cuts.parquet"
    assert (
        main(["manifest", "convert", str(formats["lhotse_cuts"]), "--format", "lhotse", "--out", str(out)])
        == 0
    )
    converted = load_source(out)
    assert converted.equals(load_source(formats["lhotse_cuts"]))
    assert converted.column("start").null_count == 0


def test_lhotse_refusals_stay(tmp_path):
    from lhotse import CutSet, Recording, SupervisionSegment

    from speechlm.data.lhotse_adapter import cuts_to_manifest

    wav = tmp_path / "st.wav"
    sf.write(wav, np.zeros((1600, 2), np.float32), 16000)
    rec = Recording.from_file(wav)
    with pytest.raises(ManifestError, match="0 supervisions"):
        cuts_to_manifest(CutSet.from_cuts([rec.to_cut()]))
    cut = rec.to_cut()
    cut.supervisions = [SupervisionSegment("s", rec.id, 0, 0.1, text="x", language="en")]
    with pytest.raises(ManifestError, match="2 channels"):
        cuts_to_manifest(CutSet.from_cuts([cut]))


# ---------------------------------------------------------------------------------------- bad data
def _copy(formats, kind: str, tmp_path: Path) -> Path:
    src = formats[kind]
    if src.is_dir():
        dst = tmp_path / src.name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.idx.parquet"))
        return dst
    dst = tmp_path / src.parent.name
    shutil.copytree(src.parent, dst, ignore=shutil.ignore_patterns("*.parquet"))
    # the copy's list names the copy's tars (relative)
    return dst / src.name


def _read(path: Path, kind: str) -> tuple[pa.Table, SourceReport]:
    _import_readers()
    report = SourceReport()
    return SOURCE_READERS[kind.split("_shard")[0]](path, report=report), report


def _drops(report: SourceReport, tar: Path, baseline: SourceReport) -> dict[str, int]:
    """The drops counted against `tar`; every other shard's counts must be those of `baseline`."""
    named = {Path(k).name: v for k, v in report.dropped.items()}
    before = {Path(k).name: v for k, v in baseline.dropped.items()}
    assert {k: v for k, v in named.items() if k != tar.name} == {
        k: v for k, v in before.items() if k != tar.name
    }
    return named.get(tar.name, {})


def _rewrite(tar: Path, edit) -> None:
    """Rewrite `tar` member by member, `edit(info) -> info | None` (None leaves the member out)."""
    with tarfile.open(tar) as src:
        members = [(info, src.extractfile(info).read()) for info in src.getmembers()]
    tmp = tar.with_suffix(".new")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as dst:
        for info, data in members:
            info = edit(info)
            if info is not None:
                dst.addfile(info, io.BytesIO(data))
    os.replace(tmp, tar)


BAD_KINDS = {
    "nemo_tarred": "audio_0.tar",
    "lhotse_shar": "recording.000000.tar",
    "wenet_shard": "shard_0.tar",
}


@pytest.mark.parametrize("kind", list(BAD_KINDS))
def test_missing_member_is_dropped_and_counted(kind, formats, tmp_path):
    path = _copy(formats, kind, tmp_path)
    before, baseline = _read(path, kind)
    victim = before.column("segment_id")[3].as_py()
    tar = path.parent / BAD_KINDS[kind] if path.is_file() else path / BAD_KINDS[kind]
    # WeNet has no index of its own: an utterance whose members are all gone leaves no trace, so the
    # case it can count is a KEY with audio but no text; the others lose the audio member
    gone = victim + ".txt" if kind == "wenet_shard" else before.column("audio_filepath")[3].as_py()
    _rewrite(tar, lambda info: None if info.name == gone else info)
    after, report = _read(path, kind)
    assert len(after) == len(before) - 1 and victim not in after.column("segment_id").to_pylist()
    assert _drops(report, tar, baseline) == {"missing_member": 1}


@pytest.mark.parametrize("kind", list(BAD_KINDS))
def test_truncated_tar_keeps_whole_members_and_counts_the_rest(kind, formats, tmp_path):
    from speechlm.data.sources.tar_index import scan_tar

    path = _copy(formats, kind, tmp_path)
    before, baseline = _read(path, kind)
    tar = path.parent / BAD_KINDS[kind] if path.is_file() else path / BAD_KINDS[kind]
    scan = scan_tar(tar)
    cut_in = next(j for j, n in enumerate(scan.names) if j > 30 and n.endswith(".flac"))
    os.truncate(tar, int(scan.offsets[cut_in]) + 10)  # ends inside a member
    after, report = _read(path, kind)
    per = _drops(report, tar, baseline)
    assert set(per) == {"truncated_shard"} and per["truncated_shard"] >= 1
    if kind != "wenet_shard":  # the index knows every row: each one lost is counted
        assert len(before) - len(after) == per["truncated_shard"]
    ds = SpeechDataset(after, _tokenizer_from(formats))
    kept = [i for i in range(len(after)) if after.column("shard_id")[i].as_py() == tar.name]
    assert kept and all(isinstance(ds[i], Sample) or ds[i].reason == "undecodable" for i in kept)


def _tokenizer_from(formats):
    from speechlm.data.tokenizer import Tokenizer

    return Tokenizer(str(Path(formats["_tok"])))


@pytest.mark.parametrize("kind", list(BAD_KINDS))
@pytest.mark.parametrize("hide_change", [False, True], ids=["rescanned", "stale_cache"])
def test_renamed_member_never_pairs_with_the_wrong_text(kind, hide_change, formats, tmp_path):
    path = _copy(formats, kind, tmp_path)
    before, baseline = _read(path, kind)  # indexes and caches
    victim = before.column("segment_id")[5].as_py()
    row = before.column("segment_id").to_pylist().index(victim)
    tar = path.parent / BAD_KINDS[kind] if path.is_file() else path / BAD_KINDS[kind]
    st = os.stat(tar)

    def rename(info):
        if info.name.startswith(victim + ".") and not info.name.endswith((".json", ".txt", ".lang")):
            info.name = victim[:-1] + "Z" + info.name[len(victim) :]  # same length: same offsets
        return info

    _rewrite(tar, rename)
    assert os.path.getsize(tar) == st.st_size
    if hide_change:  # same size and time: the fingerprint cannot see it, the header check at read time does
        os.utime(tar, ns=(st.st_atime_ns, st.st_mtime_ns))
        after, report = _read(path, kind)
        assert report.dropped == baseline.dropped and after.equals(before)
        dropped = SpeechDataset(after, _tokenizer_from(formats))[row]
        assert isinstance(dropped, DroppedSample) and dropped.reason == "stale_index"
        assert victim[:-1] + "Z" in dropped.detail
    else:  # the changed tar is scanned again: the row has no member any more
        after, report = _read(path, kind)
        assert victim not in after.column("segment_id").to_pylist()
        assert set(_drops(report, tar, baseline)) == {"missing_member"}


@pytest.mark.parametrize("kind", list(BAD_KINDS))
def test_missing_or_unreadable_tar_is_an_error_naming_it(kind, formats, tmp_path):
    path = _copy(formats, kind, tmp_path)
    tar = path.parent / BAD_KINDS[kind] if path.is_file() else path / BAD_KINDS[kind]
    tar.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ManifestError, match=tar.name):
        _read(path, kind)
    tar.unlink()
    with pytest.raises(ManifestError, match=f"{tar.name}.*does not exist"):
        _read(path, kind)


# ------------------------------------------------------------------------------------- training
def _training_helpers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_training_helpers", REPO / "tests/train/test_training.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_eight_training_steps_from_tars_give_the_extracted_manifests_losses(formats, demo_data, tmp_path):
    import pyarrow.parquet as pq

    helpers = _training_helpers()
    full = load_source(demo_data["train"])
    shar_ids = load_source(formats["lhotse_shar"]).column("segment_id")
    pq.write_table(
        full.filter(pc.is_in(full.column("segment_id"), shar_ids)), tmp_path / "without_broken.parquet"
    )
    common = [
        helpers.SMOKE,
        f"data.val_manifest={demo_data['val']}",
        f"data.tokenizer={demo_data['tok']}",
        "trainer.max_steps=8",
        "trainer.grad_accum=1",
        "model.dropout=0",
    ]
    runs = {
        "extracted": demo_data["train"],
        "nemo_tarred": formats["nemo_tarred"],
        "extracted_without_broken": tmp_path / "without_broken.parquet",
        "lhotse_shar": formats["lhotse_shar"],
    }
    metrics = {}
    for name, manifest in runs.items():
        done = helpers.run_train(
            [*common, f"data.train_manifest={manifest}", f"trainer.run_dir={tmp_path / name}"]
        )
        assert done.returncode == 0, done.stderr[-3000:]
        metrics[name] = helpers.read_metrics(tmp_path / name)
        print(name, [m["loss"] for m in metrics[name]])
    for tars, reference in (("nemo_tarred", "extracted"), ("lhotse_shar", "extracted_without_broken")):
        assert [m["step"] for m in metrics[tars]] == list(range(1, 9))
        assert [m["rows_digest"] for m in metrics[tars]] == [m["rows_digest"] for m in metrics[reference]]
        assert [m["loss"] for m in metrics[tars]] == [m["loss"] for m in metrics[reference]]  # exactly


def test_wenet_raw_drops_missing_files_needs_a_language_and_caches(formats, tmp_path):
    src = formats["wenet_raw"]
    lines = src.read_text(encoding="utf-8").splitlines()[:6]
    gone = json.loads(lines[2]) | {"wav": str(tmp_path / "gone.flac")}
    lst = tmp_path / "data.list"
    lst.write_text("\n".join([*lines[:2], json.dumps(gone), *lines[3:]]) + "\n", encoding="utf-8")
    table, report = _read(lst, "wenet")
    assert len(table) == 5 and report.dropped == {str(lst): {"missing_file": 1}}
    assert (tmp_path / "data.list.speechlm.parquet").is_file()
    cached, again = _read(lst, "wenet")  # from the sidecar: same table, same drops reported
    assert cached.equals(table) and again.dropped == report.dropped
    no_lang = {k: v for k, v in json.loads(lines[0]).items() if k != "lang"}
    lst.write_text(json.dumps(no_lang) + "\n", encoding="utf-8")  # the changed list is indexed again
    with pytest.raises(ManifestError, match="no language"):
        _read(lst, "wenet")
    _import_readers()
    assert SOURCE_READERS["wenet"](lst, report=SourceReport(), default_lang="EN").column(
        "lang"
    ).to_pylist() == ["en"]
