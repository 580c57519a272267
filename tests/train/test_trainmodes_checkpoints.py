"""Checkpoints of frozen and LoRA runs: what trains plus a reference to the frozen base, resume exact.

Runs of configs/smoke.yaml on the demo corpus from a random tiny pretrained LLM directory
(tests/trainmodes_helpers.py), 4 optimizer steps with a checkpoint every 2. Resume: the run directory
is copied with its last checkpoint removed and continued to step 4 (`trainer.resume=auto`); its
losses must be the uninterrupted run's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import SMOKE, read_train_metrics, run_train
from trainmodes_helpers import lora_overrides, make_tiny_llm_dir, sentencepiece_on_pretrained

from speechlm.train.checkpoint import META_NAME, load_metadata, read_dcp_metadata


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory) -> Path:
    return make_tiny_llm_dir(tmp_path_factory.mktemp("tiny_llm"), vocab_size=300)


def args(demo_data: dict[str, str], llm_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        SMOKE,
        f"data.train_manifest={demo_data['train']}",
        f"data.tokenizer={demo_data['tok']}",
        f"model.llm.pretrained={llm_dir}",
        *sentencepiece_on_pretrained(),
        "sampler.max_batch_duration=60",
        "trainer.final_eval_split=none",
        "trainer.max_steps=4",
        "trainer.ckpt_every=2",
        f"trainer.run_dir={run_dir}",
        *extra,
    ]


def train(*a: str | Path) -> str:
    res = run_train([str(x) for x in a])
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def ckpt_bytes(ckpt: Path) -> int:
    return sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())


def model_keys(ckpt: Path) -> set[str]:
    meta = read_dcp_metadata(ckpt / ".metadata")
    return {k.removeprefix("state_dict.") for k in meta.state_dict_metadata if k.startswith("state_dict.")}


def drop_last_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of run `src` as if it had been killed after its step-2 checkpoint."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints/step_000004")
    (dst / "checkpoints/latest").write_text("step_000002")
    return dst


@pytest.fixture(scope="module")
def full_run(demo_data, llm_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("full") / "run"
    train(*args(demo_data, llm_dir, run, "trainer.max_steps=2"))
    return run


@pytest.fixture(scope="module")
def lora_run(demo_data, llm_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("lora") / "run"
    out = train(*args(demo_data, llm_dir, run, *lora_overrides()))
    assert "trained (llm.train=lora, encoder.train=full)" in out
    return run


def check_resume_exact(demo_data, llm_dir, run: Path, tmp_path: Path, *mode: str) -> None:
    resumed = drop_last_checkpoint(run, tmp_path / "resumed")
    train(*args(demo_data, llm_dir, resumed, *mode, "trainer.resume=auto"))
    a, b = read_train_metrics(run), read_train_metrics(resumed)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert [m["loss"] for m in b] == [m["loss"] for m in a]
    assert [m["rows_digest"] for m in b] == [m["rows_digest"] for m in a]


def test_lora_checkpoint_holds_adapters_and_a_base_fingerprint_not_the_base(lora_run, full_run):
    ckpt = lora_run / "checkpoints/step_000002"
    keys = model_keys(ckpt)
    assert any(".lora_A." in k for k in keys) and any(".lora_B." in k for k in keys)
    assert not any(".base_layer." in k or "embed_tokens" in k or "lm_head" in k for k in keys), sorted(keys)
    assert any(k.startswith("model.encoder.") for k in keys) and any(
        k.startswith("model.projector.") for k in keys
    )
    base = load_metadata(ckpt)["speechlm"]["base"]
    assert base["llm"] == "lora" and len(base["fingerprints"]["llm"]) == 64 and base["llm_pretrained"]
    full = full_run / "checkpoints/step_000002"
    assert any(".embed_tokens." in k for k in model_keys(full))
    assert ckpt_bytes(ckpt) < ckpt_bytes(full)
    assert (ckpt / META_NAME).is_file()


def test_lora_resume_is_exact(demo_data, llm_dir, lora_run, tmp_path):
    check_resume_exact(demo_data, llm_dir, lora_run, tmp_path, *lora_overrides())


def test_resume_onto_a_changed_base_is_refused(demo_data, tmp_path):
    """The pretrained LLM's weights changed in place after the checkpoint (same path, so the saved
    config matches): the checkpoint does not hold the base, so resuming onto it would silently train
    another model; the fingerprint refuses it, naming the key to fix."""
    import torch
    from safetensors.torch import load_file, save_file

    base = make_tiny_llm_dir(tmp_path / "llm", vocab_size=300)
    run = tmp_path / "run"
    train(*args(demo_data, base, run, *lora_overrides(), "trainer.max_steps=2"))
    weights = base / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if "layers.1.mlp.down_proj" in k)
    tensors[name] = tensors[name] + 1e-3 * torch.ones_like(tensors[name])
    save_file(tensors, weights, metadata={"format": "pt"})
    res = run_train(args(demo_data, base, run, *lora_overrides(), "trainer.resume=auto"))
    assert res.returncode != 0
    err = res.stderr + res.stdout
    assert "frozen llm" in err and "differs" in err and "model.llm.pretrained" in err, err[-2000:]


@pytest.mark.slow
def test_frozen_llm_and_encoder_checkpoint_is_small_and_resumes_exactly(
    demo_data, llm_dir, full_run, tmp_path
):
    mode = ("model.llm.train=frozen", "model.encoder.train=frozen")
    run = tmp_path / "frozen"
    train(*args(demo_data, llm_dir, run, *mode))
    ckpt = run / "checkpoints/step_000002"
    keys = model_keys(ckpt)
    assert not any(k.startswith(("model.llm.", "model.encoder.")) for k in keys), sorted(keys)
    assert any(k.startswith("model.projector.") for k in keys)
    assert set(load_metadata(ckpt)["speechlm"]["base"]["fingerprints"]) == {"llm", "encoder"}
    assert ckpt_bytes(ckpt) < ckpt_bytes(full_run / "checkpoints/step_000002") / 2
    check_resume_exact(demo_data, llm_dir, run, tmp_path, *mode)


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_under_fsdp2_dp2_saves_adapters_only_and_resumes_exactly(demo_data, llm_dir, tmp_path):
    """Two ranks (dp_shard=2: FSDP2 shards every decoder layer, adapters and frozen base in one unit):
    the sharded checkpoint holds no base weight and resuming it gives the uninterrupted losses."""
    from test_torchrun_smoke import torchrun

    run = tmp_path / "run"
    res = torchrun(2, args(demo_data, llm_dir, run, *lora_overrides()))
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = run / "checkpoints/step_000002"
    assert len(list(ckpt.glob("*.distcp"))) == 2
    keys = model_keys(ckpt)
    assert any(".lora_B." in k for k in keys) and not any(".base_layer." in k for k in keys)
    resumed = drop_last_checkpoint(run, tmp_path / "resumed")
    res = torchrun(2, args(demo_data, llm_dir, resumed, *lora_overrides(), "trainer.resume=auto"))
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = read_train_metrics(run), read_train_metrics(resumed)
    assert [m["loss"] for m in b] == [m["loss"] for m in a] and len(a) == 4
