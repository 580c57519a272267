"""`speechlm evaluate --cp-size 2` and `speechlm transcribe --cp-size 2` (issue 40, item 4): two gloo
processes decode together under dynamic CP; a clip longer than 30 s is encoded slice by slice over the pair
(not whole on each process), and the hypotheses (evaluate: also the counts and table) equal one process's,
written by one process."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from formats_helpers import write_wav
from helpers import SMOKE, run_train

from parallel.testing import run_distributed

STEPS = 2


@pytest.fixture(scope="module")
def limited_run(demo_data, tmp_path_factory) -> Path:
    """A smoke run whose encoder attends a limited window (what a sharded clip needs), 2 steps."""
    run_dir = tmp_path_factory.mktemp("evalcp") / "run"
    r = run_train(
        [
            SMOKE,
            f"data.train_manifest={demo_data['train']}",
            f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}",
            "model.encoder.att_context_size=[8,8]",
            f"trainer.max_steps={STEPS}",
            "trainer.grad_accum=1",
            f"trainer.ckpt_every={STEPS}",
            "trainer.final_eval_split=none",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def long_manifest(demo_data, tmp_path_factory) -> str:
    """A NeMo manifest: one 36 s clip (longer than the 30 s past which a clip is sharded) and two short
    ones, with transcripts and languages of the demo corpus (so the tokenizer covers them)."""
    root = tmp_path_factory.mktemp("long_manifest")
    rows = pq.read_table(demo_data["val"], columns=["text", "lang"]).slice(0, 3).to_pylist()
    lines = []
    for k, (seconds, row) in enumerate(zip((36.0, 2.0, 3.5), rows, strict=True)):
        write_wav(root / f"clip{k}.wav", seconds, 200.0 + 150 * k)
        lines.append(
            {"audio_filepath": f"clip{k}.wav", "duration": seconds, "text": row["text"], "lang": row["lang"]}
        )
    path = root / "manifest.json"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def count_decoding_slices() -> list[tuple[int, int]]:
    """The bounds of the slices this process encodes while decoding, from now on (the teacher-forced loss
    encodes its own: not counted)."""
    import speechlm.model.cp_audio as cp_audio
    import speechlm.model.generation as generation

    decoding, slices = [False], []
    prepare, encode = cp_audio.prepare_slices, generation.encode_for_decoding

    def counting_prepare(*args, **kwargs):
        out = prepare(*args, **kwargs)
        if decoding[0]:
            slices.extend(s.bounds for s in out)
        return out

    def flagged_encode(*args, **kwargs):
        decoding[0] = True
        try:
            return encode(*args, **kwargs)
        finally:
            decoding[0] = False

    cp_audio.prepare_slices, generation.encode_for_decoding = counting_prepare, flagged_encode
    return slices


def _evaluate_rank(rank: int, world_size: int, run_dir: str, manifest: str, cp_size: int) -> dict:
    from speechlm.use.evaluation import evaluate_checkpoint

    slices = count_decoding_slices()
    out = evaluate_checkpoint(run_dir, manifest, rank=rank, world_size=world_size, cp_size=cp_size)
    return {"record": out["record"], "decodes": out["decodes"], "table": out["table"], "slices": slices}


@pytest.mark.multiproc
def test_evaluate_at_cp_2_shards_the_long_clip_and_equals_one_process(limited_run, long_manifest):
    from speechlm.use.evaluation import evaluate_checkpoint

    one = evaluate_checkpoint(limited_run, long_manifest)
    two = run_distributed(_evaluate_rank, 2, "gloo", str(limited_run), long_manifest, 2, timeout_s=400)
    assert one["decodes"] and any(d["hyp"] for d in one["decodes"]), (
        "a model that emits nothing tests nothing"
    )
    teacher_forced = ("loss", "reliance", "ctc_per_token")  # float sums over the CP shards
    floats = {
        k for k, v in one["record"].items() if isinstance(v, float) and any(t in k for t in teacher_forced)
    }
    for rank, part in enumerate(two):
        assert part["decodes"] == one["decodes"], f"rank {rank}"
        # counts and WER exactly; the teacher-forced sums of the CP shards to rounding (the audio reliance, a
        # difference of two CE sums, to 1e-5 as over dp ranks: tests/use/test_usecli.py)
        assert {k: v for k, v in part["record"].items() if k not in floats} == {
            k: v for k, v in one["record"].items() if k not in floats
        }
        assert {k: part["record"][k] for k in floats} == pytest.approx(
            {k: one["record"][k] for k in floats}, rel=1e-4, abs=1e-5
        )
    # each process encoded one slice of the long clip (contiguous, together the clip), not the clip whole
    (lo0, hi0), (lo1, hi1) = two[0]["slices"] + two[1]["slices"]
    assert len(two[0]["slices"]) == len(two[1]["slices"]) == 1
    assert lo0 == 0 and hi0 == lo1 < hi1


# the layout is checked before anything loads: no run is needed to refuse it
def test_evaluate_refuses_a_cp_size_that_does_not_divide_the_processes(tmp_path):
    from speechlm.errors import UsageError
    from speechlm.use.evaluation import evaluate_checkpoint

    with pytest.raises(UsageError, match="--cp-size 2 with 3 process"):
        evaluate_checkpoint(tmp_path / "run", tmp_path / "m.json", rank=0, world_size=3, cp_size=2)


def test_the_evaluate_command_takes_cp_size_and_names_a_bad_one(tmp_path, capsys):
    from speechlm.cli import main

    assert (
        main(["evaluate", str(tmp_path / "run"), "--manifest", str(tmp_path / "m.json"), "--cp-size", "2"])
        != 0
    )
    assert "--cp-size 2 with 1 process(es)" in capsys.readouterr().err


def _transcribe_rank(rank: int, world_size: int, run_dir: str, manifest: str, out: str) -> dict:
    import os

    from speechlm.cli import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    slices = count_decoding_slices()
    args = ["transcribe", run_dir, "--manifest", manifest, "--max-duration", "40", "--device", "cpu"]
    code = main([*args, "--cp-size", str(world_size), "--out", out])
    return {"code": code, "slices": slices}


@pytest.mark.multiproc
def test_transcribe_at_cp_2_shards_the_long_clip_and_writes_one_processs_lines(
    limited_run, long_manifest, tmp_path
):
    from speechlm.cli import main

    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    args = [
        "transcribe",
        str(limited_run),
        "--manifest",
        long_manifest,
        "--max-duration",
        "40",
        "--device",
        "cpu",
    ]
    assert main([*args, "--out", str(one)]) == 0
    got = run_distributed(
        _transcribe_rank, 2, "gloo", str(limited_run), long_manifest, str(two), timeout_s=400
    )
    assert [g["code"] for g in got] == [0, 0]
    lines = one.read_text().splitlines()
    assert len(lines) == 3 and any(json.loads(line)["text"] for line in lines)
    assert two.read_text() == one.read_text()
    assert [len(g["slices"]) for g in got] == [1, 1]  # each process encoded one slice of the long clip
    assert got[0]["slices"][0][1] == got[1]["slices"][0][0]


def test_transcribe_refuses_a_cp_size_other_than_the_processes(tmp_path, capsys):
    from speechlm.cli import main

    assert (
        main(["transcribe", str(tmp_path / "run"), "--manifest", str(tmp_path / "m.json"), "--cp-size", "2"])
        != 0
    )
    assert "--cp-size 2 with 1 process(es)" in capsys.readouterr().err
