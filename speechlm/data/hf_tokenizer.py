"""The pretrained LLM's own tokenizer (a Hugging Face tokenizer directory) with the speech side's tokens.

With ``model.llm.pretrained`` set, the ids that reach the LLM must be the ones its embeddings were
trained on: `HFTokenizer` reads the directory's ``tokenizer.json`` with the `tokenizers` library (the
data layer does not import transformers; tests check that its ids are ``AutoTokenizer``'s), its special
tokens from ``tokenizer_config.json`` (or ``special_tokens_map.json``) and its chat template (from
``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``, rendered by jinja2 in a
sandbox as transformers renders it), and adds

    <|audio|>        one special token, the audio placeholder (never split, never a transcript token)
    <|xx|> per lang  one special token per language (``data.lang_tags: special``), in the order given

after the LLM's vocabulary (ids ``len(tokenizer)``, ``len(tokenizer) + 1``, ...). Tokens the directory
already has (a directory written by `HFTokenizer.save`) keep their ids. The LLM gets one embedding row
per added token (`speechlm.model.llm.init_added_rows`).

It has the attributes the SentencePiece `speechlm.data.tokenizer.Tokenizer` has (``pad_id``,
``bos_id``, ``eos_id``, ``audio_id``, ``vocab_size``, ``langs``, ``lang_id``, ``encode``, ``decode``),
so the dataset, the collator and the evaluator take either. Differences:

- ``pad_id`` is the tokenizer's pad token, or its EOS when it has none (Qwen and Llama 3 have none):
  pad only fills the collated ``tokens`` past each row's length and never reaches a loss.
- ``bos_id`` may be None (no BOS token); the prompt then starts without one.
- ``ctc_blank_id`` is ``audio_id`` (never a CTC target), not ``pad_id`` (which may be EOS).
- ``lang_tags="none"``: `encode` drops the language tags of the text (the transcript starts with its
  first word, ``tag_tokens == 0``) and `lang_id` is refused.
- `encode` cuts the text at the tags and encodes the words between them with
  ``add_special_tokens=False`` after collapsing whitespace (as the SentencePiece tokenizer does), so a
  transcript ``<|en|> moon blue`` is ``[<|en|>, "moon", " blue"]``: no BOS/EOS, no leading space.
- `decode` drops every special token of the tokenizer (the template's ``<|im_end|>``, ...), pad, BOS,
  EOS, the placeholder and (unless asked) the tags, and ids past the vocabulary (a padded embedding
  matrix has rows no token owns): what is left is words, which is what the WER scores.

`save(directory)` writes the tokenizer with its added tokens (`save_pretrained`: transformers loads it)
and ``speechlm_tokenizer.json`` (languages, tag mode), from which `HFTokenizer(directory)` restores
the languages when none are given.
"""

from __future__ import annotations

import datetime
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from speechlm.data.special_tokens import (
    AUDIO,
    TokenizerError,
    TokenizerFileError,
    UnknownLanguageError,
    _check_langs,
    decode_in_runs,
    encode_with_tags,
    format_lang_tag,
)
from speechlm.io import atomic_path

SIDECAR = "speechlm_tokenizer.json"
LANG_TAG_MODES = ("special", "none")
# files of a tokenizer directory that `save` copies next to the tokenizer.json it writes
_COPIED = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def is_hf_tokenizer_dir(path: str | Path) -> bool:
    """A directory that holds a Hugging Face tokenizer (tokenizer.json or tokenizer_config.json)."""
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(
            f"{path} is not valid JSON ({e}); it is truncated or corrupt: restore it"
        ) from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} does not hold a JSON object: restore it")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The directory's default chat template: chat_template.jinja, chat_template.json or tokenizer_config.json."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template") or config.get(
        "chat_template"
    )
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def render_chat_template(template: str, messages: list[dict[str, str]], **variables: Any) -> str:
    """`template` applied to `messages` the way transformers' ``apply_chat_template`` renders text:
    jinja2's immutable sandbox, trim_blocks/lstrip_blocks, loop controls, its ``tojson`` filter and
    ``raise_exception``/``strftime_now`` globals; ``{% generation %}`` blocks render their body."""

    class _Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=False, **variables)


class HFTokenizer:
    """A Hugging Face tokenizer directory plus ``<|audio|>`` and one tag per language; `encode` adds no bos/eos."""

    def __init__(
        self, path: str | Path, *, langs: Sequence[str] | None = None, lang_tags: str | None = None
    ) -> None:
        self.path = Path(path)
        self._load(langs, lang_tags)

    def _load(self, langs: Sequence[str] | None, lang_tags: str | None) -> None:
        meta = _read_json(self.path / SIDECAR)
        self.lang_tags = lang_tags or meta.get("lang_tags", "special")
        if self.lang_tags not in LANG_TAG_MODES:
            raise TokenizerError(f"lang_tags={self.lang_tags!r} is not one of {', '.join(LANG_TAG_MODES)}")
        known = [str(x) for x in meta.get("langs", [])] if isinstance(meta.get("langs"), list) else []
        wanted = known + [x for x in (langs or ()) if x not in known]
        self.langs: tuple[str, ...] = tuple(_check_langs(wanted)) if wanted else ()
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerFileError(
                f"{file} does not exist: data.tokenizer / model.llm.pretrained must be a Hugging Face "
                "directory with a fast tokenizer (tokenizer.json); write one with "
                "`AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`, or give a .model file of "
                "`speechlm tokenizer train` for a model trained from scratch"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises its own exception type for a damaged file
            raise TokenizerError(
                f"{file} cannot be loaded ({type(e).__name__}: {e}); restore it from where the LLM came from"
            ) from None
        self._config = _read_json(self.path / "tokenizer_config.json")
        self._template = read_chat_template(self.path, self._config)
        added = [AUDIO] + ([format_lang_tag(x) for x in self.langs] if self.lang_tags == "special" else [])
        before = self._tok.get_vocab_size(with_added_tokens=True)
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
        # rows the LLM lacks: those added now, and those a saved copy records (its tokenizer.json has them)
        recorded = meta.get("added_ids", []) if isinstance(meta.get("added_ids"), list) else []
        self.added_ids: tuple[int, ...] = tuple(
            sorted({*map(int, recorded), *range(before, self.vocab_size)})
        )
        self.audio_id = self._id_of(AUDIO)
        tags = [format_lang_tag(x) for x in self.langs] if self.lang_tags == "special" else []
        self._tag_ids = {t: self._id_of(t) for t in tags}
        self._lang_by_id = {i: t[2:-2] for t, i in self._tag_ids.items()}
        specials = {**_read_json(self.path / "special_tokens_map.json"), **self._config}
        self.special_tokens = {
            k: _token_text(specials.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        eos = self.special_tokens["eos_token"]
        if eos is None:
            raise TokenizerError(
                f"tokenizer {self.path} has no EOS token (eos_token in tokenizer_config.json): the prompt "
                "needs one to end a transcript; set eos_token in that file"
            )
        self.eos_id = self._id_of(eos)
        bos, pad, unk = (self.special_tokens[k] for k in ("bos_token", "pad_token", "unk_token"))
        self.bos_id: int | None = None if bos is None else self._id_of(bos)
        self.pad_id: int = self.eos_id if pad is None else self._id_of(pad)
        self.unk_id: int | None = None if unk is None else self._id_of(unk)
        special = {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(special | {self.pad_id, self.eos_id, self.audio_id})

    def _id_of(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"tokenizer {self.path} has no token {token!r} (named in its config)")
        return int(i)

    # pickling (DataLoader workers): the path and the languages; the receiving process reloads
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "langs": list(self.langs), "lang_tags": self.lang_tags}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = Path(state["path"])
        self._load(state["langs"], state["lang_tags"])

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, langs={list(self.langs)})"

    @property
    def tag_tokens(self) -> int:
        """Tokens of the language tag that starts an encoded transcript (CTC skips them)."""
        return 1 if self.lang_tags == "special" else 0

    @property
    def ctc_blank_id(self) -> int:
        return self.audio_id

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that are never words: the tokenizer's special tokens, pad, eos and the placeholder."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._template

    def lang_id(self, lang: str) -> int:
        """The id of the tag token ``<|lang|>`` (``lang_tags: special`` only)."""
        if self.lang_tags != "special":
            raise UnknownLanguageError(
                f"tokenizer {self.path} has no language tags (data.lang_tags={self.lang_tags}); "
                "decode without forcing a language"
            )
        try:
            return self._tag_ids[format_lang_tag(lang)]
        except KeyError:
            raise UnknownLanguageError(
                f"language {lang!r} is not in tokenizer {self.path} (known: {', '.join(self.langs)}); "
                "add it to the training data (its tag is added when the run starts)"
            ) from None

    def id_to_piece(self, i: int) -> str:
        return str(self._tok.id_to_token(int(i)))

    def encode(self, text: str) -> list[int]:
        """Token ids of a transcript (language tags one id each, or dropped with ``lang_tags: none``);
        ``<|audio|>`` is its id (the prompt builder refuses it in a transcript)."""

        def ids_of_tag(tag: str) -> list[int] | None:
            if tag == AUDIO:
                return [self.audio_id]
            if tag in self._tag_ids:
                return [self._tag_ids[tag]]
            return [] if self.lang_tags == "none" and tag[2:-2] in self.langs else None

        return encode_with_tags(
            text,
            self._encode_plain,
            ids_of_tag,
            lambda tag: (
                f"text contains the tag {tag!r}, which tokenizer {self.path} does not know "
                f"(languages: {', '.join(self.langs)}); fix the text: {text[:80]!r}"
            ),
        )

    def _encode_plain(self, text: str) -> list[int]:
        text = " ".join(text.split())
        return list(self._tok.encode(text, add_special_tokens=False).ids) if text else []

    def encode_template(self, text: str) -> list[int]:
        """Ids of rendered chat-template text: special tokens written in it (``<|im_start|>``,
        ``<|audio|>``, a BOS the template writes) become their ids; nothing is added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids) if text else []

    def render_chat(self, messages: list[dict[str, str]], template: str | None = None) -> str:
        """`template` (default: the directory's) applied to `messages` as text, no generation prompt."""
        template = template or self._template
        if template is None:
            raise TokenizerError(f"tokenizer {self.path} has no chat template")
        return render_chat_template(template, messages, **{k: v for k, v in self.special_tokens.items() if v})

    def decode(self, ids: Iterable[int], *, keep_lang_tag: bool = False) -> str:
        """Words of `ids`: special tokens, pad/bos/eos/audio and ids past the vocabulary dropped; the
        language tags only with ``keep_lang_tag=True``."""
        n = self.vocab_size
        return decode_in_runs(
            ids,
            lambda run: str(self._tok.decode(run, skip_special_tokens=True)),
            lang_by_id=self._lang_by_id,
            is_word=lambda i: 0 <= i < n and i not in self._special_ids,
            keep_lang_tag=keep_lang_tag,
        )

    def decode_verbatim(self, ids: Iterable[int]) -> str:
        """Every id as text, special tokens included (what the LLM reads; for inspection and tests)."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def save(self, directory: str | Path) -> Path:
        """Write the tokenizer with its added tokens (``AutoTokenizer`` loads the directory) and the
        languages (``speechlm_tokenizer.json``); the config and template files are copied as they are.
        Each file is written to a temporary name and renamed: a kill leaves each file whole."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)

        def put(name: str, write: Any) -> None:
            with atomic_path(out / name) as tmp:
                write(tmp)

        for name in _COPIED:
            src = self.path / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                put(name, lambda tmp, src=src: shutil.copyfile(src, tmp))
        put("tokenizer.json", lambda tmp: self._tok.save(str(tmp)))
        sidecar = {
            "format": 1,
            "langs": list(self.langs),
            "lang_tags": self.lang_tags,
            "audio": AUDIO,
            "added_ids": list(self.added_ids),  # the LLM's pretrained matrices lack these rows
        }
        put(SIDECAR, lambda tmp: tmp.write_text(json.dumps(sidecar, indent=2, ensure_ascii=False) + "\n"))
        return out
