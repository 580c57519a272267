"""Every command block of README.md and docs/*.md runs as written (issue 21, item 5).

A small parser reads the fenced blocks of the docs: ```bash / ```sh / ```shell blocks are commands
(one per line; `\\` continues a line, `#` starts a comment), ```console blocks are `$ ` commands
followed by their output, and an untagged block is read the same way when one of its lines starts
with a command word (`speechlm`, `python`, `torchrun`, `pip`, `sbatch`), so a command written in an
untagged block is not missed (tag usage synopses ```text).

Each command runs in its own copy of a workspace laid out like the repository: `configs/` and the
bundled corpus `data/demo/`, with what the README's first commands build already there
(`data/demo_manifest/` with the tokenizer, `data/demo_tars/`), plus the inputs other commands name
(a NeMo JSON manifest, a Lhotse `cuts.jsonl.gz`, the `sweep.yaml` that docs/sweep.md shows).
`test_the_readme_commands_run_in_order_on_a_fresh_clone` (slow) runs the README's commands once more,
one after the other in one workspace that starts as a fresh clone.
Commands that train get tiny step counts appended (`TINY`, later overrides win) and are marked
`slow`; placeholders (`CONFIG`, `DATA_OVERRIDES`, ...) and measurement sizes are replaced by the
explicit edits in `ADAPT`, each of which must still match its doc. A command that cannot run here
is in `NOT_RUN` with the reason; `test_every_command_is_run_or_listed_with_a_reason` holds that every
entry of the tables still names a command of the docs, so a new block is run by default and a stale
entry fails. Console blocks whose output is deterministic (`CHECK_OUTPUT`) must print what the doc
shows.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
COMMAND_WORDS = ("speechlm", "python", "torchrun", "pip", "sbatch")
_FENCE = re.compile(r"^\s*```(\S*)")
_COMMAND_LINE = re.compile(r"^(\$ )?(" + "|".join(COMMAND_WORDS) + r") ")


@dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the command in the doc
    text: str  # continuation lines joined, trailing comment removed
    output: tuple[str, ...] = ()  # console blocks: the lines shown after the command

    @property
    def key(self) -> tuple[str, str]:
        return (self.doc, self.text)


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line of the first body line, language tag, body lines) of every fenced block."""
    blocks: list[tuple[int, str, list[str]]] = []
    open_at: tuple[int, str] | None = None
    body: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m is None:
            if open_at is not None:
                body.append(line)
        elif open_at is None:
            open_at, body = (number + 1, m.group(1)), []
        else:
            blocks.append((open_at[0], open_at[1], body))
            open_at = None
    assert open_at is None, f"unclosed fence opened at line {open_at[0] - 1}"
    return blocks


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s+)#(\s.*)?$", "", line).rstrip()


def block_commands(doc: str, start: int, lang: str, body: list[str]) -> list[Command]:
    """The commands of one block (see the module docstring for which blocks hold commands)."""
    console = lang == "console" or (lang == "" and any(line.startswith("$ ") for line in body))
    if lang not in SHELL_LANGS and not (lang == "" and any(_COMMAND_LINE.match(x) for x in body)):
        return []
    out: list[Command] = []
    i = 0
    while i < len(body):
        line = body[i]
        first = i
        i += 1
        if console:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        elif lang == "" and not _COMMAND_LINE.match(line):
            continue
        parts = [line]
        while parts[-1].rstrip().endswith("\\") and i < len(body):
            parts[-1] = parts[-1].rstrip()[:-1]
            parts.append(body[i].strip())
            i += 1
        text = " ".join(_strip_comment(p).strip() for p in parts).strip()
        text = re.sub(r"\s+", " ", text)
        if not text:
            continue
        output: list[str] = []
        if console:
            while i < len(body) and not body[i].startswith("$ "):
                output.append(body[i])
                i += 1
        out.append(Command(doc, start + first, text, tuple(output)))
    return out


def doc_commands() -> list[Command]:
    out: list[Command] = []
    for path in DOCS:
        for start, lang, body in fenced_blocks(path.read_text(encoding="utf-8")):
            out.extend(block_commands(str(path.relative_to(REPO)), start, lang, body))
    return out


# ---- what is run, how, and what is not --------------------------------------------------------

# appended to every training launch: two optimizer steps, no validation, the final evaluation on the
# 12 validation utterances (the demo config scores all 221 training ones); `speechlm faults` keeps its
# step count (its --kill steps must fall inside it: ADAPT shrinks both where they are large)
TINY = "trainer.max_steps=2 trainer.val_every=0 trainer.final_eval_split=val"
TINY_FAULTS = "trainer.val_every=0 trainer.final_eval_split=val"
TRAINS = re.compile(
    r"(^|&& )(speechlm (train|demo|faults)\b(?!.*--help)|torchrun .*-m speechlm\.train|speechlm sweep run)"
)
DATA_OVERRIDES = (
    "data.train_manifest=data/demo_manifest/train.parquet data.val_manifest=data/demo_manifest/val.parquet "
    "data.tokenizer=data/demo_manifest/tokenizer.model"
)

# (doc, command) -> why it does not run here
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest'): (
        "installs packages (network, changes the environment under test) and runs the whole suite, "
        "this test included"
    ),
    ("README.md", "python -m pytest -m gpu"): "the one-GPU kit: needs a CUDA device",
    ("docs/benchmarks.md", "speechlm bench attention --repeats 5 --json attention.json"): (
        "times CUDA attention kernels: needs a CUDA device"
    ),
    ("docs/benchmarks.md", "speechlm bench gpu --out gpu-acceptance"): (
        "the GPU acceptance run: needs a CUDA device (its --dry-run beside it runs here)"
    ),
    (
        "docs/parallelism.md",
        "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
        "-m speechlm.train CONFIG --cp-size 2 --tp-size 4",
    ): "multi-node: 4 machines and a rendezvous host",
    ("docs/sweep.md", "sbatch /shared/sweeps/temp/sweep.sbatch"): "needs a Slurm cluster",
    (
        "docs/validator.md",
        "speechlm validate CONFIG [--manifest M] [--world-size N] [--cp-size C] [--tp-size T]",
    ): "a usage synopsis, not a command (generated by scripts/gen_validator_docs.py)",
}

# (doc, command) -> [(written, run instead), ...]: placeholders filled, measurement sizes made tiny
ADAPT: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("README.md", "pip install torch==2.13.0 && pip install -e . && speechlm demo"): [
        ("pip install torch==2.13.0 && pip install -e . && ", ""),  # installing is not what is tested
        ("speechlm demo", "speechlm demo --utterances 100 --heldout 4"),  # a small synthesized corpus
    ],
    (
        "README.md",
        "speechlm faults configs/demo.yaml trainer.max_steps=150 trainer.max_minutes=0 --kill sigterm@88",
    ): [("trainer.max_steps=150", "trainer.max_steps=3"), ("--kill sigterm@88", "--kill sigterm@2")],
    (  # the workspace's sweep_tiny.yaml: the same matrix, two steps a job
        "README.md",
        "speechlm sweep init configs/sweep_example.yaml --out sweeps/t && speechlm sweep run sweeps/t --slots 0,1,2,3",
    ): [("configs/sweep_example.yaml", "sweep_tiny.yaml")],
    ("README.md", "speechlm bench sampler"): [
        ("sampler", "sampler --rows 20000 --reference-rows 20000 --repeats 1")
    ],
    (
        "docs/benchmarks.md",
        "speechlm bench sampler --rows 10000000 --reference-rows 10000000 --repeats 3",
    ): [
        (
            "--rows 10000000 --reference-rows 10000000 --repeats 3",
            "--rows 20000 --reference-rows 20000 --repeats 1",
        )
    ],
    (
        "docs/benchmarks.md",
        "speechlm bench sampler --rows 10000000 --reference-rows 1000000 --repeats 3",
    ): [
        (
            "--rows 10000000 --reference-rows 1000000 --repeats 3",
            "--rows 20000 --reference-rows 2000 --repeats 1",
        )
    ],
    ("docs/data.md", "python benchmarks/bench_manifest_memory.py"): [
        ("bench_manifest_memory.py", "bench_manifest_memory.py --rows 2000 --dict-rows 200")
    ],
    (
        "docs/parallelism.md",
        "speechlm validate CONFIG --world-size 32 --cp-size 2 --tp-size 4 --device-capability 9.0",
    ): [("CONFIG", "configs/demo.yaml")],
    ("docs/parallelism.md", "speechlm plan --config CONFIG --dp-size 4 --cp-size 2 --tp-size 4"): [
        ("CONFIG", "configs/demo.yaml")
    ],
    ("docs/training.md", "speechlm train CONFIG trainer.run_dir=runs/x trainer.resume=auto"): [
        ("CONFIG", "configs/demo.yaml")
    ],
    (
        "docs/training.md",
        "speechlm train CONFIG trainer.run_dir=runs/x trainer.resume=runs/x/checkpoints/step_000500",
    ): [("CONFIG", "configs/demo.yaml"), ("step_000500", "step_000001")],
    (
        "docs/training.md",
        "speechlm faults configs/smoke.yaml DATA_OVERRIDES trainer.max_steps=9 trainer.ckpt_every=2 "
        "--kill sigterm@3 --kill sigkill_in_save@6 --kill sigkill@7 [--nproc 2] [--cp-size 2] --run-root runs/faults",
    ): [("DATA_OVERRIDES", DATA_OVERRIDES), (" [--nproc 2] [--cp-size 2]", "")],
    (
        "docs/training.md",
        "speechlm faults configs/demo.yaml trainer.max_steps=150 trainer.max_minutes=0 "
        "trainer.final_eval_split=val --kill sigterm@88 --run-root runs/faults-demo",
    ): [("trainer.max_steps=150", "trainer.max_steps=3"), ("--kill sigterm@88", "--kill sigterm@2")],
}
# (doc, command) -> commands run first in its workspace (what the doc's earlier lines left there)
SMALL_MANIFEST = "speechlm manifest build data/demo/shards --out data/small_manifest"
SETUP: dict[tuple[str, str], list[str]] = {
    ("README.md", "speechlm manifest stats data/small_manifest/train.parquet --plot stats.png"): [
        SMALL_MANIFEST
    ],
    (
        "README.md",
        "speechlm tokenizer train --manifest data/small_manifest/train.parquet --out data/small_manifest/tokenizer",
    ): [SMALL_MANIFEST],
    (  # `shards write` refuses a non-empty folder: in the README's order the tars do not exist yet
        "README.md",
        "speechlm shards write data/demo_manifest/train.parquet --out data/demo_tars --skip-bad-audio && "
        "speechlm train configs/demo.yaml data.train_manifest=data/demo_tars trainer.run_dir=runs/tars",
    ): ["rm -r data/demo_tars"],
    (
        "docs/training.md",
        "speechlm train CONFIG trainer.run_dir=runs/x trainer.resume=runs/x/checkpoints/step_000500",
    ): [f"speechlm train configs/demo.yaml trainer.run_dir=runs/x trainer.ckpt_every=1 {TINY}"],
    ("docs/sweep.md", "speechlm sweep run /shared/sweeps/temp --slots 0,1,2,3"): [
        "speechlm sweep init sweep.yaml --out sweeps/temp"
    ],
    ("docs/sweep.md", "speechlm sweep status /shared/sweeps/temp"): [
        "speechlm sweep init sweep.yaml --out sweeps/temp"
    ],
    ("docs/sweep.md", "speechlm sweep report /shared/sweeps/temp --plot best.png"): [
        "speechlm sweep init sweep.yaml --out sweeps/temp && speechlm sweep run sweeps/temp --slots 0,1,2,3"
    ],
    (
        "docs/sweep.md",
        "speechlm sweep slurm /shared/sweeps/temp --nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00",
    ): ["speechlm sweep init sweep.yaml --out sweeps/temp"],
}

# (doc, command) -> exit status the doc says it has (default 0)
EXIT: dict[tuple[str, str], int] = {
    (
        "README.md",
        "speechlm validate configs/demo.yaml --world-size 8 --cp-size 2 model.packed_sequences=false",
    ): 1,
}

# console commands whose output the doc shows verbatim, whole or a run of its lines (others show
# measurements of another machine)
CHECK_OUTPUT = {
    (
        "README.md",
        "speechlm validate configs/demo.yaml --world-size 8 --cp-size 2 --tp-size 2 --device-capability 9.0",
    ),
    (
        "README.md",
        "speechlm validate configs/demo.yaml --world-size 8 --cp-size 2 model.packed_sequences=false",
    ),
    ("docs/benchmarks.md", "speechlm bench cp-placement --per-rank"),
    ("docs/benchmarks.md", "speechlm bench cp-placement --per-rank --max-seconds 600"),
    ("docs/benchmarks.md", "speechlm bench cp-placement"),
    ("docs/training.md", "speechlm train --help"),
}

# slow although they do not train: each builds a 100k-row synthetic manifest for three cp sizes
SLOW = {c for c in CHECK_OUTPUT if c[0] == "docs/benchmarks.md"}


def command_to_run(cmd: Command) -> str:
    """The command as it runs here: `ADAPT`'s edits, /shared/ made local, `TINY` after a training launch."""
    text = cmd.text
    for written, instead in ADAPT.get(cmd.key, []):
        text = text.replace(written, instead)
    text = text.replace("/shared/sweeps/", "sweeps/")
    segments = [s.strip() for s in text.split("&&")]
    tiny = []
    for s in segments:
        if s.startswith("speechlm faults"):
            s = f"{s} {TINY_FAULTS}"
        elif TRAINS.match(s) and not s.startswith("speechlm sweep run"):  # the sweep's jobs: sweep.yaml
            s = f"{s} {TINY}"
        tiny.append(s)
    return " && ".join(tiny)


def trains(cmd: Command) -> bool:
    return any(TRAINS.match(s.strip()) for s in command_to_run(cmd).split("&&"))


COMMANDS = doc_commands()
RUN = [c for c in COMMANDS if c.key not in NOT_RUN]


def _is_slow(cmd: Command) -> bool:
    setup_trains = any(TRAINS.match(s.strip()) for pre in SETUP.get(cmd.key, []) for s in pre.split("&&"))
    return trains(cmd) or setup_trains or cmd.key in SLOW


def _param(cmd: Command):  # type: ignore[no-untyped-def]
    slow = _is_slow(cmd)
    return pytest.param(cmd, id=f"{cmd.doc}:{cmd.line}", marks=[pytest.mark.slow] if slow else [])


def test_the_parser_reads_shell_console_and_untagged_command_blocks() -> None:
    text = "\n".join(
        [
            "```bash",
            "# a comment line",
            "speechlm plan --config c.yaml \\",
            "    --dp-size 8   # a trailing comment",
            "```",
            "```console",
            "$ speechlm validate c.yaml",
            "OK: layout valid",
            "```",
            "```",
            "speechlm train c.yaml",
            "  not a command",
            "```",
            "```text",
            "speechlm plan [--config CONFIG]",
            "```",
            "```python",
            "x = 1",
            "```",
        ]
    )
    got = [c for start, lang, body in fenced_blocks(text) for c in block_commands("d.md", start, lang, body)]
    assert [(c.line, c.text, c.output) for c in got] == [
        (3, "speechlm plan --config c.yaml --dp-size 8", ()),
        (7, "speechlm validate c.yaml", ("OK: layout valid",)),
        (11, "speechlm train c.yaml", ()),
    ]


def test_every_command_is_run_or_listed_with_a_reason() -> None:
    """A new command block runs by default; an entry of a table that names no doc command any more fails
    (the doc changed: update the table), and so does an edit of `ADAPT` that no longer applies."""
    keys = {c.key for c in COMMANDS}
    assert len(COMMANDS) >= 40, [c.key for c in COMMANDS]  # the parser still finds the docs' commands
    for table in (NOT_RUN, ADAPT, SETUP, EXIT):
        stale = sorted(set(table) - keys)
        assert not stale, f"no doc has these commands any more: {stale}"
    assert not (CHECK_OUTPUT | SLOW) - keys
    for key, edits in ADAPT.items():
        for written, _ in edits:
            assert written in key[1], (key, written)
    for key, why in NOT_RUN.items():
        assert len(why) > 20, key
    for c in RUN:
        assert not re.search(r"\b(CONFIG|HOST|DATA_OVERRIDES|PATH)\b|\[--", command_to_run(c)), (
            f"{c.doc}:{c.line}: a placeholder is left in {command_to_run(c)!r}; add an ADAPT entry"
        )
    for key in CHECK_OUTPUT:  # the doc shows an output to compare with
        assert any(c.output for c in COMMANDS if c.key == key), key


# ---- the workspace ----------------------------------------------------------------------------


def _write_nemo_and_lhotse(base: Path, rows: list[dict]) -> None:
    from lhotse import CutSet, Recording, SupervisionSegment

    with open(base / "train_manifest.json", "w", encoding="utf-8") as f:
        for r in rows:
            text = re.sub(r"^<\|\w+\|>\s*", "", r["text"])
            f.write(
                json.dumps({"audio_filepath": r["audio_filepath"], "duration": r["duration"], "text": text})
                + "\n"
            )
    cuts = []
    for r in rows:
        rec = Recording.from_file(r["audio_filepath"], recording_id=r["segment_id"])
        cut = rec.to_cut()
        text = re.sub(r"^<\|\w+\|>\s*", "", r["text"])
        cut.supervisions = [
            SupervisionSegment(r["segment_id"], rec.id, 0.0, rec.duration, text=text, language=r["lang"])
        ]
        cuts.append(cut)
    CutSet.from_cuts(cuts).to_file(base / "cuts.jsonl.gz")
    with gzip.open(base / "cuts.jsonl.gz") as f:
        assert f.readline()


def _sweep_yaml() -> str:
    """docs/sweep.md's sweep.yaml, with each job trained for two steps and validated after the second."""
    text = (REPO / "docs" / "sweep.md").read_text(encoding="utf-8")
    body = next(b for _, lang, b in fenced_blocks(text) if lang == "yaml" and b and b[0] == "# sweep.yaml")
    spec = "\n".join(body)
    assert "trainer.max_steps: 3000" in spec and "trainer.val_every: 250" in spec
    spec = spec.replace("trainer.max_steps: 3000", "trainer.max_steps: 2").replace(
        "trainer.val_every: 250", "trainer.val_every: 2\n  trainer.final_eval_split: none"
    )
    return spec


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "PYTEST_"))}
    bin_dir = str(Path(sys.executable).parent)
    return {
        **env,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "COLUMNS": "100",
    }


def _run(command: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """What the README's first commands leave in a checkout, built once; each test copies it."""
    import pyarrow.parquet as pq

    base = tmp_path_factory.mktemp("docs_base")
    shutil.copytree(REPO / "configs", base / "configs")
    (base / "data").mkdir()
    os.symlink(REPO / "data" / "demo", base / "data" / "demo")
    os.symlink(REPO / "benchmarks", base / "benchmarks")
    setup = (
        "speechlm manifest build data/demo/shards --out data/demo_manifest"
        " && speechlm tokenizer train --manifest data/demo_manifest/train.parquet --out data/demo_manifest/tokenizer"
        " && speechlm shards write data/demo_manifest/train.parquet --out data/demo_tars --skip-bad-audio"
    )
    done = _run(setup, base)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = pq.read_table(base / "data/demo_manifest/train.parquet").slice(0, 24).to_pylist()
    _write_nemo_and_lhotse(base, rows)
    (base / "sweep.yaml").write_text(_sweep_yaml(), encoding="utf-8")
    (base / "sweep_tiny.yaml").write_text(_sweep_yaml(), encoding="utf-8")  # the README's, two steps a job
    return base


def _in_process(command: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`speechlm A && speechlm B` through `speechlm.cli.main` (no interpreter start-up per command)."""
    from speechlm.cli import main

    rc, out, err = 0, "", ""
    for segment in command.split("&&"):
        argv = shlex.split(segment)
        assert argv[0] == "speechlm", segment
        try:
            rc = main(argv[1:])
        except SystemExit as e:  # --help
            rc = e.code if isinstance(e.code, int) else 0
        got = capsys.readouterr()
        out, err = out + got.out, err + got.err
        if rc != 0:
            break
    return rc, out, err


@pytest.mark.parametrize("cmd", [_param(c) for c in RUN])
def test_doc_command_runs_as_written(
    cmd: Command,
    workspace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, symlinks=True)
    for pre in SETUP.get(cmd.key, []):
        done = _run(pre, ws)
        assert done.returncode == 0, f"setup {pre!r}:\n{done.stdout}\n{done.stderr}"
    command = command_to_run(cmd)
    if _is_slow(cmd) or not all(s.strip().startswith("speechlm ") for s in command.split("&&")):
        done = _run(command, ws)
        rc, out, err = done.returncode, done.stdout, done.stderr
    else:
        monkeypatch.chdir(ws)
        monkeypatch.setenv("COLUMNS", "100")
        rc, out, err = _in_process(command, capsys)
    where = f"{cmd.doc}:{cmd.line}: {command}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    assert rc == EXIT.get(cmd.key, 0), where
    assert "Traceback" not in err, where
    if cmd.key in CHECK_OUTPUT and cmd.output:  # the doc shows these lines of the standard output, in a row
        shown = [line.rstrip() for line in cmd.output if line.strip()]
        printed = [line.rstrip() for line in out.splitlines() if line.strip()]
        assert any(printed[i : i + len(shown)] == shown for i in range(len(printed))), where


@pytest.mark.slow
@pytest.mark.timeout(3600)  # every README command, the demo, torchrun and a sweep among them
def test_the_readme_commands_run_in_order_on_a_fresh_clone(tmp_path: Path) -> None:
    """Issue 36: each command above runs in a workspace where the README's first commands have been run;
    here they run one after the other, as a new user runs them, in a checkout holding only what git
    ships (configs/, the bundled corpus, benchmarks/), with `ADAPT`'s and `TINY`'s sizes and no `SETUP`.
    On 0aa2f99 the Everyday commands' `manifest build` and `tokenizer train` replaced what the Quick
    start had built, and `sweep init sweep.yaml` named a file the README never shows."""
    ws = tmp_path / "clone"
    shutil.copytree(REPO / "configs", ws / "configs")
    (ws / "data").mkdir()
    os.symlink(REPO / "data" / "demo", ws / "data" / "demo")
    os.symlink(REPO / "benchmarks", ws / "benchmarks")
    # ADAPT: configs/sweep_example.yaml, two steps a job (a name the README does not use: on 0aa2f99 its
    # `sweep init sweep.yaml` named a file a fresh clone lacks)
    (ws / "sweep_tiny.yaml").write_text(_sweep_yaml(), encoding="utf-8")
    readme = [c for c in RUN if c.doc == "README.md"]
    assert [c.line for c in readme] == sorted(c.line for c in readme) and len(readme) > 15
    for cmd in readme:
        command = command_to_run(cmd)
        print(f"README.md:{cmd.line}: {command}", flush=True)
        done = _run(command, ws)
        where = f"README.md:{cmd.line}: {command}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        assert done.returncode == EXIT.get(cmd.key, 0), where
        assert "Traceback" not in done.stderr, where
    demo_built = json.loads((ws / "data/demo_manifest/speechlm_outputs.json").read_text())["files"]
    assert "demo_corpus" in demo_built["train.parquet"]["by"]  # the Quick start's manifest is still there


def test_the_sweep_example_is_the_spec_docs_sweep_shows() -> None:
    """The README's `sweep init configs/sweep_example.yaml` and docs/sweep.md's `sweep.yaml` are one spec."""
    import yaml

    text = (REPO / "docs" / "sweep.md").read_text(encoding="utf-8")
    body = next(b for _, lang, b in fenced_blocks(text) if lang == "yaml" and b and b[0] == "# sweep.yaml")
    shipped = (REPO / "configs" / "sweep_example.yaml").read_text(encoding="utf-8")
    assert yaml.safe_load("\n".join(body)) == yaml.safe_load(shipped)


def test_the_readme_shows_the_mix_file_it_plans() -> None:
    """issue 21: the README planned `configs/mix_example.yaml` but never showed it; the YAML block it
    shows now is the file's content (comments aside), so the two cannot drift apart."""
    import yaml

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    shown = [b for _, lang, b in fenced_blocks(readme) if lang == "yaml"]
    assert len(shown) == 1
    path = REPO / "configs" / "mix_example.yaml"
    assert yaml.safe_load("\n".join(shown[0])) == yaml.safe_load(path.read_text(encoding="utf-8"))
    assert "configs/mix_example.yaml" in readme
