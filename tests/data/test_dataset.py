"""Dataset, collation and loader: decoding, resampling, drops with reasons, padding, workers, seeding."""

from __future__ import annotations

import os
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from torch.utils.data import Dataset

from speechlm.data.dataset import (
    AudioDecodeError,
    Batch,
    Collator,
    DroppedSample,
    Sample,
    SpeechDataset,
    build_dataloader,
    load_audio,
    seed_worker,
)
from speechlm.data.tokenizer import Tokenizer, train_tokenizer

SR = 16000
TEXTS = {
    "hi": "<|hi|> नमस्ते दुनिया यह एक छोटा परीक्षण है",
    "bn": "<|bn|> আমি বাংলায় কথা বলি এবং গান গাই",
    "ta": "<|ta|> வணக்கம் உலகம் இது ஒரு சோதனை",
    "en": "<|en|> hello world this is a small test",
}


def write_sine(path: Path, sr: int, seconds: float, *, channels: int = 1, subtype: str | None = None) -> None:
    t = np.arange(int(round(sr * seconds))) / sr
    x = 0.3 * np.sin(2 * np.pi * 440.0 * t)
    data = np.stack([x * (c + 1) / channels for c in range(channels)], axis=1) if channels > 1 else x
    sf.write(path, data.astype(np.float32), sr, subtype=subtype)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    return Tokenizer(train_tokenizer(list(TEXTS.values()) * 10, out, langs=list(TEXTS), vocab_size=200))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    """Rows 0-3 good (one relative path), 4 missing, 5 random bytes, 6 truncated FLAC, 7 empty, 8 good."""
    root = tmp_path_factory.mktemp("audio")
    write_sine(root / "a.wav", 16000, 0.50, subtype="PCM_16")
    write_sine(root / "b.flac", 48000, 0.25, channels=2)
    write_sine(root / "c.wav", 8000, 0.75, subtype="FLOAT")
    write_sine(root / "d.flac", 44100, 0.40, subtype="PCM_24")
    (root / "e.flac").write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    write_sine(root / "full.flac", 16000, 2.0)
    blob = (root / "full.flac").read_bytes()
    (root / "f.flac").write_bytes(blob[: len(blob) // 2])
    sf.write(root / "g.wav", np.zeros(0, np.float32), 16000)
    write_sine(root / "h.wav", 22050, 0.30)
    files = ["a.wav", "b.flac", "c.wav", "d.flac", "missing.flac", "e.flac", "f.flac", "g.wav", "h.wav"]
    paths = [str(root / f) for f in files]
    paths[3] = "d.flac"  # relative: resolved against the manifest's folder
    langs = ["hi", "bn", "ta", "en", "hi", "bn", "ta", "en", "hi"]
    table = pa.table(
        {
            "segment_id": [f"seg{i}" for i in range(len(files))],
            "shard_id": pa.array(["s0"] * len(files)).dictionary_encode(),
            "audio_filepath": paths,
            "duration": pa.array([0.5, 0.25, 0.75, 0.4, 1.0, 1.0, 2.0, 0.0, 0.3], pa.float32()),
            "text": [TEXTS[lang] for lang in langs],
            "lang": pa.array(langs).dictionary_encode(),
            "source": ["test"] * len(files),
        }
    )
    pq.write_table(table, root / "manifest.parquet")
    return root, table


GOOD, DROPS = [0, 1, 2, 3, 8], {4: "missing_file", 5: "undecodable", 6: "undecodable", 7: "empty_audio"}


# ------------------------------------------------------------------------------------------ load_audio


def test_load_audio_averages_channels(tmp_path: Path) -> None:
    left, right = np.full(800, 0.5, np.float32), np.full(800, -0.1, np.float32)
    sf.write(tmp_path / "st.wav", np.stack([left, right], axis=1), SR, subtype="FLOAT")
    x = load_audio(tmp_path / "st.wav")
    assert x.dtype == np.float32 and x.ndim == 1 and x.shape == (800,)
    np.testing.assert_allclose(x, 0.2, atol=1e-6)


def test_load_audio_keeps_16k_float_exactly(tmp_path: Path) -> None:
    x = np.random.default_rng(1).uniform(-0.5, 0.5, 1234).astype(np.float32)
    sf.write(tmp_path / "x.wav", x, SR, subtype="FLOAT")
    np.testing.assert_array_equal(load_audio(tmp_path / "x.wav"), x)


def test_load_audio_int16_scales_to_unit_range(tmp_path: Path) -> None:
    sf.write(tmp_path / "i.wav", np.array([16384, -32768, 0], np.int16), SR, subtype="PCM_16")
    np.testing.assert_allclose(load_audio(tmp_path / "i.wav"), [0.5, -1.0, 0.0])


@pytest.mark.parametrize("sr", [8000, 22050, 44100, 48000])
@pytest.mark.parametrize("ext", ["wav", "flac"])
def test_load_audio_resamples_to_16k(tmp_path: Path, sr: int, ext: str) -> None:
    path = tmp_path / f"s.{ext}"
    write_sine(path, sr, 1.0, channels=2)
    x = load_audio(path)
    assert x.dtype == np.float32 and abs(x.shape[0] - SR) <= 1
    spectrum = np.abs(np.fft.rfft(x))
    assert abs(np.argmax(spectrum) * SR / x.shape[0] - 440.0) < 2.0  # the tone survives resampling


def test_load_audio_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_audio(tmp_path / "none.wav")
    (tmp_path / "bad.flac").write_bytes(os.urandom(2000))
    with pytest.raises(AudioDecodeError, match="bad.flac"):
        load_audio(tmp_path / "bad.flac")
    sf.write(tmp_path / "nan.wav", np.array([0.0, np.nan], np.float32), SR, subtype="FLOAT")
    with pytest.raises(AudioDecodeError, match="NaN"):
        load_audio(tmp_path / "nan.wav")


# -------------------------------------------------------------------------------------------- dataset


@pytest.mark.parametrize("with_manifest_module", [True, False])
def test_dataset_samples_and_drops(
    corpus: tuple[Path, pa.Table], tok: Tokenizer, with_manifest_module: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus
    if not with_manifest_module:  # the dataset reads the parquet itself when manifest.py is absent
        monkeypatch.setitem(sys.modules, "speechlm.data.manifest", None)
    ds = SpeechDataset(root / "manifest.parquet", tok)
    assert len(ds) == 9
    items = [ds[i] for i in range(len(ds))]
    for i in GOOD:
        s = items[i]
        assert isinstance(s, Sample) and s.index == i
        assert s.audio.dtype == torch.float32 and s.audio.ndim == 1
        assert s.tokens.dtype == torch.int64 and s.tokens.tolist() == tok.encode(TEXTS[s.lang])
        assert s.duration == pytest.approx(s.audio.numel() / SR)
    expected_seconds = {0: 0.5, 1: 0.25, 2: 0.75, 3: 0.4, 8: 0.3}
    for i, seconds in expected_seconds.items():
        assert abs(items[i].audio.numel() - seconds * SR) <= 1
    assert [items[i].lang for i in GOOD] == ["hi", "bn", "ta", "en", "hi"]
    for i, reason in DROPS.items():
        assert items[i] == DroppedSample(i, reason, items[i].detail, items[i].path)
        assert items[i].detail
    with pytest.raises(IndexError, match="out of range"):
        ds[9]


def test_relative_path_needs_base_dir(corpus: tuple[Path, pa.Table], tok: Tokenizer) -> None:
    root, table = corpus
    assert SpeechDataset(table, tok, base_dir=root)[3].__class__ is Sample
    in_other_dir = SpeechDataset(table, tok, base_dir=root / "elsewhere")[3]
    assert isinstance(in_other_dir, DroppedSample) and in_other_dir.reason == "missing_file"


def test_too_many_tokens_dropped_not_truncated(corpus: tuple[Path, pa.Table], tok: Tokenizer) -> None:
    _, table = corpus
    s = SpeechDataset(table, tok, max_tokens=3)[0]
    assert isinstance(s, DroppedSample) and s.reason == "too_many_tokens"
    assert Collator(tok.pad_id)([s, s]).dropped == {"too_many_tokens": 2}


def test_dataset_rejects_bad_manifests(corpus: tuple[Path, pa.Table], tok: Tokenizer, tmp_path: Path) -> None:
    _, table = corpus
    with pytest.raises(ValueError, match=r"language\(s\) \['fr'\].*speechlm tokenizer train"):
        SpeechDataset(table.set_column(5, "lang", pa.array(["fr"] * 9)), tok)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['text'\]"):
        SpeechDataset(table.drop(["text"]), tok)
    nulls = table.set_column(2, "audio_filepath", pa.array(["x"] * 8 + [None], pa.string()))
    with pytest.raises(ValueError, match="row 8 .segment seg8.: column audio_filepath is null"):
        SpeechDataset(nulls, tok)
    pq.write_table(table.drop(["lang"]), tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"m\.parquet.*'lang'"):
        SpeechDataset(tmp_path / "m.parquet", tok)
    with pytest.raises((FileNotFoundError, ValueError), match="speechlm manifest build"):
        SpeechDataset(tmp_path / "none.parquet", tok)


# -------------------------------------------------------------------------------------------- collate


def make_sample(index: int, n_audio: int, tokens: list[int], lang: str = "hi") -> Sample:
    audio = torch.arange(1, n_audio + 1, dtype=torch.float32)
    return Sample(index, audio, torch.tensor(tokens, dtype=torch.int64), n_audio / SR, lang)


def test_collate_pads_and_counts_drops() -> None:
    items = [
        make_sample(3, 4, [5, 10, 11]),
        DroppedSample(7, "undecodable"),
        make_sample(1, 6, [6]),
        DroppedSample(2, "missing_file"),
        DroppedSample(9, "undecodable"),
    ]
    b = Collator(pad_id=99)(items)
    assert len(b) == 2 and b.indices == [3, 1] and b.langs == ["hi", "hi"]
    assert b.audio.shape == (2, 6) and b.audio.dtype == torch.float32
    assert b.audio[0].tolist() == [1, 2, 3, 4, 0, 0] and b.audio[1].tolist() == [1, 2, 3, 4, 5, 6]
    assert b.audio_lens.tolist() == [4, 6] and b.audio_lens.dtype == torch.int64
    assert b.tokens.tolist() == [[5, 10, 11], [6, 99, 99]] and b.tokens.dtype == torch.int64
    assert b.token_lens.tolist() == [3, 1] and b.token_lens.dtype == torch.int64
    assert b.durations.dtype == torch.float32 and b.durations.tolist() == pytest.approx([4 / SR, 6 / SR])
    assert b.dropped == {"undecodable": 2, "missing_file": 1}


def test_all_dropped_gives_empty_batch_with_counts() -> None:
    b = Collator(pad_id=0)([DroppedSample(0, "empty_audio"), DroppedSample(1, "undecodable")])
    assert len(b) == 0 and b.is_empty
    assert b.audio.shape == (0, 0) and b.tokens.shape == (0, 0)
    assert b.audio_lens.shape == b.token_lens.shape == b.durations.shape == (0,)
    assert b.langs == [] and b.indices == []
    assert b.dropped == {"empty_audio": 1, "undecodable": 1}
    moved = b.to("cpu")
    assert len(moved) == 0 and moved.dropped == b.dropped
    with pytest.raises(TypeError, match="expected Sample or DroppedSample"):
        Collator(0)([None])  # type: ignore[list-item]


def test_batch_to_and_pin_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data._utils.pin_memory import pin_memory as pin_like_dataloader

    b = Collator(0)([make_sample(0, 3, [5, 9]), DroppedSample(1, "missing_file")])
    moved = b.to(torch.device("cpu"))
    assert isinstance(moved, Batch) and torch.equal(moved.tokens, b.tokens) and moved.dropped == b.dropped
    if not torch.accelerator.is_available():  # no page-locked memory without an accelerator: fake it
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    pinned = pin_like_dataloader(b)
    assert isinstance(pinned, Batch) and pinned.indices == [0] and pinned.dropped == {"missing_file": 1}
    assert torch.equal(pinned.audio, b.audio) and torch.equal(pinned.token_lens, b.token_lens)
    if torch.accelerator.is_available():
        assert pinned.audio.is_pinned() and pinned.tokens.is_pinned()


# --------------------------------------------------------------------------------------------- loader

BATCHES = [[0, 4], [1, 2, 5], [6, 7], [3], [8, 0, 1]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_in_order_with_drop_counts(
    corpus: tuple[Path, pa.Table], tok: Tokenizer, num_workers: int
) -> None:
    root, _ = corpus
    ds = SpeechDataset(root / "manifest.parquet", tok)
    loader = build_dataloader(ds, BATCHES, num_workers=num_workers, pin_memory=True, seed=3)
    counter: Counter[str] = Counter()
    seen = []
    for batch in loader:
        assert isinstance(batch, Batch)
        counter += Counter(batch.dropped)
        seen.append(batch.indices)
        assert batch.tokens.shape[0] == batch.audio.shape[0] == len(batch)
    assert seen == [[i for i in b if i not in DROPS] for b in BATCHES]
    assert seen[2] == []  # both rows failed: an empty batch, still yielded in its place
    assert counter == {"missing_file": 1, "undecodable": 2, "empty_audio": 1}


class RandomProbe(Dataset):
    """Each item draws from random, numpy and torch, to expose how the worker was seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Sample:
        draws = [random.random(), float(np.random.rand()), float(torch.rand(()))]
        info = torch.utils.data.get_worker_info()
        worker = -1 if info is None else info.id
        return Sample(i, torch.tensor(draws), torch.tensor([worker]), 0.0, "xx")


def collect_draws(seed: int) -> list[list[float]]:
    loader = build_dataloader(
        RandomProbe(), [[0], [1], [2], [3]], num_workers=2, seed=seed, collate_fn=Collator(0)
    )
    batches = list(loader)
    assert [b.tokens.item() for b in batches] == [0, 1, 0, 1]  # round-robin over the two workers
    return [b.audio[0].tolist() for b in batches]


def test_worker_seeding_is_deterministic_and_distinct() -> None:
    first = collect_draws(seed=11)
    assert first == collect_draws(seed=11)
    assert first != collect_draws(seed=12)
    assert first[0] != first[1]  # the two workers do not share a stream
    for k in range(3):  # and none of the three generators is shared
        assert first[0][k] != first[1][k]


def test_seed_worker_depends_on_seed_and_worker_only() -> None:
    def draw(seed: int, worker: int) -> tuple[float, float, float]:
        seed_worker(worker, seed=seed)
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        assert draw(0, 0) == draw(0, 0)
        assert draw(0, 0) != draw(0, 1) and draw(0, 0) != draw(1, 0)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


def test_build_dataloader_needs_a_pad_id() -> None:
    with pytest.raises(ValueError, match="collate_fn=Collator"):
        build_dataloader(RandomProbe(), [[0]])


def test_dataset_pickles_for_spawned_workers(corpus: tuple[Path, pa.Table], tok: Tokenizer) -> None:
    import pickle

    root, _ = corpus
    ds = SpeechDataset(root / "manifest.parquet", tok)
    clone = pickle.loads(pickle.dumps(ds))
    a, b = ds[1], clone[1]
    assert isinstance(a, Sample) and isinstance(b, Sample)
    assert torch.equal(a.audio, b.audio) and torch.equal(a.tokens, b.tokens) and a.lang == b.lang
