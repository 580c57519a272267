"""`speechlm bench sampler --lhotse` runs end to end on a small manifest, and its figures hold together."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speechlm.preflight.bench import load_benchmark


def test_bench_sampler_side_by_side_with_lhotse(tmp_path):
    pytest.importorskip("lhotse")
    out = tmp_path / "lhotse.json"
    assert load_benchmark("sampler").main(["--lhotse", "--lhotse-rows", "3000", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["rows"] == 3000 and r["versions"]["lhotse"]
    for kind in ("ours-estimated", "ours-fixed", "lhotse"):
        assert r[kind]["seconds"] > 0 and r[kind]["peak_rss"] >= r[kind]["rss_after_imports"] > 0
        assert r[kind]["micro_batches_per_rank"] > 0 and 0.5 < r[kind]["padded_efficiency"] <= 1.0
    # buckets from the data pad less than the six fixed ones, and about as little as Lhotse's
    assert r["ours-estimated"]["padded_efficiency"] > r["ours-fixed"]["padded_efficiency"] + 0.05
    assert r["ours-estimated"]["padded_efficiency"] == pytest.approx(
        r["lhotse"]["padded_efficiency"], abs=0.03
    )


def test_padded_efficiency_is_real_over_b_times_longest():
    bench = load_benchmark("sampler")  # puts benchmarks/ on the path
    from bench_sampler_lhotse import padded_efficiency

    assert padded_efficiency([np.array([1.0, 3.0]), np.array([2.0])]) == pytest.approx(6.0 / 8.0)
    assert bench is not None
