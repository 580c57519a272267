"""The run's inputs, built from the config: manifests, tokenizer, chat template, prompt, renderer, dataset.

Training (`speechlm.train`), its pre-flight (`speechlm.preflight.checks`), `speechlm evaluate`,
`transcribe` and `export` (`speechlm.use`) all build these the same way, here:

- `open_manifests`: the train table (data.train_manifest or data.input_cfg) and the val table;
- `load_run_tokenizer`: data.tokenizer's SentencePiece model, or the LLM's own Hugging Face tokenizer
  (model.llm.pretrained) with <|audio|> and a tag per language of the manifests added
  (`tokenizer_source` says which; `check_tokenizer_choice` refuses a mismatch);
- `read_chat_template`: data.chat_template, read once per launch and handed to
  `build_run_prompt` (the run's `PromptFormat`) and `build_run_renderer` (its `ConversationRenderer`);
- `run_dataset`: a `SpeechDataset` over a table, rendered by the run's renderer;
- `RUN_TOKENIZER_DIR`: where a run saves the tokenizer it extended (read back by `speechlm.use`);
- `tokenizer_info`: what the model needs from the tokenizer (`TokenizerInfo`).

A problem raises a `speechlm.errors.UserError` that names the key, the file and the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speechlm.config import ExperimentConfig
from speechlm.data.hf_tokenizer import HFTokenizer, is_hf_tokenizer_dir
from speechlm.data.sources.input_cfg import load_input_cfg
from speechlm.data.sources.mmap_cache import open_index
from speechlm.data.text import normalize_target
from speechlm.data.tokenizer import AUDIO, SP_SAVED, Tokenizer, load_text_tokenizer
from speechlm.errors import DataError, UsageError

RunTokenizer = (
    Tokenizer | HFTokenizer
)  # the run's tokenizer: data.tokenizer's SentencePiece, or the LLM's own

if TYPE_CHECKING:
    import pyarrow as pa

    from speechlm.data.dataset import SpeechDataset
    from speechlm.packing.prompt import ConversationRenderer, PromptFormat


# --- manifests --------------------------------------------------------------------------------------
def open_manifests(cfg: ExperimentConfig) -> tuple[pa.Table, pa.Table | None]:
    """(train table, val table or None) as training reads them; a missing or unreadable one is a DataError."""
    if cfg.data.input_cfg is not None:  # several weighted datasets (sources/input_cfg.py)
        train_table = load_input_cfg(cfg.data.input_cfg)
    else:
        train_table = open_index(cfg.data.train_manifest)  # type: ignore[arg-type]  # set: require_inputs
    val_table = open_index(cfg.data.val_manifest) if cfg.data.val_manifest else None
    return train_table, val_table


def manifest_langs(*tables: pa.Table | None) -> list[str]:
    """The sorted languages of the manifests' lang columns (the tags a Hugging Face tokenizer gets)."""
    import pyarrow.compute as pc  # lazy: pyarrow.compute (CLI start-up)

    langs: set[str] = set()
    for table in tables:
        if table is not None and "lang" in table.column_names:
            for chunk in table.column("lang").chunks:
                langs.update(str(x) for x in pc.unique(chunk).to_pylist() if x is not None)
    return sorted(langs)


# --- the tokenizer ----------------------------------------------------------------------------------
def tokenizer_prefix(path: str | Path) -> Path:
    """data.tokenizer without its .model/.vocab/.json suffix (the prefix `speechlm tokenizer train` wrote)."""
    p = Path(str(path))
    return p.with_suffix("") if p.suffix in (".model", ".vocab", ".json") else p


def load_tokenizer(path: str | Path | None) -> RunTokenizer:
    """The SentencePiece tokenizer at `path` (data.tokenizer: a .model file, its prefix, or a directory
    of `Tokenizer.save`); a missing or damaged file is a DataError naming it."""
    try:
        return load_text_tokenizer(path)  # type: ignore[arg-type]  # None: refused below as before
    except FileNotFoundError as e:
        raise DataError(f"data.tokenizer={path}: {e}") from None
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
        # sentencepiece raises RuntimeError/OSError for a damaged model; the sidecar json ValueError or KeyError
        prefix = tokenizer_prefix(str(path))
        raise DataError(
            f"data.tokenizer={path} cannot be loaded ({type(e).__name__}: {e}); {prefix}.model and its "
            f"sidecar {prefix}.json must come from one `speechlm tokenizer train` run: retrain the tokenizer "
            "or restore the files"
        ) from e


def tokenizer_source(cfg: ExperimentConfig) -> tuple[str | None, str]:
    """(the run's tokenizer path, its kind): data.tokenizer, else model.llm.pretrained's directory (that
    LLM's own tokenizer); kind "hf" for a Hugging Face tokenizer directory, "sentencepiece" otherwise
    (None path: neither is set)."""
    path = cfg.data.tokenizer or cfg.model.llm.pretrained
    if path is None:
        return None, "sentencepiece"
    if cfg.data.tokenizer is None:  # the LLM's own, even where its directory is absent (validate elsewhere)
        return str(path), "hf"
    p = Path(str(path))
    hf = is_hf_tokenizer_dir(p) and not (p / f"{SP_SAVED}.model").is_file()
    return str(path), "hf" if hf else "sentencepiece"


def check_tokenizer_choice(cfg: ExperimentConfig, kind: str) -> None:
    """A pretrained LLM trains on its own tokenizer's ids: a SentencePiece data.tokenizer is refused
    (its ids index embeddings trained for other tokens) unless data.allow_sentencepiece_with_pretrained."""
    if (
        cfg.model.llm.pretrained
        and kind == "sentencepiece"
        and not cfg.data.allow_sentencepiece_with_pretrained
    ):
        raise UsageError(
            f"model.llm.pretrained={cfg.model.llm.pretrained} with the SentencePiece data.tokenizer="
            f"{cfg.data.tokenizer}: the LLM's embeddings are indexed by its own tokenizer's ids, which mean "
            "other tokens in this SentencePiece model, so the pretrained weights would be wasted. Unset "
            "data.tokenizer (data.tokenizer=null: the LLM's own tokenizer), or point it at the LLM's "
            "tokenizer directory; to train on these ids anyway set data.allow_sentencepiece_with_pretrained=true"
        )
    if kind == "sentencepiece" and cfg.data.lang_tags != "special":
        raise UsageError(
            f"data.lang_tags={cfg.data.lang_tags} needs a Hugging Face tokenizer (data.tokenizer is the "
            f"SentencePiece model {cfg.data.tokenizer}, whose tags are built in): set data.lang_tags=special"
        )


def load_run_tokenizer(cfg: ExperimentConfig, langs: Iterable[str] = ()) -> RunTokenizer:
    """The run's tokenizer (`tokenizer_source`): a SentencePiece `Tokenizer`, or the LLM's `HFTokenizer`
    with <|audio|> and a tag per language of `langs` added. Errors name the key and the file."""
    path, kind = tokenizer_source(cfg)
    check_tokenizer_choice(cfg, kind)
    if kind == "sentencepiece":
        return load_tokenizer(path)
    key = "data.tokenizer" if cfg.data.tokenizer else "model.llm.pretrained (its own tokenizer)"
    if path is None:
        raise UsageError("no tokenizer: set data.tokenizer=PATH or model.llm.pretrained=DIR")
    try:
        return HFTokenizer(path, langs=list(langs), lang_tags=cfg.data.lang_tags)
    except FileNotFoundError as e:
        raise DataError(f"{key}={path}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{key}={path} cannot be loaded ({type(e).__name__}: {e})") from e


# --- the prompt and the renderer --------------------------------------------------------------------
def read_chat_template(cfg: ExperimentConfig) -> str:
    """data.chat_template: ``auto``/``none`` or the text of the template file it names (read here, once
    per launch: the prompt and every renderer of the run take the text)."""
    template: str = cfg.data.chat_template
    if template not in ("auto", "none"):
        try:
            template = Path(template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(
                f"data.chat_template={cfg.data.chat_template} cannot be read ({e}): give a Jinja template "
                "file, or 'auto' / 'none'"
            ) from None
    return template


def build_run_prompt(
    cfg: ExperimentConfig, tokenizer: RunTokenizer, template: str | None = None
) -> PromptFormat:
    """The run's `speechlm.packing.prompt.PromptFormat` (data.chat_template, data.instruction,
    data.system_prompt); `template` is `read_chat_template`'s text (None: read it now)."""
    from speechlm.packing.prompt import build_prompt_format  # lazy: torch (speechlm validate start-up)

    try:
        return build_prompt_format(
            tokenizer,
            instruction=cfg.data.instruction,
            system_prompt=cfg.data.system_prompt,
            chat_template=read_chat_template(cfg) if template is None else template,
            audio_token=AUDIO,
        )
    except ValueError as e:  # a template that cannot be split, a system prompt with no template
        raise UsageError(
            f"the prompt cannot be built (data.chat_template={cfg.data.chat_template}): {e}"
        ) from None


def build_run_renderer(
    cfg: ExperimentConfig, tokenizer: RunTokenizer, template: str | None = None
) -> ConversationRenderer:
    """The run's `speechlm.packing.prompt.ConversationRenderer` (data.chat_template, data.system_prompt,
    data.loss_turns, data.text_normalize), which every dataset of training and evaluation renders its
    rows with; its one-turn prompts are `build_run_prompt`'s (data.instruction is the datasets' default
    instruction). `template` is `read_chat_template`'s text (None: read it now)."""
    from speechlm.packing.prompt import ConversationRenderer  # lazy: torch (speechlm validate start-up)

    return ConversationRenderer(
        tokenizer,
        system_prompt=cfg.data.system_prompt,
        chat_template=read_chat_template(cfg) if template is None else template,
        loss_turns=cfg.data.loss_turns,
        audio_token=AUDIO,
        normalize=functools.partial(normalize_target, rule=cfg.data.text_normalize),
    )


def run_dataset(
    cfg: ExperimentConfig,
    table: pa.Table,
    tokenizer: RunTokenizer,
    *,
    template: str | None = None,
    **overrides: Any,
) -> SpeechDataset:
    """A `SpeechDataset` over `table` as training and evaluation read it: the run's renderer (of
    `template`, `read_chat_template`'s text; None: read it now), its default instruction,
    data.max_tokens/sample_rate/duration_tolerance (`overrides` replace them)."""
    from speechlm.data.dataset import SpeechDataset  # lazy: torch (speechlm validate start-up)

    d = cfg.data
    options = {
        "max_tokens": d.max_tokens,
        "sample_rate": d.sample_rate,
        "duration_tolerance": d.duration_tolerance,
        "renderer": build_run_renderer(cfg, tokenizer, template),
        "instruction": d.instruction,
        **overrides,
    }
    return SpeechDataset(table, tokenizer, **options)


RUN_TOKENIZER_DIR = (
    "tokenizer"  # run_dir/tokenizer: the LLM's tokenizer as the run extended it (train.recipe)
)


# --- what the model needs from the tokenizer ---------------------------------------------------------
@dataclass
class TokenizerInfo:
    """What the model needs from the run's tokenizer. ``prompt`` is the run's `PromptFormat` (None: the
    plain form of ``bos_id``/``eos_id``/``instruction_ids``); ``ctc_blank_id`` None means ``pad_id``;
    ``ctc_skip_leading`` the language tag's tokens at the start of a transcript (0 without tags);
    ``added_token_ids`` the ids the tokenizer added to a pretrained LLM (rows to initialise)."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    audio_id: int
    instruction_ids: tuple[int, ...] = ()
    prompt: PromptFormat | None = None
    ctc_blank_id: int | None = None
    ctc_skip_leading: int = 1
    added_token_ids: tuple[int, ...] = ()


def tokenizer_info(
    cfg: ExperimentConfig, tokenizer: RunTokenizer, prompt: PromptFormat | None = None
) -> TokenizerInfo:
    """What the model needs from the tokenizer (ids, CTC blank, added rows and the prompt format, built
    from the config when `prompt` is None): training, evaluate and export."""
    if prompt is None:
        prompt = build_run_prompt(cfg, tokenizer)
    return TokenizerInfo(  # the prompt holds the instruction (instruction_ids: only for the plain shorthand)
        len(tokenizer),
        tokenizer.pad_id,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.audio_id,
        prompt=prompt,
        ctc_blank_id=tokenizer.ctc_blank_id,
        ctc_skip_leading=tokenizer.tag_tokens,
        added_token_ids=tuple(getattr(tokenizer, "added_ids", ())),
    )
