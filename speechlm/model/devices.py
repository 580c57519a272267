"""The ``--device`` argument of every command that runs a model (transcribe, evaluate, the benchmarks).

`device_argument` is the argparse ``type=`` of those flags: a device torch does not know (``tpu``), or a
GPU this machine does not have (``cuda`` without CUDA, ``cuda:3`` on a two-GPU machine), is refused
while the command line is read, with the devices that exist here, so nothing is loaded first (argparse
then exits 2, docs/errors.md). `check_device` is the same check for a caller that is not argparse.
"""

from __future__ import annotations

import argparse

from speechlm.errors import UsageError

KINDS = ("cpu", "cuda", "mps")


def available_devices() -> list[str]:
    """The device names this machine has: cpu, then cuda:0..N-1, then mps where present."""
    import torch  # lazy: torch (CLI start-up: --device is checked while the command line is read)

    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return names


def check_device(name: str, *, flag: str = "--device", here_only: bool = True) -> str:
    """`name` when this machine can run on it (``here_only=False``: when it is a cpu/cuda/mps device at
    all, for a plan made for another machine); a UsageError naming the value and the devices there are."""
    import torch  # lazy: torch (CLI start-up: --device is checked while the command line is read)

    here = available_devices()
    fix = f"use one of: {', '.join(here)} (or leave {flag} out)"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag} {name!r} is not a device: {fix}") from None
    if device.type not in KINDS:
        raise UsageError(
            f"{flag} {name!r}: speechlm runs on {', '.join(KINDS)} devices only; {fix}"
        ) from None
    if not here_only:
        return name
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch was built without CUDA"
                if torch.version.cuda is None
                else "no CUDA GPU is visible"
            )
            raise UsageError(f"{flag} {name!r}: {why} on this machine; {fix}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"{flag} {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s); {fix}"
            )
    if device.type == "mps" and "mps" not in here:
        raise UsageError(f"{flag} {name!r}: MPS is not available on this machine; {fix}")
    return name


def device_argument(text: str, *, here_only: bool = True) -> str:
    """argparse ``type=`` for ``--device``: `check_device`, reported as an argument error (exit 2)."""
    try:
        return check_device(text, here_only=here_only)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device ")) from None


def device_name_argument(text: str) -> str:
    """argparse ``type=`` for a ``--device`` that may name a GPU this machine lacks (a dry run planned
    for another machine; the command checks the device itself before it runs): the kind only."""
    return device_argument(text, here_only=False)
