"""LR schedule: warmup then cosine; the encoder's two-phase schedule."""

import pytest

from speechlm.train.schedule import decoder_lr_lambda, encoder_frozen, encoder_lr_lambda


def test_warmup_then_cosine():
    f = [decoder_lr_lambda(s, warmup_steps=10, max_steps=110, min_lr_ratio=0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))  # rising during warmup
    assert all(a >= b for a, b in zip(f[10:110], f[11:110]))  # decaying afterwards
    assert f[110] == pytest.approx(0.1) and f[119] == pytest.approx(0.1)


def test_encoder_frozen_then_own_warmup():
    kw = dict(unfreeze_step=20, encoder_warmup_steps=5, warmup_steps=10, max_steps=100, min_lr_ratio=0.0)
    f = [encoder_lr_lambda(s, **kw) for s in range(100)]
    assert all(v == 0.0 for v in f[:20])
    assert f[20] == pytest.approx(0.2) and f[24] == pytest.approx(1.0)
    assert encoder_frozen(19, 20) and not encoder_frozen(20, 20) and not encoder_frozen(0, 0)


def test_no_freeze_follows_decoder():
    for s in range(50):
        assert encoder_lr_lambda(
            s, unfreeze_step=0, encoder_warmup_steps=3, warmup_steps=10, max_steps=50, min_lr_ratio=0.1
        ) == decoder_lr_lambda(s, warmup_steps=10, max_steps=50, min_lr_ratio=0.1)
