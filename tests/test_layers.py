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


def import_cycles(package: str) -> list[list[str]]:
    """The import cycles (strongly connected components of 2+ modules) among the modules of `package`,
    counting imports inside functions too; a module importing its own parent package is not an edge."""
    root = REPO / package.replace(".", "/")
    modules = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_the_data_layer_has_no_import_cycles():
    """manifest/load <-> sources/detect and sources/join <-> sources/shards were cycles (issue 21)."""
    assert import_cycles("speechlm.data") == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text("from pkg import a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert import_cycles("pkg") == [["pkg.a", "pkg.b"]]
