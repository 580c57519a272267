"""Audio decoding per CP rank: every peer decodes the whole micro-batch (``data.decode_local=false``) vs each
rank decodes only the clips its encoder reads (``data.decode_local=true``, issue 40 item 2), side by side.

For each ``--cp`` size and each CP rank, the training data pipeline (`speechlm.train.data.StepLoader`: the
sampler, the dataset with the run's renderer, the collation) reads the same ``--steps`` micro-batches of the
demo corpus (``data/demo/shards``: FLAC clips of 1-5 s, its manifest and tokenizer built into a temporary
folder unless ``--manifest``/``--tokenizer`` are given) twice: with `Collator` (every clip decoded) and with
`LocalCollator` and the demo model's `ClipPlanner` for that rank (its clips only, their lengths read from
the headers). Reported per rank: CPU seconds of the data pipeline (``time.process_time`` over the loop:
header reads, rendering, decoding, collation), ``data_wait_s`` (what the step would log: seconds waiting
for the loader; ``--workers 0``, so it is the loading itself) and the clips decoded.

By default the CP ranks are simulated one after the other in this process: the data path holds no
collective (the placement is a pure function of the lengths, computed alike on every rank), so a rank's
figures do not depend on the others running, and the CPU seconds are free of contention. The CPU is shared
with nothing else only if the machine is idle: run it with ``OMP_NUM_THREADS=1``.

``--gloo``: as training runs it. Each CP rank's pipeline runs in its own process of a gloo group of ``cp``
ranks (forked: `parallel.testing.run_distributed`), in lockstep: after each step the ranks do the step's
agreement all-reduce (`Collectives.agree`, as `SpeechLLMModule._agree_step` does; a clip that failed on
the one rank that decoded it has every rank read the step again whole and agree once more), so a rank
cannot read step n+1 before every peer has read step n. Reported besides: ``agree_wait_s``, the wall seconds
a rank spent in the agreement, i.e. waiting for its slowest peer's loader (training logs ``data_wait_s`` as
the loader's time only; this wait lands in its step time), and the loop's wall seconds. ``cp`` processes
share the machine's cores: with fewer cores than ranks the wall-clock figures include that contention.

``--long``: the same rows over synthetic 48 kHz stereo FLAC clips of 8-16 s (decoded, mixed down and
resampled to 16 kHz: decoding then dominates the loader, as with Common Voice's 48 kHz MP3 or podcasts).

Usage: ``speechlm bench decode-local [--cp 1 2 4] [--steps 12] [--batch-seconds 40] [--long] [--gloo]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def demo_corpus(out: Path) -> tuple[str, str]:
    """(manifest, tokenizer) of the bundled demo shards, built into ``out``."""
    from speechlm.cli import main

    if main(["manifest", "build", str(REPO / "data/demo/shards"), "--out", str(out)]) != 0:
        raise SystemExit("error: speechlm manifest build failed on data/demo/shards")
    tok = ["tokenizer", "train", "--manifest", str(out / "train.parquet"), "--out", str(out / "tok")]
    if main([*tok, "--vocab-size", "300"]) != 0:
        raise SystemExit("error: speechlm tokenizer train failed on the demo manifest")
    return str(out / "train.parquet"), str(out / "tok.model")


def long_corpus(manifest: str, out: Path, sample_rate: int, seconds: tuple[float, float]) -> str:
    """The manifest's rows with their audio replaced by synthetic stereo FLAC clips at ``sample_rate`` Hz
    lasting ``seconds`` (uniform; a corpus like Common Voice or podcasts: longer clips, resampled on
    decode), written under ``out``; the texts stay."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import soundfile as sf

    from speechlm.data.sources.detect import load_source

    table = load_source(manifest)
    rng = np.random.default_rng(0)
    paths, durations = [], []
    (out / "audio").mkdir(parents=True, exist_ok=True)
    for i in range(len(table)):
        n = int(rng.uniform(*seconds) * sample_rate)
        t = np.arange(n) / sample_rate
        x = 0.1 * np.sin(2 * np.pi * (180 + 40 * (i % 7)) * t) + 0.02 * rng.standard_normal(n)
        path = out / "audio" / f"{i:05d}.flac"
        sf.write(path, np.stack([x, x[::-1]], axis=1).astype(np.float32), sample_rate)
        paths.append(str(path))
        durations.append(n / sample_rate)
    table = table.set_column(
        table.schema.get_field_index("audio_filepath"), "audio_filepath", pa.array(paths)
    )
    table = table.set_column(
        table.schema.get_field_index("duration"), "duration", pa.array(durations, pa.float32())
    )
    pq.write_table(table, out / "long.parquet")
    return str(out / "long.parquet")


def build_planner(cfg: Any, tok: Any, cp: int, rank: int) -> Any:
    """The demo model's `ClipPlanner` on CP rank ``rank`` of ``cp`` (random weights: only lengths matter)."""
    from parallel.mesh import ParallelDims
    from speechlm.model.clip_planner import ClipPlanner
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.train.distributed import build_cp_layout

    model = SpeechLLM(
        cfg.model, vocab_size=len(tok), pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
        audio_id=tok.audio_id,
    )  # fmt: skip
    dims = ParallelDims(cp, 1, -1, cp, 1)
    layout = build_cp_layout(cfg, dims, rank, model.llm.config.hidden_size, planning=True)
    return ClipPlanner.of(model, layout)


def rank_loader(
    table: Any, tok: Any, cfg: Any, *, cp: int, rank: int, local: bool, batch_seconds: float
) -> Any:
    """CP rank ``rank``'s `StepLoader` over the manifest, every clip decoded or (``local``) its own only."""
    import numpy as np

    from speechlm.data.dataset import SpeechDataset
    from speechlm.data.sampler import DurationBucketBatchSampler, SamplerSettings
    from speechlm.packing.prompt import ConversationRenderer
    from speechlm.train.data import StepLoader

    durations = table.column("duration").to_numpy().astype(np.float32)
    settings = SamplerSettings(dp_size=1, grad_accum=1, max_batch_duration=batch_seconds, seed=0)
    sampler = DurationBucketBatchSampler(durations, np.zeros(len(durations), np.int32), ["xx"], settings)
    ds = SpeechDataset(table, tok, renderer=ConversationRenderer(tok))
    loader = StepLoader(sampler, ds, grad_accum=1, seed=0)
    if local:
        loader.decode_local(build_planner(cfg, tok, cp, rank))
    return loader


def new_figures() -> dict[str, Any]:
    """A rank's figures before its first step (`measure`, `lockstep`)."""
    return {"cpu_s": 0.0, "data_wait_s": 0.0, "clips": 0, "decoded": 0, "redecoded_steps": 0}


def tally(fig: dict[str, Any], step: Any) -> int:
    """Add ``step``'s loader wait and clips to ``fig``; returns the clips this rank decoded in it."""
    fig["data_wait_s"] += step.data_wait_s
    decoded = 0
    for b in step.micro_batches:
        fig["clips"] += b.num_clips
        decoded += b.num_clips if b.audio_present is None else int(b.audio_present.sum())
    fig["decoded"] += decoded
    return decoded


def redecode(loader: Any, step: Any, fig: dict[str, Any]) -> Any:
    """``step`` read again whole (`StepLoader.redecode`), its CPU and wall seconds counted to ``fig``."""
    t0, w0 = time.process_time(), time.perf_counter()
    step = loader.redecode(step)
    fig["cpu_s"] += time.process_time() - t0
    fig["data_wait_s"] += time.perf_counter() - w0
    fig["redecoded_steps"] += 1
    return step


def measure(loaders: list[Any], steps: int) -> list[dict[str, float]]:
    """The CP ranks' loaders in lockstep over ``steps`` steps (module docstring): CPU seconds, data_wait_s
    and clips per rank. A step in which a clip failed on the one rank that decoded it is read again, whole,
    on every rank, as the training step's agreement has them do (`StepLoader.redecode`), and timed to each."""
    figures = [new_figures() for _ in loaders]
    its = [iter(x) for x in loaders]
    for _ in range(steps):
        got: list[Any] = []
        for it, fig in zip(its, figures):
            t0 = time.process_time()
            step = next(it, None)
            fig["cpu_s"] += time.process_time() - t0
            got.append(step)
        if any(s is None for s in got):
            break
        again = any(b.local_failure for s in got for b in s.micro_batches)
        for loader, step, fig in zip(loaders, got, figures):
            tally(fig, redecode(loader, step, fig) if again else step)
    for loader in loaders:
        loader.close()
    return figures


def lockstep(loader: Any, steps: int, collectives: Any) -> dict[str, Any]:
    """This rank's loader over ``steps`` steps in a gloo group, in lockstep with its peers as training runs
    it (module docstring, ``--gloo``): after each step, the step's agreement all-reduce (clips read, and
    whether a clip failed on the one rank that decoded it: then every rank reads the step again whole and
    agrees once more, as `SpeechLLMModule._agree_step` does). Besides `measure`'s figures: ``agree_wait_s``
    (wall seconds in the agreement: waiting for the slowest peer's loader), ``wall_s`` (the whole loop) and,
    per step, the clips this rank decoded and whether the step was read again."""
    fig: dict[str, Any] = {**new_figures(), "agree_wait_s": 0.0, "per_step": []}
    it = iter(loader)
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.process_time()
        step = next(it, None)
        fig["cpu_s"] += time.process_time() - t0
        clips = 0 if step is None else sum(b.num_clips for b in step.micro_batches)
        failed = step is not None and any(b.local_failure for b in step.micro_batches)
        w0 = time.perf_counter()
        _, (ended, again) = collectives.agree([clips], [step is None, failed])
        fig["agree_wait_s"] += time.perf_counter() - w0
        if ended or step is None:  # the same sampler on every rank: they run out together
            break
        if again:
            step = redecode(loader, step, fig)
            w0 = time.perf_counter()
            clips = sum(b.num_clips for b in step.micro_batches)  # the rows that still read
            collectives.agree([clips], [False, False])  # the step read whole, agreed once more
            fig["agree_wait_s"] += time.perf_counter() - w0
        fig["per_step"].append({"clips": clips, "decoded": tally(fig, step), "read_again": again})
    fig["wall_s"] = time.perf_counter() - start
    loader.close()
    return fig


def gloo_rank(rank: int, world: int, table: Any, tok: Any, cfg: Any, steps: int, batch_seconds: float) -> Any:
    """CP rank ``rank`` of a gloo group of ``world`` (= cp) ranks: every clip decoded, then its own clips,
    each over the same micro-batches in lockstep with the group (`lockstep`)."""
    from parallel.collectives import Collectives

    collectives = Collectives(rank=rank, world_size=world, primary=rank == 0)
    out = {}
    for mode, local in (("every clip", False), ("its clips", True)):
        loader = rank_loader(
            table, tok, cfg, cp=world, rank=rank, local=local and world > 1, batch_seconds=batch_seconds
        )
        collectives.agree([], [])  # every rank's loader built: the clocks start together
        out[mode] = lockstep(loader, steps, collectives)
    return out


def run(
    manifest: str, tokenizer: str, cps: list[int], steps: int, batch_seconds: float, gloo: bool = False
) -> dict[str, Any]:
    from parallel.testing import run_distributed
    from speechlm.config import load_config
    from speechlm.data.sources.detect import load_source
    from speechlm.data.tokenizer import Tokenizer

    table, tok = load_source(manifest), Tokenizer(tokenizer)
    out: dict[str, Any] = {}
    warm = load_config(str(REPO / "configs/demo.yaml"), [])  # files into the page cache, imports done
    measure([rank_loader(table, tok, warm, cp=1, rank=0, local=False, batch_seconds=batch_seconds)], steps)
    for cp in cps:
        cfg = load_config(str(REPO / "configs/demo.yaml"), [f"parallel.cp_size={cp}"])
        if gloo:  # one process per CP rank, forked from this one (imports and the page cache warm)
            ranks = run_distributed(
                gloo_rank, cp, "gloo", table, tok, cfg, steps, batch_seconds, timeout_s=3600
            )
            for mode in ("every clip", "its clips"):
                out[f"cp{cp} {mode}"] = {"cp": cp, "mode": mode, "ranks": [r[mode] for r in ranks]}
            continue
        for mode, local in (("every clip", False), ("its clips", True)):
            loaders = [
                rank_loader(
                    table, tok, cfg, cp=cp, rank=r, local=local and cp > 1, batch_seconds=batch_seconds
                )
                for r in range(cp)
            ]
            ranks = measure(loaders, steps)
            out[f"cp{cp} {mode}"] = {"cp": cp, "mode": mode, "ranks": ranks}
    return out


def format_table(results: dict[str, Any]) -> str:
    gloo = any("agree_wait_s" in x for r in results.values() for x in r["ranks"])
    extra = " waiting for peers s per rank (mean / max) | loop wall s (max) |" if gloo else ""
    rows = [
        "| cp | each rank decodes | decode CPU s per rank (mean / max) | data_wait_s per rank (mean / max) |"
        f"{extra} clips decoded per rank (of the micro-batches') | steps read again whole |",
        "| --- " * (8 if gloo else 6) + "|",
    ]
    for r in results.values():
        cpu = [x["cpu_s"] for x in r["ranks"]]
        wait = [x["data_wait_s"] for x in r["ranks"]]
        dec = [x["decoded"] for x in r["ranks"]]
        cells = ""
        if gloo:
            peers = [x["agree_wait_s"] for x in r["ranks"]]
            wall = max(x["wall_s"] for x in r["ranks"])
            cells = f" {statistics.mean(peers):.2f} / {max(peers):.2f} | {wall:.2f} |"
        rows.append(
            f"| {r['cp']} | {r['mode']} | {statistics.mean(cpu):.2f} / {max(cpu):.2f} | "
            f"{statistics.mean(wait):.2f} / {max(wait):.2f} |{cells} {statistics.mean(dec):.1f} "
            f"(of {r['ranks'][0]['clips']}) | {r['ranks'][0]['redecoded_steps']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speechlm bench decode-local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP sizes (default 1 2 4)")
    ap.add_argument("--steps", type=int, default=12, help="micro-batches per rank (default 12)")
    ap.add_argument("--batch-seconds", type=float, default=40.0, help="micro-batch budget in seconds")
    ap.add_argument("--manifest", default=None, help="a manifest (default: the demo shards, built here)")
    ap.add_argument("--tokenizer", default=None, help="its SentencePiece model (with --manifest)")
    ap.add_argument(
        "--long", action="store_true",
        help="the demo texts over synthetic 48 kHz stereo FLAC clips of 8-16 s (resampled on decode)",
    )  # fmt: skip
    ap.add_argument(
        "--gloo", action="store_true",
        help="each CP rank in its own process of a gloo group, in lockstep with the step's agreement",
    )  # fmt: skip
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if (args.manifest is None) != (args.tokenizer is None):
        raise SystemExit("error: give --manifest and --tokenizer together (or neither: the demo corpus)")
    with tempfile.TemporaryDirectory() as tmp:
        manifest, tokenizer = args.manifest, args.tokenizer
        if manifest is None:
            manifest, tokenizer = demo_corpus(Path(tmp))
        if args.long:
            manifest = long_corpus(manifest, Path(tmp) / "long", 48000, (8.0, 16.0))
        results = run(manifest, tokenizer, args.cp, args.steps, args.batch_seconds, args.gloo)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
