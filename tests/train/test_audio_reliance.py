"""Audio reliance (issue 38, item 2): how much the decoder's teacher-forced loss rises when each sample hears
another sample's clip (`speechlm.use.evaluator.Evaluator.teacher_forced`, `rotate_clips`), per (task,
language), from the per-row CE the model returns (`SpeechLLM.forward(per_seq=True)`); the warning when it
stays near zero after the CTC head has converged (`speechlm.train.progress.reliance_warning`).

In-process on the tiny model of the layout tests (`parallel_harness`); the CP case over two gloo ranks.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from parallel_harness import batch_to, build_model, make_batch, tiny_config

from speechlm.data.dataset import Batch
from speechlm.model.conversation_inputs import as_conversation, conversation_prompts
from speechlm.model.speech_llm import SpeechLLM
from speechlm.use.eval_report import format_eval_table, reliance_scores
from speechlm.use.evaluator import Evaluator, SlotResult, rotate_clips


def module_of(model) -> SimpleNamespace:
    """What `Evaluator.teacher_forced` reads of a module: the model and its device."""
    return SimpleNamespace(model=model, device=torch.device("cpu"))


def row_of(batch: Batch, b: int, clip: int | None = None) -> Batch:
    """Row ``b`` of a transcription batch alone, hearing clip ``clip`` (default its own)."""
    c = b if clip is None else clip
    n = int(batch.audio_lens[c])
    return dataclasses.replace(
        batch,
        audio=batch.audio[c : c + 1, :n],
        audio_lens=batch.audio_lens[c : c + 1],
        tokens=batch.tokens[b : b + 1],
        token_lens=batch.token_lens[b : b + 1],
        langs=[batch.langs[b]],
        indices=[batch.indices[b]],
        durations=batch.durations[b : b + 1],
        tasks=[batch.tasks[b]] if batch.tasks else [],
    )


def audible_model():
    """The tiny model, untrained, its projector scaled up so that a clip moves the decoder's loss."""
    model = build_model(tiny_config())
    with torch.no_grad():
        model.projector.fc1.weight.mul_(10)
        model.projector.fc2.weight.mul_(30)
    return model.eval()


def listening(model, penalty: float):
    """``model`` made to read its audio, by construction: every row whose clip is not its own (another
    length than its own) costs ``penalty`` nats per labelled token more, on top
    of the model's own CE (a from-scratch decoder does not learn to read in a test's budget: issue 38)."""
    own_len = {}

    def forward(batch, *, encoder_frozen=False, per_seq=False):
        out = SpeechLLM.forward(model, batch, encoder_frozen=encoder_frozen, per_seq=per_seq)
        for row, n in zip(batch.indices, batch.audio_lens.tolist()):
            own_len.setdefault(row, n)  # the first forward of each row is with its own clip
        wrong = torch.tensor(
            [float(own_len[r] != n) for r, n in zip(batch.indices, batch.audio_lens.tolist())]
        )
        per_row = (
            wrong
            * penalty
            * torch.tensor(
                [
                    float(m.sum())
                    for _, m in conversation_prompts(as_conversation(batch, model.prompt), model.audio_id)[0]
                ]
            )
        )
        out.ce_sum = out.ce_sum + per_row.sum()
        if out.ce_per_seq is not None:
            out.ce_per_seq = out.ce_per_seq + per_row
        return out

    model.forward = forward
    return model


@pytest.mark.parametrize("packed", [True, False], ids=["thd", "bshd"])
def test_ce_per_seq_is_each_rows_own_ce_and_leaves_the_sum_as_it_was(packed):
    overrides = () if packed else ("model.packed_sequences=false",)
    model = build_model(tiny_config(overrides=overrides)).eval()
    batch = make_batch(3, 4)
    with torch.no_grad():
        plain = model(batch)
        out = model(batch, per_seq=True)
        alone = [float(model(row_of(batch, b)).ce_sum) for b in range(len(batch))]
    assert plain.ce_per_seq is None
    assert torch.equal(out.ce_sum, plain.ce_sum)  # the loss of training and validation is unchanged
    assert out.ce_per_seq is not None and out.ce_per_seq.dtype == torch.float32
    assert out.ce_per_seq.tolist() == pytest.approx(alone, rel=1e-4)
    assert float(out.ce_per_seq.sum()) == pytest.approx(float(out.ce_sum), rel=1e-5)


def test_rotate_clips_moves_each_clip_one_place_and_keeps_the_rows():
    batch = make_batch(5, 3)
    rotated = rotate_clips(batch)
    assert rotated is not None
    assert torch.equal(rotated.audio[1], batch.audio[0]) and torch.equal(rotated.audio[0], batch.audio[2])
    assert rotated.audio_lens.tolist() == [int(batch.audio_lens[i]) for i in (2, 0, 1)]
    assert torch.equal(rotated.tokens, batch.tokens) and rotated.langs == batch.langs
    assert rotate_clips(make_batch(5, 1)) is None  # one clip: nothing to rotate


def test_reliance_is_positive_for_a_decoder_that_reads_the_audio_and_zero_for_one_that_cannot():
    batch = dataclasses.replace(make_batch(4, 4), audio_lens=torch.tensor([3000, 4000, 5000, 6000]))
    out = SlotResult()
    with torch.no_grad():
        model = build_model(tiny_config()).eval()
        model.projector.fc2.weight.zero_()  # the projector's output is zero: every clip looks alike ...
        model.projector.fc2.bias.zero_()
    same_len = dataclasses.replace(batch, audio_lens=torch.full((4,), 5000))  # ... and rotating moves no row
    Evaluator.teacher_forced(module_of(model), same_len, out)
    deaf = reliance_scores(out.reliance_ce, out.reliance_tokens)
    assert set(deaf) == {"audio_reliance", "audio_reliance_xx", "asr/audio_reliance", "asr/audio_reliance_xx"}
    assert all(abs(v) < 1e-5 for v in deaf.values()), deaf

    out = SlotResult()
    Evaluator.teacher_forced(module_of(listening(model, 2.0)), batch, out)
    reads = reliance_scores(out.reliance_ce, out.reliance_tokens)
    assert reads["audio_reliance"] == pytest.approx(2.0, abs=0.05)  # (rotated - own) / tokens: the sign too


def test_reliance_is_summed_per_task_and_language_from_each_rows_own_difference():
    model = audible_model()
    batch = dataclasses.replace(
        make_batch(6, 4), langs=["hi", "en", "hi", "en"], tasks=["asr", "asr", "asr", "qa"]
    )
    out = SlotResult()
    Evaluator.teacher_forced(module_of(model), batch, out)
    got = reliance_scores(out.reliance_ce, out.reliance_tokens)
    with (
        torch.no_grad()
    ):  # row b hears clip b - 1 after the rotation: each row alone, its own clip and that one
        own = [model(row_of(batch, b)) for b in range(4)]
        delta = [float(model(row_of(batch, b, (b - 1) % 4)).ce_sum - own[b].ce_sum) for b in range(4)]
    n = [o.n_labelled for o in own]
    assert min(abs(d) for d in delta) > 1e-3  # the audio moves every row's loss
    want = {
        "audio_reliance": sum(delta) / sum(n),
        "audio_reliance_hi": (delta[0] + delta[2]) / (n[0] + n[2]),
        "audio_reliance_en": (delta[1] + delta[3]) / (n[1] + n[3]),
        "asr/audio_reliance": (delta[0] + delta[1] + delta[2]) / (n[0] + n[1] + n[2]),
        "asr/audio_reliance_hi": (delta[0] + delta[2]) / (n[0] + n[2]),
        "asr/audio_reliance_en": delta[1] / n[1],
        "qa/audio_reliance": delta[3] / n[3],
        "qa/audio_reliance_en": delta[3] / n[3],
    }
    assert got == pytest.approx(want, rel=1e-3, abs=1e-5)
    assert out.reliance_tokens == {("asr", "hi"): n[0] + n[2], ("asr", "en"): n[1], ("qa", "en"): n[3]}


def test_a_batch_of_one_clip_or_none_counts_nothing_but_runs_both_forwards():
    """Every rank runs two forwards per batch (FSDP and CP need the same collectives everywhere), but a
    batch that cannot be rotated adds nothing to the reliance; its loss still counts."""
    model = build_model(tiny_config()).eval()
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    one, out = make_batch(2, 1), SlotResult()
    Evaluator.teacher_forced(module_of(model), one, out)
    assert len(calls) == 2 and out.n_tokens > 0 and out.ce > 0
    assert out.reliance_ce == {} and out.reliance_tokens == {} and reliance_scores({}, {}) == {}
    calls.clear()
    empty = SlotResult()
    Evaluator.teacher_forced(module_of(model), Batch.empty(), empty)
    assert len(calls) == 2 and empty.n_tokens == 0 and empty.ce == 0 and empty.reliance_tokens == {}
    calls.clear()
    Evaluator.teacher_forced(module_of(model), make_batch(2, 3), out)
    assert len(calls) == 2 and sum(out.reliance_tokens.values()) > 0


def test_the_table_gives_the_llm_alone_then_joint_and_the_reliance_per_language():
    scores = {"wer": 0.04, "asr/wer": 0.04, "asr/wer_hi": 0.02, "asr/wer_en": 0.06}
    scores |= {"llm_wer": 0.99, "asr/llm_wer": 0.99, "asr/llm_wer_hi": 0.98, "asr/llm_wer_en": 1.0}
    scores |= {"audio_reliance": 0.3, "asr/audio_reliance": 0.3, "asr/audio_reliance_hi": 0.25}
    scores |= {"asr/audio_reliance_en": 0.35}
    lines = format_eval_table(scores, {"hi": 3, "en": 3}).splitlines()
    assert lines[0].split() == ["language", "utterances", "LLM", "WER", "joint", "WER", "reliance"]
    assert lines[2].split() == ["en", "3", "100.0%", "6.0%", "0.35"]
    assert lines[4].split() == ["all", "6", "99.0%", "4.0%", "0.30"]
    plain = {k: v for k, v in scores.items() if "llm" not in k and "reliance" not in k}
    assert format_eval_table(plain, {"hi": 3, "en": 3}).splitlines()[0].split() == [
        "language",
        "utterances",
        "WER",
    ]


# ------------------------------------------------------------------------------------------ the warning
def val_record(step: int, reliance: float | None, ctc: float | None, llm_wer: float | None = 0.99) -> dict:
    rec = {"kind": "val", "step": step, "loss": 1.1, "wer": 0.04}
    for key, value in (("audio_reliance", reliance), ("ctc_per_token", ctc), ("llm_wer", llm_wer)):
        if value is not None:
            rec[key] = value
    return rec


def test_the_warning_needs_a_converged_ctc_and_a_reliance_near_zero():
    from speechlm.train.progress import CTC_CONVERGED, RELIANCE_FLOOR, reliance_warning

    text = reliance_warning(val_record(600, 0.2, 0.1))
    assert text is not None and "the LLM is not reading the audio" in text and "step 600" in text
    for lever in ("model.audio_compression=ctc", "model.projector_stack=1", "model.audio_positions=aligned"):
        assert lever in text
    assert "CTC warm-up" in text and "pretrained LLM" in text and "99.0%" in text
    assert reliance_warning(val_record(600, RELIANCE_FLOOR + 0.1, 0.1)) is None  # the LLM reads
    assert reliance_warning(val_record(600, 0.2, CTC_CONVERGED + 0.5)) is None  # the encoder is not there yet
    assert reliance_warning(val_record(600, 0.2, None)) is None  # no CTC head: no basis to warn
    assert reliance_warning(val_record(600, None, 0.1)) is None  # no batch of two clips


def test_the_run_summary_warns_from_the_last_validation(tmp_path):
    from speechlm.train.progress import run_summary

    def summary(records: list[dict]) -> str:
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        kw = dict(steps=900, wall_seconds=600.0, train_minutes=10.0, best_metric="wer", lower_is_better=True)
        return run_summary(tmp_path, **kw)

    deaf = [val_record(300, 0.1, 2.0), val_record(600, 0.2, 0.3), val_record(900, 0.25, 0.2)]
    assert "the LLM is not reading the audio (validation at step 900" in summary(deaf)
    reading = [*deaf[:2], val_record(900, 1.4, 0.2)]
    assert "not reading" not in summary(reading)
    assert "not reading" not in summary([val_record(300, 0.1, 2.0)])  # CTC not converged yet


def test_the_validation_line_gives_the_llm_alone_and_the_reliance_and_the_warning(tmp_path, capsys):
    from speechlm.train.callbacks import MetricsWriter, ValidationCallback

    result = {"loss": 1.1, "wer": 0.04, "asr/wer": 0.04, "llm_wer": 0.992, "audio_reliance": 0.21}
    result["ctc_per_token"] = 0.2
    cb = ValidationCallback(
        lambda m: dict(result), MetricsWriter(tmp_path), tmp_path, every=5, best_metric="loss"
    )
    trainer = SimpleNamespace(global_step=5, is_global_zero=True)
    cb.best = 0.0  # no new best: nothing to save
    cb.on_train_batch_end(trainer, SimpleNamespace(), None, None, 0)
    out = capsys.readouterr().out
    assert "[val step 5] wer=4.0% llm_wer=99.2% audio_reliance=0.21" in out
    assert "the LLM is not reading the audio" in out
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["audio_reliance"] == 0.21 and logged["llm_wer"] == 0.992


# ------------------------------------------------------------------------------------------ CP
def _cp_worker(rank: int, world: int, threshold: int) -> dict:
    from parallel.mesh import ParallelDims
    from speechlm.train.distributed import build_distributed_context

    torch.set_num_threads(1)
    dims = ParallelDims(world, 1, -1, world, 1)
    dims.build_mesh("cpu")
    cfg = tiny_config(cp=world, split_threshold=threshold)
    model = build_model(cfg)
    build_distributed_context(model, dims, cfg, torch.device("cpu"))
    batch = batch_to(make_batch(7, 4), torch.device("cpu"))
    out = SlotResult()
    Evaluator.teacher_forced(module_of(model), batch, out)
    with torch.no_grad():
        own = model.eval()(batch, per_seq=True)
    return {"ce_per_seq": own.ce_per_seq, "ce": out.ce, "reliance_ce": out.reliance_ce}


@pytest.mark.multiproc
@pytest.mark.parametrize("threshold", [9, 10**6], ids=["split", "whole"])
def test_per_row_ce_and_reliance_summed_over_the_cp_group_equal_one_process(threshold):
    """cp 2, every sequence split over both ranks (threshold 9) or each whole on one rank: summed over the
    CP group (as the evaluator's gather sums the shards), the per-row CE and the reliance equal one
    process's."""
    from parallel.testing import run_distributed

    model = build_model(tiny_config()).eval()
    batch = make_batch(7, 4)
    ref = SlotResult()
    Evaluator.teacher_forced(module_of(model), batch, ref)
    with torch.no_grad():
        want = model(batch, per_seq=True).ce_per_seq
    ranks = run_distributed(_cp_worker, 2, "gloo", threshold, timeout_s=240)
    got = sum(r["ce_per_seq"] for r in ranks)
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-4)
    if threshold > 9:  # each sequence whole on one rank: the other rank holds 0 for it
        assert all(min(abs(float(r["ce_per_seq"][b])) for r in ranks) == 0 for b in range(4))
    assert sum(r["ce"] for r in ranks) == pytest.approx(ref.ce, rel=1e-4)
    for key, value in ref.reliance_ce.items():
        assert sum(r["reliance_ce"][key] for r in ranks) == pytest.approx(value, rel=1e-3, abs=1e-4)


def test_the_learning_curve_draws_the_llm_alone_wer_and_the_reliance(tmp_path):
    from speechlm.train.plots import plot_learning_curve, validation_series

    val = [val_record(300, 0.1, 2.0, 0.99), val_record(600, 0.6, 0.3, 0.42)]
    series = validation_series(val)
    assert series["greedy WER"]["llm_wer"] == [(300, 99.0), (600, 42.0)]
    assert series["greedy WER"]["wer"] == [(300, 4.0), (600, 4.0)]
    assert series["audio reliance"] == {"audio_reliance": [(300, 0.1), (600, 0.6)]}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"kind": "train", "step": 1, "loss": 2.0}, *val]))
    assert plot_learning_curve(path, tmp_path / "curve.png").stat().st_size > 1000
