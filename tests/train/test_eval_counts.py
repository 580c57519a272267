"""Evaluation counts what it scored: per-language counts of decoded-and-scored utterances, drops
counted with their reason, `data.max_dropped_fraction` applied to the split, no result from nothing.

Issue 20 item 2 (audit cases B0, O1c, O1d, O1e, O1f, O1h, TC35) and the streaming evaluator (item 6).
In-process: the smoke model, untrained, on the demo val split (12 utterances, 3 languages).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_train

from speechlm.errors import DataError

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")


def rewrite_paths(src: str, out: Path, which) -> str:
    """A copy of manifest `src` whose rows `which(i)` point at audio that does not exist."""
    t = pq.read_table(src)
    paths = t["audio_filepath"].to_pylist()
    new = [str(Path(p).parent / "gone" / Path(p).name) if which(i) else p for i, p in enumerate(paths)]
    t = t.set_column(t.schema.get_field_index("audio_filepath"), "audio_filepath", pa.array(new))
    pq.write_table(t, out)
    return str(out)


def smoke_cfg(demo_data: dict[str, str], *extra: str):
    from speechlm.config import load_config

    return load_config(
        SMOKE,
        [f"data.train_manifest={demo_data['train']}", f"data.val_manifest={demo_data['val']}",
         f"data.tokenizer={demo_data['tok']}", *extra],
    )  # fmt: skip


def build_evaluator(demo_data, manifest: str, *extra: str, max_batches=None):
    from speechlm.data.sources.mmap_cache import open_index
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.train.module import SpeechLLMModule, TokenizerInfo
    from speechlm.use.evaluator import Evaluator

    cfg = smoke_cfg(demo_data, *extra)
    tokenizer = Tokenizer(cfg.data.tokenizer)
    tok = TokenizerInfo(
        len(tokenizer), tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.audio_id
    )
    module = SpeechLLMModule(cfg, tok)
    table = open_index(manifest)
    ev = Evaluator(cfg, tokenizer, table, 0, max_batches=max_batches)
    return ev, module, table


def test_half_missing_split_counts_only_what_was_scored(demo_data, tmp_path):
    """O1c/O1d/B0: 6 of 12 val files missing, limit 1: the counts say 6 scored and 6 dropped (by reason)."""
    half = rewrite_paths(demo_data["val"], tmp_path / "half.parquet", lambda i: i % 2 == 0)
    ev, module, table = build_evaluator(demo_data, half, "data.max_dropped_fraction=1")
    result = ev(module)
    counts = ev.last_counts
    assert result["utterances"] == 6 == len(ev.last_decodes) == sum(counts["scored"].values())
    assert result["dropped"] == 6 and counts["dropped_reasons"] == {"missing_file": 6}
    langs = set(table.column("lang").to_pylist())
    assert set(counts["scored"]) | set(counts["dropped"]) == langs  # no language silently vanishes
    for lang in langs:
        n_decoded = sum(1 for d in ev.last_decodes if d[0] == lang)
        assert counts["scored"].get(lang, 0) == n_decoded
    from speechlm.use.eval_report import format_wer_table

    table_text = format_wer_table(result, counts)
    all_line = next(ln for ln in table_text.splitlines() if ln.startswith("all"))
    assert all_line.split()[1] == "6"
    assert "dropped" in table_text and "missing_file" in table_text
    for lang in langs - set(counts["scored"]):  # a language with nothing scored still has its row
        assert any(ln.startswith(lang) for ln in table_text.splitlines())


def test_drop_limit_applies_to_the_evaluated_split(demo_data, tmp_path):
    """O1d: more than data.max_dropped_fraction of the split undecodable -> DataError naming the files."""
    some = rewrite_paths(demo_data["val"], tmp_path / "some.parquet", lambda i: i < 7)
    ev, module, _ = build_evaluator(demo_data, some, "data.max_dropped_fraction=0.5")
    with pytest.raises(
        DataError, match=r"7 of 12 samples of the val split .* were dropped \(missing_file 7\)"
    ) as e:
        ev(module)
    assert "/gone/" in str(e.value) and "data.max_dropped_fraction" in str(e.value)


@pytest.mark.parametrize("limit", ["0.5", "1"])
def test_split_with_no_decodable_utterance_is_an_error(demo_data, tmp_path, limit):
    """O1e/O1f: every file of the split missing is an error, never {"loss": 0.0}, whatever the limit."""
    gone = rewrite_paths(demo_data["val"], tmp_path / "gone.parquet", lambda i: True)
    ev, module, _ = build_evaluator(demo_data, gone, f"data.max_dropped_fraction={limit}")
    with pytest.raises(DataError, match="every one of the 12 samples of the val split .* was dropped"):
        ev(module)


@pytest.mark.parametrize("max_batches", [-1, 0])
def test_evaluation_of_zero_batches_gives_no_result(demo_data, max_batches):
    """TC35: val_max_batches=-1 (refused by the config check) used to validate on batches[:-1] = none."""
    ev, module, _ = build_evaluator(demo_data, demo_data["val"], max_batches=max_batches)
    if max_batches == 0:  # 0 means "no limit", as null
        assert ev(module)["utterances"] == 12
        return
    with pytest.raises(ValueError, match="val_max_batches"):
        ev(module)


def test_empty_split_is_an_error(demo_data, tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(demo_data["val"]).slice(0, 0), empty)
    ev, module, _ = build_evaluator(demo_data, str(empty))
    with pytest.raises(DataError, match="no utterance"):
        ev(module)


def test_evaluation_streams_its_batches(demo_data):
    """The evaluator decodes batch by batch: when the first batch is decoded, the rest is not loaded yet."""
    ev, module, _ = build_evaluator(demo_data, demo_data["val"], "trainer.eval_batch_duration=5")
    from speechlm.data.dataset import SpeechDataset

    loaded: list[int] = []
    seen_at_decode: list[int] = []
    orig_get = SpeechDataset.__getitem__
    orig_gen = module.model.generate_for_batch  # what evaluation decodes through

    def getitem(self, i):
        loaded.append(i)
        return orig_get(self, i)

    def generate(*a, **k):
        seen_at_decode.append(len(loaded))
        return orig_gen(*a, **k)

    module.model.generate_for_batch = generate
    SpeechDataset.__getitem__ = getitem
    try:
        result = ev(module)
    finally:
        SpeechDataset.__getitem__ = orig_get
    assert result["utterances"] == 12 and len(seen_at_decode) >= 3
    assert seen_at_decode[0] < 12  # not everything loaded before the first decode
    assert seen_at_decode == sorted(seen_at_decode) and seen_at_decode[-1] == 12


def test_training_on_no_decodable_utterance_is_an_error(demo_data, tmp_path):
    """O1h: every audio file missing with max_dropped_fraction=1: an error at step 1, not loss 0.0."""
    gone = rewrite_paths(demo_data["train"], tmp_path / "gone.parquet", lambda i: True)
    r = run_train([SMOKE, f"data.train_manifest={gone}", f"data.val_manifest={demo_data['val']}",
                   f"data.tokenizer={demo_data['tok']}", "data.max_dropped_fraction=1", "trainer.max_steps=3",
                   f"trainer.run_dir={tmp_path / 'run'}"])  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert (
        "optimizer step 1" in r.stderr
        and "every one of its" in r.stderr
        and "restore or remove the unreadable audio" in r.stderr
        and "/gone/" in r.stderr
    )
    assert not (tmp_path / "run/eval.json").exists()


def test_final_eval_json_and_table_count_the_scored_utterances(demo_data, tmp_path):
    """B0/O1c: eval.json and the printed table give per-language counts equal to eval_decodes.jsonl."""
    half = rewrite_paths(demo_data["val"], tmp_path / "half.parquet", lambda i: i % 3 == 0)
    run_dir = tmp_path / "run"
    r = run_train([SMOKE, f"data.train_manifest={demo_data['train']}", f"data.val_manifest={half}",
                   f"data.tokenizer={demo_data['tok']}", "trainer.max_steps=1", "trainer.final_eval_split=val",
                   f"trainer.run_dir={run_dir}"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    decodes = [json.loads(ln) for ln in (run_dir / "eval_decodes.jsonl").read_text().splitlines()]
    ev = json.loads((run_dir / "eval.json").read_text())
    assert len(decodes) == 8 and ev["utterances"]["all"] == 8 and ev["dropped"]["all"] == 4
    for lang in {d["lang"] for d in decodes}:
        assert ev["utterances"][lang] == sum(1 for d in decodes if d["lang"] == lang)
    assert ev["dropped_reasons"] == {"missing_file": 4}
    all_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("all "))
    assert all_line.split()[1] == "8"


@pytest.mark.multiproc
def test_counts_are_summed_over_two_dp_ranks(demo_data, tmp_path):
    """Under dp=2 each rank decodes half the split; eval.json counts every scored and dropped one once."""
    from test_signals import start_ranks, wait_all

    part = rewrite_paths(demo_data["val"], tmp_path / "part.parquet", lambda i: i % 4 == 1)
    run_dir = tmp_path / "run"
    procs = start_ranks([SMOKE, f"data.train_manifest={demo_data['train']}", f"data.val_manifest={part}",
                         f"data.tokenizer={demo_data['tok']}", "trainer.max_steps=1", "trainer.final_eval_split=val",
                         "trainer.eval_batch_duration=8", f"trainer.run_dir={run_dir}"], tmp_path)  # fmt: skip
    codes = wait_all(procs, timeout=300)
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    ev = json.loads((run_dir / "eval.json").read_text())
    decodes = (run_dir / "eval_decodes.jsonl").read_text().splitlines()
    assert len(decodes) == 9 and ev["utterances"]["all"] == 9
    assert ev["dropped"]["all"] == 3 and ev["dropped_reasons"] == {"missing_file": 3}


def test_an_eval_json_that_cannot_be_written_is_an_output_error(demo_data, tmp_path):
    from speechlm.errors import OutputError
    from speechlm.use.eval_report import write_eval_outputs

    (tmp_path / "eval.json").mkdir()  # a folder in the way (as a full disk or a read-only dir would fail)
    with pytest.raises(OutputError, match=r"cannot write .*eval.json .*checkpoints"):
        write_eval_outputs(tmp_path, {"wer": 1.0}, [("en", "a", "b")])
