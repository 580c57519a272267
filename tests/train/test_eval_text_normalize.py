"""Issue 36 item 1, evaluation (audit 2026-11-28: EV10, MC01, EM09t): references are the manifest's own
text under data.text_normalize, the rule training encoded, never the tokenizer's round trip of its ids;
trainer.eval_cer_langs compares language codes in lower case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_eval_counts import build_evaluator, smoke_cfg
from textnorm_helpers import ast_upper, plain, upper_transcripts


# --- evaluation scores against the manifest's text under the rule -----------------------------------------
def _oracle(module) -> None:
    """The model writes exactly what training would teach it: each row's rendered target ids."""

    def generate_for_batch(batch, **_kw):
        return [batch.tokens[b, : int(batch.token_lens[b])].tolist() for b in range(len(batch))]

    module.model.generate_for_batch = generate_for_batch


def test_ev10_references_are_the_manifest_text_not_the_tokenizer_round_trip(
    demo_data: dict[str, str], tmp_path: Path
) -> None:
    """EV10: the references are the manifest's transcripts (upper case as written), never `⁇ ⁇ ⁇`."""
    val = upper_transcripts(demo_data["val"], tmp_path / "val_upper.parquet")
    ev, module, table = build_evaluator(demo_data, str(val))
    _oracle(module)
    ev(module)
    want = {r: plain(t) for r, t in enumerate(table.column("text").to_pylist())}
    assert any(ref.isupper() for _, ref, _ in ev.last_decodes)
    for row, (_, ref, hyp) in zip(ev.last_rows, ev.last_decodes):
        assert ref == want[row] and "⁇" not in ref, (ref, want[row])
        assert (hyp == ref) == (not ref.isupper())  # upper case cannot be written: counted as errors


def test_mc01_lower_rule_trains_and_scores_the_same_text(demo_data: dict[str, str], tmp_path: Path) -> None:
    """MC01 with data.text_normalize=lower: the rendered targets hold no <unk> and are the lower-cased
    answers; a model that writes exactly those targets scores BLEU 100 against the lower-cased manifest
    answers (the rule applied to references and hypotheses the same way)."""
    from speechlm.data.run_inputs import run_dataset

    val = ast_upper(demo_data["val"], tmp_path / "ast_upper.parquet")
    ev, module, table = build_evaluator(demo_data, str(val), "data.text_normalize=lower")
    ds = run_dataset(ev.cfg, table, ev.tokenizer)
    answers = table.column("answer").to_pylist()
    for i in range(len(table)):
        sample = ds[i]
        labels = sample.prompt_ids[sample.prompt_mask].tolist()
        assert ev.tokenizer.unk_id not in labels
        assert sample.tokens.tolist() == ev.tokenizer.encode(answers[i].lower())
    _oracle(module)
    scores = ev(module)
    for row, (_, ref, hyp) in zip(ev.last_rows, ev.last_decodes):
        assert ref == hyp == " ".join(answers[row].lower().split())
    assert scores["ast/bleu"] == pytest.approx(100.0)


# --- EM09t -----------------------------------------------------------------------------------------------
def test_em09t_cer_langs_match_in_any_case(demo_data: dict[str, str]) -> None:
    """trainer.eval_cer_langs=[EN] scores the data's `en` rows by CER, as [en] does."""
    from speechlm.metrics import MetricSpec

    for given in ("[EN]", "[en]", "[' En ']"):
        spec = MetricSpec.from_config(smoke_cfg(demo_data, f"trainer.eval_cer_langs={given}"))
        assert spec.row_metrics("asr", "en") == ("cer",), given
        assert spec.row_metrics("asr", "hi") == ("wer",)
        stats = spec.score_utterance("asr", "en", "moon blue", "moon blve")
        assert stats is not None and set(stats) == {"cer"}
    assert json.dumps(sorted(MetricSpec.build(cer_langs=["ZH", "ja"]).cer_langs)) == '["ja", "zh"]'
