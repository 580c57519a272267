"""Each CP rank decodes only the clips it encodes (issue 40 item 2, `speechlm.data.local_decode`): the
header's length is the decoded one; per rank, the batch is today's but for the audio of the clips another
rank encodes; every clip is decoded once over the group; a clip that fails only when decoded is an error
of the step naming the row, on the rank that decodes it; a resumed loader gives the same next batch."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch
from local_decode_helpers import nan_clip_table

from parallel.clip_placement import clip_readers, place_clips
from parallel.cp_layout import DynamicCPLayout, NullCPLayout
from speechlm.data import audio as audio_mod
from speechlm.data.audio import decode_audio, probe_length
from speechlm.data.batch import Batch
from speechlm.data.dataset import Collator, SpeechDataset
from speechlm.data.local_decode import LocalCollator
from speechlm.data.samples import DroppedSample, Sample
from speechlm.data.sources.detect import load_source
from speechlm.data.tokenizer import Tokenizer
from speechlm.model.clip_planner import ClipPlanner, ModelShape
from speechlm.packing.prompt import ConversationRenderer, build_prompt_format

THRESHOLD = 60  # tokens: the demo's micro-batches below hold whole and split samples at cp 2


@pytest.fixture(scope="module")
def tok(demo_data) -> Tokenizer:
    return Tokenizer(demo_data["tok"])


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    from parallel_harness import build_model, tiny_config

    return ModelShape.of(build_model(tiny_config()))


def planner(shape: ModelShape, tok: Tokenizer, cp: int, rank: int, threshold: int | str = THRESHOLD):
    layout = (
        NullCPLayout()
        if cp == 1
        else DynamicCPLayout(None, cp, rank, "ring", threshold=threshold, pair_cost=1 / 192)
    )
    return ClipPlanner(shape, layout, build_prompt_format(tok), tok.audio_id, compressed=False)


def datasets(demo_data, tok, table=None) -> tuple[SpeechDataset, SpeechDataset]:
    table = load_source(demo_data["train"]) if table is None else table
    today = SpeechDataset(table, tok, renderer=ConversationRenderer(tok))
    local = SpeechDataset(table, tok, renderer=ConversationRenderer(tok), defer_audio=True)
    return today, local


@pytest.mark.parametrize("sr", [16000, 22050, 44100, 8000])
@pytest.mark.parametrize("cut", [None, (0.13, 0.41), (0.2, None), (0.9, 5.0)])
def test_the_header_gives_the_decoded_length(tmp_path, sr, cut):
    path = tmp_path / f"x{sr}.wav"
    sf.write(path, np.random.default_rng(0).uniform(-0.5, 0.5, (int(1.037 * sr), 2)), sr)
    start, duration = cut or (0.0, None)
    got = probe_length(str(path), "x", 16000, start=start, duration=duration)
    assert got == decode_audio(str(path), "x", 16000, start=start, duration=duration).size


@pytest.mark.parametrize("fmt, subtype, sr", [("MP3", "MPEG_LAYER_III", 44100), ("OGG", "VORBIS", 22050),
                                              ("OGG", "OPUS", 48000), ("FLAC", "PCM_16", 48000)])  # fmt: skip
def test_compressed_formats_give_their_decoded_length_in_the_header(tmp_path, fmt, subtype, sr):
    path = tmp_path / f"x.{subtype.lower()}"
    sf.write(
        path, np.random.default_rng(1).uniform(-0.3, 0.3, int(3.7 * sr)), sr, format=fmt, subtype=subtype
    )
    for start, duration in ((0.0, None), (0.5, 1.25)):
        got = probe_length(str(path), "x", 16000, start=start, duration=duration)
        assert got == decode_audio(str(path), "x", 16000, start=start, duration=duration).size


def test_the_demo_rows_probe_to_their_decoded_lengths_without_decoding(demo_data, tok, monkeypatch):
    today, local = datasets(demo_data, tok)
    rows = list(range(0, len(today), 7))
    want = Collator(tok.pad_id)(today.__getitems__(rows))
    monkeypatch.setattr(audio_mod.sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded a clip"))
    items = local.__getitems__(rows)
    samples = [s for s in items if isinstance(s, Sample)]
    assert [s.reason for s in items if isinstance(s, DroppedSample)] == want_reasons(want)  # the header says
    lens = [p.samples for s in samples for p in s.pending]
    assert lens == want.audio_lens.tolist() and all(s.audio.numel() == 0 for s in samples)


def want_reasons(batch: Batch) -> list[str]:
    return [r for r, n in sorted(batch.dropped.items()) for _ in range(n)]


def _micro_batches(n_rows: int, size: int) -> list[list[int]]:
    order = np.random.default_rng(3).permutation(n_rows)
    return [order[k : k + size].tolist() for k in range(0, size * 4, size)]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_decodes_its_clips_once_and_the_batch_is_todays(demo_data, tok, shape, cp, monkeypatch):
    today, local = datasets(demo_data, tok)
    calls: list[int] = []
    real = audio_mod.sf.SoundFile.read

    def counted(self, *a, **k):  # every decode reads samples; a header probe reads none
        calls.append(1)
        return real(self, *a, **k)

    split_seen = redecoded = False
    for rows in _micro_batches(len(today), 6):
        want = Collator(tok.pad_id)(today.__getitems__(rows))
        per_rank = []
        monkeypatch.setattr(audio_mod.sf.SoundFile, "read", counted)
        for r in range(cp):
            calls.clear()
            got = LocalCollator(tok.pad_id, planner(shape, tok, cp, r))(local.__getitems__(rows))
            per_rank.append((got, len(calls)))
        monkeypatch.undo()
        if any(g.local_failure for g, _ in per_rank):  # the demo's broken FLAC: the step is read whole
            redone = _redecode(local, [g for g, _ in per_rank])
            assert all(b.indices == want.indices and torch.equal(b.audio, want.audio) for b in redone)
            assert all(b.dropped == want.dropped == {"undecodable": 1} for b in redone)
            redecoded = True
            continue
        present = torch.stack([g.audio_present for g, _ in per_rank])  # [cp, C]
        # every clip decoded on exactly one rank (no clip is sharded by this encoder), each rank decoding
        # nothing else (its decode calls are its present clips)
        assert present.sum(0).tolist() == [1] * want.num_clips
        assert [n for _, n in per_rank] == present.sum(1).tolist()
        owners = planner(shape, tok, cp, 0)
        readers = [[r for r in range(cp) if present[r, c]] for c in range(want.num_clips)]
        assert readers == [list(x) for x in _readers(owners, want)]
        for r, (got, _) in enumerate(per_rank):
            assert got.local_failure is None
            for f in dataclasses.fields(Batch):
                if f.name in ("audio", "audio_present", "source_rows"):
                    continue
                a, b = getattr(got, f.name), getattr(want, f.name)
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
            for c in range(want.num_clips):
                n = int(want.audio_lens[c])
                if present[r, c]:
                    assert torch.equal(got.audio[c, :n], want.audio[c, :n])
                else:  # no sample of it here, and the row cannot be read as a clip of that length
                    assert got.audio.shape[1] < n or not got.audio[c].any()
        split_seen |= len({int(present[:, c].nonzero()[0]) for c in range(want.num_clips)}) > 1
    assert split_seen and redecoded  # clips spread over the ranks; one micro-batch has the broken clip


def _redecode(local: SpeechDataset, batches: list[Batch]) -> list[Batch]:
    from speechlm.train.data import StepBatch, StepLoader

    loader = StepLoader(SimpleNamespace(epoch=0, position=0), local, grad_accum=1)  # type: ignore[arg-type]
    return [loader.redecode(StepBatch([b], {"epoch": 0, "position": 1})).micro_batches[0] for b in batches]


def _readers(planner_: ClipPlanner, batch: Batch) -> list[tuple[int, ...]]:
    from speechlm.model.cp_audio import plan_audio

    ap = plan_audio(planner_.shape, planner_.layout, batch, audio_id=planner_.audio_id, compressed=False)
    return ap.readers(planner_.layout.cp_size)


def test_clip_readers_name_the_owner_or_the_group_of_a_sharded_clip():
    whole = place_clips([10, 900, 10], 2, min_frames=100)
    assert whole.sharded == (False, True, False)
    assert clip_readers([1, 0, 1], whole, 2) == [(1,), (0, 1), (1,)]
    assert clip_readers([0, 0], None, 1) == [(0,), (0,)]
    # hybrid CP degrees: a long clip of a sequence over ranks 2-3 of 4 is read there only
    sub = place_clips([900, 900, 10], 4, min_frames=100, groups=[(2, 2), (0, 4), (0, 4)])
    assert sub.sharded == (True, True, False)
    assert clip_readers([3, 1, 0], sub, 4) == [(2, 3), (0, 1, 2, 3), (0,)]
    with pytest.raises(ValueError, match="clip 1 is owned by rank 2"):
        clip_readers([0, 2], None, 2)


def test_a_clip_that_fails_only_when_decoded_marks_its_ranks_batch_and_redecoding_gives_todays(
    demo_data, tok, shape, tmp_path
):
    from speechlm.train.data import DroppedDataError, StepBatch, StepLoader

    table = nan_clip_table(demo_data, tmp_path)
    today, local = datasets(demo_data, tok, table)
    rows = [0, 5, 9, 14]
    want = Collator(tok.pad_id)(today.__getitems__(rows))
    assert want.dropped == {"undecodable": 1} and 0 not in want.indices  # today: dropped, counted
    got = [LocalCollator(tok.pad_id, planner(shape, tok, 2, r))(local.__getitems__(rows)) for r in range(2)]
    owner = next(r for r in range(2) if got[r].local_failure)
    assert got[1 - owner].local_failure is None and not got[1 - owner].audio_present[0]
    assert "row 0" in got[owner].local_failure and "nan.wav" in got[owner].local_failure
    assert "NaN" in got[owner].local_failure
    for limit, fails in ((1.0, False), (0.1, True)):
        sampler = SimpleNamespace(epoch=0, position=0)
        loader = StepLoader(sampler, local, grad_accum=1, max_dropped_fraction=limit)  # type: ignore[arg-type]
        for b in got:  # what every rank does once the flag is agreed: the same rows, every clip decoded
            step = StepBatch([b], {"epoch": 0, "position": 3})
            if fails:  # too much of the micro-batch unreadable: the step fails, the row named (as today)
                with pytest.raises(DroppedDataError, match=r"(?s)micro-batch 2 \(epoch 0\).*nan.wav"):
                    loader.redecode(step)
                continue
            again = loader.redecode(step).micro_batches[0]
            assert again.audio_present is None and again.dropped == want.dropped
            for f in ("audio", "audio_lens", "prompt_ids", "clip_sample", "durations"):
                assert torch.equal(getattr(again, f), getattr(want, f)), f
            assert again.indices == want.indices and again.dropped_files == want.dropped_files


def _step_loader(demo_data, tok, shape, rank: int | None, seed: int = 0):
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings
    from speechlm.train.data import StepLoader

    today, local = datasets(demo_data, tok)
    table = load_source(demo_data["train"])
    durations = table.column("duration").to_numpy().astype(np.float32)
    settings = SamplerSettings(dp_size=1, grad_accum=2, max_batch_duration=20.0, seed=seed)
    sampler = DurationBucketBatchSampler(durations, np.zeros(len(durations), np.int32), ["en"], settings)
    loader = StepLoader(sampler, today if rank is None else local, grad_accum=2, seed=seed)
    if rank is not None:
        loader.decode_local(planner(shape, tok, 2, rank))
    return loader


def test_a_resumed_loader_gives_the_same_next_batch_on_every_rank(demo_data, tok, shape):
    for rank in (0, 1):
        whole = iter(_step_loader(demo_data, tok, shape, rank))
        first, second = next(whole), next(whole)
        resumed = _step_loader(demo_data, tok, shape, rank)
        loader = _step_loader(demo_data, tok, shape, rank)
        loader.mark_consumed(first.position)
        resumed.restore(loader.state_dict())
        again = next(iter(resumed))
        assert again.rows_digest() == second.rows_digest() and again.position == second.position
        for a, b in zip(again.micro_batches, second.micro_batches, strict=True):
            assert torch.equal(a.audio, b.audio) and torch.equal(a.audio_present, b.audio_present)
    today = next(iter(_step_loader(demo_data, tok, shape, None)))
    assert today.rows_digest() == first.rows_digest()  # the rows are today's


def test_the_planner_travels_to_a_loader_worker_without_the_model(demo_data, tok, shape):
    """A DataLoader worker started by spawn gets the collate_fn pickled: the planner holds lengths only (no
    weights, no process group) and answers the same there; a worker process decodes the same clips."""
    import pickle

    today, local = datasets(demo_data, tok)
    rows = _micro_batches(len(today), 6)[1]
    plan = planner(shape, tok, 2, 1)
    blob = pickle.dumps(LocalCollator(tok.pad_id, plan))
    assert len(blob) < 20_000
    want = LocalCollator(tok.pad_id, plan)(local.__getitems__(rows))
    got = pickle.loads(blob)(local.__getitems__(rows))
    assert torch.equal(got.audio_present, want.audio_present) and torch.equal(got.audio, want.audio)
    from speechlm.data.dataset import build_dataloader

    loader = build_dataloader(local, [rows], num_workers=1, collate_fn=LocalCollator(tok.pad_id, plan))
    (batch,) = list(loader)
    assert torch.equal(batch.audio_present, want.audio_present) and torch.equal(batch.audio, want.audio)
