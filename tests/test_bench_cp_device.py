"""`speechlm bench cp --device cuda`: refused with the reason on a machine without (enough) GPUs."""

from __future__ import annotations

import torch

from speechlm.preflight.bench import load_benchmark


def test_cuda_needs_a_gpu_per_cp_rank(monkeypatch, capsys):
    bench = load_benchmark("cp")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda", "--cp", "1,2"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "needs 4 GPUs" in bench.check_device("cuda", 4)
    assert bench.check_device("cuda", 1) is None and bench.check_device("cpu", 8) is None
