"""Command-line values that cannot be used are argument errors, not exit-70 tracebacks (issue 36, item 7).

Audit cases (bad-input-2026-11-28): TL10/EV09 `--device cuda` without CUDA and TL11/BE04 `--device tpu` in
transcribe, evaluate and bench (one shared check, `speechlm.model.devices`); BE09/BE10 `bench packing
--batches 0` / `--max-batch-duration -5`; LF03t `data.max_duration` below every clip in validate and train.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SMOKE

from speechlm.cli import main, positive_float, positive_int
from speechlm.errors import UsageError
from speechlm.model.devices import check_device


def argument_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `speechlm ARGV`, expecting argparse's exit 2; return stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and "internal error" not in err
    return err


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_check_device_names_the_value_and_the_devices_there_are(no_cuda: None) -> None:
    assert check_device("cpu") == "cpu"
    with pytest.raises(UsageError, match=r"--device 'tpu' is not a device: use one of: cpu \(or leave"):
        check_device("tpu")
    with pytest.raises(UsageError, match=r"--device 'cuda:1': .* on this machine; use one of: cpu"):
        check_device("cuda:1")
    with pytest.raises(UsageError, match="speechlm runs on cpu, cuda, mps devices only"):
        check_device("meta")
    assert check_device("cuda:1", here_only=False) == "cuda:1"  # a plan for another machine
    with pytest.raises(UsageError, match="is not a device"):
        check_device("tpu", here_only=False)


def test_a_missing_gpu_index_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1"
    with pytest.raises(UsageError, match="this machine has 2 CUDA GPU"):
        check_device("cuda:2")


@pytest.mark.parametrize(
    "argv",
    [
        ["transcribe", "runs/x", "a.wav", "--device", "cuda"],  # TL10
        ["transcribe", "runs/x", "a.wav", "--device", "tpu"],  # TL11
        ["evaluate", "runs/x", "--manifest", "m.parquet", "--device", "cuda"],  # EV09
        # BE04; bench mfu --device cuda stays allowed: --dry-run plans for a GPU machine from anywhere
        ["bench", "mfu", "--device", "tpu"],
    ],
    ids=["TL10", "TL11", "EV09", "BE04"],
)
def test_device_flags_are_checked_before_anything_loads(
    argv: list[str], no_cuda: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run dir and files do not exist: the flag is refused first, nothing is read."""
    err = argument_error(argv, capsys)
    assert "argument --device:" in err and repr(argv[-1]) in err and "use one of: cpu" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["bench", "packing", "--batches", "0"],
            "argument --batches: 0: give a number of at least 1",
        ),  # BE09
        (
            ["bench", "packing", "--max-batch-duration", "-5"],
            "--max-batch-duration: -5: give a finite number",
        ),
        (["bench", "packing", "--repeats", "x"], "'x' is not a whole number"),
        (["bench", "mfu", "--budget", "nan"], "--budget: nan: give a finite number above 0"),
    ],
    ids=["BE09", "BE10", "repeats_word", "mfu_budget_nan"],
)
def test_bench_counts_and_seconds_must_be_positive(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert needle in argument_error(argv, capsys)


def test_positive_argument_types() -> None:
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5
    for bad in ("0", "-1", "1.5"):
        with pytest.raises(Exception, match="at least 1|whole number"):
            positive_int(bad)
    for bad in ("0", "-5", "inf", "x"):
        with pytest.raises(Exception, match="above 0"):
            positive_float(bad)


def test_LF03t_max_duration_below_every_clip_is_a_clear_error_in_validate_and_train(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = [
        f"data.train_manifest={demo_data['train']}",
        f"data.val_manifest={demo_data['val']}",
        f"data.tokenizer={demo_data['tok']}",
        "data.max_duration=0.5",
    ]
    for argv in (["validate", SMOKE, *data], ["train", SMOKE, *data, f"trainer.run_dir={tmp_path / 'run'}"]):
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 1, (argv[0], out, err)
        assert "every row of the epoch lasts longer than data.max_duration=0.5 s" in err
        assert "internal error" not in err and "model:" not in out
