"""`speechlm bench packing` runs end to end (it crashed once when `StepContext` lost `prompts`)."""

from __future__ import annotations

import json

from speechlm.preflight.bench import load_benchmark


def test_bench_packing_runs_one_batch(tmp_path):
    out = tmp_path / "packing.json"
    assert load_benchmark("packing").main(["--batches", "1", "--repeats", "1", "--json", str(out)]) == 0
    layouts = json.loads(out.read_text())["layouts"]
    assert set(layouts) == {"bshd", "thd_padded_encoder", "thd"}
    assert layouts["thd"]["decoder_token_efficiency"] == 1.0


def test_bench_packing_reports_the_compute_bound_beside_the_speedup(tmp_path):
    """Issue 26, item 5: BSHD's computed frames, tokens and counted FLOPs over THD's, and the share of
    that bound the measured speedup reaches."""
    out = tmp_path / "packing.json"
    argv = ["--durations", "lognormal", "--batches", "1", "--repeats", "1", "--json", str(out)]
    assert load_benchmark("packing").main(argv) == 0
    payload = json.loads(out.read_text())
    layouts, thd = payload["layouts"], payload["bounds"]["thd"]
    bshd = layouts["bshd"]
    assert (
        thd["encoder_frames_ratio"]
        == bshd["encoder_frames_computed"] / layouts["thd"]["encoder_frames_computed"]
    )
    assert (
        thd["decoder_tokens_ratio"]
        == bshd["decoder_tokens_computed"] / layouts["thd"]["decoder_tokens_computed"]
    )
    assert thd["compute_bound"] == bshd["flops"] / layouts["thd"]["flops"]
    assert thd["encoder_frames_ratio"] > 1 and thd["compute_bound"] > 1  # a log-normal batch has padding
    assert thd["share_of_bound"] == thd["speedup"] / thd["compute_bound"]
    assert thd["speedup"] == bshd["step_ms"] / layouts["thd"]["step_ms"]


def test_a_data_folder_built_from_another_checkout_is_built_again(tmp_path):
    """The bench's demo folder once was one /tmp path for every checkout: a manifest built by another
    checkout read that checkout's audio, and none once it was removed (every row dropped, then an FFT of
    an empty batch crashed). Such a folder is rebuilt from this checkout's shards."""
    import shutil

    from speechlm.cli import main

    bench = load_benchmark("packing")
    other = tmp_path / "other-checkout/shards"
    shutil.copytree(bench.REPO / "data/demo/shards", other)
    data = tmp_path / "data"
    assert main(["manifest", "build", str(other), "--out", str(data)]) == 0
    shutil.rmtree(other)  # that checkout is gone
    assert not bench._reads_this_checkout(data / "train.parquet")
    bench.prepare_demo(data)
    assert bench._reads_this_checkout(data / "train.parquet") and (data / "tokenizer.model").exists()
    assert bench.DEFAULT_DATA.startswith("/tmp/speechlm_bench_demo-")  # one folder per checkout
