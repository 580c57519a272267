"""The layering of DESIGN.md, checked on the source: which folder may import what.

parallel/      torch, the standard library and parallel/ itself (plus `packaging` in the validator);
               never speechlm.
speechlm/data  never the model, the trainer, Lightning, transformers or torch.distributed.
speechlm/model never torch.distributed (the training layer binds collectives to the model), the
               trainer, Lightning or the data layer.
packing/prompt torch and parallel.rounding only.
Only speechlm/train (and the CLI-level modules) import Lightning.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import, including those inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def files(rel: str) -> list[Path]:
    p = REPO / rel
    return [p] if p.is_file() else sorted(p.rglob("*.py"))


def violations(rel: str, allowed, forbidden=()) -> list[str]:
    bad = []
    for f in files(rel):
        for line, mod in imports_of(f):
            top = mod.split(".")[0]
            ok = (top in STDLIB or any(mod == a or mod.startswith(a + ".") for a in allowed(f))) and not any(
                mod == x or mod.startswith(x + ".") for x in forbidden
            )
            if not ok:
                bad.append(f"{f.relative_to(REPO)}:{line} imports {mod}")
    return bad


def test_parallel_imports_only_torch():
    def allowed(f: Path) -> list[str]:
        return ["torch", "parallel"] + (["packaging"] if "validator" in f.parts else [])

    assert violations("parallel", allowed) == []


DATA_FORBIDDEN = ("speechlm.model", "speechlm.train", "lightning", "transformers", "torch.distributed")
MODEL_FORBIDDEN = ("torch.distributed", "speechlm.train", "speechlm.data", "lightning")


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("speechlm/data", DATA_FORBIDDEN), ("speechlm/model", MODEL_FORBIDDEN)],
)
def test_data_and_model_do_not_import_upward(folder, forbidden):
    bad = [
        f"{f.relative_to(REPO)}:{line} imports {mod}"
        for f in files(folder)
        for line, mod in imports_of(f)
        if any(mod == x or mod.startswith(x + ".") for x in forbidden)
    ]
    assert bad == []


@pytest.mark.parametrize("module", ["speechlm/packing.py", "speechlm/prompt.py"])
def test_packing_and_prompts_import_only_torch(module):
    assert violations(module, lambda f: ["torch", "parallel.rounding", "speechlm.packing"]) == []


def test_only_the_training_layer_imports_lightning():
    outside = [
        f"{f.relative_to(REPO)}:{line} imports {mod}"
        for f in files("speechlm")
        if "train" not in f.relative_to(REPO).parts
        for line, mod in imports_of(f)
        if mod.split(".")[0] in ("lightning", "pytorch_lightning")
    ]
    assert outside == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    bad = tmp_path / "parallel" / "x.py"
    bad.parent.mkdir()
    bad.write_text("def f():\n    from speechlm.model import speech_llm\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert violations("parallel", lambda f: ["torch", "parallel"]) == ["parallel/x.py:2 imports speechlm.model"]


def test_the_command_line_does_not_import_torch_or_lightning():
    """`speechlm plan`, `validate`, `manifest` ... start without torch (~0.4 GB and seconds); only the
    commands that train or bench import it, inside their handlers."""
    import subprocess
    import sys

    code = (
        "import sys; from speechlm.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
