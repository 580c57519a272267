"""The one sampler builder (`speechlm.data.sampler.build`): the token cost model taken from the encoder
(its frame rate and subsampling) plus the text tokens, the same sampler for `speechlm train` and
`speechlm plan`, and the validator's token rule fed with the same count."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from speechlm.cli import main
from speechlm.config import load_config
from speechlm.data.sampler.build import build_sampler

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")


def _config(*overrides: str):
    return load_config(None, list(overrides))


def _table(durations: list[float], texts: list[str]) -> pa.Table:
    return pa.table(
        {"duration": pa.array(durations, pa.float32()), "lang": ["en"] * len(texts), "text": texts}
    )


@pytest.mark.parametrize(
    ("kind", "audio_tokens"),
    [
        ("whisper", 250),  # 100 feature frames/s, 2x conv stride: 50/s, stacked by 2: 25 tokens/s
        ("parakeet", 63),  # FastConformer 8x: 12.5/s, stacked by 2: 6.25 tokens/s (rounded up)
    ],
)
def test_audio_tokens_follow_the_encoder_frame_rate(kind: str, audio_tokens: int) -> None:
    cfg = _config(f"model.encoder.kind={kind}", "model.projector_stack=2", "sampler.max_batch_tokens=4000")
    sampler = build_sampler(cfg, _table([10.0] * 8, [""] * 8), dp_rank=0, dp_size=1)
    cost = sampler.settings.token_cost
    assert cost.count_tokens(np.array([10.0]))[0] == audio_tokens + cost.prompt_tokens


def test_a_token_budget_counts_the_text_tokens() -> None:
    """Long transcripts take budget: the same clips with 300-character texts pack into more micro-batches."""
    cfg = _config("sampler.max_batch_tokens=400", "sampler.mode=exhaustive", "trainer.grad_accum=1")
    durations = [4.0] * 60
    short = build_sampler(cfg, _table(durations, ["hi"] * 60), dp_rank=0, dp_size=1)
    long = build_sampler(cfg, _table(durations, ["x" * 300] * 60), dp_rank=0, dp_size=1)
    assert len(long) > len(short)
    # a duration budget does not read the texts: the plan and the sampler state stay as they were
    cfg = _config("sampler.mode=exhaustive", "trainer.grad_accum=1")
    a = build_sampler(cfg, _table(durations, ["hi"] * 60), dp_rank=0, dp_size=1)
    b = build_sampler(cfg, _table(durations, ["x" * 300] * 60), dp_rank=0, dp_size=1)
    assert list(a) == list(b) and a.state_dict() == b.state_dict()


def test_the_token_rule_fires_on_a_budget_below_the_longest_utterance(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = [f"data.train_manifest={demo_data['train']}", f"data.tokenizer={demo_data['tok']}"]
    rc = main(["validate", SMOKE, *data, "sampler.max_batch_tokens=40", "--world-size", "1", "--json"])
    out = capsys.readouterr().out
    findings = {f["rule_id"] for f in json.loads(out)["findings"]}
    assert rc == 0 and "budget-below-longest-utterance" in findings, out
    rc = main(["validate", SMOKE, *data, "sampler.max_batch_tokens=4000", "--world-size", "1", "--json"])
    out = capsys.readouterr().out
    assert "budget-below-longest-utterance" not in {f["rule_id"] for f in json.loads(out)["findings"]}


def test_plan_builds_the_sampler_train_builds(demo_data: dict[str, str], tmp_path: Path) -> None:
    """`speechlm plan --config` plans rank 0's micro-batches exactly as the training sampler hands them out,
    token budget (text tokens included) and the streaming read mode too."""
    from speechlm.data.sources.mmap_cache import open_index

    tars = tmp_path / "tars"
    assert main(["shards", "write", demo_data["train"], "--out", str(tars), "--skip-bad-audio"]) == 0
    for extra in (
        "sampler:\n  max_batch_tokens: 600\n",
        "  read_mode: streaming\n  num_workers: 2\n",
    ):
        cfg_file = tmp_path / "exp.yaml"
        data = f"data:\n  train_manifest: {tars}\n"
        body = data + extra
        cfg_file.write_text(body + "trainer:\n  grad_accum: 1\n")
        out = tmp_path / "plan.json"
        assert main(["plan", "--config", str(cfg_file), "--json", str(out)]) == 0
        plan = json.loads(out.read_text())
        cfg = load_config(str(cfg_file))
        sampler = build_sampler(cfg, open_index(tars), dp_rank=0, dp_size=1)
        assert plan["ranks"][0] == list(sampler)
        assert plan["mode"] == sampler.plan.mode
        assert plan["mode"].startswith("streaming") == (cfg.data.read_mode == "streaming")


def test_whisper_settings_are_what_the_sampler_saves() -> None:
    cfg = _config("model.encoder.kind=whisper", "sampler.max_batch_tokens=4000")
    sampler = build_sampler(cfg, _table([3.0] * 8, ["a b"] * 8), dp_rank=0, dp_size=1)
    saved = sampler.state_dict()["params"]["token_cost"]
    assert saved == dataclasses.asdict(sampler.settings.token_cost) and saved["encoder_subsampling"] == 2


def test_the_text_token_estimate_has_one_owner():
    """CHARS_PER_TOKEN is the sampler's token cost model's (`speechlm.data.sampler.cost`); `speechlm estimate`
    uses that one."""
    from speechlm.data.sampler import cost
    from speechlm.preflight import estimate

    assert estimate.CHARS_PER_TOKEN is cost.CHARS_PER_TOKEN == 3.0
    assert cost.text_tokens_of(np.array([0, 1, 3, 4]), None).tolist() == [0, 1, 1, 2]
