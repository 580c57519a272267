"""A pretrained LLM directory (``model.llm.pretrained``) checked before anything is loaded from it.

`read_llm_dir` reads what a `save_pretrained` directory must hold, without loading a weight:

    config.json           a JSON object with ``model_type`` (what `AutoConfig` reads)
    weights               model.safetensors, or model.safetensors.index.json and every shard it names,
                          or pytorch_model.bin (or its index); each safetensors file's header is read
                          and its tensors must end exactly where the file ends (a truncated copy does not)

and returns the config. `check_tokenizer_fits_llm` compares the run's tokenizer with that config: the
LLM has an embedding row for every id of the tokenizer except the rows the run itself adds (``<|audio|>``
and the language tags: the tokenizer's ``added_ids``, docs/pretrained-tokenizer.md), and the tokenizer's
EOS, PAD and BOS are the ids the model was trained with (config.json or generation_config.json) where
both name one. `lora_target_problem` checks ``model.llm.lora.target_modules`` against the LLM's module
names, read from a model built on the meta device (no weights, no memory).

Each problem is a `PretrainedDirError` (exit 1) naming the directory, the file and what to do.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from speechlm.errors import DataError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
_MAX_HEADER = 100 << 20  # a safetensors header is a few MB at most; more is a damaged length field


class PretrainedDirError(DataError):
    """A pretrained model directory that cannot be loaded (missing or damaged files) or that does not
    belong with the run's tokenizer."""


def _where(key: str, path: Path) -> str:
    return f"{key}={path}"


def read_llm_dir(path: str | Path, *, key: str = "model.llm.pretrained") -> dict[str, Any]:
    """The config.json of the pretrained LLM directory `path`, once its files are checked (module doc)."""
    p = Path(path)
    if not p.is_dir():
        what = "does not exist" if not p.exists() else "is not a directory"
        raise PretrainedDirError(
            f"{_where(key, p)} {what}: give a local save_pretrained directory of a causal LM (config.json "
            "and model.safetensors), e.g. one written by `AutoModelForCausalLM.save_pretrained` or "
            "`speechlm llm import-gguf`"
        )
    config = _read_config(p, key)
    check_weights(p, key=key)
    return config


def _read_config(p: Path, key: str) -> dict[str, Any]:
    file = p / "config.json"
    if not file.is_file():
        raise PretrainedDirError(
            f"{_where(key, p)} has no config.json, so the model's architecture is unknown: copy the "
            "directory again from where the model came from (save_pretrained writes config.json beside "
            "the weights)"
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PretrainedDirError(
            f"{file} cannot be read as JSON ({e}): it is truncated or damaged; restore it from where the "
            "model came from"
        ) from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise PretrainedDirError(
            f"{file} has no model_type, so transformers cannot tell which architecture it is: restore the "
            "file from where the model came from"
        )
    return config


def check_weights(p: Path, *, key: str = "model.llm.pretrained") -> None:
    """The directory has weights, and every safetensors file among them is whole (header and size)."""
    if (p / SAFETENSORS).is_file():
        check_safetensors_file(p / SAFETENSORS)
        return
    for index, check in ((SAFETENSORS_INDEX, check_safetensors_file), (TORCH_BIN_INDEX, None)):
        if (p / index).is_file():
            for shard in _index_shards(p / index):
                if not (p / shard).is_file():
                    raise PretrainedDirError(
                        f"{p / shard}, a shard that {p / index} names, does not exist: copy the missing "
                        "shard(s) into the directory"
                    )
                if check is not None:
                    check(p / shard)
            return
    if (p / TORCH_BIN).is_file():
        return
    raise PretrainedDirError(
        f"{_where(key, p)} holds no weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN}): copy the "
        "weight file(s) into it, or point the key at the directory that has them"
    )


def _index_shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({str(v) for v in weight_map.values()})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise PretrainedDirError(
            f"{index} is not a valid index (a JSON object with a weight_map; {type(e).__name__}: {e}): "
            "restore it from where the model came from"
        ) from None


def safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """(the JSON header of a safetensors file, its length in bytes); a file too short for its header is a
    PretrainedDirError."""
    damaged = f"{file} is truncated or damaged"
    fix = "copy or download it again (its size must match the original's)"
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PretrainedDirError(f"{damaged} ({len(head)} bytes, no safetensors header): {fix}")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise PretrainedDirError(f"{damaged} (a header length of {n} bytes): {fix}")
            raw = f.read(n)
    except OSError as e:
        raise PretrainedDirError(f"{file} cannot be read ({e}): fix its permissions or restore it") from None
    if len(raw) < n:
        raise PretrainedDirError(f"{damaged} (it ends inside its {n}-byte header): {fix}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise PretrainedDirError(f"{damaged} (its header is not valid JSON): {fix}")
    return header, n


def check_safetensors_file(file: Path) -> None:
    """The tensors the header lists end exactly where the file ends (safetensors' own rule)."""
    header, n = safetensors_header(file)
    ends = [
        int(t["data_offsets"][1])
        for name, t in header.items()
        if name != "__metadata__" and isinstance(t, dict) and "data_offsets" in t
    ]
    expected = 8 + n + max(ends, default=0)
    size = file.stat().st_size
    if size != expected:
        raise PretrainedDirError(
            f"{file} is truncated or damaged: it has {size} bytes, its header describes {expected}; copy "
            "or download it again"
        )


# --- the tokenizer against the model -------------------------------------------------------------
def _config_ids(config: dict[str, Any], generation: dict[str, Any], name: str) -> set[int]:
    ids: set[int] = set()
    for source in (config, config.get("text_config") or {}, generation):
        value = source.get(f"{name}_token_id") if isinstance(source, dict) else None
        values = value if isinstance(value, list) else [value]
        ids.update(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool))
    return ids


def config_vocab_size(config: dict[str, Any]) -> int | None:
    """The LLM's embedding rows as config.json says (top level, else a multimodal model's text_config)."""
    size = config.get("vocab_size")
    if size is None and isinstance(config.get("text_config"), dict):
        size = config["text_config"].get("vocab_size")
    return int(size) if isinstance(size, int) else None


def _read_generation_config(llm_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((llm_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def tokenizer_model_problems(tokenizer: Any, config: dict[str, Any], llm_dir: Path) -> list[str]:
    """Where `tokenizer` (an `HFTokenizer`) does not fit the LLM whose config.json is `config` (module doc)."""
    problems = []
    added = set(int(i) for i in getattr(tokenizer, "added_ids", ()))
    own = int(tokenizer.vocab_size) - len(added)
    rows = config_vocab_size(config)
    if rows is not None and own > rows:
        problems.append(
            f"it has {own} tokens of its own (plus {len(added)} the run adds), but the LLM has "
            f"{rows} embedding rows (vocab_size in {llm_dir / 'config.json'}): {own - rows} of its ids have no "
            "trained row"
        )
    generation = _read_generation_config(llm_dir)
    specials = getattr(tokenizer, "special_tokens", {}) or {}
    for name in ("eos", "pad", "bos"):
        token = specials.get(f"{name}_token")
        tok_id = getattr(tokenizer, f"{name}_id", None)
        expected = _config_ids(config, generation, name)
        if token is None or tok_id is None or not expected or int(tok_id) in expected:
            continue
        problems.append(
            f"its {name} token {token!r} is id {tok_id}, but the LLM was trained with {name}_token_id="
            f"{'/'.join(str(i) for i in sorted(expected))}"
        )
    return problems


def check_tokenizer_fits_llm(
    tokenizer: Any, config: dict[str, Any], llm_dir: str | Path, *, key: str
) -> None:
    """Refuse a tokenizer that is not the LLM's (see `tokenizer_model_problems`), naming both and the fix."""
    problems = tokenizer_model_problems(tokenizer, config, Path(llm_dir))
    if not problems:
        return
    if Path(tokenizer.path).resolve() == Path(llm_dir).resolve():
        fix = (
            f"the tokenizer files in {llm_dir} are another model's: restore tokenizer.json and "
            "tokenizer_config.json from where the model came from"
        )
    else:
        fix = (
            "use the LLM's own tokenizer (data.tokenizer=null reads the one in model.llm.pretrained; a run's "
            "saved run_dir/tokenizer of the same LLM fits too), or point model.llm.pretrained at the model "
            "this tokenizer belongs to"
        )
    raise PretrainedDirError(
        f"the tokenizer {tokenizer.path} ({key}) does not belong to the LLM model.llm.pretrained={llm_dir}: "
        f"{'; '.join(problems)}. Its ids would index embedding rows trained for other tokens: {fix}"
    )
