"""`speechlm evaluate`, `speechlm export`, `speechlm transcribe` on one tiny run trained on the demo data.

The run (module fixture, a subprocess) trains 40 steps and ends with its own final evaluation on the
val split, so the figures of `speechlm evaluate` are checked against the run's eval.json and
eval_decodes.jsonl, and those of `transcribe` (from the run and from its export) against `evaluate`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, SMOKE, run_train

from parallel.testing import run_distributed

# what the run's final evaluation and `speechlm evaluate` decode alike: the defaults of both
RUN_STEPS = 40


@pytest.fixture(scope="module")
def trained_run(demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("usecli") / "run"
    r = run_train(
        [
            SMOKE,
            f"data.train_manifest={demo_data['train']}",
            f"data.val_manifest={demo_data['val']}",
            f"data.tokenizer={demo_data['tok']}",
            f"trainer.max_steps={RUN_STEPS}",
            "trainer.grad_accum=1",
            f"trainer.ckpt_every={RUN_STEPS}",
            f"trainer.run_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def evaluated(trained_run, demo_data) -> dict:
    from speechlm.use.evaluation import evaluate_checkpoint

    return evaluate_checkpoint(trained_run, demo_data["val"])


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory) -> Path:
    from speechlm.use.export import export_checkpoint

    return export_checkpoint(trained_run, tmp_path_factory.mktemp("export") / "model")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ evaluate
def test_evaluate_gives_the_runs_own_final_evaluation(trained_run, evaluated):
    run_eval = json.loads((trained_run / "eval.json").read_text())
    record = evaluated["record"]
    assert record["step"] == RUN_STEPS and record["checkpoint"].endswith(f"step_{RUN_STEPS:06d}")
    for key in [k for k in run_eval if k.startswith("wer")]:
        assert record[key] == run_eval[key], key
    assert record["utterances"] == run_eval["utterances"]
    run_decodes = [(d["lang"], d["ref"], d["hyp"]) for d in read_jsonl(trained_run / "eval_decodes.jsonl")]
    assert [(d["lang"], d["ref"], d["hyp"]) for d in evaluated["decodes"]] == run_decodes
    assert any(d["hyp"] for d in evaluated["decodes"]), "a model that emits nothing tests nothing"


def test_evaluate_cli_prints_the_table_or_one_json_object(
    trained_run, demo_data, evaluated, capsys, tmp_path
):
    from speechlm.cli import main

    decodes = tmp_path / "decodes.jsonl"
    args = ["evaluate", str(trained_run / "checkpoints" / "latest"), "--manifest", demo_data["val"]]
    # `latest` is a pointer file, not a checkpoint: a clear error, exit code 3
    assert main(args) == 3
    assert "neither a checkpoint" in capsys.readouterr().err
    ckpt = trained_run / "checkpoints" / f"step_{RUN_STEPS:06d}"
    assert (
        main(["evaluate", str(ckpt), "--manifest", demo_data["val"], "--json", "--decodes", str(decodes)])
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # one machine-readable object, nothing else on stdout
    assert json.loads(out[0]) == json.loads(json.dumps(evaluated["record"]))
    assert read_jsonl(decodes) == evaluated["decodes"]
    assert main(["evaluate", str(trained_run), "--manifest", demo_data["val"]]) == 0
    table = capsys.readouterr().out
    assert table.strip() == evaluated["table"].strip()
    assert "language  utterances  WER" in table and "\nall " in table


def _evaluate_rank(rank: int, world_size: int, run_dir: str, manifest: str) -> dict:
    from speechlm.use.evaluation import evaluate_checkpoint

    out = evaluate_checkpoint(run_dir, manifest, rank=rank, world_size=world_size, max_utterances=3)
    return {"record": out["record"], "decodes": out["decodes"], "table": out["table"]}


@pytest.mark.multiproc
def test_evaluate_sharded_over_two_gloo_ranks_equals_one_rank(trained_run, demo_data):
    from speechlm.use.evaluation import evaluate_checkpoint

    one = evaluate_checkpoint(trained_run, demo_data["val"], max_utterances=3)  # 4 batches of 3
    two = run_distributed(_evaluate_rank, 2, "gloo", str(trained_run), demo_data["val"], timeout_s=300)
    # the audio reliance is a difference of two float CE sums: equal to rounding (the counts: exactly)
    reliance = {k for k in one["record"] if "audio_reliance" in k}
    assert reliance
    for part in two:  # every rank gets the gathered result
        assert {k: v for k, v in part["record"].items() if k not in reliance} == {
            k: v for k, v in one["record"].items() if k not in reliance
        }
        assert {k: part["record"][k] for k in reliance} == pytest.approx(
            {k: one["record"][k] for k in reliance}, abs=1e-5
        )
        assert part["decodes"] == one["decodes"]
        assert part["table"] == one["table"]


def test_evaluate_refuses_a_manifest_with_languages_the_tokenizer_lacks(
    trained_run, demo_data, tmp_path, capsys
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speechlm.cli import main

    bad = tmp_path / "fr.parquet"
    src = pq.read_table(demo_data["val"])
    pq.write_table(src.set_column(src.column_names.index("lang"), "lang", pa.array(["fr"] * len(src))), bad)
    assert main(["evaluate", str(trained_run), "--manifest", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "fr" in err and str(bad) in err


def test_ev10_evaluate_scores_the_manifest_text_and_warns_of_what_the_model_cannot_write(
    trained_run, demo_data, tmp_path, capsys
):
    """EV10: English references in upper case are scored as written (never the tokenizer's `⁇` round
    trip), and a warning names the rows and characters the model cannot write (scored as errors)."""
    import pyarrow.parquet as pq
    from textnorm_helpers import plain, upper_transcripts

    from speechlm.cli import main

    val = upper_transcripts(demo_data["val"], tmp_path / "val_upper.parquet")
    decodes = tmp_path / "decodes.jsonl"
    args = ["evaluate", str(trained_run), "--manifest", str(val), "--json", "--decodes", str(decodes)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "warning:" in err and "'A' (U+0041)" in err and "count them as errors" in err, err
    texts = pq.read_table(val).column("text").to_pylist()
    rows = read_jsonl(decodes)
    en = [r for r in rows if r["lang"] == "en"]
    assert en and all(r["ref"] == plain(texts[r["row"]]) and r["ref"].isupper() for r in en)
    assert not any("⁇" in r["ref"] for r in rows)
    assert json.loads(out)["wer_en"] >= 1.0  # no upper-case word can be written


# ------------------------------------------------------------------------------------ export, transcribe
TRANSCRIBE_NO_TRAINING = """
import argparse, json, sys
from speechlm.use import transcribe
p = argparse.ArgumentParser()
transcribe.add_parser(p.add_subparsers())
args = p.parse_args(sys.argv[1:])
rc = args.func(args)
training = sorted(m for m in sys.modules if m.startswith(("speechlm.train", "lightning")))
print(json.dumps({"rc": rc, "training_modules": training}), file=sys.stderr)
"""


def transcribe_subprocess(args: list[str], **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    """`speechlm transcribe ARGS` through the transcribe module alone, offline; stderr ends with the
    training modules it imported."""
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"
    )
    cmd = [sys.executable, "-c", TRANSCRIBE_NO_TRAINING, "transcribe", *args]
    if kw.pop("background", False):
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
        )
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def test_export_then_transcribe_gives_the_hypotheses_of_evaluate(exported, evaluated, demo_data, tmp_path):
    from speechlm.model.exported import EXPORT_CONFIG

    files = {str(p.relative_to(exported)) for p in exported.rglob("*") if p.is_file()}
    assert {EXPORT_CONFIG, "llm/config.json", "llm/model.safetensors", "speech.safetensors"} <= files
    assert {"llm/sentencepiece.model", "llm/tokenizer.json"} <= files  # the tokenizer beside the LLM
    config = json.loads((exported / EXPORT_CONFIG).read_text())
    assert config["model"]["llm"]["pretrained"] == "llm" and config["source"]["step"] == RUN_STEPS
    assert {"torch", "transformers"} <= set(config["versions"])

    out = tmp_path / "hyps.jsonl"
    r = transcribe_subprocess([str(exported), "--manifest", demo_data["val"], "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stderr.strip().splitlines()[-1])
    assert report == {"rc": 0, "training_modules": []}  # the export loads with no training code
    lines = read_jsonl(out)
    assert [line["row"] for line in lines] == list(range(len(lines)))  # input order
    by_row = {line["row"]: line["text"] for line in lines}
    assert {d["row"]: d["hyp"] for d in evaluated["decodes"]} == by_row
    assert all(set(line) == {"row", "path", "lang", "text"} for line in lines)


def test_the_llm_of_an_export_loads_with_transformers_alone(exported, trained_run):
    import torch
    from transformers import AutoModelForCausalLM

    from speechlm.use.checkpoint import load_checkpoint

    llm = AutoModelForCausalLM.from_pretrained(exported / "llm", local_files_only=True)
    ref = load_checkpoint(trained_run).model.llm
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        assert torch.allclose(llm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5)


def test_transcribe_a_run_dir_equals_its_export(trained_run, exported, demo_data, capsys, monkeypatch):
    import speechlm.progress as progress
    from speechlm.cli import main

    # the progress display is drawn on a terminal only (issue 26): pretend stderr is one
    monkeypatch.setattr(progress, "progress_enabled", lambda rank=0: rank == 0)
    outs = []
    for model in (trained_run, exported):
        assert main(["transcribe", str(model), "--manifest", demo_data["val"], "--batch-size", "5"]) == 0
        captured = capsys.readouterr()
        outs.append([json.loads(x) for x in captured.out.splitlines()])
        assert "12/12" in captured.err and "utt" in captured.err  # the progress bar: 3 batches of <= 5
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_transcribe_files_reports_missing_and_undecodable_ones_and_exits_1(
    exported, demo_data, tmp_path, capsys
):
    import pyarrow.parquet as pq

    from speechlm.cli import main

    paths = [p for p in pq.read_table(demo_data["val"]).column("audio_filepath").to_pylist()[:2]]
    paths = [str(Path(demo_data["val"]).parent / p) if not Path(p).is_absolute() else p for p in paths]
    garbage = tmp_path / "noise.wav"
    garbage.write_bytes(b"RIFF not really a wave file")
    missing = tmp_path / "nowhere.flac"
    inputs = [paths[0], str(missing), paths[1], str(garbage)]
    out = tmp_path / "out.jsonl"
    assert main(["transcribe", str(exported), *inputs, "--out", str(out), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "2 of 4 inputs could not be transcribed" in err and str(missing) in err
    lines = read_jsonl(out)
    assert [line["path"] for line in lines] == inputs  # every input, in order
    assert set(lines[0]) == {"path", "lang", "text"} and set(lines[2]) == {"path", "lang", "text"}
    assert "does not exist" in lines[1]["error"] and lines[3]["error"]
    assert main(["transcribe", str(exported)]) == 2  # nothing to transcribe
    assert "give audio files or --manifest" in capsys.readouterr().err


def test_transcribe_killed_leaves_the_previous_out_untouched(exported, demo_data, tmp_path):
    import pyarrow.parquet as pq

    audio = [str(Path(p)) for p in pq.read_table(demo_data["val"]).column("audio_filepath").to_pylist()]
    audio = [p if Path(p).is_absolute() else str(Path(demo_data["val"]).parent / p) for p in audio]
    out = tmp_path / "hyps.jsonl"
    out.write_text('{"previous": "complete file"}\n')
    proc = transcribe_subprocess(
        [str(exported), *(audio * 40), "--batch-size", "1", "--out", str(out)], background=True
    )
    assert isinstance(proc, subprocess.Popen) and proc.stderr is not None
    started = time.time()
    for line in proc.stderr:  # the model is loaded and decoding has begun
        if line.startswith("transcribing "):
            break
        assert time.time() - started < 240, "transcribe did not start"
    time.sleep(1.0)
    assert proc.poll() is None, "finished before it could be killed: give it more inputs"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert out.read_text() == '{"previous": "complete file"}\n'
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_export_refuses_a_non_empty_out_and_an_interrupted_one_leaves_nothing(
    trained_run, tmp_path, monkeypatch, capsys
):
    from speechlm.cli import main
    from speechlm.use import export

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    assert main(["export", str(trained_run), "--out", str(taken)]) == 4
    assert "not empty" in capsys.readouterr().err and (taken / "x").read_text() == "mine"

    # a SIGKILL'd export leaves its temp dir (no config): transcribe refuses it, the next export removes it
    out = tmp_path / "model"
    stale = tmp_path / ".tmp-export-model-999999"
    (stale / "llm").mkdir(parents=True)
    assert main(["transcribe", str(stale), str(REPO / "README.md")]) == 3
    assert "speechlm_export.json" in capsys.readouterr().err

    def dies_midway(loaded, tmp):
        (tmp / "llm").mkdir()
        raise KeyboardInterrupt  # SIGINT/SIGTERM while writing

    monkeypatch.setattr(export, "write_export", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        export.export_checkpoint(trained_run, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no out, no temp dir, stale removed


def test_checkpoint_weights_must_cover_every_trainable_tensor(trained_run):
    """A checkpoint of another model config is refused naming a tensor it lacks (the frozen base a frozen
    or LoRA run leaves out is checked by fingerprint: tests/train/test_trainmodes_checkpoints.py)."""
    from speechlm.data.run_inputs import load_tokenizer, tokenizer_info
    from speechlm.train.checkpoint import CheckpointError
    from speechlm.train.module import SpeechLLMModule
    from speechlm.use.checkpoint import checkpoint_config, load_checkpoint_weights, resolve_checkpoint

    ckpt = resolve_checkpoint(trained_run)
    cfg = checkpoint_config(ckpt)
    cfg.model.llm.num_layers += 1  # one decoder layer the checkpoint does not hold
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    module = SpeechLLMModule(cfg, tokenizer_info(cfg, tokenizer))
    with pytest.raises(CheckpointError, match=r"has no model\.llm\.model\.layers\.2\."):
        load_checkpoint_weights(module, ckpt)


def test_a_runs_saved_tokenizer_is_preferred_to_the_configs(trained_run, tmp_path, monkeypatch):
    """RUN/tokenizer (the tokenizer with the tokens a run added) is what its checkpoints load."""
    import shutil

    import yaml

    from speechlm.data import run_inputs
    from speechlm.use.checkpoint import load_checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    tok = Path(yaml.safe_load((run / "config.yaml").read_text())["data"]["tokenizer"])
    (run / "tokenizer").mkdir()
    for suffix in (".model", ".json"):
        shutil.copyfile(tok.with_suffix(suffix), run / "tokenizer" / f"sentencepiece{suffix}")

    def config_tokenizer(path):
        raise AssertionError(f"loaded data.tokenizer={path} although the run saved its own")

    monkeypatch.setattr(run_inputs, "load_tokenizer", config_tokenizer)
    loaded = load_checkpoint(run)
    assert Path(loaded.tokenizer.path).parent == run / "tokenizer"


def test_transcribe_lang_forces_the_language_tag(exported, demo_data, capsys):
    from speechlm.cli import main

    assert main(["transcribe", str(exported), "--manifest", demo_data["val"], "--lang", "ta"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 12 and {line["lang"] for line in lines} == {"ta"}
    assert main(["transcribe", str(exported), "--manifest", demo_data["val"], "--lang", "xx"]) == 2
    assert "--lang xx" in capsys.readouterr().err


def test_ctc_weight_decodes_jointly_alike_in_transcribe_and_evaluate(
    trained_run, exported, demo_data, capsys
):
    from speechlm.cli import main
    from speechlm.use.evaluation import evaluate_checkpoint

    texts = {}
    for weight in ("0", "1"):
        argv = ["transcribe", str(exported), "--manifest", demo_data["val"], "--ctc-weight", weight]
        assert main(argv) == 0
        texts[weight] = {
            json.loads(x)["row"]: json.loads(x)["text"] for x in capsys.readouterr().out.splitlines()
        }
    plain = {
        json.loads(x)["row"]: json.loads(x)["text"] for x in _transcribe_default(exported, demo_data, capsys)
    }
    assert texts["0"] == plain  # weight 0: the LLM alone, the default of a model trained without the key
    assert texts["1"] != plain  # weight 1: the CTC head spells the transcript
    joint = evaluate_checkpoint(trained_run, demo_data["val"], ctc_weight=1.0)
    assert {d["row"]: d["hyp"] for d in joint["decodes"]} == texts["1"]
    assert main(["transcribe", str(exported), "--manifest", demo_data["val"], "--ctc-weight", "1.5"]) == 2
    assert "--ctc-weight 1.5" in capsys.readouterr().err


def _transcribe_default(exported, demo_data, capsys) -> list[str]:
    from speechlm.cli import main

    assert main(["transcribe", str(exported), "--manifest", demo_data["val"]]) == 0
    return capsys.readouterr().out.splitlines()


def test_transcribe_a_manifest_of_new_audio_gives_the_texts_of_the_same_audio_with_transcripts(
    exported, demo_data, tmp_path, capsys
):
    """Issue 36 TR12/TR13: rows with "text": "" (or no text) were dropped and the run exited 0 with no line."""
    import pyarrow.parquet as pq

    from speechlm.cli import main

    val = pq.read_table(demo_data["val"]).to_pylist()
    base = Path(demo_data["val"]).parent
    rows = [
        {
            "audio_filepath": str(base / r["audio_filepath"]),
            "duration": r["duration"],
            **({"text": ""} if i % 2 else {}),
        }
        for i, r in enumerate(val)
    ]
    new = tmp_path / "new.jsonl"
    new.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = []
    for manifest in (demo_data["val"], str(new)):
        assert main(["transcribe", str(exported), "--manifest", manifest, "--device", "cpu"]) == 0
        outs.append([json.loads(x) for x in capsys.readouterr().out.splitlines()])
    assert len(outs[1]) == len(val) > 0
    assert [(x["row"], x["text"], x["lang"]) for x in outs[1]] == [
        (x["row"], x["text"], x["lang"]) for x in outs[0]
    ]
