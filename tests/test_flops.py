"""The analytic FLOP count (`speechlm.model.flops`), what the model's forward records for it, and the step's
throughput figures (`speechlm.train.throughput`); the end-to-end figures of a run are in
tests/train/test_step_metrics.py."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel.cp_layout import NullCPLayout
from speechlm.config import EncoderConfig, LLMConfig, ModelConfig
from speechlm.model.flops import (
    EncoderDims,
    LLMDims,
    ModelDims,
    Trainable,
    device_kind_of,
    dims_of_model,
    encoder_flops,
    encoder_frames,
    llm_flops,
    micro_flops,
    peak_tflops,
    projector_flops,
    record_work,
    work_of,
)
from speechlm.packing.prompt import build_prompts
from speechlm.train.step import StepWork
from speechlm.train.throughput import step_metrics

# a config small enough to count by hand (the numbers in the test below)
TINY = ModelDims(
    encoder=EncoderDims(hidden=4, layers=1, ffn=8, conv_channels=2, n_mels=8, subsampling=4, conv_kernel=3),
    llm=LLMDims(hidden=8, layers=1, heads=2, kv_heads=1, ffn=16, vocab=10),
    stack=2,
    proj_hidden=6,
    ctc_vocab=5,
)


def test_flop_count_matches_a_hand_count():
    # encoder, one clip of 16 feature frames, 8 mel bins; U = 4 encoder frames
    conv1 = 2 * 9 * 2 * 8 * 4  # 1 -> 2 channels, output 8 x 4
    stage2 = 2 * 9 * 2 * 4 * 2 + 2 * 2 * 2 * 4 * 2  # depthwise + pointwise, output 4 x 2
    linear = 2 * 4 * (2 * 2) * 4  # U x (C * F/4) x E
    ffns = 2 * (2 * 4 * 4 * 8 * 2)  # two FFNs, two linears each
    qkvo = 4 * 2 * 4 * 4 * 4
    rel_keys = 2 * 7 * 4 * 4  # 2U - 1 positions
    quadratic = 2 * 4 * 4 * 4 * 2 + 2 * 4 * 7 * 4  # QK^T and AV; position scores
    conv_module = 2 * 4 * 4 * 8 + 2 * 4 * 4 * 4 + 2 * 4 * 4 * 3  # pointwise 1 (E -> 2E), 2; depthwise
    ctc = 2 * 4 * 4 * 5
    enc = conv1 + stage2 + linear + ffns + qkvo + rel_keys + quadratic + conv_module + ctc
    assert enc == 4512
    assert encoder_flops(TINY, 16) == enc
    proj = 2 * 2 * (2 * 4 * 6 + 6 * 8)  # V = 2 stacked frames
    assert projector_flops(TINY, 16) == proj == 384
    # LLM: sequences of 3 and 5 tokens, 4 labelled; head_dim 4, one KV head: G = 4
    per_token = 2 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16)
    llm = 8 * per_token + 2 * (3 * 3 + 5 * 5) * 8 + 2 * 8 * 10 * 4
    assert llm == 10400
    assert llm_flops(TINY.llm, [3, 5], 4) == llm
    work = record_work([3, 5], [1, 3], [0, 1], 0, 1, clip_frames=[16], computed_tokens=8)
    assert micro_flops(TINY, work, Trainable()) == 3 * (enc + proj + llm)
    # frozen encoder: forward only; frozen LLM: no weight gradients (2x); the projector always trains
    frozen = micro_flops(TINY, work, Trainable(encoder=False, llm=False))
    assert frozen == enc + 3 * proj + 2 * llm


def test_limited_context_counts_attention_per_window_and_slices_add_up():
    """With a window of W = l + 1 + r frames the conformer's attention is linear in U (keys 2*W*E^2,
    content 4*U*W*E, position 2*U*W*E): a clip sharded over the CP group counts, over its slices, what it
    counts whole; and the count is read from a built encoder's att_context."""
    from dataclasses import replace

    from speechlm.model.flops import conformer_layer_flops

    full = TINY.encoder
    win = replace(full, window=5)
    u, e = 100, full.hidden
    linear = 2 * 4.0 * u * e * full.ffn + 8.0 * u * e * e + 6.0 * u * e * e + 2.0 * u * e * full.conv_kernel
    assert (
        conformer_layer_flops(full, u)
        == linear + 2.0 * (2 * u - 1) * e * e + 4.0 * u * u * e + 2.0 * u * (2 * u - 1) * e
    )
    assert conformer_layer_flops(win, u) == linear + 2.0 * 5 * e * e + 4.0 * u * 5 * e + 2.0 * u * 5 * e
    per_frame = conformer_layer_flops(win, u) - 2.0 * 5 * e * e  # the key table is per call
    slices = [33, 33, 34]
    assert sum(conformer_layer_flops(win, n) - 2.0 * 5 * e * e for n in slices) == pytest.approx(per_frame)
    cfg = ModelConfig(
        encoder=EncoderConfig(hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16,
                              subsampling_conv_channels=4, att_context_size=[3, 2]),
        llm=LLMConfig(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16),
    )  # fmt: skip
    from speechlm.model.speech_llm import SpeechLLM

    model = SpeechLLM(cfg, vocab_size=16, pad_id=0, bos_id=1, eos_id=2, audio_id=3)
    assert dims_of_model(model).encoder.window == 6


def test_cp_shares_split_a_sequence_and_its_labels():
    work = record_work([10, 6, 4], [2, 2, 1], [2, 0], 1, 2, clip_frames=[], computed_tokens=8)
    assert work.seq_lens == [4, 10] and work.seq_shares == [0.5, 1.0]  # the first local one is split
    assert work.real_tokens == 2 + 10 and work.labelled == 0.5 + 2
    d = TINY.llm
    assert llm_flops(d, [4, 10], 2.5, [0.5, 1.0]) == pytest.approx(
        12 * (llm_flops(d, [1], 0) - 2 * 8) + 2 * 8 * (0.5 * 16 + 100) + 2 * 8 * 10 * 2.5
    )


def _small_model_cfg() -> ModelConfig:
    enc = EncoderConfig(
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        intermediate_size=32,
        subsampling_conv_channels=4,
        num_mel_bins=16,
        subsampling_factor=4,
    )
    llm = LLMConfig(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32)
    return ModelConfig(encoder=enc, llm=llm, projector_hidden=24)


def _small_model():
    from speechlm.model.speech_llm import SpeechLLM

    torch.manual_seed(0)
    return SpeechLLM(_small_model_cfg(), vocab_size=40, pad_id=0, bos_id=1, eos_id=2, audio_id=3)


def test_encoder_and_projector_count_equal_torch_flop_counter():
    """The conformer's terms (subsampling, projections, relative-position and quadratic attention, conv
    module, FFNs) against torch's own count of the same forward (matmuls, convolutions, SDPA)."""
    model = _small_model().eval()
    dims = dims_of_model(model)
    assert dims.encoder.hidden == 16 and dims.encoder.subsampling == 4 and dims.encoder.n_mels == 16
    assert (dims.llm.kv_heads, dims.llm.vocab, dims.proj_hidden, dims.ctc_vocab) == (1, 40, 24, 40)
    t = 203
    feats = torch.randn(1, t, 16)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hidden, lens = model.encoder(feats, torch.tensor([t]), packed=False)
    # torch's counter has no formula for the CPU's fused SDPA kernel: add its QK^T and AV (4 U^2 E a layer)
    u = encoder_frames(dims.encoder, t)
    measured_enc = counter.get_total_flops() + dims.encoder.layers * 4 * u * u * dims.encoder.hidden
    no_ctc = ModelDims(dims.encoder, dims.llm, dims.stack, dims.proj_hidden, ctc_vocab=0)
    assert encoder_flops(no_ctc, t) == pytest.approx(measured_enc, rel=1e-9)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.projector(hidden, lens)
    assert projector_flops(dims, t) == pytest.approx(counter.get_total_flops(), rel=1e-3)


def test_forward_records_real_and_computed_tokens():
    """Real tokens are the same for every layout; computed ones grow with BSHD padding and CP rounding."""
    model = _small_model()
    audio_lens = [8000, 5000, 11000]
    audio = torch.zeros(3, max(audio_lens))
    tokens = torch.tensor([[4, 5, 6, 7, 8], [4, 5, 0, 0, 0], [4, 5, 6, 0, 0]])
    batch = dict(
        audio=audio, audio_lens=torch.tensor(audio_lens), tokens=tokens, token_lens=torch.tensor([5, 2, 3])
    )
    embeds = model.audio_embed_lengths(torch.tensor(audio_lens))
    prompts = build_prompts(tokens, torch.tensor([5, 2, 3]), prompt=model.prompt)
    real = sum(int(ids.shape[0]) - 1 + a for (ids, _), a in zip(prompts, embeds))

    def work(packed: bool, cp: int = 1):
        model.cfg.packed_sequences = packed
        model.set_cp_layout(NullCPLayout(round_cp=cp))
        return work_of(model(batch).placed)

    thd, thd_cp4, bshd = work(True), work(True, cp=4), work(False)
    assert thd.real_tokens == thd_cp4.real_tokens == bshd.real_tokens == real
    assert thd.computed_tokens == real  # THD: no padding at cp = 1
    assert thd_cp4.computed_tokens > real and thd_cp4.computed_tokens % 8 == 0  # each sequence to 2*cp
    longest = max(int(ids.shape[0]) - 1 + a for (ids, _), a in zip(prompts, embeds))
    assert bshd.computed_tokens == 3 * longest  # BSHD: every row padded to the longest
    assert thd.labelled == sum(int(m.sum()) for _, m in prompts)
    assert thd.clip_frames == [n // 160 for n in audio_lens]


def test_step_metrics_arithmetic():
    work = StepWork(
        real_tokens=300.0,
        computed_tokens=400.0,
        flops=3e12,
        optim_s=0.25,
        real_tokens_total=1200.0,
        computed_tokens_total=1500.0,
        flops_total=16e12,
    )
    m = step_metrics(
        work, step_s=2.0, data_wait_s=0.5, audio_s_rank=10.0, audio_s_total=40.0, world_size=4, peak=4.0
    )
    assert m["tokens_per_s"] == 600 and m["tokens_per_s_rank"] == 150
    assert m["audio_s_per_s"] == 20 and m["audio_s_per_s_rank"] == 5
    assert m["real_token_share"] == 0.8
    assert m["tflops_per_s"] == pytest.approx(2.0) and m["mfu"] == pytest.approx(0.5)  # 16 TFLOP / 2 s / 4
    assert (m["data_wait_s"], m["optim_s"], m["step_s"]) == (0.5, 0.25, 2.0)
    unknown = step_metrics(
        work, step_s=2.0, data_wait_s=0, audio_s_rank=0, audio_s_total=0, world_size=4, peak=None
    )
    assert unknown["mfu"] is None and unknown["tflops_per_s"] == pytest.approx(2.0)


def test_peak_table_override_and_device_names():
    assert peak_tflops("h100") == 989.0 and peak_tflops("a100") == 312.0
    assert peak_tflops("cpu", cpu_cores=2) == pytest.approx(0.192)
    assert peak_tflops("h100", override=500.0) == 500.0 and peak_tflops(None, override=1.5) == 1.5
    assert peak_tflops(None) is None  # a GPU not in the table: no MFU unless trainer.peak_tflops is set
    assert device_kind_of("NVIDIA H100 80GB HBM3") == "h100" and device_kind_of("NVIDIA H200") == "h200"
    assert device_kind_of("NVIDIA A100-SXM4-80GB") == "a100" and device_kind_of("NVIDIA L4") is None


def test_loader_wait_is_timed():
    from speechlm.train.data import _timed

    def slow():
        for i in range(2):
            time.sleep(0.05)
            yield i

    got = list(_timed(slow()))
    assert [x for x, _ in got] == [0, 1] and all(0.04 < w < 1.0 for _, w in got)


def _totals_worker(rank: int, world: int, cp: int) -> dict:
    from parallel_harness import build_model, global_steps, tiny_config

    from parallel.mesh import ParallelDims
    from speechlm.model.flops import dims_of_model, step_flops
    from speechlm.train.distributed import build_distributed_context
    from speechlm.train.schedule import build_optimizer
    from speechlm.train.step import run_optimizer_step

    torch.set_num_threads(1)
    dims = ParallelDims(world, 1, -1, cp, 1)
    dims.build_mesh("cpu")
    cfg = tiny_config()
    model = build_model(cfg)
    fdims = dims_of_model(model)
    ctx = build_distributed_context(model, dims, cfg, torch.device("cpu"))
    opt, sched = build_optimizer(model, cfg)
    micro = [global_steps(1, dims.dp)[0][dims.dp_rank(rank)]]
    res = run_optimizer_step(
        model, micro, ctx, opt, sched, cfg, step=0, flop_count=lambda w, f: step_flops(fdims, w, Trainable())
    )
    work = res["work"]
    return {k: getattr(work, k) for k in ("real_tokens", "real_tokens_total", "flops", "flops_total")}


@pytest.mark.multiproc
@pytest.mark.parametrize("cp", [1, 2], ids=["dp2", "cp2"])
def test_step_totals_sum_the_ranks_and_cp_shares_add_up(cp):
    """dp 2: each rank's own batch, the totals their sum; cp 2: both ranks share one batch, and their
    shares add up to the single-process figures of that batch."""
    from parallel_harness import build_model, global_steps, tiny_config

    from parallel.testing import run_distributed
    from speechlm.model.flops import dims_of_model, micro_flops

    per_rank = run_distributed(_totals_worker, 2, "gloo", cp, timeout_s=240)
    model = build_model(tiny_config())
    dims = dims_of_model(model)
    batches = global_steps(1, 2 // cp)[0]
    alone = [work_of(model(b).placed) for b in batches]  # one process, no CP: every sequence whole
    want_tokens = sum(w.real_tokens for w in alone)
    want_flops = sum(micro_flops(dims, w, Trainable()) for w in alone)
    for got in per_rank:
        assert got["real_tokens_total"] == pytest.approx(want_tokens)
        assert got["flops_total"] == pytest.approx(want_flops, rel=1e-9)
    assert sum(g["real_tokens"] for g in per_rank) == pytest.approx(want_tokens)
    assert 0 < per_rank[0]["real_tokens"] < want_tokens


def test_memory_figures_read_the_cuda_peaks_without_resetting_them(monkeypatch):
    from speechlm.train.throughput import memory_figures

    def no_reset(*a, **k):
        raise AssertionError("the run's peak counters were reset (other readers would lose the run's peak)")

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", no_reset)
    gpu = memory_figures(torch.device("cuda", 0))
    assert (gpu["mem_cuda_alloc_gib"], gpu["mem_cuda_reserved_gib"]) == (3.0, 4.0)
    cpu = memory_figures(torch.device("cpu"))
    assert cpu["mem_cuda_alloc_gib"] is None and cpu["mem_cuda_reserved_gib"] is None
    assert 0.05 < cpu["rss_gib"] == pytest.approx(gpu["rss_gib"], rel=0.1)
