"""Bad input met when training or evaluation reads its data (issue 20, "dataset" scope).

Durations checked against the decoded audio, one transcript rule for every source, no truncated
transcripts, audio paths relative to the manifest's folder, messages that name the manifest and the
resolved path, the input_cfg mix that cannot silently vanish, and the index cache keyed on every file
it indexes and built once under a lock.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from speechlm.data.dataset import DROP_REASONS, Collator, DroppedSample, Sample, SpeechDataset
from speechlm.data.manifest.schema import ManifestError, duration_mismatch
from speechlm.data.text import check_transcript
from speechlm.data.tokenizer import Tokenizer, train_tokenizer
from speechlm.errors import DataError

SR = 16000
TEXTS = {"hi": "<|hi|> नमस्ते दुनिया यह एक छोटा परीक्षण है", "en": "<|en|> hello world this is a small test"}


def write_tone(path: Path, seconds: float, sr: int = SR) -> None:
    t = np.arange(int(round(sr * seconds))) / sr
    sf.write(path, (0.3 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32), sr)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    return Tokenizer(train_tokenizer(list(TEXTS.values()) * 10, out, langs=list(TEXTS), vocab_size=120))


def manifest(root: Path, rows: list[dict]) -> pa.Table:
    """A table in the manifest's columns; each row: path, duration, text, lang (+ start)."""
    n = len(rows)
    cols: dict = {
        "segment_id": [f"seg{i}" for i in range(n)],
        "shard_id": pa.array(["s0"] * n).dictionary_encode(),
        "audio_filepath": [r["path"] for r in rows],
        "duration": pa.array([r.get("duration", 1.0) for r in rows], pa.float32()),
        "text": [r.get("text", TEXTS[r.get("lang", "en")]) for r in rows],
        "lang": pa.array([r.get("lang", "en") for r in rows]).dictionary_encode(),
        "source": pa.array(["test"] * n).dictionary_encode(),
    }
    if any("start" in r for r in rows):
        cols["start"] = pa.array([r.get("start") for r in rows], pa.float64())
    return pa.table(cols)


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("audio")
    write_tone(root / "one.wav", 1.0)
    write_tone(root / "long.wav", 6.0)
    return root


# ------------------------------------------------------------------- 1. durations checked at decode


def test_duration_mismatch_rule() -> None:
    assert not duration_mismatch(2.0, 2.4)  # within 0.5 s
    assert duration_mismatch(2.0, 2.6)
    assert not duration_mismatch(20.0, 21.9)  # within 10% of 20 s
    assert duration_mismatch(20.0, 22.1)
    assert duration_mismatch(1.0, 1.2, tolerance_s=0.1)
    assert duration_mismatch(float("nan"), 1.0) and duration_mismatch(float("inf"), 1.0)


def test_clip_far_from_its_duration_is_dropped_and_counted(audio: Path, tok: Tokenizer) -> None:
    table = manifest(
        audio,
        [
            {"path": str(audio / "one.wav"), "duration": 1.0},
            {"path": str(audio / "long.wav"), "duration": 2.0},  # O4a: claims 2 s, holds 6 s
            {"path": str(audio / "one.wav"), "duration": 1e6},  # O4e_huge
            {"path": str(audio / "one.wav"), "duration": 1.3},  # within the tolerance
        ],
    )
    ds = SpeechDataset(table, tok, source="m.parquet")
    items = [ds[i] for i in range(4)]
    assert isinstance(items[0], Sample) and isinstance(items[3], Sample)
    for i in (1, 2):
        assert isinstance(items[i], DroppedSample) and items[i].reason == "duration_mismatch"
    assert "6.00 s" in items[1].detail and "2.00 s" in items[1].detail and "long.wav" in items[1].detail
    assert Collator(tok.pad_id)(items).dropped == {"duration_mismatch": 2}
    # the tolerance is the config's
    loose = SpeechDataset(table, tok, duration_tolerance=5.0)
    assert isinstance(loose[1], Sample)
    assert "duration_mismatch" in DROP_REASONS


def test_duration_tolerance_is_a_data_config_field() -> None:
    from speechlm.config import DataConfig

    assert DataConfig().duration_tolerance == 0.5


# ------------------------------------------------------------------ 2. one rule for transcripts


@pytest.mark.parametrize(
    ("text", "lang", "reason"),
    [
        ("<|en|> hello world", "en", None),
        ("hello world", "en", "missing_tag"),  # M_train_notag
        ("<|hi|> hello world", "en", "tag_mismatch"),  # M_train_tagmismatch
        ("<|xx|> hello", "en", "tag_mismatch"),  # M_train_unknowntag: a drop, not a mid-run crash
        ("<|bn|> ", "bn", "empty_text"),  # M_train_emptytext
        ("<|en|> [noise] <unk> ...", "en", "empty_text"),
        ("", "en", "missing_tag"),
    ],
)
def test_check_transcript(text: str, lang: str, reason: str | None) -> None:
    assert check_transcript(text, lang) == reason


def test_bad_transcripts_are_dropped_and_counted(audio: Path, tok: Tokenizer) -> None:
    one = str(audio / "one.wav")
    texts = [
        "hello world this",
        "<|hi|> hello world",
        "<|en|> ",
        "<|xx|> hello",
        "<|EN|> hello",  # the tokenizer knows <|en|> only: a drop, not a mid-run ValueError
        "<|en|> hello <|xx|> world",
        TEXTS["en"],
    ]
    table = manifest(audio, [{"path": one, "text": t} for t in texts])
    ds = SpeechDataset(table, tok)
    items = [ds[i] for i in range(len(texts))]
    assert [getattr(x, "reason", None) for x in items] == [
        "missing_tag",
        "tag_mismatch",
        "empty_text",
        "tag_mismatch",
        "tag_mismatch",
        "tag_mismatch",
        None,
    ]
    # what reaches the model starts with the tag of its language, which the CTC head skips
    assert items[-1].tokens[0].item() == tok.lang_id("en")
    assert Collator(tok.pad_id)(items).dropped == {"missing_tag": 1, "tag_mismatch": 4, "empty_text": 1}


def test_invalid_utf8_text_is_dropped_naming_the_manifest_and_row(
    audio: Path, tok: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = manifest(audio, [{"path": str(audio / "one.wav")}] * 3)
    raw = [s.encode() for s in table.column("text").to_pylist()]
    raw[1] = b"<|en|> \xff\xfe bad"  # U3
    table = table.set_column(4, "text", pa.array(raw, pa.binary()).view(pa.string()))
    pq.write_table(table, tmp_path / "bad.parquet")
    ds = SpeechDataset(table, tok, source=str(tmp_path / "bad.parquet"))
    with caplog.at_level("WARNING"):
        item = ds[1]
    assert isinstance(item, DroppedSample) and item.reason == "invalid_text"
    assert "UTF-8" in item.detail
    assert "segment seg1" in caplog.text and "bad.parquet" in caplog.text
    assert isinstance(ds[0], Sample)


# ---------------------------------------------------------------- 3. no transcript cut at max_tokens


def test_too_many_tokens_is_dropped_not_cut(audio: Path, tok: Tokenizer) -> None:
    table = manifest(audio, [{"path": str(audio / "one.wav")}])
    n = len(tok.encode(TEXTS["en"]))
    assert isinstance(SpeechDataset(table, tok, max_tokens=n)[0], Sample)
    item = SpeechDataset(table, tok, max_tokens=n - 1)[0]
    assert isinstance(item, DroppedSample) and item.reason == "too_many_tokens"
    assert f"data.max_tokens={n - 1}" in item.detail
    assert Collator(tok.pad_id)([item]).dropped == {"too_many_tokens": 1}


def test_new_drop_reasons_reach_the_step_metrics() -> None:
    """module._sum_step_stats all-reduces one count per DROP_REASONS entry: every new reason is one."""
    for reason in ("duration_mismatch", "segment_beyond_audio", "invalid_text", "empty_text", "missing_tag"):
        assert reason in DROP_REASONS
    assert {"tag_mismatch", "too_many_tokens"} <= set(DROP_REASONS)


# ----------------------------------------------------------------- 7. a cut beyond its recording


def test_cut_beyond_the_recording_names_the_offset(audio: Path, tok: Tokenizer) -> None:
    one = str(audio / "one.wav")
    table = manifest(
        audio,
        [
            {"path": one, "start": 50.0, "duration": 1.0},  # L_beyond_train
            {"path": one, "start": 0.2, "duration": 0.5},
            {"path": one, "start": 0.5, "duration": 3.0},  # runs 2.5 s past the end
        ],
    )
    ds = SpeechDataset(table, tok)
    beyond = ds[0]
    assert isinstance(beyond, DroppedSample) and beyond.reason == "segment_beyond_audio"
    assert (
        "50.00 s" in beyond.detail and "1.00 s long" in beyond.detail and "the file is fine" in beyond.detail
    )
    assert isinstance(ds[1], Sample) and abs(ds[1].audio.numel() - 0.5 * SR) <= 1
    past_end = ds[2]
    assert isinstance(past_end, DroppedSample) and past_end.reason == "duration_mismatch"
    assert "from 0.50 s" in past_end.detail


# --------------------------------------------------- 4. tar member errors name the tar and the member


def test_undecodable_tar_member_names_tar_and_member(tmp_path: Path, tok: Tokenizer) -> None:
    import io

    from speechlm.data.audio import AudioDecodeError, decode_audio

    with pytest.raises(AudioDecodeError) as e:
        decode_audio(io.BytesIO(b"not audio" * 50), "shard-000000.tar:a.flac", SR)
    assert "shard-000000.tar:a.flac" in str(e.value) and "BytesIO" not in str(e.value)


# ----------------------------------------------- 1. NaN/Inf/<=0 durations refused when train opens


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -4.0])
def test_bad_duration_is_refused_at_open_naming_file_and_row(audio: Path, tmp_path: Path, bad: float) -> None:
    from speechlm.data.sources.mmap_cache import open_index

    rows = [{"path": str(audio / "one.wav"), "duration": d} for d in (1.0, 1.0, 1.0, bad, 1.0)]
    pq.write_table(manifest(audio, rows), tmp_path / "train.parquet")
    with pytest.raises(DataError, match=r"train\.parquet, row 3 \(segment seg3\): duration .* not a finite"):
        open_index(tmp_path / "train.parquet", cache_dir=tmp_path / "cache")


def test_nan_duration_in_nemo_json_names_file_and_line(audio: Path, tmp_path: Path) -> None:
    from speechlm.data.sources.mmap_cache import open_index

    line = {"audio_filepath": str(audio / "one.wav"), "duration": 1.0, "text": "hello world", "lang": "en"}
    bad = {**line, "duration": float("nan")}
    text = "\n".join([json.dumps(line), "", json.dumps(line), json.dumps(bad)]) + "\n"  # N_train_nan
    (tmp_path / "train.json").write_text(text)
    with pytest.raises(ManifestError, match=r"train\.json:4\b.*duration'? nan"):
        open_index(tmp_path / "train.json", cache_dir=tmp_path / "cache")


# ------------------------------------------- 4. paths relative to the manifest's folder, named


def test_parquet_relative_paths_resolve_against_the_manifest_folder(
    audio: Path,
    tok: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from speechlm.data.sources.mmap_cache import open_index

    (tmp_path / "v").mkdir()
    rel = os.path.relpath(audio / "one.wav", tmp_path / "v")
    rows = [{"path": rel}, {"path": "gone.wav"}]
    pq.write_table(manifest(audio, rows), tmp_path / "v" / "rel.parquet")
    monkeypatch.chdir(audio)  # M_train_relpaths: not the working directory
    table = open_index(tmp_path / "v" / "rel.parquet", cache_dir=tmp_path / "cache")
    ds = SpeechDataset(table, tok)
    assert isinstance(ds[0], Sample)
    with caplog.at_level("WARNING"):
        gone = ds[1]
    assert isinstance(gone, DroppedSample) and gone.reason == "missing_file"
    resolved = str(tmp_path / "v" / "gone.wav")
    assert gone.path == resolved and resolved in gone.detail
    assert str(tmp_path / "v" / "rel.parquet") in caplog.text and "<table>" not in caplog.text


def test_load_manifest_resolves_relative_paths_too(audio: Path, tmp_path: Path) -> None:
    from speechlm.data.manifest.load import read_parquet_manifest

    pq.write_table(manifest(audio, [{"path": "sub/a.wav"}]), tmp_path / "m.parquet")
    assert read_parquet_manifest(tmp_path / "m.parquet").column("audio_filepath")[0].as_py() == str(
        tmp_path.resolve() / "sub/a.wav"
    )


# ------------------------------------------------ 6. the index cache: every indexed file, one build


def write_wenet_tar(tar: Path, audio: Path, keys: list[str]) -> None:
    with tarfile.open(tar, "w") as t:
        for key in keys:
            t.add(audio / "one.wav", arcname=f"{key}.wav")
            txt = tar.parent / f"{key}.txt"
            txt.write_text("hello world")
            t.add(txt, arcname=f"{key}.txt")
            txt.unlink()


def test_cache_is_rebuilt_when_a_tar_outside_the_list_folder_changes(audio: Path, tmp_path: Path) -> None:
    from speechlm.data.sources.mmap_cache import open_index

    (tmp_path / "tars").mkdir()
    (tmp_path / "lists").mkdir()
    tar = tmp_path / "tars" / "shard-0.tar"
    write_wenet_tar(tar, audio, ["a", "b"])
    lst = tmp_path / "lists" / "data.list"
    lst.write_text(f"{tar}\n")
    cache = tmp_path / "cache"
    first = open_index(lst, cache_dir=cache, default_lang="en")
    assert first.column("segment_id").to_pylist() == ["a", "b"]
    write_wenet_tar(tar, audio, ["c", "a", "b"])  # rewritten: every offset moves; the list is unchanged
    os.utime(tar, ns=(tar.stat().st_atime_ns, tar.stat().st_mtime_ns + 10**9))
    again = open_index(lst, cache_dir=cache, default_lang="en")
    assert sorted(again.column("segment_id").to_pylist()) == ["a", "b", "c"]


def _build_in_child(args: tuple[str, str, str]) -> str:
    import contextlib
    import io

    from speechlm.data.sources import mmap_cache

    path, cache, go = args
    while not os.path.exists(go):  # start together
        pass
    err = io.StringIO()
    real_write = mmap_cache._write_ipc

    def slow_write(*a: object, **k: object) -> None:
        import time

        time.sleep(0.5)  # a long build: the other process arrives while it runs
        real_write(*a, **k)  # type: ignore[arg-type]

    mmap_cache._write_ipc = slow_write  # type: ignore[assignment]
    with contextlib.redirect_stderr(err):
        table = mmap_cache.open_index(path, cache_dir=cache)
    return f"{len(table)} {err.getvalue().count('indexing ')}"


def test_two_processes_building_at_once_build_once(audio: Path, tmp_path: Path) -> None:
    pq.write_table(manifest(audio, [{"path": str(audio / "one.wav")}] * 7), tmp_path / "m.parquet")
    go = tmp_path / "go"
    args = (str(tmp_path / "m.parquet"), str(tmp_path / "cache"), str(go))
    with mp.get_context("fork").Pool(2) as pool:
        result = pool.map_async(_build_in_child, [args, args], chunksize=1)
        go.touch()
        out = result.get(timeout=60)
    assert sorted(out) == ["7 0", "7 1"]  # both mapped the 7 rows; one of them indexed
    entries = [p.name for p in (tmp_path / "cache").iterdir() if p.suffix == ".arrow"]
    assert len(entries) == 1 and not any(".tmp" in p.name for p in (tmp_path / "cache").iterdir())


# ----------------------------------------------- 5. the input_cfg mix cannot vanish with metadata


def test_mix_without_its_metadata_is_refused_not_unweighted(audio: Path, tmp_path: Path) -> None:
    from speechlm.config import ExperimentConfig
    from speechlm.data.sampler.build import build_sampler
    from speechlm.data.sources.input_cfg import load_input_cfg, mix_of_table, read_modes_of_table

    for name, n in (("a", 3), ("b", 5)):
        pq.write_table(manifest(audio, [{"path": str(audio / "one.wav")}] * n), tmp_path / f"{name}.parquet")
    entries = [
        {"path": str(tmp_path / "a.parquet"), "name": "a", "weight": 9.0},
        {"path": str(tmp_path / "b.parquet"), "name": "b", "weight": 1.0},
    ]
    table = load_input_cfg(entries, cache_dir=tmp_path / "cache")
    assert mix_of_table(table).shares == pytest.approx((0.9, 0.1))
    stripped = table.replace_schema_metadata(None)  # what select/cast/concat/parquet-to-cache may do
    for read in (mix_of_table, read_modes_of_table):
        with pytest.raises(ManifestError, match="'dataset' column .* dropped it.*temperature sampling"):
            read(stripped)
    cfg = ExperimentConfig()
    cfg.sampler.max_batch_duration = 3.0
    with pytest.raises(DataError, match="data.input_cfg mix"):
        build_sampler(cfg, stripped, dp_rank=0, dp_size=1)
    # a table of one dataset (no 'dataset' column, or an all-null one) has no mix to lose
    plain = manifest(audio, [{"path": str(audio / "one.wav")}])
    assert mix_of_table(plain) is None
    nulls = plain.append_column("dataset", pa.nulls(1, pa.dictionary(pa.int16(), pa.string())))
    assert mix_of_table(nulls) is None and read_modes_of_table(nulls) is None


# ------------------------------------------------------- 7. a null text names its row (plan, train)


def test_null_text_names_the_row_in_plan_and_train(audio: Path, tmp_path: Path) -> None:
    from speechlm.data.plan.inputs import read_plan_inputs
    from speechlm.data.sources.mmap_cache import open_index

    table = manifest(audio, [{"path": str(audio / "one.wav")}] * 6)
    texts = table.column("text").to_pylist()
    texts[4] = None  # M_plan_nulltext, M_train_nulltext
    pq.write_table(table.set_column(4, "text", pa.array(texts, pa.string())), tmp_path / "nulltext.parquet")
    for read in (read_plan_inputs, lambda p: open_index(p, cache_dir=tmp_path / "cache")):
        with pytest.raises(DataError, match=r"nulltext\.parquet, row 4: column 'text' is null"):
            read(tmp_path / "nulltext.parquet")


# -------------------------------------------- 7. a refused streaming resume names data.num_workers


def test_streaming_resume_refusal_names_the_setting() -> None:
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings, StreamingLayout
    from speechlm.errors import UsageError

    n = 40
    durations = np.full(n, 1.0, np.float32)
    codes = np.zeros(n, np.int16)
    shards = np.repeat(np.arange(4), n // 4)

    def sampler(workers: int | None) -> DurationBucketBatchSampler:
        layout = None
        if workers is not None:
            layout = StreamingLayout(shards, np.arange(n, dtype=np.int64), streams_per_rank=max(1, workers))
        settings = SamplerSettings(max_batch_duration=4.0)
        return DurationBucketBatchSampler(durations, codes, ["en"], settings, dp_rank=0, streaming=layout)

    saved = sampler(0).state_dict()
    with pytest.raises(UsageError, match=r"params\.streaming\.streams_per_rank.*data\.num_workers"):  # ST3
        sampler(2).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"data\.read_mode"):  # saved streaming, resumed indexed
        sampler(None).load_state_dict(saved)
    sampler(0).load_state_dict(saved)  # the same settings resume


def test_dropped_files_lines_carry_the_reason_and_the_fix(audio: Path, tok: Tokenizer) -> None:
    """What a DroppedDataError lists: each file with its reason and what to do (not only 'restore it')."""
    one = str(audio / "one.wav")
    table = manifest(audio, [{"path": one, "start": 50.0}, {"path": one, "text": "<|hi|> hello"}])
    ds = SpeechDataset(table, tok)
    lines = Collator(tok.pad_id)([ds[0], ds[1]]).dropped_files
    assert lines[0].startswith(f"{one} (segment_beyond_audio): ") and "fix the cut" in lines[0]
    assert "(tag_mismatch): " in lines[1] and "<|en|>" in lines[1]


def test_a_killed_builders_leftovers_are_not_an_entry_and_are_cleaned(audio: Path, tmp_path: Path) -> None:
    from speechlm.data.sources.mmap_cache import default_cache_dir, open_index, source_fingerprint

    pq.write_table(manifest(audio, [{"path": str(audio / "one.wav")}] * 2), tmp_path / "m.parquet")
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = f"m.parquet.{source_fingerprint(tmp_path / 'm.parquet')}.arrow"
    (cache / f".{entry}.tmp-otherhost-999999").write_bytes(
        b"half a file"
    )  # SIGKILL mid-write (atomic_path's name)
    (cache / f"{entry}.lock").touch()  # the lock file stays; its flock died with the process
    assert len(open_index(tmp_path / "m.parquet", cache_dir=cache)) == 2
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry, f"{entry}.lock"])
    assert default_cache_dir() != cache


def test_drops_of_a_mix_name_the_rows_dataset(audio: Path, tok: Tokenizer, tmp_path: Path, caplog) -> None:
    from speechlm.data.sources.input_cfg import load_input_cfg

    pq.write_table(manifest(audio, [{"path": str(audio / "one.wav")}]), tmp_path / "a.parquet")
    pq.write_table(manifest(audio, [{"path": str(tmp_path / "gone.wav")}]), tmp_path / "b.parquet")
    entries = [
        {"path": str(tmp_path / "a.parquet"), "name": "a"},
        {"path": str(tmp_path / "b.parquet"), "name": "b"},
    ]
    ds = SpeechDataset(load_input_cfg(entries, cache_dir=tmp_path / "cache"), tok)
    with caplog.at_level("WARNING"):
        assert isinstance(ds[0], Sample) and isinstance(ds[1], DroppedSample)
    assert f"of {tmp_path / 'b.parquet'} (missing_file)" in caplog.text


def test_a_path_that_is_not_utf8_is_read_not_a_traceback(audio: Path, tok: Tokenizer, tmp_path: Path) -> None:
    name = os.fsencode(tmp_path) + b"/caf\xe9.wav"  # a Latin-1 file name, as old exporters write them
    with open(name, "wb") as f:
        f.write((audio / "one.wav").read_bytes())
    table = manifest(audio, [{"path": "x"}, {"path": "y"}])
    paths = pa.array([name, os.fsencode(tmp_path) + b"/gone\xff.wav"], pa.binary()).view(pa.string())
    ds = SpeechDataset(table.set_column(2, "audio_filepath", paths), tok)
    assert isinstance(ds[0], Sample)
    gone = ds[1]
    assert isinstance(gone, DroppedSample) and gone.reason == "missing_file"


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_a_bad_duration_tolerance_is_a_usage_error(audio: Path, tok: Tokenizer, bad: float) -> None:
    from speechlm.errors import UsageError

    with pytest.raises(UsageError, match="data.duration_tolerance"):
        SpeechDataset(manifest(audio, [{"path": "x"}]), tok, duration_tolerance=bad)
