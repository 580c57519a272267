"""WER per language and reference/hypothesis clean-up."""

import pytest

from speechlm.train.evaluate import format_wer_table, strip_lang_tag, wer_by_language


def test_strip_lang_tag():
    assert strip_lang_tag("<|hi|> नमस्ते  दुनिया ") == "नमस्ते दुनिया"
    assert strip_lang_tag("plain words") == "plain words"


def test_wer_by_language():
    refs = ["a b c d", "x y", "p q r s"]
    hyps = ["a b c e", "x y", ""]
    m = wer_by_language(refs, hyps, ["en", "hi", "en"])
    assert m["wer_hi"] == 0.0
    assert m["wer_en"] == pytest.approx(5 / 8)  # one substitution + four deletions (empty hypothesis)
    assert m["wer"] == pytest.approx(5 / 10)
    table = format_wer_table(m, {"en": 2, "hi": 1})
    assert "en" in table and "62.5%" in table and "all" in table
