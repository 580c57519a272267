"""Long-form audio through the data path (issue 25, item 1): clips of tens of minutes are planned, each one
longer than the micro-batch budget is a micro-batch of its own (never trimmed away), `data.max_duration`
leaves longer rows out (counted, never silently), and `speechlm plan` shows both."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parallel.cp_placement import place_sequences
from speechlm.cli import main
from speechlm.config import ConfigError, load_config
from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings, build_epoch_plan
from speechlm.data.sampler.cost import TokenCostModel
from speechlm.data.sampler.stateful import SamplerStateError
from speechlm.data.sampler.streaming import build_streaming_plan

LONG = np.array([600.0, 1800.0, 3600.0, 2400.5], np.float32)  # 10, 30, 60 and 40 minutes


def long_form_durations(n_short: int = 1500, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = rng.uniform(2.0, 20.0, n_short).astype(np.float32)
    out = np.concatenate([short, LONG])
    return out[rng.permutation(len(out))]


def batches_of(plan) -> list[np.ndarray]:
    return [plan.batch(r, s) for r in range(plan.dp_size) for s in range(plan.batches_per_rank)]


@pytest.mark.parametrize("mode", ["temperature", "exhaustive"])
# a 10-minute clip is 3,754 tokens: over the token budget too
@pytest.mark.parametrize("budget", [{"max_batch_duration": 90.0}, {"max_batch_tokens": 2048}])
def test_a_clip_over_the_budget_is_a_micro_batch_of_its_own_and_never_trimmed(mode, budget):
    durations = long_form_durations()
    langs = np.zeros(len(durations), np.int32)
    settings = SamplerSettings(dp_size=2, grad_accum=2, mode=mode, bucket_boundaries=None, **budget)
    plan = build_epoch_plan(durations, langs, settings)
    long_rows = set(np.flatnonzero(durations >= 600).tolist())
    seen = {}
    for batch in batches_of(plan):
        for row in batch.tolist():
            if row in long_rows:
                assert len(batch) == 1, f"a {durations[row]:g} s clip shares its micro-batch"
                seen[row] = seen.get(row, 0) + 1
    assert seen == dict.fromkeys(long_rows, 1)  # every long clip trains once: the trims drop the cheapest
    assert plan.too_long == 0


def test_max_duration_leaves_longer_rows_out_and_counts_them():
    durations = long_form_durations()
    langs = np.zeros(len(durations), np.int32)
    for mode in ("exhaustive", "temperature"):
        s = SamplerSettings(mode=mode, max_batch_duration=90.0, bucket_boundaries=None, max_duration=1000.0)
        plan = build_epoch_plan(durations, langs, s)
        planned = np.concatenate([plan.rows[plan.batch_offsets[b] : plan.batch_offsets[b + 1]]
                                  for b in range(len(plan.batch_offsets) - 1)])  # fmt: skip
        assert durations[plan.rows].max() == 600.0  # the 10-minute clip stays, the longer ones go
        assert plan.too_long == 3 and len(plan.rows) == len(durations) - 3
        assert len(planned) == len(plan.rows)
        # the packer's segments moved with the rows: no micro-batch of two rows exceeds the budget
        for b in range(len(plan.batch_offsets) - 1):
            rows = plan.rows[plan.batch_offsets[b] : plan.batch_offsets[b + 1]]
            assert len(rows) == 1 or durations[rows].sum(dtype=np.float64) <= 90.0 + 1e-6


def test_max_duration_estimates_the_buckets_of_the_planned_rows_only():
    durations = long_form_durations()
    s = SamplerSettings(bucket_boundaries=None, num_buckets=30, max_duration=1000.0)
    assert max(s.with_buckets(durations).boundaries) < 1000.0
    assert max(SamplerSettings(bucket_boundaries=None).with_buckets(durations).boundaries) > 1000.0


def test_max_duration_below_every_row_is_an_error_naming_the_key():
    durations = np.array([30.0, 40.0, 50.0], np.float32)
    with pytest.raises(ValueError, match=r"data\.max_duration=10 s .*shortest row lasts 30 s"):
        build_epoch_plan(durations, np.zeros(3, np.int32), SamplerSettings(max_duration=10.0))
    with pytest.raises(ValueError, match="max_duration=-1"):
        SamplerSettings(max_duration=-1.0).check()


def test_data_max_duration_is_a_config_key_with_a_range():
    assert load_config(None).data.max_duration is None  # the default: no limit, as before
    assert load_config(None, ["data.max_duration=3600"]).data.max_duration == 3600.0
    with pytest.raises(ConfigError, match="data.max_duration"):
        load_config(None, ["data.max_duration=0"])


def test_streaming_plan_leaves_the_same_rows_out():
    durations = long_form_durations(300)
    n = len(durations)
    s = SamplerSettings(max_batch_duration=90.0, bucket_boundaries=None, max_duration=1000.0)
    plan = build_streaming_plan(
        durations, np.zeros(n, np.int32), np.arange(n) // 50, np.arange(n), s, 0,
        streams_per_rank=1, shuffle_buffer=8, sort_buffer=8,
    )  # fmt: skip
    assert plan.too_long == 3 and durations[plan.rows].max() == 600.0


def test_the_sampler_state_holds_max_duration_only_when_set():
    durations = long_form_durations(300)
    langs = np.zeros(len(durations), np.int32)
    edges = (5.0, 10.0, 15.0)  # fixed: only the limit differs between the two samplers
    plain = DurationBucketBatchSampler(durations, langs, ["en"], SamplerSettings(bucket_boundaries=edges))
    assert "max_duration" not in plain.state_dict()["params"]  # checkpoints made without a limit still resume
    limited = DurationBucketBatchSampler(
        durations, langs, ["en"], SamplerSettings(bucket_boundaries=edges, max_duration=1000.0)
    )
    assert limited.state_dict()["params"]["max_duration"] == 1000.0
    with pytest.raises(SamplerStateError, match="data.max_duration"):
        plain.load_state_dict(limited.state_dict())


def test_a_long_clip_alone_in_its_micro_batch_is_split_over_the_whole_cp_group():
    """The micro-batch of one 60-minute clip (22,500 audio tokens + a 6,000-token transcript) is given to
    every CP rank (the sampler runs over dp ranks only) and dynamic CP splits it over all of them."""
    tokens = int(TokenCostModel().count_tokens(np.array([3600.0]), np.array([6000]))[0])
    for threshold in ("auto", 0, 4096):
        p = place_sequences([tokens], 4, threshold=threshold, tp=1, pair_cost=1 / (6 * 256))
        assert p.split == (True,) and p.local_tokens(0) == p.local_tokens(3) == p.split_total // 4


@pytest.fixture()
def long_manifest(tmp_path):
    durations = long_form_durations(600)
    path = tmp_path / "long.parquet"
    table = pa.table({"duration": pa.array(durations, pa.float32()), "lang": ["en"] * len(durations)})
    pq.write_table(table, path)
    return path


def test_plan_shows_the_long_utterances_and_what_max_duration_leaves_out(long_manifest, tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--manifest", str(long_manifest), "--max-batch-duration", "90", "--mode", "exhaustive"]
    assert main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "long utterances: 4 micro-batches hold one utterance over the budget" in text
    assert "the longest 3600 s" in text and "left out" not in text
    summary = json.loads(out.read_text())
    assert summary["over_budget"]["micro_batches"] == 4
    assert summary["over_budget"]["hours"] == pytest.approx(float(LONG.sum()) / 3600, rel=1e-6)
    assert summary["too_long_utterances"] == 0

    assert main([*args, "--max-duration", "1000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "long utterances: 1 micro-batches hold one utterance over the budget" in text
    assert "left out: 3 utterances longer than data.max_duration=1000 s" in text
    summary = json.loads(out.read_text())
    assert summary["too_long_utterances"] == 3 and summary["max_duration"] == 1000.0


def test_plan_reads_data_max_duration_from_the_config(long_manifest, tmp_path, capsys):
    cfg = tmp_path / "long.yaml"
    cfg.write_text(
        f"data:\n  train_manifest: {long_manifest}\n  max_duration: 2000\nsampler:\n  mode: exhaustive\n"
    )
    assert main(["plan", "--config", str(cfg)]) == 0
    assert "left out: 2 utterances longer than data.max_duration=2000 s" in capsys.readouterr().out
