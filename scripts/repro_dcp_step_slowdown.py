"""Reproduce: after one DCP checkpoint save in a process with a gloo process group, CPU training steps
of the demo model run about 1.5-2x slower for the rest of the process (2026-11-23, torch 2.13.0+cpu,
2-core CPU). `speechlm demo` meets it at its first checkpoint (step 200): 0.31 s/step before,
0.6 s/step after.

What triggers it: a DCP save of the model's own tensors through the process group. A DCP save of a
fresh tensor, a save with ``no_dist=True``, and ``torch.save`` do not; neither do the state-dict calls
alone. Ruled out: torch thread counts, CPU affinity, anomaly mode, deterministic algorithms, grad mode,
glibc malloc trim/mmap thresholds, shared memory. The root cause is not known. One-process training
now saves with ``no_dist=True`` (`speechlm.train.lightning_compat.save_checkpoint_one_process`), which
removes the slowdown there; whether multi-process CPU/gloo runs slow down the same way after a save is
not measured. Run: `python scripts/repro_dcp_step_slowdown.py`.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

import torch
import torch.distributed as dist

REPO = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_cp import make_batch
    from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from speechlm.config import load_config
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.train.schedule import build_optimizer

    cfg = load_config(str(REPO / "configs/demo.yaml"), [])
    torch.manual_seed(0)
    model = SpeechLLM(cfg.model, vocab_size=256, pad_id=0, bos_id=2, eos_id=3, audio_id=4)
    model.train()
    opt, _ = build_optimizer(model, cfg)
    batch = make_batch(6, 3.0)

    def seconds_per_step(n: int = 8) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(batch)
            (out.ce_sum + out.ctc_sum).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / n

    before = min(seconds_per_step(), seconds_per_step())
    options = StateDictOptions(full_state_dict=False, cpu_offload=True)
    state = {
        "state_dict": get_model_state_dict(model, options=options),
        "optimizer_0": get_optimizer_state_dict(model, opt, options=options),
    }
    _distributed_checkpoint_save(state, pathlib.Path(tempfile.mkdtemp()))
    after = min(seconds_per_step(), seconds_per_step())
    print(f"s/step before the DCP save {before:.3f}, after {after:.3f} ({after / before:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
