"""`speechlm validate CONFIG`: the pre-flight of `speechlm train`, in seconds, before a job is submitted.

It runs every rule train runs before its first step: the layout rules, and, with the training data
(`--manifest M`, else the config's data.input_cfg / data.train_manifest when it exists), train's file
checks (`speechlm.preflight.checks`: manifests and tokenizer open, languages and tags known to the tokenizer,
no null values) and the data-side rules (grad-accum-exceeds-batches, epoch-plan-too-short,
budget-below-longest-utterance). What it could not check (no manifest or tokenizer at the configured
path) it says on stderr. Only the run dir and `trainer.resume` checks are train's alone.

The rules live in `parallel.validator` (the parallelism rules) and `speechlm.preflight.rules` (the
training rules, and `RULES`, the full table run here). This module gathers what the rules need from
the machine, or from flags when validating for another machine:

    speechlm validate configs/validate_example.yaml --world-size 64 --device-capability 12.0 \
        --env NVTE_FUSED_ATTN=0 --assume-installed transformer-engine=2.5 model.attention_backend=te

- world size: --world-size, else WORLD_SIZE from the environment, else the configured product
  dp_replicate * max(dp_shard, 1) * cp * tp;
- environment: this process's variables, changed by --env KEY=VALUE (--env KEY unsets KEY);
- device capability: --device-capability (9.0, 12.0, sm_90, none), else torch.cuda's current
  device, else none (CPU). torch is imported only for this, and only when the flag is missing;
- installed versions: importlib.metadata (torch, transformer-engine, flash-attn; cuDNN from torch
  when CUDA is up), changed by --assume-installed NAME=VERSION (VERSION=none: not installed).

Exit status: 0 no error (warnings allowed), 1 at least one error (a rule, or data train refuses),
2 the config (or a flag) cannot be read; the message names the file and the key.

`validate_at_fit_start` runs the same checks inside the trainer, on every rank, before model load.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parallel.validator import (
    ERROR,
    Finding,
    Rule,
    ValidationContext,
    build_context,
    check_or_raise,
    evaluate,
    format_findings,
    has_errors,
    normalize_installed,
    parse_capability,
)
from speechlm import errors
from speechlm.config import ConfigError, ExperimentConfig, load_config, parse_command_line, split_override
from speechlm.preflight.rules import RULES

# installed-package name -> (distribution names to ask importlib.metadata, import name)
PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch",), "torch"),
    "transformer-engine": (
        ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
        "transformer_engine",
    ),
    "flash-attn": (("flash-attn", "flash_attn"), "flash_attn"),
}


class UsageError(errors.UsageError):
    """A flag or override that cannot be used; reported with exit status 2."""


# --------------------------------------------------------------------------------------------
# What this machine has
# --------------------------------------------------------------------------------------------


def detect_installed() -> dict[str, str | None]:
    """Versions of torch, transformer-engine and flash-attn (None: not installed), without importing them."""
    out: dict[str, str | None] = {}
    for name, (distributions, module) in PACKAGES.items():
        version = None
        for dist in distributions:
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        if version is None and importlib.util.find_spec(module) is not None:
            version = "unknown"  # importable without package metadata (e.g. a source checkout)
        out[name] = version
    return out


def format_cudnn_version(code: int | None) -> str | None:
    """torch.backends.cudnn.version() as 'major.minor.patch': 90100 -> 9.1.0, 8902 -> 8.9.2 (cuDNN 8)."""
    if not code:
        return None
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def detect_device() -> tuple[tuple[int, int] | None, str | None]:
    """(compute capability of the current CUDA device, cuDNN version), or (None, None) without CUDA."""
    if importlib.util.find_spec("torch") is None:
        return None, None
    import torch  # lazy: torch (CLI start-up)

    if not torch.cuda.is_available():
        return None, None
    major, minor = torch.cuda.get_device_capability()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (int(major), int(minor)), format_cudnn_version(cudnn)


def detect_device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without CUDA (imports torch if installed)."""
    return detect_device()[0]


def validate_at_fit_start(
    config: ExperimentConfig,
    world_size: int,
    *,
    rank: int = 0,
    log: Callable[[str], Any] = print,
    device_capability: Any = "auto",  # Any: "auto", None, or what detect_device() gives (a capability tuple)
    env: Mapping[str, str] | None = None,
    manifest_summary: Mapping[str, Any] | None = None,
    rules: Sequence[Rule] = RULES,
) -> list[Finding]:
    """Validate this run's layout on every rank before the model loads; raise `ValidationError` on an error.

    Rank 0 logs the findings once. `device_capability="auto"` asks torch.cuda; pass None for a CPU
    run on a GPU machine. `rules` defaults to the full table (train passes the epoch-plan rule alone
    once the plan is built). Returns the findings (warnings only, when it returns).
    """
    installed = detect_installed()
    if device_capability == "auto":
        device_capability, installed["cudnn"] = detect_device()
    ctx = build_context(
        config, world_size, os.environ if env is None else env, device_capability, installed, manifest_summary
    )
    findings = evaluate(ctx, rules)
    check_or_raise(findings, log=log, rank=rank)
    return findings


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:  # Any: argparse's subparsers action (private)
    """Add `validate` to the `speechlm` subcommands (sets `func`)."""
    p = subparsers.add_parser(
        "validate",
        help="the pre-flight of train: check a layout and its data before launch (exit 0 valid, 1 errors, "
        "2 unreadable config)",
        description=(
            "Run the checks `speechlm train` runs before its first step: the parallel layout (CP/TP/FSDP sizes, "
            "packing, attention backend, environment, installed versions) and, with the training data "
            "(--manifest, or the config's manifests when they exist), the data rules and file checks "
            "(languages and tags known to the tokenizer, the epoch plan against grad_accum). Prints the "
            "findings with reasons and fixes. Device and versions default to this machine's; pass them as "
            "flags to validate for another machine."
        ),
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="dotted config overrides")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes in the job (default: WORLD_SIZE or as configured)",
    )
    p.add_argument("--cp-size", type=int, default=None, help="set parallel.cp_size")
    p.add_argument("--tp-size", type=int, default=None, help="set parallel.tp_size")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set an environment variable for the check (repeatable); --env KEY unsets it",
    )
    p.add_argument(
        "--device-capability",
        default=None,
        metavar="X.Y",
        help="GPU compute capability of the job (9.0, 12.0, sm_90) or 'none' for CPU (default: this machine)",
    )
    p.add_argument(
        "--assume-installed",
        action="append",
        default=[],
        metavar="NAME=VERSION",
        help="treat NAME (torch, transformer-engine, flash-attn, cudnn) as installed at VERSION "
        "(VERSION 'none': absent)",
    )
    p.add_argument(
        "--manifest",
        default=None,
        metavar="PATH",
        help="training data to check as `speechlm train` would (languages, tags, the epoch plan); "
        "default: the config's data.input_cfg or data.train_manifest when it exists",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)
    return p


def _split_pairs(items: Sequence[str], flag: str, allow_bare: bool) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for item in items:
        key, eq, value = item.partition("=")
        if not key.strip() or (not eq and not allow_bare):
            raise UsageError(f"{flag} {item!r}: write it as {flag} NAME=VALUE")
        out.append((key.strip(), value if eq else None))
    return out


def _gather_overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides or [])
    for item in overrides:
        key, _ = split_override(item)
        if "." not in key:
            raise UsageError(
                f"{item!r} is not a dotted config override (section.key=value); "
                f"pass an environment variable as --env {item}"
            )
    if args.cp_size is not None:
        overrides.append(f"parallel.cp_size={args.cp_size}")
    if args.tp_size is not None:
        overrides.append(f"parallel.tp_size={args.tp_size}")
    return overrides


def _resolve_world_size(
    args: argparse.Namespace, env: Mapping[str, str], config: ExperimentConfig
) -> tuple[int, str]:
    if args.world_size is not None:
        if args.world_size < 1:
            raise UsageError(f"--world-size {args.world_size}: the world size must be at least 1")
        return args.world_size, "--world-size"
    if env.get("WORLD_SIZE"):
        try:
            return int(env["WORLD_SIZE"]), "WORLD_SIZE"
        except ValueError:
            raise UsageError(
                f"WORLD_SIZE={env['WORLD_SIZE']!r} is not an integer; pass --world-size N"
            ) from None
    par = config.parallel
    return par.dp_replicate * max(par.dp_shard, 1) * par.cp_size * par.tp_size, "config"


def _collect(args: argparse.Namespace) -> tuple[ValidationContext, str]:
    config = load_config(  # ConfigError propagates to run()
        args.config, _gather_overrides(args)
    )
    env = dict(os.environ)
    for key, value in _split_pairs(args.env, "--env", allow_bare=True):
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    installed: dict[str, str | None] = dict(detect_installed())
    if args.device_capability is not None:
        try:
            capability = parse_capability(args.device_capability)
        except ValueError as e:
            raise UsageError(f"--device-capability: {e}") from None
    else:
        capability, installed["cudnn"] = detect_device()
    installed.update(
        normalize_installed(dict(_split_pairs(args.assume_installed, "--assume-installed", False)))
    )
    world_size, source = _resolve_world_size(args, env, config)
    # train's file checks (manifests, tokenizer, languages, tags) and the data-side rules' figures
    from speechlm.preflight.checks import summarize_plan, validate_data  # lazy: torch (CLI start-up)

    summary, checked, table, notes = validate_data(config, args.manifest)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    ctx = build_context(config, world_size, env, capability, installed, summary)
    if table is not None and not has_errors(evaluate(ctx, RULES)):
        # as train does: the epoch plan is built once the other rules pass
        plan, _ = summarize_plan(checked, table, world_size)
        ctx = build_context(config, world_size, env, capability, installed, {**(summary or {}), **plan})
    return ctx, source


def run(args: argparse.Namespace) -> int:
    try:
        ctx, world_source = _collect(args)
    except (ConfigError, UsageError) as e:
        print(f"speechlm validate: {e}", file=sys.stderr)
        return 2
    findings = evaluate(ctx, RULES)
    invalid = has_errors(findings)
    if args.json:
        context = {
            **ctx.as_dict(),
            "manifest": dict(ctx.manifest) if ctx.manifest is not None else None,
            "config": str(args.config),
            "world_size_source": world_source,
        }
        print(
            json.dumps(
                {"valid": not invalid, "findings": [f.as_dict() for f in findings], "context": context},
                indent=2,
            )
        )
        return 1 if invalid else 0
    n_errors = sum(f.level == ERROR for f in findings)
    n_warnings = len(findings) - n_errors
    if findings:
        print(f"{args.config}: {n_errors} error(s), {n_warnings} warning(s) for {ctx.describe()}\n")
        print(format_findings(findings))
    if invalid:
        return 1
    suffix = f"; {n_warnings} warning(s) above" if n_warnings else ""
    print(("\n" if findings else "") + f"OK: layout valid ({ctx.describe()}){suffix}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m speechlm.preflight.validate CONFIG ...`: the same as `speechlm validate CONFIG ...`."""
    parser = argparse.ArgumentParser(prog="speechlm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parse_command_line(parser, ["validate", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
