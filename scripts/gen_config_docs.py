#!/usr/bin/env python3
"""Write docs/config.md from the config's key declarations, or check that it is current.

    python scripts/gen_config_docs.py           # rewrite docs/config.md
    python scripts/gen_config_docs.py --check   # exit 1 if docs/config.md differs from the declarations

Every key of `speechlm.config.ExperimentConfig` appears with its type, default, valid range or
choices and meaning, all read from the sections' fields (`key(default, doc, rule)` in
speechlm/config/), so adding a field and rerunning this script documents it
(`speechlm.config.docs.render_reference`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speechlm.config import KEYS  # noqa: E402
from speechlm.config.docs import render_reference  # noqa: E402

DOC_PATH = ROOT / "docs" / "config.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/config.md is stale")
    parser.add_argument("--out", type=Path, default=DOC_PATH, help="where to write (default: docs/config.md)")
    args = parser.parse_args(argv)
    text = render_reference()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date ({len(KEYS)} keys)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(KEYS)} keys)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
