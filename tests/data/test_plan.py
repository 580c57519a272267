"""`speechlm plan`: the printed summary, the JSON plan, config + flag precedence, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speechlm.cli import main
from speechlm.data.plan.figures import cp_padding
from speechlm.data.plan.inputs import read_plan_inputs
from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings, build_epoch_plan

NAMES = ["sw", "en", "de"]  # deliberately unsorted: the plan codes languages by sorted name


@pytest.fixture()
def manifest(tmp_path):
    rng = np.random.default_rng(0)
    n = 6000
    durations = np.clip(rng.lognormal(np.log(5), 0.6, n), 0.5, 20).astype(np.float32)
    langs = rng.choice(3, size=n, p=[0.1, 0.7, 0.2])
    path = tmp_path / "train.parquet"
    table = pa.table({"duration": pa.array(durations, pa.float32()), "lang": [NAMES[i] for i in langs]})
    pq.write_table(table, path)
    return path, durations, [NAMES[i] for i in langs]


def test_plan_prints_the_summary_and_writes_every_rank(manifest, tmp_path, capsys):
    path, durations, langs = manifest
    out = tmp_path / "plan.json"
    rc = main(["plan", "--manifest", str(path), "--dp-size", "2", "--grad-accum", "2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for phrase in (
        "micro-batches per rank",
        "optimizer steps per epoch",
        "h of audio per optimizer step",
        "natural",
        "target",
        "bucket",
        "BSHD",
        "THD",
    ):
        assert phrase in text
    plan = json.loads(out.read_text())
    for key in (
        "ranks",
        "micro_batches_per_rank",
        "optimizer_steps_per_epoch",
        "audio_hours_per_step",
        "languages",
        "buckets",
        "padding",
        "settings",
        "manifest",
    ):
        assert key in plan
    assert len(plan["ranks"]) == 2
    assert {len(r) for r in plan["ranks"]} == {plan["micro_batches_per_rank"]}
    assert plan["micro_batches_per_rank"] % 2 == 0
    flat = [i for rank in plan["ranks"] for batch in rank for i in batch]
    assert all(isinstance(i, int) and 0 <= i < len(durations) for i in flat)
    assert plan["padding"]["thd_efficiency"] == 1.0 >= plan["padding"]["bshd_efficiency"]
    assert sum(b["utterances"] for b in plan["buckets"]) == len(flat)
    # the same micro-batches the training sampler hands rank 1 (languages coded by sorted name)
    codes = np.searchsorted(sorted(NAMES), langs)
    settings = SamplerSettings(dp_size=2, grad_accum=2, bucket_boundaries=None)  # the config's default
    sampler = DurationBucketBatchSampler(durations, codes, sorted(NAMES), settings, dp_rank=1)
    assert list(sampler) == plan["ranks"][1]


def test_plan_reads_a_config_and_flags_override_it(manifest, tmp_path):
    path, durations, _ = manifest
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(
        f"data:\n  train_manifest: {path}\n"
        "sampler:\n  mode: exhaustive\n  max_batch_duration: 30.0\n  seed: 5\n"
        "trainer:\n  grad_accum: 3\n"
        "parallel:\n  dp_shard: 2\n"
    )
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(cfg), "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["settings"]["max_batch_duration"] == 30.0 and plan["grad_accum"] == 3 and plan["dp_size"] == 2
    flat = [i for rank in plan["ranks"] for batch in rank for i in batch]
    assert len(flat) == len(set(flat))  # exhaustive: every row at most once
    assert all(durations[b].sum() <= 30.0 or len(b) == 1 for rank in plan["ranks"] for b in rank)

    assert (
        main(
            [
                "plan",
                "--config",
                str(cfg),
                "--grad-accum",
                "1",
                "--max-batch-tokens",
                "800",
                "--mode",
                "temperature",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plan = json.loads(out.read_text())
    assert plan["grad_accum"] == 1 and plan["mode"] == "temperature"
    assert plan["settings"]["max_batch_tokens"] == 800


def test_plan_with_text_estimates_tokens_and_thd_rounding(tmp_path, capsys):
    path = tmp_path / "m.parquet"
    n = 3000
    rng = np.random.default_rng(1)
    durations = rng.uniform(1, 15, n).astype(np.float32)
    table = pa.table(
        {
            "duration": durations,
            "lang": pa.array(["en"] * n).dictionary_encode(),
            "text": ["a b c " * int(d) for d in durations],
        }
    )
    pq.write_table(table, path)
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--manifest", str(path), "--cp-size", "2", "--tp-size", "2", "--json", str(out)]) == 0
    )
    pad = json.loads(out.read_text())["padding"]
    assert pad["text_tokens_estimated"] and pad["cp_size"] == 2
    assert pad["bshd_efficiency"] < pad["thd_efficiency"] <= 1.0
    assert pad["thd_efficiency_split_all"] <= pad["thd_efficiency"] and pad["cp_max_over_mean"] >= 1.0
    assert 0.0 <= pad["cp_ring_token_share"] <= 1.0 and pad["cp_split_threshold"] == "auto"
    out_text = capsys.readouterr().out
    assert "text ~ chars/3" in out_text and "CP placement (cp_split_threshold=auto)" in out_text


def test_plan_prints_whole_or_all_split_all_and_hybrid_side_by_side(tmp_path, capsys, monkeypatch):
    """Issue 40: `speechlm plan --cp-size N` shows the three CP placements (real/computed tokens, max/mean
    rank cost, share of tokens whose K/V travel); hybrid degrees pad least on a fixed micro-batch."""
    import speechlm.data.plan.figures as plan_module
    from benchmarks.bench_cp_placement import write_manifest

    path, out = tmp_path / "m.parquet", tmp_path / "plan.json"
    write_manifest(path, 3000, 20.0)
    argv = ["plan", "--manifest", str(path), "--cp-size", "8", "--max-batch-duration", "90"]
    assert main([*argv, "--json", str(out)]) == 0
    layouts = json.loads(out.read_text())["cp_layouts"]
    assert set(layouts) == {"whole_or_all", "split_all", "hybrid"}
    assert layouts["split_all"]["ring_token_share"] == 1.0 and layouts["split_all"]["max_over_mean"] == 1.0
    assert layouts["split_all"]["efficiency"] < layouts["whole_or_all"]["efficiency"]
    assert layouts["whole_or_all"]["efficiency"] < layouts["hybrid"]["efficiency"]
    assert layouts["hybrid"]["efficiency"] >= 0.99 and layouts["hybrid"]["max_over_mean"] <= 1.05
    assert layouts["hybrid"]["micro_batches"] == layouts["hybrid"]["of_micro_batches"]
    text = capsys.readouterr().out
    assert "CP placements side by side (cp 8, tp 1):" in text
    hybrid = next(line for line in text.splitlines() if "hybrid degrees" in line)
    assert f"{100 * layouts['hybrid']['efficiency']:.1f}%" in hybrid
    # a long epoch: hybrid placement is estimated on an evenly strided sample of the micro-batches
    monkeypatch.setattr(plan_module, "HYBRID_MICRO_BATCHES", 5)
    assert main([*argv, "--json", str(out)]) == 0
    sampled = json.loads(out.read_text())["cp_layouts"]["hybrid"]
    assert sampled["micro_batches"] == 5 < sampled["of_micro_batches"]
    assert f"(5 of {sampled['of_micro_batches']:,} micro-batches)" in capsys.readouterr().out
    assert main(["plan", "--manifest", str(path), "--json", str(out)]) == 0  # cp 1: nothing to compare
    assert json.loads(out.read_text())["cp_layouts"] == {}
    assert "side by side" not in capsys.readouterr().out


def test_thd_rounding_matches_the_packing_module():
    packing = pytest.importorskip("speechlm.packing.thd")
    lengths = np.array([5, 9, 1, 12, 7, 3])
    offsets = np.array([0, 2, 6])
    for cp, tp in [(1, 1), (1, 4), (2, 1), (2, 2), (4, 2)]:
        expected = sum(sum(packing.round_lengths(lengths[a:b].tolist(), cp, tp)) for a, b in [(0, 2), (2, 6)])
        assert cp_padding(lengths, offsets, cp, tp, 0, 0.0)["computed"] == expected  # threshold 0: split all


def test_plan_inputs_code_languages_by_sorted_name(manifest):
    path, durations, langs = manifest
    inputs = read_plan_inputs(path)
    assert inputs.lang_names == sorted(NAMES)
    assert [inputs.lang_names[c] for c in inputs.lang_codes[:50]] == langs[:50]
    assert inputs.text_chars is None and inputs.durations.dtype == np.float32
    plan = build_epoch_plan(inputs.durations, inputs.lang_codes, SamplerSettings(dp_size=1))
    assert plan.manifest_rows == len(durations)


def test_plan_errors_name_the_manifest(tmp_path, capsys):
    missing = tmp_path / "nope.parquet"
    assert main(["plan", "--manifest", str(missing)]) == 1
    assert str(missing) in capsys.readouterr().err
    bad = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"duration": [1.0, 2.0]}), bad)
    assert main(["plan", "--manifest", str(bad)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "'lang'" in err


def test_parquet_plan_inputs_are_read_batch_by_batch(tmp_path, monkeypatch):
    """The texts are reduced to lengths batch by batch: `read_table` (all columns at once) is never used."""
    rng = np.random.default_rng(1)
    n = 700_000  # several batches
    texts = pa.array([f"<|en|> {'x' * int(k)}" for k in rng.integers(1, 40, n)])
    langs = pa.DictionaryArray.from_arrays(pa.array(rng.integers(0, 3, n).astype(np.int8)), pa.array(NAMES))
    durations = rng.uniform(0.5, 20, n).astype(np.float32)
    path = tmp_path / "m.parquet"
    pq.write_table(
        pa.table({"duration": durations, "lang": langs, "text": texts}), path, row_group_size=100_000
    )

    def refuse(*a, **k):
        raise AssertionError("read_table would hold every text at once")

    monkeypatch.setattr(pq, "read_table", refuse)
    got = read_plan_inputs(path)
    assert got.lang_names == sorted(NAMES)
    np.testing.assert_array_equal(got.durations, durations)
    np.testing.assert_array_equal(got.text_chars, pa.compute.utf8_length(texts).to_numpy())
    codes = langs.indices.to_numpy()
    np.testing.assert_array_equal(np.array(got.lang_names)[got.lang_codes], np.array(NAMES)[codes])


def test_plan_reads_shards_and_an_input_cfg_with_dataset_shares(demo_data, tmp_path, capsys):
    import yaml

    tars = tmp_path / "tars"
    assert main(["shards", "write", demo_data["train"], "--out", str(tars), "--skip-bad-audio"]) == 0
    assert main(["plan", "--manifest", str(tars), "--max-batch-duration", "30"]) == 0
    assert "220 utterances" in capsys.readouterr().out  # the demo's non-audio file is not packed
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump([
        {"path": demo_data["train"], "name": "files", "weight": 1},
        {"path": str(tars), "name": "tars", "weight": 3},
    ]))  # fmt: skip
    out = tmp_path / "plan.json"
    rc = main(["plan", "--input-cfg", str(mix), "--max-batch-duration", "30", "--epoch-size", "2000",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "dataset" in text and "tars" in text
    shares = {d["dataset"]: d for d in json.loads(out.read_text())["datasets"]}
    assert shares["files"]["target_share"] == pytest.approx(0.25)
    assert shares["tars"]["planned_share"] == pytest.approx(0.75, abs=0.01)


@pytest.mark.parametrize(
    ("cp", "tp", "threshold"),
    [(1, 1, "auto"), (1, 2, "auto"), (1, 4, 0), (2, 1, 0), (2, 2, 0), (4, 2, 0), (2, 1, "auto"), (4, 1, 40)],
)
def test_cp_padding_matches_the_per_micro_batch_placement(cp, tp, threshold):
    """The vectorised summary equals `place_sequences` run on every micro-batch (the summary before it),
    empty micro-batches included; at cp = 1 and at threshold 0 it never calls `place_sequences`."""
    from speechlm.preflight.bench import load_benchmark

    reference = load_benchmark("plan-memory").per_batch_cp_padding
    rng = np.random.default_rng(cp * 10 + tp)
    lengths = rng.integers(1, 300, 400).astype(np.int32)
    offsets = np.unique(np.concatenate(([0, 400], rng.integers(0, 400, 60), [17, 17])))
    offsets = np.sort(np.concatenate((offsets, [17])))  # one empty micro-batch
    want = reference(lengths, offsets, cp, tp, threshold, 1 / 384)
    got = cp_padding(lengths, offsets, cp, tp, threshold, 1 / 384)
    assert {k: got[k] for k in ("computed", "computed_split_all", "ring_tokens")} == {
        k: want[k] for k in ("computed", "computed_split_all", "ring_tokens")
    }
    assert got["max_over_mean"] == pytest.approx(want["max_over_mean"], rel=1e-12)


def test_plan_prints_what_the_per_micro_batch_summary_printed(manifest, tmp_path, capsys, monkeypatch):
    """`speechlm plan`'s printed figures are unchanged by the vectorised padding summary (cp 1 and 2)."""
    import speechlm.data.plan.figures as plan_module
    from speechlm.preflight.bench import load_benchmark

    reference = load_benchmark("plan-memory").per_batch_cp_padding
    path = tmp_path / "text.parquet"
    table = pq.read_table(manifest[0])
    text = ["a b c " * int(d) for d in table.column("duration").to_numpy()]
    pq.write_table(table.append_column("text", pa.array(text)), path)
    for flags in (["--tp-size", "2"], ["--cp-size", "2"], ["--cp-size", "2", "--cp-split-threshold", "0"]):
        argv = ["plan", "--manifest", str(path), "--dp-size", "2", "--max-batch-duration", "60", *flags]
        assert main(argv) == 0
        new = capsys.readouterr().out
        with monkeypatch.context() as m:
            m.setattr(plan_module, "cp_padding", reference)
            assert main(argv) == 0
        assert new == capsys.readouterr().out


def test_plan_at_cp_1_places_no_micro_batch(manifest, monkeypatch):
    import speechlm.data.plan.figures as plan_module

    def refuse(*a, **k):
        raise AssertionError("cp = 1 has nothing to place")

    monkeypatch.setattr(plan_module, "place_sequences", refuse)
    assert main(["plan", "--manifest", str(manifest[0]), "--dp-size", "2"]) == 0


def test_plan_warns_when_the_lockstep_trims_drop_much(demo_data, tmp_path, capsys):
    """newcomer 40/136: `plan --dp-size 8` on the demo dropped 41% of the utterances without a word."""
    out = tmp_path / "plan.json"
    demo_config = Path(__file__).resolve().parents[2] / "configs/demo.yaml"
    demo = ["plan", "--config", str(demo_config), "--manifest", demo_data["train"]]
    assert main([*demo, "--dp-size", "8", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    plan = json.loads(out.read_text())
    dropped, drawn = plan["dropped_utterances"], plan["dropped_utterances"] + plan["planned_utterances"]
    assert dropped / drawn > 0.05
    assert f"WARNING: the lockstep trims drop {dropped:,} of the epoch's {drawn:,} utterances" in captured.err
    assert "--dp-size" in captured.err and "--max-batch-duration" in captured.err
    assert plan["warnings"] == [captured.err.strip()]
    assert main([*demo, "--dp-size", "1", "--json", str(out)]) == 0  # nothing dropped: no warning
    assert "WARNING" not in capsys.readouterr().err and json.loads(out.read_text())["warnings"] == []


def test_plan_json_is_written_whole_or_not_at_all(manifest, tmp_path, monkeypatch, capsys):
    """A write that fails half-way (a full disk; SIGKILL is the same to the file) leaves the previous plan
    and no partial file."""
    out = tmp_path / "plan.json"
    out.write_text('{"previous": true}')

    def dump_half(data, f):
        f.write('{"ranks": [[1, 2')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", dump_half)
    assert main(["plan", "--manifest", str(manifest[0]), "--json", str(out)]) == 1
    assert "cannot write" in capsys.readouterr().err
    assert json.loads(out.read_text()) == {"previous": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "train.parquet"]


def test_plan_keeps_the_text_lengths_and_reads_no_text_the_next_time(tmp_path, monkeypatch, capsys):
    import speechlm.data.plan.inputs as plan_module

    path = tmp_path / "t.parquet"
    n = 2000
    durations = np.random.default_rng(4).uniform(1, 15, n).astype(np.float32)
    texts = ["a b c " * int(d) for d in durations]
    pq.write_table(pa.table({"duration": durations, "lang": ["en"] * n, "text": texts}), path)
    first = read_plan_inputs(path)
    np.testing.assert_array_equal(first.text_chars, [len(t) for t in texts])
    cache = plan_module.text_chars_cache(path)
    assert cache.is_file()

    def no_texts(*a, **k):
        raise AssertionError("the text lengths are cached: no text is read")

    with monkeypatch.context() as m:
        m.setattr(pq.ParquetFile, "iter_batches", no_texts)
        np.testing.assert_array_equal(read_plan_inputs(path).text_chars, first.text_chars)
    cache.write_bytes(b"\x93NUMPY garbage")  # damaged (or cut off by SIGKILL before the rename)
    np.testing.assert_array_equal(read_plan_inputs(path).text_chars, first.text_chars)
    assert plan_module.load_text_chars(path, n) is not None  # written again, whole
    texts = [t + "xyz" for t in texts]  # the manifest changes: its size and mtime, so the cache misses
    pq.write_table(pa.table({"duration": durations, "lang": ["en"] * n, "text": texts}), path)
    np.testing.assert_array_equal(read_plan_inputs(path).text_chars, [len(t) for t in texts])


def test_plan_does_not_hash_the_manifest(manifest, monkeypatch, capsys):
    """The sampler's fingerprint (a hash of every row, checked on resume) is taken when a state is saved,
    not when the sampler is built: `speechlm plan` saves none."""
    import speechlm.data.sampler.stateful as stateful

    path, durations, _ = manifest
    calls = []
    real = stateful.fingerprint_manifest
    monkeypatch.setattr(stateful, "fingerprint_manifest", lambda *a: calls.append(len(a[0])) or real(*a))
    assert main(["plan", "--manifest", str(path), "--dp-size", "2"]) == 0
    assert calls == []
    codes = np.zeros(len(durations), np.int16)
    sampler = DurationBucketBatchSampler(durations, codes, ["en"], SamplerSettings(dp_size=1))
    assert calls == []
    assert sampler.state_dict()["manifest"] == real(durations, codes, None, ["en"])
    assert calls == [len(durations)]
