"""Training-step pieces without Lightning: the encoder freeze, early stopping, the bundled broken files."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from parallel_harness import build_model, global_steps, tiny_config

from speechlm.train.schedule import build_optimizer
from speechlm.train.step import StepContext, run_optimizer_step

REPO = Path(__file__).resolve().parents[2]


def test_encoder_frozen_until_unfreeze_step_then_trained():
    cfg = tiny_config()
    cfg.optim.unfreeze_step = 2
    model = build_model(cfg)
    ctx = StepContext()
    opt, sched = build_optimizer(model, cfg)
    steps = global_steps(3, 1)
    seen = []
    for step, micro in enumerate(steps):

        def probe(step: int = step) -> float:
            enc = [p.grad for p in model.encoder.parameters()]
            rest = [p.grad for p in model.projector.parameters()]
            seen.append((step, all(g is None for g in enc), all(g is not None for g in rest)))
            return 0.0

        res = run_optimizer_step(model, micro, ctx, opt, sched, cfg, step=step, clip=probe)
        assert res["encoder_frozen"] == (step < 2)
    # steps 0 and 1: no encoder gradient (run without autograd), the projector still learns; step 2: both
    assert seen == [(0, True, True), (1, True, True), (2, False, True)]
    assert sched.get_last_lr()[1] > 0.0


class _FakeStrategy:
    def barrier(self, *_):
        pass


def test_validation_keeps_best_and_stops_after_patience(tmp_path, monkeypatch):
    from speechlm.train import callbacks
    from speechlm.train.callbacks import MetricsWriter, ValidationCallback

    saved: list[str] = []
    monkeypatch.setattr(
        callbacks, "save_checkpoint_atomic", lambda trainer, root, name, **kw: saved.append(name)
    )
    wers = iter([0.5, 0.4, 0.45, 0.41, 0.3])
    cb = ValidationCallback(
        lambda module: {"wer": next(wers)},
        MetricsWriter(tmp_path),
        tmp_path,
        every=1,
        best_metric="wer",
        patience=2,
    )
    trainer = SimpleNamespace(
        global_step=0,
        lightning_module=None,
        received_sigterm=False,
        is_global_zero=True,
        should_stop=False,
        strategy=_FakeStrategy(),
    )
    stopped_at = None
    for step in range(1, 6):
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, None, step)
        if trainer.should_stop:
            stopped_at = step
            break
    assert saved == ["best", "best"]  # 0.5, then 0.4; 0.45 and 0.41 are no better
    assert stopped_at == 4 and cb.best == pytest.approx(0.4)
    assert cb.state_dict() == {"best": 0.4, "bad_evals": 2, "metric": "wer"}


def test_bundled_broken_files_are_dropped_and_counted(demo_data):
    """The demo corpus ships two undecodable files: the loader drops them, counts them, never substitutes."""
    from collections import Counter

    from speechlm.data.dataset import SpeechDataset, build_dataloader
    from speechlm.data.sources.detect import load_source
    from speechlm.data.tokenizer import Tokenizer

    rows = []
    counter: Counter[str] = Counter()
    for split in ("train", "val"):
        table = load_source(demo_data[split])
        ds = SpeechDataset(table, Tokenizer(demo_data["tok"]))
        batches = [list(range(i, min(i + 16, len(table)))) for i in range(0, len(table), 16)]
        ids = table.column("segment_id").to_pylist()
        for b in build_dataloader(ds, batches):
            counter += Counter(b.dropped)
            rows += [ids[i] for i in b.indices]
            assert b.audio.shape[0] == len(b.indices)  # nothing substituted for the dropped rows
    assert counter == {"undecodable": 2}
    assert "en_001_00056" not in rows and "hi_000_00032" not in rows
    assert len(rows) == 231 and len(set(rows)) == 231


def test_training_and_decoding_prompts_share_the_instruction():
    """`data.instruction` reached the training prompts but not greedy decoding (the model had its own,
    empty, copy): validation WER was measured on prompts the model was not trained on."""
    import torch
    from parallel_harness import VOCAB

    from speechlm.packing.prompt import build_prompts
    from speechlm.train.module import SpeechLLMModule, TokenizerInfo

    tok = TokenizerInfo(vocab_size=VOCAB, pad_id=0, bos_id=2, eos_id=3, audio_id=4, instruction_ids=(9, 10))
    model = SpeechLLMModule(tiny_config(), tok).model
    ids, _ = build_prompts(torch.tensor([[5, 6]]), torch.tensor([2]), prompt=model.prompt)[0]
    assert ids.tolist() == [2, 4, 9, 10, 5, 6, 3]  # bos, <audio>, instruction, target, eos
    embedded: list[list[int]] = []
    embed = model.embed_tokens
    model.embed_tokens = lambda t: (embedded.append(t.tolist()), embed(t))[1]
    model.generate_greedy(torch.zeros(1, 3200), torch.tensor([3200]), max_new_tokens=1)
    # the prompt's text around the audio, embedded in one call: bos, instruction
    assert embedded[0] == [2, 9, 10]
