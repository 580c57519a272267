"""`speechlm train` refuses a bad run before its first step (issue 20, items 1 and 7).

Every row runs `speechlm train` in-process with the smoke config and a bad input, and checks the exit
code, the one-paragraph message (file/row/key and the fix), and that no step ran: the model was never
built ("model:" not printed) and the run dir holds no metrics. The parity tests check that
`speechlm validate` gives the same verdict and rule id as `train` for the data-side rules.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speechlm.cli import main

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")


def _set_column(table: pa.Table, name: str, values: list) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, pa.string()))


@pytest.fixture(scope="module")
def bad(demo_data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Bad copies of the demo manifests and tokenizer, each with one defect."""
    out = tmp_path_factory.mktemp("preflight_inputs")
    train = pq.read_table(demo_data["train"])
    val = pq.read_table(demo_data["val"])
    files: dict[str, str] = {}

    def write(name: str, table: pa.Table) -> None:
        files[name] = str(out / f"{name}.parquet")
        pq.write_table(table, files[name])

    langs = train.column("lang").cast(pa.string()).to_pylist()
    langs[7] = "fr"
    write("frlang", _set_column(train, "lang", langs))
    vlangs = val.column("lang").cast(pa.string()).to_pylist()
    vlangs[0] = "fr"
    write("val_fr", _set_column(val, "lang", vlangs))
    texts = train.column("text").to_pylist()
    texts[6] = "<|xx|> hello"
    write("unknowntag", _set_column(train, "text", texts))
    texts = val.column("text").to_pylist()
    texts[2] = texts[2] + " <|zz|>"
    write("val_unknowntag", _set_column(val, "text", texts))
    # a three-row manifest: enough rows for grad_accum=2, but they pack into one micro-batch
    write("three_rows", train.slice(0, 3))
    # a tokenizer whose sidecar is not JSON
    tok_dir = out / "badtok"
    tok_dir.mkdir()
    model = Path(demo_data["tok"])
    (tok_dir / "tok.model").write_bytes(model.read_bytes())
    (tok_dir / "tok.json").write_text("{not json")
    files["bad_sidecar_tok"] = str(tok_dir / "tok.model")
    # T2 / T5: tar shard folders with a listed tar deleted, and without index.parquet
    for name, victim in (("tars_t2", "shard-000001.tar"), ("tars_t5", "index.parquet")):
        folder = out / name
        assert (
            main(
                [
                    "shards",
                    "write",
                    demo_data["train"],
                    "--out",
                    str(folder),
                    "--shard-size",
                    "60",
                    "--skip-bad-audio",
                ]
            )
            == 0
        )
        (folder / victim).unlink()
        files[name] = str(folder)
    # I_train_typo: an input_cfg entry with a misspelt key
    files["ic_typo"] = str(out / "ic_typo.yaml")
    Path(files["ic_typo"]).write_text(f"- {{path: {demo_data['train']}, name: demo, wieght: 1}}\n")
    files["afile"] = str(out / "afile")
    Path(files["afile"]).write_text("not a run dir\n")
    return files


Case = tuple[str, Callable[[dict[str, str], dict[str, str], Path], list[str]], int, tuple[str, ...]]


def _data(d: dict[str, str], *, train: str | None = None, val: str | None = None, tok: str | None = None):
    return [
        f"data.train_manifest={train or d['train']}",
        f"data.val_manifest={val or d['val']}",
        f"data.tokenizer={tok or d['tok']}",
    ]


CASES: list[Case] = [
    # O6d / newcomer 150: a missing train manifest, and a missing val manifest
    ("O6d", lambda d, b, t: _data(d, train=str(t / "nope.parquet")), 1, ("nope.parquet", "does not exist")),
    (
        "O6d_val",
        lambda d, b, t: _data(d, val=str(t / "noval.parquet")),
        1,
        ("noval.parquet", "does not exist"),
    ),
    # O6e: a missing tokenizer, and a tokenizer whose sidecar is not JSON
    (
        "O6e",
        lambda d, b, t: _data(d, tok=str(t / "tok.model")),
        1,
        ("data.tokenizer", "tok.model", "train one"),
    ),
    ("O6e_sidecar", lambda d, b, t: _data(d, tok=b["bad_sidecar_tok"]), 1, ("data.tokenizer", "tok.json")),
    # M_train_frlang and DV1: a language the tokenizer lacks, in train and in val
    ("M_train_frlang", lambda d, b, t: _data(d, train=b["frlang"]), 1, ("frlang.parquet", "'fr'", "row 7")),
    ("DV1", lambda d, b, t: _data(d, val=b["val_fr"]), 1, ("val_fr.parquet", "'fr'", "row 0")),
    # M_train_unknowntag: found before the first step (it used to be found by the final evaluation)
    (
        "M_train_unknowntag",
        lambda d, b, t: _data(d, train=b["unknowntag"]),
        1,
        ("unknowntag", "<|xx|>", "row 6"),
    ),
    (
        "val_unknowntag",
        lambda d, b, t: _data(d, val=b["val_unknowntag"]),
        1,
        ("val_unknowntag", "<|zz|>", "row 2"),
    ),
    # DI1: the instruction's tag is a config value
    (
        "DI1",
        lambda d, b, t: [*_data(d), "data.instruction=<|fr|> transcribe"],
        2,
        ("data.instruction", "<|fr|>"),
    ),
    # O6f and K14: the run dir, or its checkpoints folder, is a file
    (
        "O6f",
        lambda d, b, t: [*_data(d), f"trainer.run_dir={b['afile']}"],
        3,
        ("trainer.run_dir", "not a directory"),
    ),
    ("K14", lambda d, b, t: _data(d), 3, ("checkpoints", "not a directory")),
    (
        "run_dir_under_a_file",
        lambda d, b, t: [*_data(d), f"trainer.run_dir={b['afile']}/sub"],
        3,
        ("cannot be created",),
    ),
    ("checkpoints_dangling_link", lambda d, b, t: _data(d), 3, ("symbolic link", "does not exist")),
    # O6g / newcomer 144: trainer.resume names no checkpoint (checked before the model is built)
    (
        "O6g",
        lambda d, b, t: [*_data(d), f"trainer.resume={t}/gone/step_000100"],
        3,
        ("trainer.resume", "step_000100"),
    ),
    # T2, T5, I_train_typo: tar folders and an input_cfg that cannot be read
    ("T2", lambda d, b, t: _data(d, train=b["tars_t2"]), 1, ("shard-000001.tar", "does not exist")),
    ("T5", lambda d, b, t: _data(d, train=b["tars_t5"]), 1, ("no index.parquet", "run it again")),
    (
        "I_train_typo",
        lambda d, b, t: [*_data(d)[1:], f"data.input_cfg={b['ic_typo']}"],
        1,
        ("'wieght'", "weight"),
    ),
    # O6j3b: enough rows for grad_accum, too few micro-batches
    ("O6j3b", lambda d, b, t: _data(d, train=b["three_rows"]), 1, ("epoch-plan-too-short",)),
    # newcomer 108 (grad_accum=16 on the demo config): the same rule on the smoke config
    ("newcomer108", lambda d, b, t: [*_data(d), "trainer.grad_accum=100"], 1, ("epoch-plan-too-short",)),
    (
        "newcomer110",
        lambda d, b, t: [*_data(d), "trainer.grad_accum=300"],
        1,
        ("grad-accum-exceeds-batches",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_train_refuses_before_the_first_step(
    case: Case,
    demo_data: dict[str, str],
    bad: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name, overrides, code, needles = case
    run_dir = tmp_path / "run"
    if name == "K14":
        run_dir.mkdir()
        (run_dir / "checkpoints").write_text("")
    if name == "checkpoints_dangling_link":
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(tmp_path / "gone")
    argv = ["train", SMOKE, f"trainer.run_dir={run_dir}", "trainer.final_eval_split=val"]
    argv += overrides(demo_data, bad, tmp_path)
    t0 = time.monotonic()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == code, (rc, out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "model:" not in out, "the model was built before the check"
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
    assert time.monotonic() - t0 < 60


def test_unknown_tag_message_names_every_bad_row_count(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two bad rows with two different tags: both tags and the count are named, the first row too."""
    table = pq.read_table(demo_data["train"])
    texts = table.column("text").to_pylist()
    texts[3] = texts[3] + " <|qq|>"
    texts[9] = "<|yy|> " + texts[9]
    path = tmp_path / "two_tags.parquet"
    pq.write_table(_set_column(table, "text", texts), path)
    rc = main(["train", SMOKE, *_data(demo_data, train=str(path)), f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "2 rows" in err and "<|qq|>" in err and "<|yy|>" in err and "row 3" in err


def test_null_text_is_named_by_row(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """M_train_nulltext: a null transcript is refused before the first step, naming its row."""
    table = pq.read_table(demo_data["train"])
    texts = table.column("text").to_pylist()
    texts[4] = None
    path = tmp_path / "nulltext.parquet"
    pq.write_table(_set_column(table, "text", texts), path)
    rc = main(["train", SMOKE, *_data(demo_data, train=str(path)), f"trainer.run_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert "nulltext.parquet, row 4" in err and "is null" in err and "Traceback" not in err
    assert "model:" not in out


def test_a_good_run_passes_the_preflight(
    demo_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checks accept the demo data (dry run: the pre-flight, then exit)."""
    rc = main(["train", SMOKE, *_data(demo_data), f"trainer.run_dir={tmp_path / 'run'}", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "micro-batches per dp rank" in out


# --- validate is the pre-flight of train (item 7) ---------------------------------------------------

PARITY = [
    # (overrides, exit code of both, rule id or message that both print)
    (["trainer.grad_accum=300"], 1, "grad-accum-exceeds-batches"),  # newcomer 62 / 110
    (["trainer.grad_accum=100"], 1, "epoch-plan-too-short"),  # newcomer 61 / 108
    (["sampler.max_batch_duration=1"], 0, "budget-below-longest-utterance"),  # newcomer 63 (a warning)
    # a layout rule, reported before the plan is built (the plan needs a valid layout)
    (["parallel.tp_size=2"], 1, "world-size"),
]


@pytest.mark.parametrize("overrides,code,rule", PARITY, ids=[p[2] for p in PARITY])
def test_validate_and_train_give_the_same_verdict(
    overrides: list[str],
    code: int,
    rule: str,
    demo_data: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _data(demo_data)
    rc_validate = main(["validate", SMOKE, *data, *overrides, "--world-size", "1"])  # as train runs here
    out_v, err_v = capsys.readouterr()
    rc_train = main(["train", SMOKE, *data, *overrides, f"trainer.run_dir={tmp_path / 'run'}", "--dry-run"])
    out_t, err_t = capsys.readouterr()
    assert (rc_validate, rc_train) == (code, code), (out_v, err_v, out_t, err_t)
    assert rule in out_v + err_v and rule in out_t + err_t
    if code:  # train's refusal points at validate, which shows the same findings
        assert "speechlm validate CONFIG" in err_t


@pytest.mark.parametrize(
    "name,code,needle",
    [("frlang", 1, "'fr'"), ("unknowntag", 1, "<|xx|>"), ("three_rows", 1, "epoch-plan-too-short")],
)
def test_validate_with_manifest_runs_the_file_checks(
    name: str,
    code: int,
    needle: str,
    demo_data: dict[str, str],
    bad: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`speechlm validate CONFIG --manifest M` runs train's checks on M (languages, tags, the plan)."""
    rc = main(
        [
            "validate",
            SMOKE,
            f"data.tokenizer={demo_data['tok']}",
            "data.val_manifest=null",
            "--manifest",
            bad[name],
        ]
    )
    out, err = capsys.readouterr()
    assert rc == code, (out, err)
    assert needle in out + err and "Traceback" not in err


def test_validate_json_carries_the_manifest_summary(
    demo_data: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["validate", SMOKE, *_data(demo_data), "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out)
    assert report["valid"] and report["context"]["manifest"]["n_rows"] > 0


def test_validate_says_when_the_data_rules_did_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No manifest at the configured path and no --manifest: layout only, and it says so."""
    rc = main(["validate", SMOKE, f"data.train_manifest={tmp_path / 'absent.parquet'}"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "absent.parquet" in err and "--manifest" in err


def test_tag_scan_finds_every_unknown_tag_and_only_those() -> None:
    """The vectorised scan agrees with Tokenizer.encode's tag rule, over several chunks and slices."""
    import pyarrow as pa

    from speechlm.data import tokenizer_checks as preflight

    known = ["<|audio|>", "<|en|>", "<|hi|>"]
    texts = [
        "<|en|> hello",  # clean
        "<|en|> a < b and c <d>",  # '<' that opens no tag
        "<|xx|> hello",  # unknown leading tag
        "<|en|> hello <|hi|> again",  # known tags only
        None,  # null: named by the null check, not here
        "<|en|> hello <|zz|>",  # unknown tag later
        "plain text",
        "<|en|><|qq|>",  # two tags, the second unknown
        "<|en|> <|audio|> x",
    ]
    chunked = pa.chunked_array([pa.array(texts[:4], pa.string()), pa.array(texts[4:], pa.string())])
    saved = preflight.SCAN_ROWS
    try:
        preflight.SCAN_ROWS = 3  # several slices per chunk
        count, rows = preflight.unknown_tag_rows(chunked, known)
    finally:
        preflight.SCAN_ROWS = saved
    assert (count, rows) == (3, [2, 5, 7])
