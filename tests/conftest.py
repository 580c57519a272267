"""Shared fixtures of the test suite (pytest loads this file before any test module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers share the cores (pyproject's `-n auto`): one thread each, and for the training
    # subprocesses and gloo ranks they start, instead of every process spinning up one per core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def _lightning_logs_to_the_real_stderr() -> None:
    """Lightning adds a StreamHandler bound to the sys.stderr of the moment it is first imported; if that is
    a test's capsys stream, every later test's Lightning log line fails with '--- Logging error ---'
    (a traceback in their stderr). Import it once, before any test captures."""
    import lightning.pytorch  # noqa: F401


_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that runs `speechlm train` in-process leaves Lightning's process group (and its TCPStore
    listening on MASTER_PORT) and the MASTER_* variables behind; a later subprocess would inherit the
    port and fail with EADDRINUSE. Tear both down after every test."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    import sys

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            import gc

            gc.collect()  # the group's Python object may sit in a cycle: free it here, not in a forked child
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def _index_cache(tmp_path_factory) -> None:
    """Index caches (tar offsets, memory-mapped manifests) go to a temp folder, not ~/.cache."""
    os.environ["SPEECHLM_CACHE"] = str(tmp_path_factory.mktemp("speechlm_cache"))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> dict[str, str]:
    """The bundled demo corpus as a manifest plus a tokenizer (built once per session; the one demo corpus
    fixture of the suite: test files use it instead of building their own)."""
    from helpers import build_corpus

    return build_corpus(REPO / "data/demo/shards", tmp_path_factory.mktemp("demo_manifest"))
