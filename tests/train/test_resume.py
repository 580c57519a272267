"""Resume loses nothing: the data position, the losses and the counters continue exactly.

The demo corpus is conftest.py's session fixture `demo_data`. Small runs (smoke-sized model, 4 optimizer steps per epoch) so that several epoch boundaries are cheap.
"""

from __future__ import annotations

from pathlib import Path

from helpers import build_corpus, read_train_metrics, run_train  # noqa: F401  (imported from here too)

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs/smoke.yaml")
# 8 micro-batches per epoch, grad_accum 2: 4 optimizer steps per epoch
SMALL_EPOCHS = ["sampler.max_batch_duration=60", "trainer.grad_accum=2", "trainer.val_every=0"]


def base_args(d: dict[str, str]) -> list[str]:
    return [
        SMOKE,
        f"data.train_manifest={d['train']}",
        f"data.val_manifest={d['val']}",
        f"data.tokenizer={d['tok']}",
        "trainer.final_eval_split=none",  # losses are compared: no greedy decode at the end
        *SMALL_EPOCHS,
    ]


def straight_and_resumed(base: list[str], tmp_path: Path, *, steps: int, stop: int) -> tuple[list, list]:
    """The metrics of one run of ``steps`` steps, and of a run stopped at ``stop`` (checkpointed there) then
    resumed to ``steps``."""
    full = run_train([*base, f"trainer.max_steps={steps}", f"trainer.run_dir={tmp_path / 'full'}"])
    assert full.returncode == 0, full.stderr[-3000:]
    p = tmp_path / "p"
    part = run_train(
        [*base, f"trainer.max_steps={stop}", f"trainer.ckpt_every={stop}", f"trainer.run_dir={p}"]
    )
    assert part.returncode == 0, part.stderr[-3000:]
    resumed = run_train([*base, f"trainer.max_steps={steps}", f"trainer.run_dir={p}", "trainer.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return read_train_metrics(tmp_path / "full"), read_train_metrics(p)


def test_resume_mid_epoch_keeps_full_epochs_after_the_boundary(demo_data, tmp_path):
    """Resumed at step 3 of a 4-step epoch: epochs 1 and 2 must still have all their 4 steps each."""
    base = base_args(demo_data)
    a, b = straight_and_resumed(base, tmp_path, steps=10, stop=3)
    assert [m["epoch"] for m in a] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert [m["epoch"] for m in b] == [m["epoch"] for m in a], "epochs after the resume are cut short"
    assert [m["rows_digest"] for m in b] == [m["rows_digest"] for m in a]
    assert [m["loss"] for m in b] == [m["loss"] for m in a]


COMPRESSED = [
    "model.audio_compression=ctc",
    "model.projector_stack=1",
    "model.audio_positions=aligned",
    "model.audio_token_embedding=true",
    "model.oracle_warmup_steps=4",
]


def test_resume_with_compressed_audio_and_an_oracle_warmup_is_exact(demo_data, tmp_path):
    """Issue 38: CTC-compressed audio rows (whose lengths come from the CTC head), aligned positions and the
    oracle warm-up (steps 1-4) resumed at step 3: the same batches and losses as one run, across the switch
    from the oracle to the audio."""
    base = [*base_args(demo_data), *COMPRESSED]
    a, b = straight_and_resumed(base, tmp_path, steps=6, stop=3)
    assert len(a) == 6 and [m["step"] for m in b] == [m["step"] for m in a]
    assert [m["rows_digest"] for m in b] == [m["rows_digest"] for m in a]
    assert [m["loss"] for m in b] == [m["loss"] for m in a]
    # the LLM computed the compressed rows, and the logged share counts them
    assert all(m["computed_tokens"] == m["real_tokens"] for m in a)
