"""Bad audio after the manifest was built: dropped and counted in metrics.jsonl, or the run stops.

A file that disappears (or stops decoding) is dropped from its micro-batch and the run goes on; the
per-step and running counts are in metrics.jsonl. When more than `data.max_dropped_fraction` of one
micro-batch is dropped the run stops with an error naming the files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_resume import SMALL_EPOCHS, SMOKE, build_corpus, read_train_metrics, run_train

from speechlm.train.data import DroppedDataError, check_dropped_fraction

REPO = Path(__file__).resolve().parents[2]


class FakeBatch:
    def __init__(self, kept: int, dropped_files: list[str]):
        self.kept, self.dropped_files = kept, dropped_files
        self.dropped = {"missing_file": len(dropped_files)} if dropped_files else {}

    def __len__(self) -> int:
        return self.kept


def test_dropped_fraction_limit_names_the_files():
    check_dropped_fraction(FakeBatch(2, ["a.flac (missing_file)"] * 2), 0.5, epoch=0, position=3)  # 50%: ok
    with pytest.raises(
        DroppedDataError, match=r"3 of 5 samples of micro-batch 3 \(epoch 0\) were dropped"
    ) as e:
        check_dropped_fraction(
            FakeBatch(2, ["/x/a.flac (missing_file)", "b.flac (undecodable)", "c"]), 0.5, epoch=0, position=3
        )
    assert "/x/a.flac (missing_file)" in str(e.value) and "data.max_dropped_fraction" in str(e.value)
    check_dropped_fraction(FakeBatch(0, ["a"] * 9), 1.0, epoch=0, position=0)  # 1.0 never stops


@pytest.fixture(scope="module")
def own_corpus(tmp_path_factory) -> dict[str, str]:
    """A private copy of the demo shards (so files can be deleted) with its manifest and tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    shutil.copytree(REPO / "data/demo/shards", root / "shards")
    return build_corpus(root / "shards", root / "m")


def rows_of_first_micro_batch(args: list[str]) -> list[int]:
    from speechlm.config import load_config
    from speechlm.data.sampler.build import build_sampler
    from speechlm.data.sources.detect import load_source

    cfg = load_config(args[0], args[1:])
    return next(iter(build_sampler(cfg, load_source(cfg.data.train_manifest), dp_rank=0, dp_size=1)))


def test_file_gone_after_manifest_build_is_dropped_counted_or_stops_the_run(own_corpus, tmp_path):
    import pyarrow.parquet as pq

    args = [
        SMOKE,
        f"data.train_manifest={own_corpus['train']}",
        f"data.val_manifest={own_corpus['val']}",
        f"data.tokenizer={own_corpus['tok']}",
        "trainer.final_eval_split=val",
        *SMALL_EPOCHS,
        "trainer.max_steps=2",
    ]
    paths = pq.read_table(own_corpus["train"]).column("audio_filepath").to_pylist()
    gone = paths[rows_of_first_micro_batch(args)[0]]
    Path(gone).unlink()

    ok = run_train([*args, f"trainer.run_dir={tmp_path / 'ok'}"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    m = read_train_metrics(tmp_path / "ok")
    # the demo corpus also ships undecodable files: they are counted under their own reason
    assert m[0]["dropped_missing_file"] == 1 and m[0]["dropped_step"] == 1 + m[0].get(
        "dropped_undecodable", 0
    )
    assert m[1]["dropped_missing_file"] >= 1  # a running total

    stop = run_train([*args, "data.max_dropped_fraction=0", f"trainer.run_dir={tmp_path / 'stop'}"])
    assert stop.returncode == 1
    assert f"{gone} (missing_file)" in stop.stderr and "data.max_dropped_fraction=0" in stop.stderr


def test_the_advice_fits_the_reasons_a_token_drop_is_not_a_missing_file():
    from speechlm.data.drops import drop_advice

    batch = FakeBatch(0, ["a.flac (too_many_tokens): its answer has 90 tokens"] * 3)
    batch.dropped = {"too_many_tokens": 3}
    with pytest.raises(DroppedDataError) as e:
        check_dropped_fraction(batch, 0.5, epoch=0, position=1)
    msg = str(e.value)
    assert "3 of 3 samples" in msg and "too_many_tokens 3" in msg and "data.max_tokens" in msg
    assert "restore" not in msg.lower()  # nothing is missing: restoring files would be the wrong advice
    assert "restore" in drop_advice({"undecodable": 1})
    assert "texts" in drop_advice({"missing_tag": 2}) and "restore" not in drop_advice({"missing_tag": 2})
    assert "durations" in drop_advice(["duration_mismatch"])
