"""Issue 23 item 4, the metric functions (speechlm/metrics.py) against sacrebleu and jiwer on fixed strings:
corpus scores from summed per-utterance statistics, whatever the split over ranks; normalisation per task;
CER languages; metric names, their form and their direction."""

from __future__ import annotations

import random

import jiwer
import pytest
import sacrebleu

from speechlm.errors import UsageError
from speechlm.metrics import (
    MetricSpec,
    aggregate,
    check_metric_name,
    corpus_score,
    lower_is_better,
    normalize_text,
    sentence_stats,
)

REFS = [
    "the cat is on the mat",
    "there is a small house near the river",
    "we went to the market yesterday",
    "it is raining again .",
    "I don't know what to say",
    "Good morning, how are you?",
]
HYPS = [
    "the cat sat on the mat",
    "there is a house by the river",
    "we go to market yesterday",
    "it rains again .",
    "",
    "good morning how are you",
]


def summed(metric: str, pairs: list[tuple[str, str]]) -> list[int]:
    stats = [sentence_stats(metric, r, h) for r, h in pairs]
    return [sum(col) for col in zip(*stats, strict=True)]


@pytest.mark.parametrize(
    ("metric", "reference"),
    [
        ("bleu", lambda h, r: sacrebleu.corpus_bleu(h, [r]).score),
        ("chrf", lambda h, r: sacrebleu.corpus_chrf(h, [r]).score),
    ],
)
def test_corpus_score_from_summed_sentence_statistics_is_sacrebleus_and_split_free(metric, reference):
    pairs = list(zip(REFS, HYPS, strict=True))
    whole = corpus_score(metric, summed(metric, pairs))
    assert whole == reference(HYPS, REFS)  # the same numbers sacrebleu's corpus score sums: exactly equal
    assert 0 < whole < 100
    # two "ranks", each summing its share, then summed in another order: the very same score
    rank0, rank1 = summed(metric, pairs[0::2]), summed(metric, pairs[1::2])
    assert corpus_score(metric, [a + b for a, b in zip(rank1, rank0, strict=True)]) == whole
    # and not the mean of sentence scores (what a naive sharded average would give)
    mean = sum(corpus_score(metric, sentence_stats(metric, r, h)) for r, h in pairs) / len(pairs)
    assert mean != pytest.approx(whole)


def test_wer_and_cer_from_counts_equal_jiwers_corpus_rates():
    rng = random.Random(1)
    words = "ka kha ga gha nga cha".split()
    refs = [" ".join(rng.choices(words, k=rng.randint(1, 7))) for _ in range(30)]
    hyps = [" ".join(rng.choices(words, k=rng.randint(0, 7))) for _ in range(30)]
    pairs = list(zip(refs, hyps, strict=True))
    assert corpus_score("wer", summed("wer", pairs)) == pytest.approx(jiwer.wer(refs, hyps), abs=1e-12)
    assert corpus_score("cer", summed("cer", pairs)) == pytest.approx(jiwer.cer(refs, hyps), abs=1e-12)
    assert sentence_stats("cer", "abc", "") == [3, 3]  # an empty hypothesis: every character deleted


def test_normalisation_operations_and_order():
    decomposed = "cafe\u0301"  # e + combining acute
    assert normalize_text(decomposed, ["nfc"]) == "caf\u00e9"
    assert normalize_text(decomposed, []) == decomposed
    assert normalize_text("  Hello,   World!  ", ["lowercase", "strip_punct"]) == "hello world"
    assert normalize_text("ﬁne", ["nfkc"]) == "fine"  # the ligature folds
    assert normalize_text("«Что?» — да.", ["strip_punct"]) == "Что да"  # Unicode punctuation, any script
    with pytest.raises(ValueError, match="unknown normalisation"):
        normalize_text("x", ["lower"])


def test_task_defaults_qa_ignores_case_and_punctuation_ast_and_asr_do_not():
    spec = MetricSpec.build()
    assert spec.score_utterance("qa", "en", "Paris.", "paris") == {"accuracy": [1, 1]}
    assert spec.score_utterance("qa", "en", "Paris", "Lyon") == {"accuracy": [0, 1]}
    assert spec.score_utterance("asr", "en", "Paris", "paris") == {"wer": [1, 1]}  # today's WER: case counts
    ast = spec.score_utterance("ast", "hi", "The cat.", "the cat")
    assert ast is not None and set(ast) == {"bleu", "chrf"}
    assert ast["bleu"] == sentence_stats("bleu", "The cat.", "the cat")  # no normalisation before BLEU
    # configured: asr lowercased, qa case-sensitive again
    spec = MetricSpec.build(normalize={"asr": ["lowercase"], "qa": []})
    assert spec.score_utterance("asr", "en", "Paris", "paris") == {"wer": [0, 1]}
    assert spec.score_utterance("qa", "en", "Paris", "paris") == {"accuracy": [0, 1]}
    assert spec.score_utterance("ast", "hi", "The cat.", "the cat") == ast  # other tasks keep their default
    assert spec.score_utterance("qa", "en", " ", "x") is None  # empty reference: not scored


def test_cer_languages_score_characters_where_the_task_asks_for_wer():
    spec = MetricSpec.build(metrics={"asr": ["wer"], "qa": ["accuracy", "wer"]}, cer_langs=["zh"])
    assert spec.row_metrics("asr", "zh") == ("cer",) and spec.row_metrics("asr", "hi") == ("wer",)
    assert spec.row_metrics("qa", "zh") == ("accuracy", "cer")
    rows = [
        ("asr", "zh", spec.score_utterance("asr", "zh", "我爱你", "我恨你")),
        ("asr", "hi", spec.score_utterance("asr", "hi", "a b c d", "a b c")),
    ]
    out = aggregate(rows)
    assert out["asr/cer_zh"] == pytest.approx(1 / 3) and out["asr/cer"] == pytest.approx(1 / 3)
    assert out["asr/wer_hi"] == out["asr/wer"] == out["wer"] == out["wer_hi"] == pytest.approx(1 / 4)
    assert "wer_zh" not in out and "asr/wer_zh" not in out
    # the names a validation of these (task, lang) pairs gives are exactly what aggregate gives
    assert spec.metric_names({("asr", "zh"), ("asr", "hi")}) == sorted({*out, "loss"})


def test_keys_per_task_and_language():
    spec = MetricSpec.build()
    data = [("asr", "hi", "a b", "a c"), ("asr", "ta", "x y z", "x y z"), ("ast", "hi", "the cat", "the cat"),
            ("ast", "ta", "a dog runs", "a cat runs"), ("qa", "hi", "yes", "Yes!")]  # fmt: skip
    out = aggregate((t, lang, spec.score_utterance(t, lang, r, h)) for t, lang, r, h in data)
    assert out["asr/wer_hi"] == 0.5 and out["asr/wer_ta"] == 0.0 and out["asr/wer"] == pytest.approx(1 / 5)
    assert (out["wer"], out["wer_hi"], out["wer_ta"]) == (
        out["asr/wer"],
        out["asr/wer_hi"],
        out["asr/wer_ta"],
    )
    assert (
        out["ast/bleu"] == sacrebleu.corpus_bleu(["the cat", "a cat runs"], [["the cat", "a dog runs"]]).score
    )
    assert out["ast/chrf_ta"] == sacrebleu.corpus_chrf(["a cat runs"], [["a dog runs"]]).score
    assert out["qa/accuracy"] == out["qa/accuracy_hi"] == 1.0
    assert not any(k.startswith(("bleu", "chrf", "accuracy")) for k in out)  # only ASR keeps bare names


def test_a_task_without_a_metric_is_refused_naming_the_key():
    spec = MetricSpec.build()
    with pytest.raises(UsageError, match=r"task 'caption'.*trainer\.eval_metrics"):
        spec.score_utterance("caption", "en", "a", "b")
    assert MetricSpec.build(metrics={"caption": ["bleu"]}).row_metrics("caption", "en") == ("bleu",)


@pytest.mark.parametrize(
    ("name", "ok", "lower"),
    [
        ("loss", True, True),
        ("wer", True, True),
        ("wer_hi", True, True),
        ("asr/wer", True, True),
        ("asr/cer_zh", True, True),
        ("ast/bleu", True, False),
        ("ast/chrf_hi", True, False),
        ("qa/accuracy", True, False),
        ("bleu", False, False),
        ("asr/foo", False, False),
        ("asr/", False, False),
        ("a/b/wer", False, False),
    ],
)
def test_metric_names_form_and_direction(name, ok, lower):
    assert (check_metric_name(name) is None) == ok
    if ok:
        assert lower_is_better(name) == lower


def test_best_metric_must_be_one_the_validation_produces():
    spec = MetricSpec.build()
    pairs = {("asr", "hi"), ("ast", "hi")}
    spec.check_best_metric("ast/bleu_hi", pairs, "val manifest v.parquet")
    with pytest.raises(UsageError) as e:
        spec.check_best_metric("qa/accuracy", pairs, "val manifest v.parquet")
    msg = str(e.value)
    assert "val manifest v.parquet" in msg and "asr/wer_hi" in msg and "ast/chrf" in msg and "loss" in msg


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("trainer.eval_metrics={ast: [blue]}", "ast: 'blue' is not one of wer, cer, bleu, chrf, accuracy"),
        ("trainer.eval_metrics={ast: []}", "ast: must be a non-empty list"),
        ("trainer.eval_metrics={a/b: [wer]}", "task 'a/b' is not a task name"),
        (
            "trainer.eval_normalize={qa: [lower]}",
            "qa: 'lower' is not one of nfc, nfkc, lowercase, strip_punct",
        ),
        ("trainer.eval_normalize=lowercase", "must be a mapping"),
        ("trainer.eval_cer_langs=zh", "must be a list"),
        ("trainer.best_metric=bleu", "name the task: e.g. 'ast/bleu'"),
    ],
)
def test_config_keys_refuse_bad_values_naming_the_key(override, says):
    from speechlm.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert f"{override.split('=')[0]}=" in str(e.value) and says in str(e.value)


def test_config_entries_replace_only_their_tasks_default():
    from speechlm.config import load_config

    cfg = load_config(None, ["trainer.eval_metrics={ast: [bleu], caption: [chrf]}", "trainer.eval_cer_langs=[zh]",
                             "trainer.eval_normalize={asr: [lowercase]}"])  # fmt: skip
    spec = MetricSpec.from_config(cfg)
    assert spec.metrics["ast"] == ("bleu",) and spec.metrics["caption"] == ("chrf",)
    assert spec.metrics["asr"] == ("wer",) and spec.metrics["qa"] == ("accuracy",)
    assert spec.normalize["asr"] == ("lowercase",) and spec.normalize["qa"] == ("lowercase", "strip_punct")
    assert spec.row_metrics("asr", "zh") == ("cer",)
