"""Shared fixtures of the test suite (pytest loads this file before any test module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _index_cache(tmp_path_factory) -> None:
    """Index caches (tar offsets, memory-mapped manifests) go to a temp folder, not ~/.cache."""
    os.environ["SPEECHLM_CACHE"] = str(tmp_path_factory.mktemp("speechlm_cache"))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> dict[str, str]:
    """The bundled demo corpus as a manifest plus a tokenizer (built once per session)."""
    from speechlm.cli import main

    out = tmp_path_factory.mktemp("demo_manifest")
    assert main(["manifest", "build", str(REPO / "data/demo/shards"), "--out", str(out)]) == 0
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--manifest",
                str(out / "train.parquet"),
                "--out",
                str(out / "tok"),
                "--vocab-size",
                "300",
            ]
        )
        == 0
    )
    return {
        "train": str(out / "train.parquet"),
        "val": str(out / "val.parquet"),
        "tok": str(out / "tok.model"),
    }
