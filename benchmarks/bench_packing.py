"""Padding from waveform to loss: three layouts on the same micro-batches, side by side in one run.

Layouts (same weights, same batches, forward + backward of the whole model with a trainable encoder):
- ``bshd``: padded decoder (BSHD) and padded encoder (features, encoder, projector, CTC on padded clips);
- ``thd_padded_encoder``: packed decoder (THD), padded encoder (the layout before issue 12);
- ``thd``: packed decoder and padding-free encoder (``model.encoder.packed``): end to end on real frames.

Micro-batches: ``--durations demo`` takes them from the demo epoch plan (builds the demo manifest and
tokenizer under ``--data`` if missing); ``--durations lognormal`` synthesizes utterances with
log-normal durations (median 5 s, sigma 0.8, clipped to 0.5-20 s), noise audio and ~3 transcript
tokens per second, and batches them with the trainer's own sampler (``--sampler bucketed``: duration
buckets, a budget of ``--max-batch-duration`` seconds) or in random order (``--sampler mixed``: what
a run without duration buckets sees). Per layout:
- ``encoder_frame_efficiency``: real encoder frames / frames the conformer layers compute (padded:
  clips x longest clip); ``subsampling_frame_efficiency`` the same for the subsampling convolutions
  (the padding-free path computes one or two gap frames per clip there);
- ``decoder_token_efficiency``: real decoder tokens / computed (BSHD: clips x longest; THD: the
  packed total; single process, so no cp/tp rounding);
- ``step_ms``: median over ``--repeats`` of one forward+backward, summed over the batches, per batch;
  ``cpu_ms`` the same in CPU time of the process (less sensitive to other jobs on the machine).
  The layouts take turns on every batch and repeat, so a shared machine's changing load hits all
  three alike;
- ``flops``: the FLOPs of one forward+backward counted by torch's ``FlopCounterMode`` (matmuls,
  convolutions, attention), summed over the batches.

The compute bound of a layout's speedup over ``bshd`` is what it saves in work: BSHD's computed
encoder frames and decoder tokens over the layout's (each printed), combined as BSHD's counted FLOPs
over the layout's (``compute_bound``). A step whose time is proportional to the work it computes
reaches its bound; ``share_of_bound`` = measured speedup / bound says how much of it the layout
gets (the rest goes to work that does not shrink with padding: per-clip loops, host syncs,
allocation).
Usage: ``speechlm bench packing [--durations demo|lognormal] [--config CONFIG] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

from speechlm.cli import positive_float, positive_int

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"bshd": (False, False), "thd_padded_encoder": (True, False), "thd": (True, True)}


# the demo manifest and tokenizer, once per checkout: the manifest holds absolute audio paths, so a folder
# shared by two checkouts would read the other one's files (and none once it is gone)
DEFAULT_DATA = f"/tmp/speechlm_bench_demo-{hashlib.sha1(str(REPO).encode()).hexdigest()[:8]}"


def _reads_this_checkout(manifest: Path) -> bool:
    """Whether `manifest` exists and its first clip is a file of this checkout's demo shards."""
    import pyarrow.parquet as pq

    if not manifest.exists():
        return False
    first = pq.read_table(manifest, columns=["audio_filepath"]).column(0)[0].as_py()
    path = Path(first) if Path(first).is_absolute() else manifest.parent / first
    return path.is_file() and path.resolve().is_relative_to(REPO / "data/demo/shards")


def prepare_demo(out: Path) -> None:
    from speechlm.cli import main

    def run(args: list[str]) -> None:  # a failed step has printed its error: stop the benchmark there
        if main([*args, "--overwrite"]) != 0:
            raise SystemExit(f"speechlm bench: `speechlm {' '.join(args[:2])}` into {out} failed (above)")

    if not _reads_this_checkout(out / "train.parquet"):  # missing, or built from another checkout's files
        run(["manifest", "build", str(REPO / "data/demo/shards"), "--out", str(out)])
        (out / "tokenizer.model").unlink(missing_ok=True)
    if not (out / "tokenizer.model").exists():
        run(["tokenizer", "train", "--manifest", str(out / "train.parquet"), "--out", str(out / "tokenizer")])


def demo_batches(cfg: Any, data: Path, n: int, budget: float) -> tuple[list[Any], Any]:
    from speechlm.data.dataset import Collator, SpeechDataset
    from speechlm.data.manifest import manifest_arrays
    from speechlm.data.run_inputs import TokenizerInfo
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings
    from speechlm.data.sources.detect import load_source
    from speechlm.data.tokenizer import Tokenizer

    prepare_demo(data)
    tok = Tokenizer(data / "tokenizer.model")
    table = load_source(data / "train.parquet")
    arr = manifest_arrays(table)
    sampler = DurationBucketBatchSampler(
        arr.durations, arr.lang_codes, arr.lang_names, SamplerSettings(max_batch_duration=budget, seed=0)
    )
    ds = SpeechDataset(table, tok, max_tokens=cfg.data.max_tokens)
    collate = Collator(tok.pad_id)
    batches = [collate([ds[i] for i in idx]) for idx in list(sampler)[:n]]
    return batches, TokenizerInfo(len(tok), tok.pad_id, tok.bos_id, tok.eos_id, tok.audio_id)


def draw_mixed_batches(durations: Any, budget: float, seed: int) -> list[list[int]]:
    """Utterances in random order, cut into micro-batches of at most ``budget`` seconds (no buckets)."""
    import numpy as np

    order = np.random.default_rng(seed + 1).permutation(len(durations))
    batches: list[list[int]] = [[]]
    acc = 0.0
    for i in order.tolist():
        if batches[-1] and acc + float(durations[i]) > budget:
            batches.append([])
            acc = 0.0
        batches[-1].append(i)
        acc += float(durations[i])
    return batches


def lognormal_batches(n: int, budget: float, sampler_kind: str, seed: int = 0) -> tuple[list[Any], Any]:
    import numpy as np
    import torch

    from speechlm.data.dataset import Batch
    from speechlm.data.run_inputs import TokenizerInfo
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings

    rng = np.random.default_rng(seed)
    durations = np.clip(rng.lognormal(np.log(5.0), 0.8, size=4000), 0.5, 20.0).astype(np.float32)
    if sampler_kind == "bucketed":
        plan = list(
            DurationBucketBatchSampler(
                durations,
                np.zeros(len(durations), dtype=np.int16),
                ["xx"],
                SamplerSettings(max_batch_duration=budget, seed=seed),
            )
        )
    else:
        plan = draw_mixed_batches(durations, budget, seed)
    info = TokenizerInfo(vocab_size=1024, pad_id=0, bos_id=1, eos_id=2, audio_id=3)
    g = torch.Generator().manual_seed(seed)
    batches = []
    for idx in plan[:n]:
        lens = [int(durations[i] * 16000) for i in idx]
        audio = torch.randn(len(idx), max(lens), generator=g) * 0.1
        for j, m in enumerate(lens):
            audio[j, m:] = 0.0
        n_tok = [1 + max(1, round(3 * float(durations[i]))) for i in idx]  # language tag + text
        tokens = torch.zeros(len(idx), max(n_tok), dtype=torch.long)
        for j, m in enumerate(n_tok):
            tokens[j, :m] = torch.randint(8, info.vocab_size, (m,), generator=g)
        batches.append(
            Batch(
                audio=audio,
                audio_lens=torch.tensor(lens),
                tokens=tokens,
                token_lens=torch.tensor(n_tok),
                langs=["xx"] * len(idx),
                indices=list(idx),
                durations=torch.tensor([float(durations[i]) for i in idx]),
            )
        )
    return batches, info


def count_frames(
    model: Any, batch: Any, ctx: Any, *, packed_decoder: bool, packed_encoder: bool
) -> dict[str, int]:
    import torch

    from speechlm.model.packed_encoder import plan_subsampling_segments
    from speechlm.packing.prompt import build_prompts

    with torch.no_grad():
        feat_lens = model.features(batch.audio, batch.audio_lens)[1]
        enc_lens = model.encoder.output_lengths(feat_lens)
        proj_lens = [(int(u) + model.projector.stack - 1) // model.projector.stack for u in enc_lens]
    real_enc = int(enc_lens.sum())
    if packed_encoder:
        sub = (
            int(plan_subsampling_segments(feat_lens, model.encoder.n_convs).sum())
            // model.encoder.subsampling
        )
        enc = real_enc
    else:
        sub = enc = len(batch) * int(enc_lens.max())
    lens = [
        int(p[0].shape[0]) - 1 + a
        for p, a in zip(build_prompts(batch.tokens, batch.token_lens, prompt=model.prompt), proj_lens)
    ]
    dec = sum(lens) if packed_decoder else len(lens) * max(lens)
    return {"enc_real": real_enc, "enc": enc, "sub": sub, "dec_real": sum(lens), "dec": dec}


def count_flops(step: Any, batch: Any) -> int:
    """FLOPs of `step(batch)` (one forward + backward) as torch's FlopCounterMode counts them, with the
    CPU flash-attention ops (which it does not know) counted as its other attention kernels are."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def fwd(q: Any, k: Any, v: Any, *_: Any, out_shape: Any = None, **__: Any) -> int:
        return sdpa_flop_count(q, k, v)

    def bwd(dout: Any, q: Any, k: Any, v: Any, *_: Any, out_shape: Any = None, **__: Any) -> int:
        return sdpa_backward_flop_count(dout, q, k, v)

    aten = torch.ops.aten
    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu: fwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd,
    }
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        step(batch)
    return int(counter.get_total_flops())


def bound_figures(results: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    """The compute bound of `name`'s speedup over ``bshd`` and the share of it that was measured."""
    base, r = results["bshd"], results[name]
    bound = base["flops"] / r["flops"]
    return {
        "encoder_frames_ratio": base["encoder_frames_computed"] / r["encoder_frames_computed"],
        "decoder_tokens_ratio": base["decoder_tokens_computed"] / r["decoder_tokens_computed"],
        "compute_bound": bound,
        "speedup": base["step_ms"] / r["step_ms"],
        "cpu_speedup": base["cpu_ms"] / r["cpu_ms"],
        "share_of_bound": base["step_ms"] / r["step_ms"] / bound,
        "cpu_share_of_bound": base["cpu_ms"] / r["cpu_ms"] / bound,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench packing", description=__doc__.split("\n")[0])
    ap.add_argument("--durations", choices=("demo", "lognormal"), default="demo")
    ap.add_argument(
        "--sampler",
        choices=("bucketed", "mixed"),
        default="bucketed",
        help="lognormal only: the trainer's duration-bucketed sampler, or utterances in random order (no buckets)",
    )
    ap.add_argument("--config", default=str(REPO / "configs/demo.yaml"), help="model config (YAML)")
    ap.add_argument(
        "--data", default=DEFAULT_DATA, help="demo manifest/tokenizer directory (one per checkout)"
    )
    ap.add_argument("--batches", type=positive_int, default=12, help="micro-batches timed per layout")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed forward+backward passes per batch")
    ap.add_argument(
        "--max-batch-duration",
        type=positive_float,
        default=None,
        help="seconds of audio per micro-batch (default: the config's)",
    )
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)

    import torch

    from speechlm.config import load_config
    from speechlm.model.micro_losses import compute_micro_losses
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.train.step import StepContext

    cfg = load_config(args.config, [])
    if args.max_batch_duration is None:
        args.max_batch_duration = float(cfg.sampler.max_batch_duration or 32.0)
    if args.durations == "demo":
        batches, info = demo_batches(cfg, Path(args.data), args.batches, args.max_batch_duration)
    else:
        batches, info = lognormal_batches(args.batches, args.max_batch_duration, args.sampler)
    torch.manual_seed(0)
    cfg.model.encoder.packed = True
    model = SpeechLLM(
        cfg.model,
        vocab_size=info.vocab_size,
        pad_id=info.pad_id,
        bos_id=info.bos_id,
        eos_id=info.eos_id,
        audio_id=info.audio_id,
    )
    model.train()

    def use_layout(name: str) -> Any:
        packed_decoder, packed_encoder = LAYOUTS[name]
        model.encoder_packed = packed_encoder
        cfg.model.packed_sequences = packed_decoder
        return StepContext()

    def run_step(b: Any) -> None:
        out = compute_micro_losses(model, b)
        (out.ce_sum + (out.ctc_sum if out.ctc_sum is not None else 0)).backward()
        model.zero_grad(set_to_none=True)

    def time_step(b: Any, ctx: Any) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one forward + backward."""
        t0, c0 = time.perf_counter(), time.process_time()
        run_step(b)
        return time.perf_counter() - t0, time.process_time() - c0

    # The machine is shared: the layouts take turns on every batch and every repeat, so a change of
    # load hits all three alike (medians per batch and layout, summed over the batches).
    totals = {
        name: dict.fromkeys(("enc_real", "enc", "sub", "dec_real", "dec", "flops"), 0) for name in LAYOUTS
    }
    seconds = dict.fromkeys(LAYOUTS, 0.0)
    cpu_seconds = dict.fromkeys(LAYOUTS, 0.0)
    for i, b in enumerate(batches):
        per: dict[str, list[tuple[float, float]]] = {name: [] for name in LAYOUTS}
        for name in LAYOUTS:
            ctx = use_layout(name)
            packed_decoder, packed_encoder = LAYOUTS[name]
            for k, v in count_frames(
                model, b, ctx, packed_decoder=packed_decoder, packed_encoder=packed_encoder
            ).items():
                totals[name][k] += v
            totals[name]["flops"] += count_flops(run_step, b)  # also the warm-up
        for _ in range(args.repeats):
            for name in LAYOUTS:
                per[name].append(time_step(b, use_layout(name)))
        for name in LAYOUTS:
            seconds[name] += statistics.median(w for w, _ in per[name])
            cpu_seconds[name] += statistics.median(c for _, c in per[name])
        print(
            f"batch {i + 1}/{len(batches)}: "
            + ", ".join(
                f"{n} {1000 * statistics.median(w for w, _ in t):.0f} ms "
                f"(cpu {1000 * statistics.median(c for _, c in t):.0f} ms)"
                for n, t in per.items()
            ),
            flush=True,
        )
    results: dict[str, dict[str, float]] = {}
    for name in LAYOUTS:
        t = totals[name]
        results[name] = {
            "step_ms": 1000 * seconds[name] / len(batches),
            "cpu_ms": 1000 * cpu_seconds[name] / len(batches),
            "encoder_frame_efficiency": t["enc_real"] / t["enc"],
            "subsampling_frame_efficiency": t["enc_real"] / t["sub"],
            "decoder_token_efficiency": t["dec_real"] / t["dec"],
            "encoder_frames_computed": t["enc"],
            "decoder_tokens_computed": t["dec"],
            "flops": t["flops"],
        }
    bounds = {name: bound_figures(results, name) for name in LAYOUTS if name != "bshd"}

    base, base_cpu = results["bshd"]["step_ms"], results["bshd"]["cpu_ms"]
    sampler = args.sampler if args.durations == "lognormal" else "demo plan"
    print(
        f"\n{len(batches)} micro-batches ({args.durations} durations, {sampler}, budget {args.max_batch_duration:g} s), "
        f"config {args.config}, forward+backward, median of {args.repeats}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'layout':<20} {'wall':>8} {'speedup':>8} {'cpu':>8} {'speedup':>8} {'enc frames':>11} {'enc eff':>8} "
        f"{'sub eff':>8} {'dec tokens':>11} {'dec eff':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<20} {r['step_ms']:>6.0f}ms {base / r['step_ms']:>7.2f}x {r['cpu_ms']:>6.0f}ms "
            f"{base_cpu / r['cpu_ms']:>7.2f}x {r['encoder_frames_computed']:>11,} "
            f"{r['encoder_frame_efficiency']:>8.1%} {r['subsampling_frame_efficiency']:>8.1%} "
            f"{r['decoder_tokens_computed']:>11,} {r['decoder_token_efficiency']:>8.1%}"
        )
    print(
        f"\n{'layout':<20} {'enc frames':>11} {'dec tokens':>11} {'bound':>7} {'speedup':>8} {'of bound':>9} "
        f"{'cpu speedup':>12} {'of bound':>9}   (bound: BSHD's counted FLOPs over the layout's)"
    )
    for name, f in bounds.items():
        print(
            f"{name:<20} {f['encoder_frames_ratio']:>10.3f}x {f['decoder_tokens_ratio']:>10.3f}x "
            f"{f['compute_bound']:>6.3f}x {f['speedup']:>7.3f}x {f['share_of_bound']:>9.1%} "
            f"{f['cpu_speedup']:>11.3f}x {f['cpu_share_of_bound']:>9.1%}"
        )
    if args.json:
        payload = {
            "durations": args.durations,
            "sampler": sampler,
            "config": args.config,
            "batches": len(batches),
            "repeats": args.repeats,
            "max_batch_duration": args.max_batch_duration,
            "threads": torch.get_num_threads(),
            "layouts": results,
            "bounds": bounds,
            "speedup_thd_vs_bshd": base / results["thd"]["step_ms"],
            "speedup_thd_vs_thd_padded_encoder": results["thd_padded_encoder"]["step_ms"]
            / results["thd"]["step_ms"],
            "cpu_speedup_thd_vs_bshd": base_cpu / results["thd"]["cpu_ms"],
            "cpu_speedup_thd_vs_thd_padded_encoder": results["thd_padded_encoder"]["cpu_ms"]
            / results["thd"]["cpu_ms"],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
