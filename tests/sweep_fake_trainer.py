"""A stand-in for `speechlm train` in the sweep tests: reads a job config, 'trains' a few steps.

Writes metrics.jsonl lines like the real trainer (train steps, a val WER), appends its job's run dir to
`<sweep>/ran.log` so tests can count how often each job ran, keeps a checkpoint of its step so a
resumed job continues, exits 3 when `trainer.seed` is 13, and on SIGTERM saves and exits 143 (as the
real trainer does). With FAKE_SIGTERM_SELF_AT=N it sends itself SIGTERM after step N (once: not when resumed past N).
With FAKE_FINAL_EVAL=1 it writes no val line but, at the end, an `eval.json` whose WER is 1 / (2 + temperature +
steps) (the real trainer's final evaluation with trainer.val_every=0).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import yaml

cfg = yaml.safe_load(Path(sys.argv[1]).read_text())
run_dir = Path(cfg["trainer"]["run_dir"])
run_dir.mkdir(parents=True, exist_ok=True)
sweep_dir = run_dir.parent.parent.parent
step_time = float(os.environ.get("FAKE_STEP_SECONDS", "0.05"))
ckpt = run_dir / "ckpt"
step = int(ckpt.read_text()) if ckpt.exists() else 0
with open(sweep_dir / "ran.log", "a") as f:
    f.write(f"{run_dir.parent.name} {os.environ.get('CUDA_VISIBLE_DEVICES')} start={step}\n")
stop = False


def on_term(signum, frame):
    global stop
    stop = True


signal.signal(signal.SIGTERM, on_term)
if cfg["trainer"]["seed"] == 13:
    sys.exit(3)
with open(run_dir / "metrics.jsonl", "a") as m:
    while step < cfg["trainer"]["max_steps"] and not stop:
        time.sleep(step_time)
        step += 1
        m.write(json.dumps({"kind": "train", "step": step, "loss": 1.0 / step}) + "\n")
        m.flush()
        ckpt.write_text(str(step))
        if str(step) == os.environ.get("FAKE_SIGTERM_SELF_AT"):
            os.kill(os.getpid(), signal.SIGTERM)
    if stop:
        sys.exit(143)
    if os.environ.get("FAKE_FINAL_EVAL") == "1":
        wer = 1.0 / (2 + cfg["sampler"]["temperature"] + step)
        (run_dir / "eval.json").write_text(json.dumps({"split": "val", "steps": step, "wer": wer}))
    else:
        m.write(
            json.dumps({"kind": "val", "step": step, "wer": 1.0 / (1 + cfg["sampler"]["temperature"] + step)})
            + "\n"
        )
