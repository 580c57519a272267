"""The CP layout (`parallel.cp_layout`) and the parallel/ module graph around it.

Letters: B clips, T packed tokens, H hidden, N sequences.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parallel_imports(path: Path) -> set[str]:
    """The parallel.* modules a file imports, at any depth (TYPE_CHECKING blocks and functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("parallel.")
        ):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("parallel.")}
    return out


def test_varlen_kernels_and_interface_do_not_import_each_other():
    """parallel.varlen imports the flash kernels; the kernels take the boundaries from varlen_meta."""
    flash = parallel_imports(REPO / "parallel" / "varlen_flash.py")
    assert "parallel.varlen" not in flash
    assert "parallel.varlen_meta" in flash
