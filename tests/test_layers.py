"""The layering of DESIGN.md, checked on the source: which folder may import what.

parallel/      torch, the standard library and parallel/ itself (plus `packaging` in the validator);
               never speechlm.
speechlm/      each layer of DESIGN.md's table only the layers below it (`LAYERS` here): the ground
               floor (errors, io, progress, metrics) nothing above it; config the standard library and
               yaml; packing torch and parallel.rounding; data never the model, the trainer, Lightning,
               transformers or torch.distributed; model never torch.distributed (the training layer
               binds collectives to the model), the trainer, Lightning or the data layer; preflight and
               use never the trainer; train everything but the demo, the sweep and the CLI.
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
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in ("speechlm", "parallel"):
            out += [
                (node.lineno, f"{node.module}.{a.name}") for a in node.names
            ]  # `from speechlm import errors`
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


# The layers table of DESIGN.md: the project modules each layer may import (a prefix matches the module
# and everything below it). The ground floor (errors, io, progress, metrics) may be imported by all.
GROUND = ("speechlm.errors", "speechlm.io", "speechlm.progress", "speechlm.metrics", "speechlm.__version__")
BELOW_TRAIN = (
    *GROUND,
    "speechlm.config",
    "speechlm.data",
    "speechlm.packing",
    "speechlm.model",
    "speechlm.preflight",
    "speechlm.use",
    "parallel",
)
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # layer folder or file: (project modules it may import, third-party modules it must not import)
    "speechlm/errors.py": (GROUND, ()),
    "speechlm/io.py": (GROUND, ()),
    "speechlm/progress.py": (GROUND, ()),
    "speechlm/metrics.py": (GROUND, ()),
    "speechlm/config": (
        ("speechlm.config", *GROUND, "parallel.backend_caps", "parallel.frames", "parallel.clip_placement"),
        ("torch",),
    ),
    "speechlm/packing": (("speechlm.packing", "parallel.rounding"), ()),
    "speechlm/data": (
        ("speechlm.data", "speechlm.config", "speechlm.packing", *GROUND, "parallel"),
        ("lightning", "transformers", "torch.distributed"),
    ),
    "speechlm/model": (
        ("speechlm.model", "speechlm.config", "speechlm.packing", *GROUND, "parallel"),
        ("lightning", "torch.distributed"),
    ),
    "speechlm/preflight": (
        (
            "speechlm.preflight",
            "speechlm.config",
            "speechlm.data",
            "speechlm.packing",
            "speechlm.model",
            *GROUND,
            "parallel",
        ),
        ("lightning",),
    ),
    "speechlm/use": (
        (
            "speechlm.use",
            "speechlm.config",
            "speechlm.data",
            "speechlm.packing",
            "speechlm.model",
            *GROUND,
            "parallel",
        ),
        ("lightning",),
    ),
    "speechlm/train": (("speechlm.train", *BELOW_TRAIN), ()),
}


def project_imports(f: Path) -> list[tuple[int, str]]:
    return [(line, mod) for line, mod in imports_of(f) if mod.split(".")[0] in ("speechlm", "parallel")]


def layer_violations(rel: str, allowed: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    def under(mod: str, prefixes: tuple[str, ...]) -> bool:
        return any(mod == p or mod.startswith(p + ".") for p in prefixes)

    bad = []
    for f in files(rel):
        for line, mod in imports_of(f):
            internal = mod.split(".")[0] in ("speechlm", "parallel")
            if (internal and not under(mod, allowed)) or under(mod, forbidden):
                bad.append(f"{f.relative_to(REPO)}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_what_the_layers_table_allows(layer):
    """An arrow that runs back up (a lower layer importing a higher one) fails here, naming the line."""
    allowed, forbidden = LAYERS[layer]
    assert layer_violations(layer, allowed, forbidden) == []


def test_the_layers_table_covers_every_folder():
    """A new folder under speechlm/ gets a row in the table (or is one of the top floors that may
    import everything: demo, sweep)."""
    top_floors = {"demo", "sweep"}
    folders = {p.name for p in (REPO / "speechlm").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - top_floors == {rel.split("/")[1] for rel in LAYERS if "." not in rel.split("/")[1]}


def test_the_layer_checker_sees_an_arrow_back_up(tmp_path, monkeypatch):
    bad = tmp_path / "speechlm" / "use" / "x.py"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "import os\nfrom speechlm.model import llm\n\ndef f():\n    from speechlm.train import step\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert layer_violations("speechlm/use", *LAYERS["speechlm/use"]) == [
        "speechlm/use/x.py:5 imports speechlm.train"
    ]


@pytest.mark.parametrize("module", ["speechlm/packing/thd.py", "speechlm/packing/prompt.py"])
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
    assert violations("parallel", lambda f: ["torch", "parallel"]) == [
        "parallel/x.py:2 imports speechlm.model"
    ]


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


# ----------------------------------------------------------------------------- import cycles


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...] = ("speechlm", "parallel")) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any depth: a function-level import is still a
    dependency). `from pkg import name` points at pkg.name where that is a module, else at pkg;
    relative imports are resolved against the importing module."""
    paths = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for t in targets:
                while t and t not in paths:  # `import a.b.c` of a name inside a module: its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has ~150 nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:  # shortest path back to the start inside the component (BFS)
        start = min(comp)
        prev: dict[str, str] = {}
        frontier = [start]
        while start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while prev[path[-1]] != start:
            path.append(prev[path[-1]])
        cycles.append([start, *path[::-1][:-1], start])
    return sorted(cycles)


def fmt_cycle(cycle: list[str]) -> str:
    return " -> ".join(cycle)


def test_no_import_cycles():
    """speechlm/ and parallel/ import each other in one direction only; a cycle (even through an import
    inside a function) means two modules that cannot be read, tested or moved apart."""
    cycles = [fmt_cycle(c) for c in import_cycles(import_graph(REPO))]
    assert cycles == []


def test_the_cycle_checker_names_a_cycle(tmp_path):
    pkg = tmp_path / "speechlm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\nfrom speechlm.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")  # relative, inside a function
    (pkg / "sub" / "c.py").write_text("from speechlm.a import x\n")
    (pkg / "d.py").write_text("from speechlm import a\n")  # imports into the cycle, not part of it
    (tmp_path / "parallel").mkdir()
    graph = import_graph(tmp_path)
    assert graph["speechlm.sub.b"] == {"speechlm.sub.c"} and graph["speechlm.d"] == {"speechlm.a"}
    assert [fmt_cycle(c) for c in import_cycles(graph)] == [
        "speechlm.a -> speechlm.sub.b -> speechlm.sub.c -> speechlm.a"
    ]
