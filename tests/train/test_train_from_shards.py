"""Training from tar shards through `speechlm train` (subprocesses).

Covers: 8 steps from speechlm tar shards (indexed mode) give exactly the losses and batches of the
extracted-file manifest; streaming mode trains, and a run stopped at step 3 and resumed gives the
same batches and losses as an uninterrupted one (resume from the saved position, no replay).
"""

from __future__ import annotations

import pytest
from helpers import SMOKE, run_train
from helpers import read_train_metrics as read_metrics

from speechlm.cli import main


@pytest.fixture(scope="module")
def shard_dir(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("train_shards") / "train"
    argv = ["shards", "write", demo_data["train"], "--out", str(out), "--shard-size", "30"]
    assert main([*argv, "--skip-bad-audio"]) == 0  # the demo's non-audio file (en_001_00056) is not packed
    return out


@pytest.fixture(scope="module")
def packed_rows(demo_data, shard_dir, tmp_path_factory):
    """The extracted-file manifest of the rows the shards hold (all but the non-audio file)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(demo_data["train"])
    path = tmp_path_factory.mktemp("packed_rows") / "train.parquet"
    pq.write_table(table.filter(pc.not_equal(table.column("segment_id"), "en_001_00056")), path)
    return str(path)


def _args(train: str, demo_data: dict[str, str], run_dir, *extra: str) -> list[str]:
    # these runs compare batches and losses: no greedy decode of a final evaluation at the end
    return [SMOKE, f"data.train_manifest={train}", f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}", "trainer.grad_accum=1", "model.dropout=0",
            "trainer.final_eval_split=none", f"trainer.run_dir={run_dir}", *extra]  # fmt: skip


def test_eight_steps_from_shards_equal_extracted_files(demo_data, shard_dir, packed_rows, tmp_path):
    runs = {}
    for name, train in (("files", packed_rows), ("shards", str(shard_dir))):
        r = run_train(_args(train, demo_data, tmp_path / name, "trainer.max_steps=8"))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = read_metrics(tmp_path / name)
    assert len(runs["files"]) == 8
    for a, b in zip(runs["files"], runs["shards"], strict=True):
        assert a["rows_digest"] == b["rows_digest"]
        assert a["loss"] == b["loss"]


def test_streaming_mode_resumes_exactly(demo_data, shard_dir, tmp_path):
    base = [
        "data.read_mode=streaming",
        "data.shuffle_buffer=20",
        "data.sort_buffer=16",
        "trainer.ckpt_every=3",
    ]
    full = run_train(_args(str(shard_dir), demo_data, tmp_path / "full", *base, "trainer.max_steps=6"))
    assert full.returncode == 0, full.stderr[-3000:]
    part = run_train(_args(str(shard_dir), demo_data, tmp_path / "part", *base, "trainer.max_steps=3"))
    assert part.returncode == 0, part.stderr[-3000:]
    resumed = run_train(
        _args(
            str(shard_dir), demo_data, tmp_path / "part", *base, "trainer.max_steps=6", "trainer.resume=auto"
        )
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert [m["step"] for m in a] == [1, 2, 3, 4, 5, 6] == [m["step"] for m in b]
    for ma, mb in zip(a, b):
        assert ma["rows_digest"] == mb["rows_digest"], f"step {ma['step']}: different batches"
        assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-6)
    indexed = run_train(_args(str(shard_dir), demo_data, tmp_path / "indexed", "trainer.max_steps=2"))
    assert indexed.returncode == 0
    assert read_metrics(tmp_path / "indexed")[0]["rows_digest"] != a[0]["rows_digest"]  # another plan


def test_training_from_a_weighted_input_cfg(demo_data, shard_dir, tmp_path):
    import yaml

    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump([
        {"path": demo_data["train"], "name": "files", "weight": 1},
        {"path": str(shard_dir), "name": "tars", "weight": 3},
    ]))  # fmt: skip
    args = [SMOKE, f"data.input_cfg={mix}", f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}", "trainer.max_steps=2", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    r = run_train(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train data: data.input_cfg: 441 utterances" in r.stdout  # 221 files + 220 packed
    assert len(read_metrics(tmp_path / "run")) == 2
