"""The shape of the house, measured on the source (issue 37): what a newcomer reads in five minutes.

- the top level of speechlm/ holds the front door and the ground floor only;
- no file in speechlm/ or parallel/ is over 600 lines, and `SpeechLLM`'s file is at most 400;
- an import inside a function body is the exception (a cycle broken, a heavy optional dependency
  deferred, a command line kept free of torch), at most 100 of them, each with its reason beside it;
- `Any` at the seams of train/ and preflight/ is the exception (at most 30, each with a reason);
- the README's file tree names every module, one line each.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(REPO / "speechlm").rglob("*.py"), *(REPO / "parallel").rglob("*.py")])
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "errors.py", "io.py", "progress.py", "metrics.py"}
MAX_LINES = 600
MAX_LOCAL_IMPORTS = 100
MAX_ANY_PARAMETERS = 30


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def test_the_top_level_is_the_front_door_and_the_ground_floor():
    loose = {p.name for p in (REPO / "speechlm").glob("*.py")}
    assert loose == TOP_LEVEL and len(loose) <= 8


def test_no_file_is_over_600_lines():
    long = {rel(p): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_speech_llm_is_a_model_again():
    assert len((REPO / "speechlm/model/speech_llm.py").read_text().splitlines()) <= 400


def local_imports(path: Path) -> list[ast.stmt]:
    found: dict[int, ast.stmt] = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[id(node)] = node
    return sorted(found.values(), key=lambda n: n.lineno)


def has_reason(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's own lines or on the line just above it."""
    span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
    above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
    return any("#" in line for line in span) or above.startswith("#")


def test_imports_inside_functions_are_few_and_each_says_why():
    total, silent = 0, []
    for p in SOURCES:
        lines = p.read_text().splitlines()
        for node in local_imports(p):
            total += 1
            if not has_reason(lines, node):
                silent.append(f"{rel(p)}:{node.lineno}: {ast.unparse(node)}")
    assert silent == []
    assert total <= MAX_LOCAL_IMPORTS


def any_parameters(path: Path) -> list[tuple[int, str]]:
    """(line, "function(parameter)") of each `Any`-annotated parameter of a public function or method:
    the seams other modules call."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn.name.startswith("_"):
            args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            out += [
                (a.lineno, f"{fn.name}({a.arg})")
                for a in args
                if a.annotation is not None and ast.unparse(a.annotation) == "Any"
            ]
    return out


def test_any_at_the_seams_of_train_and_preflight_is_rare_and_explained():
    found = []
    for p in sorted([*(REPO / "speechlm/train").rglob("*.py"), *(REPO / "speechlm/preflight").rglob("*.py")]):
        lines = p.read_text().splitlines()
        for line, what in any_parameters(p):
            found.append((f"{rel(p)}:{line} {what}", "#" in lines[line - 1]))
    assert [name for name, reason in found if not reason] == []
    assert len(found) <= MAX_ANY_PARAMETERS


def readme_tree() -> set[str]:
    """The paths the README's annotated file tree names (the ``` block under "## File tree")."""
    text = (REPO / "README.md").read_text()
    block = text.split("## File tree", 1)[1].split("```", 2)[1]
    names: set[str] = set()
    stack: list[tuple[int, str]] = []
    for raw in block.splitlines():
        m = re.match(
            r"^(\s*)([\w./-]+/|[\w.-]+\.py)(\s|$)",
            raw.replace("│", " ").replace("├──", "   ").replace("└──", "   "),
        )
        if not m:
            continue
        depth, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        path = "".join(n for _, n in stack) + name
        if name.endswith("/"):
            stack.append((depth, name))
        else:
            names.add(path)
    return names


def test_the_readme_file_tree_lists_every_module():
    modules = {rel(p) for p in SOURCES if p.name != "__init__.py"}
    listed = readme_tree()
    assert sorted(modules - listed) == [] and sorted(listed - modules - {"README.md"}) == []
