"""`speechlm bench mfu` (benchmarks/bench_mfu.py): the tiny preset on a CPU runs both layouts and reports
figures that agree with each other; the 1b preset is the size the GPU acceptance of issue 26 asks for."""

import json

import pytest
import torch

from speechlm.cli import main as cli_main
from speechlm.preflight.bench import load_benchmark


def test_bench_mfu_tiny_runs_thd_and_bshd_with_consistent_figures(tmp_path):
    out = tmp_path / "mfu.json"
    argv = ["bench", "mfu", "--size", "tiny", "--batches", "2", "--steps", "2", "--warmup", "1"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["layouts"]) == {"thd", "bshd"}
    assert r["precision"] == "32" and r["device"] == "cpu"
    p = r["parameters"]
    assert p["total"] == p["encoder"] + p["projector_ctc"] + p["llm"] > 0
    for name, f in r["layouts"].items():
        timed_s = f["step_s"] * f["steps"]
        assert f["steps"] == 2 and f["step_s"] > 0 and f["cpu_s_per_step"] > 0, name
        assert f["tflops_per_s"] == pytest.approx(f["tflop_timed"] / timed_s), name
        assert f["mfu"] == pytest.approx(f["tflops_per_s"] / f["peak_tflops"]), name
        assert f["tokens_per_s"] == pytest.approx(f["real_tokens_timed"] / timed_s), name
        assert f["audio_s_per_s"] == pytest.approx(f["audio_s_timed"] / timed_s), name
        assert f["real_token_share"] == pytest.approx(f["real_tokens_timed"] / f["computed_tokens_timed"])
        # memory: measured, the estimate of the same config and batches, and the error between them
        assert f["measured_gib"] > 0 and f["estimate_gib"] > f["estimate_activations_gib"] > 0, name
        err = 100 * (f["estimate_gib"] - f["measured_gib"]) / f["measured_gib"]
        assert f["estimate_error_pct"] == pytest.approx(err), name
    thd, bshd = r["layouts"]["thd"], r["layouts"]["bshd"]
    # the same real work in both layouts: the same model FLOPs; padding is computed, not counted
    assert thd["tflop_timed"] == pytest.approx(bshd["tflop_timed"], rel=1e-9)
    assert thd["real_token_share"] == 1.0 and bshd["real_token_share"] < 1.0
    assert thd["decoder_tokens_computed"] < bshd["decoder_tokens_computed"]
    assert thd["encoder_frames_computed"] < bshd["encoder_frames_computed"]
    # BSHD's estimate is of its padded micro-batches: larger than THD's
    assert bshd["estimate_activations_gib"] > thd["estimate_activations_gib"]
    b = r["thd_vs_bshd"]
    assert b["compute_bound"] > 1.0
    assert b["speedup"] == pytest.approx(bshd["step_s"] / thd["step_s"])
    assert b["share_of_bound"] == pytest.approx(b["speedup"] / b["compute_bound"])
    assert b["decoder_tokens_ratio"] == pytest.approx(
        bshd["decoder_tokens_computed"] / thd["decoder_tokens_computed"]
    )


def test_bench_mfu_1b_preset_is_a_billion_parameters_and_minutes_on_an_h100(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--size", "1b", "--device", "cuda", "--dry-run", "--json", str(out)]
    assert load_benchmark("mfu").main(argv) == 0
    r = json.loads(out.read_text())
    p = r["parameters"]
    # a Parakeet-sized encoder (0.6B), a 0.5B Qwen2-like LLM with a 32k vocabulary
    assert 0.55e9 < p["encoder"] < 0.65e9 and 0.38e9 < p["llm"] < 0.5e9
    assert 0.95e9 < p["total"] < 1.2e9 and r["vocab"] == 32000
    assert r["precision"] == "bf16"
    # the default run's steps, from the FLOP count at 35% MFU: a small part of a 5-minute budget
    assert r["assume_mfu"] == 0.35 and 0 < r["predicted_steps_s_h100"] < 60
    assert r["computed_tflop_per_step"]["bshd"] > r["computed_tflop_per_step"]["thd"] > 1
    # the layouts' estimates fit an 80 GB GPU with room for an estimate error of a third
    assert r["estimate_gib_thd"] < r["estimate_gib_bshd"] < 0.67 * 79.1
    assert "parameters in all" in capsys.readouterr().out


def test_bench_mfu_without_a_gpu_names_the_device_and_what_to_do(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "mfu", "--size", "tiny", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "--device cpu" in err


def test_bench_mfu_reports_a_layout_that_ran_out_of_memory_and_still_runs_the_other(tmp_path, monkeypatch):
    bench = load_benchmark("mfu")
    real = bench.run_layout

    def run_layout(model, cfg, name, *args):
        if name == "bshd":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, cfg, name, *args)

    monkeypatch.setattr(bench, "run_layout", run_layout)
    out = tmp_path / "mfu.json"
    argv = ["--size", "tiny", "--batches", "1", "--steps", "1", "--warmup", "0", "--json", str(out)]
    assert bench.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["layouts"]["bshd"]["error"].startswith("out of memory: CUDA out of memory")
    assert r["layouts"]["bshd"]["estimate_error_pct"] is None and r["layouts"]["bshd"]["estimate_gib"] > 0
    assert r["layouts"]["thd"]["mfu"] > 0 and r["thd_vs_bshd"] is None


def test_bench_mfu_compares_cuda_allocated_memory_with_the_estimate_without_the_cuda_context():
    from speechlm.config import load_config
    from speechlm.preflight.estimate import GIB, Layout, Workload, count_parameters, estimate, llm_seq_lens

    bench = load_benchmark("mfu")
    cfg = load_config(None, bench.PRESETS["tiny"][0])
    counts, dims = count_parameters(cfg, 1024)
    est = estimate(cfg, counts, dims, Workload([500], [10]), Workload([500], [10]), Layout(1), device="h100")
    on_gpu = bench.estimate_figures(est, 1.0, cuda=True)
    assert on_gpu["estimate_gib"] == pytest.approx((est.total - est.memory["runtime"]) / GIB)
    assert on_gpu["estimate_error_pct"] == pytest.approx(100 * (on_gpu["estimate_gib"] - 1.0))
    assert bench.estimate_figures(est, 1.0, cuda=False)["estimate_gib"] == pytest.approx(est.total / GIB)
    # BSHD's LM head runs on every position of the padded rows, THD's on the labelled tokens only
    w = Workload([500, 300], [10, 4])
    extra = bench.analytic_flops(dims, cfg, w, logits_everywhere=True) - bench.analytic_flops(dims, cfg, w)
    seqs = sum(llm_seq_lens(dims, w))
    assert extra == pytest.approx(
        3 * 2 * dims.llm.hidden * dims.llm.vocab * (seqs - sum(k + 1 for k in w.text_tokens))
    )


def test_bench_mfu_profile_writes_the_operators_of_one_thd_step(tmp_path):
    prof = tmp_path / "profile.txt"
    argv = ["bench", "mfu", "--size", "tiny", "--batches", "1", "--steps", "1", "--warmup", "0"]
    assert cli_main([*argv, "--json", str(tmp_path / "mfu.json"), "--profile", str(prof)]) == 0
    text = prof.read_text()
    assert text.startswith("one THD optimizer step on cpu, sorted by self_cpu_time_total")
    assert "Self CPU" in text and "aten::" in text
    assert json.loads((tmp_path / "mfu.json").read_text())["profile"] == str(prof)
