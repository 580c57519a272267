"""Issue 36 item 1: text against the tokenizer (audit 2026-11-28: MC01, EV10, EM09t).

`data.text_normalize` is one rule for the answers and transcripts a run trains on and for the references
and hypotheses its evaluation scores; characters the tokenizer cannot encode after it are refused before
step 1 (never trained as <unk>), and evaluation scores against the manifest's own text, not the decode of
its token ids. `trainer.eval_cer_langs` compares language codes in lower case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from textnorm_helpers import ast_upper, upper_transcripts

from speechlm.cli import main

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")


def _train(demo_data: dict[str, str], tmp_path: Path, *extra: str, train=None, val=None) -> list[str]:
    return [
        "train",
        SMOKE,
        f"data.train_manifest={train or demo_data['train']}",
        f"data.val_manifest={val or demo_data['val']}",
        f"data.tokenizer={demo_data['tok']}",
        f"trainer.run_dir={tmp_path / 'run'}",
        *extra,
    ]


# --- the rule -------------------------------------------------------------------------------------------
def test_each_rule_keeps_the_tags_and_none_keeps_the_text() -> None:
    from speechlm.config import TextNormalize, choices_of
    from speechlm.data.text import TEXT_NORMALIZE, normalize_target

    assert choices_of(TextNormalize) == TEXT_NORMALIZE  # the config's choices are the rules there are
    text = "<|en|> GREEN, Book! [NOISE] don’t <unk>"
    assert normalize_target(text, "none") is text
    assert normalize_target(text, "lower") == "<|en|> green, book! [noise] don’t <unk>"
    assert normalize_target(text, "clean") == "<|en|> GREEN Book don't"
    assert normalize_target(text, "clean_lower") == "<|en|> green book don't"
    assert normalize_target("<|hi|> नमस्ते।", "clean_lower") == "<|hi|> नमस्ते"
    with pytest.raises(ValueError, match="data.text_normalize"):
        normalize_target(text, "upper")


def test_the_renderer_applies_the_rule_to_every_assistant_turn(demo_data: dict[str, str]) -> None:
    """A multi-turn conversation: each assistant turn (not the user's) is encoded under the rule."""
    import functools

    from speechlm.data.conversation import AudioRef, Clip, Conversation, Turn
    from speechlm.data.text import normalize_target
    from speechlm.data.tokenizer import Tokenizer
    from speechlm.packing.prompt import ConversationRenderer

    tok = Tokenizer(demo_data["tok"])
    conv = Conversation(
        (
            Turn("user", (AudioRef(0), "say it")),
            Turn("assistant", ("<|en|> MOON BLUE",)),
            Turn("user", ("Again",)),
            Turn("assistant", ("<|en|> SUN",)),
        ),
        (Clip("a.flac", duration=1.0),),
        lang="en",
    )
    lower = ConversationRenderer(tok, normalize=functools.partial(normalize_target, rule="lower"))
    assert lower.answers_of(conv.turns) == [tok.encode("<|en|> moon blue"), tok.encode("<|en|> sun")]
    assert tok.unk_id in ConversationRenderer(tok).answers_of(conv.turns)[0]  # as written: <unk>


# --- the coverage check before step 1 --------------------------------------------------------------------
def test_mc01_upper_case_answers_are_refused_before_step_1(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MC01: the answers' upper-case letters are not in the tokenizer: refused with the manifest, the rows,
    the characters and the key that fixes it; nothing was built or trained."""
    bad = ast_upper(demo_data["train"], tmp_path / "ast_upper.parquet")
    rc = main(_train(demo_data, tmp_path, train=bad))
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert "Traceback" not in err and "model:" not in out
    table = pq.read_table(bad)
    cased = [i for i, a in enumerate(table.column("answer").to_pylist()) if a != a.lower()]  # English rows
    first = table.column("segment_id")[cased[0]].as_py()
    for needle in (
        f"manifest {bad}:",
        f"{len(cased)} rows hold characters",
        f"column answer, row {cased[0]} (segment {first}): ",
        "'G' (U+0047)",
        "data.text_normalize=none",
        "trained as <unk>",
        "set data.text_normalize=lower",
    ):
        assert needle in err, (needle, err)
    # the rule it names is the fix: the same data passes the pre-flight under it
    rc = main([*_train(demo_data, tmp_path, "data.text_normalize=lower", train=bad), "--dry-run"])
    assert rc == 0, capsys.readouterr().err


def test_ev10_upper_case_val_transcripts_are_refused_and_validate_agrees(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """EV10 in training: the val split's references would hold characters the model cannot write."""
    bad = upper_transcripts(demo_data["val"], tmp_path / "val_upper.parquet")
    for argv in (
        _train(demo_data, tmp_path, val=bad),
        ["validate", *_train(demo_data, tmp_path, val=bad)[1:]],
    ):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 1, err
        assert f"val manifest {bad}:" in err and "row " in err and "'A' (U+0041)" in err, err
        assert "set data.text_normalize=lower" in err


def test_the_scan_names_what_each_rule_leaves(demo_data: dict[str, str]) -> None:
    """Punctuation, an annotation, a '<' outside a tag, an emoji, a decomposed accent: each is named under
    the rules that keep it; tags are never characters of the text; `clean` removes what it cleans."""
    from speechlm.data.text_coverage import coverage_problems
    from speechlm.data.tokenizer import Tokenizer

    tok = Tokenizer(demo_data["tok"])
    texts = pq.read_table(demo_data["train"]).column("text").to_pylist()
    rows = [
        texts[0] + ", hello!",  # punctuation
        "<|en|> moon [LAUGH] sun",  # an annotation
        "<|en|> a <b sun",  # '<' outside a tag
        "<|en|> sun \U0001f600",  # astral
        "<|en|> cafe\u0301",  # e + combining acute: NFKC makes é, which the demo tokenizer lacks
        *texts[1:],
    ]
    table = pa.table({"text": rows})

    def problem(rule: str) -> str:
        found = coverage_problems(table, "m", tok, rule, lambda r: f"row {r}")
        return found[0] if found else ""

    none = problem("none")
    for needle in (
        "5 rows",
        "','",
        "'!'",
        "'['",
        "'<' (U+003C)",
        "U+1F600",
        "U+0301",
        "row 0:",
        "row 1:",
        "row 2:",
    ):
        assert needle in none, (needle, none)
    assert "'|'" not in none and "'>'" not in none  # only in tags
    clean = problem("clean")
    assert "1 row holds" in clean and "U+1F600" not in clean and "'['" not in clean, clean  # cleaned away
    assert "'L' (U+004C)" not in clean  # [LAUGH] is an annotation: removed, its letters not counted
    assert "U+0301" in clean and "retrain the tokenizer" in clean  # no rule removes an accent


def test_a_composed_pair_the_tokenizer_lacks_is_found(demo_data: dict[str, str]) -> None:
    """न + nukta composes (NFC) into ऩ, which the demo tokenizer lacks, though it has both parts."""
    from speechlm.data.text_coverage import coverage_problems
    from speechlm.data.tokenizer import Tokenizer

    tok = Tokenizer(demo_data["tok"])
    texts = pq.read_table(demo_data["train"]).column("text").to_pylist()
    assert coverage_problems(pa.table({"text": texts}), "m", tok, "none", str) == []
    found = coverage_problems(pa.table({"text": [*texts, "<|hi|> \u0928\u093c"]}), "m", tok, "none", str)
    assert found and "U+0928 + U+093C" in found[0] and f"{len(texts)}: " in found[0], found


def test_conversation_rows_are_scanned(demo_data: dict[str, str]) -> None:
    """A conversation row's assistant turns and clip transcripts are targets; its user turns are not."""
    from speechlm.data.conversation import AudioRef, Clip, Conversation, Turn
    from speechlm.data.text_coverage import coverage_problems
    from speechlm.data.tokenizer import Tokenizer

    tok = Tokenizer(demo_data["tok"])

    def row(user: str, answer: str, transcript: str) -> str:
        clip = Clip("a.flac", duration=1.0, transcript=transcript)
        turns = (Turn("user", (AudioRef(0), user)), Turn("assistant", (answer,)))
        return Conversation(turns, (clip,), lang="en").to_json()

    table = pa.table(
        {
            "text": ["", "", ""],
            "conversation": [
                row("SAY IT!", "<|en|> moon", "<|en|> moon"),  # only the user turn is upper case
                row("say it", "<|en|> MOON", "<|en|> moon"),
                row("say it", "<|en|> moon", "<|en|> SUN"),
            ],
        }
    )
    found = coverage_problems(table, "m", tok, "none", lambda r: f"row {r}")
    assert found and "2 rows hold" in found[0] and "column conversation, row 1" in found[0], found
    assert "column conversation, row 2" in found[0] and "row 0" not in found[0]


def test_the_scan_encodes_characters_not_rows(demo_data: dict[str, str]) -> None:
    """20,000 rows: the tokenizer is asked about each distinct character once, not about each row."""
    from speechlm.data.text_coverage import coverage_problems
    from speechlm.data.tokenizer import Tokenizer

    tok = Tokenizer(demo_data["tok"])
    calls: list[str] = []
    real = tok.encode

    def counting(text: str) -> list[int]:
        calls.append(text)
        return real(text)

    tok.encode = counting  # type: ignore[method-assign]
    texts = pq.read_table(demo_data["train"]).column("text").to_pylist()
    rows = [texts[i % len(texts)] for i in range(20_000)]
    rows[12_345] = rows[12_345] + " X"
    found = coverage_problems(pa.table({"text": rows}), "m", tok, "none", lambda r: f"row {r}")
    assert found and "1 row holds" in found[0] and "row 12345: 'X'" in found[0], found
    distinct = {c for t in rows for c in t}
    assert len(calls) < 2 * len(distinct), len(calls)


@pytest.mark.parametrize("with_unk", [True, False], ids=["bpe_with_unk", "no_unk_token"])
def test_a_hugging_face_tokenizer_is_asked_by_its_unk_id(tmp_path: Path, with_unk: bool) -> None:
    """An HF tokenizer with an unk token refuses what maps to it; one without (byte-level BPE) covers all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from speechlm.data.hf_tokenizer import HFTokenizer
    from speechlm.data.text_coverage import coverage_problems

    tok = Tokenizer(models.BPE(unk_token="<unk>" if with_unk else None))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["moon blue sun river", "green book big sky"], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "</s>", **({"unk_token": "<unk>"} if with_unk else {})}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = HFTokenizer(tmp_path, langs=["en"])
    table = pa.table({"text": ["<|en|> moon blue", "<|en|> MOON"]})
    found = coverage_problems(table, "m", hf, "none", lambda r: f"row {r}")
    if with_unk:
        assert found and "1 row holds" in found[0] and "row 1: 'M', 'N', 'O'" in found[0], found
        assert "set data.text_normalize=lower" in found[0]
        assert coverage_problems(table, "m", hf, "lower", str) == []
    else:
        assert hf.unk_id is None and found == []
