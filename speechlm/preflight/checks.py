"""The pre-flight of `speechlm train`: what a run can find out before its first step, checked before it.

`speechlm.train.entry.prepare_inputs` runs these checks on every rank before the model is built, and
`speechlm validate` runs the ones that need only files (manifests, tokenizer, the epoch plan), so a
run that `validate` accepts does not stop at its first validation or final evaluation on bad input:

- the manifests exist and open, the tokenizer files exist and load (`open_manifests`, `load_tokenizer`);
- every transcript and the instruction use only tags the tokenizer knows, every language of the train
  and val manifests is one of its languages, and no row has a null text, path or language
  (`check_inputs`; the scan runs over the Arrow text column with pyarrow.compute, a chunk at a time);
- every character of the answers and transcripts, after the data.text_normalize rule, is one the
  tokenizer can encode, never <unk> (`coverage_problems`: a scan over the distinct characters);
- the run dir and its `checkpoints` folder are directories, or can be created, and are writable, and
  an explicit `trainer.resume` path is a complete checkpoint (`check_run_dir`, `check_resume`; train only);
- the figures the validator's data-side rules read: rows and the longest clip (`summarize`), and,
  once the other rules pass, the epoch plan's micro-batches per data-parallel rank
  (`summarize_plan`, for `epoch-plan-too-short`).

A problem raises a `speechlm.errors.UserError` that names the file, row or key, the value, and the fix.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from speechlm.errors import DataError, RunDirError, UsageError

# the tag syntax `Tokenizer.encode` reads as one special token (speechlm.data.tokenizer._TAG_RE)
TAG_PATTERN = r"<\|[^|<>\s]+\|>"
_TAG_RE = re.compile(TAG_PATTERN)
SCAN_ROWS = 1 << 18  # rows per slice of the vectorised text scan (bounds the temporary strings)
SHOW = 3  # bad rows quoted per problem


# --- files ------------------------------------------------------------------------------------------
def open_manifests(cfg: Any) -> tuple[Any, Any]:
    """(train table, val table or None) as training reads them; a missing or unreadable one is a DataError."""
    from speechlm.data.sources.mmap_cache import open_index

    if cfg.data.input_cfg is not None:  # several weighted datasets (sources/input_cfg.py)
        from speechlm.data.sources.input_cfg import load_input_cfg

        train_table = load_input_cfg(cfg.data.input_cfg)
    else:
        train_table = open_index(cfg.data.train_manifest)
    val_table = open_index(cfg.data.val_manifest) if cfg.data.val_manifest else None
    return train_table, val_table


def load_tokenizer(path: Any) -> Any:
    """The SentencePiece tokenizer at `path` (data.tokenizer: a .model file, its prefix, or a directory
    of `Tokenizer.save`); a missing or damaged file is a DataError naming it."""
    from speechlm.data.tokenizer import load_text_tokenizer

    try:
        return load_text_tokenizer(path)
    except FileNotFoundError as e:
        raise DataError(f"data.tokenizer={path}: {e}") from None
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
        # sentencepiece raises RuntimeError/OSError for a damaged model; the sidecar json ValueError or KeyError
        prefix = tokenizer_prefix(path)
        raise DataError(
            f"data.tokenizer={path} cannot be loaded ({type(e).__name__}: {e}); {prefix}.model and its "
            f"sidecar {prefix}.json must come from one `speechlm tokenizer train` run: retrain the tokenizer "
            "or restore the files"
        ) from e


def tokenizer_source(cfg: Any) -> tuple[str | None, str]:
    """(the run's tokenizer path, its kind): data.tokenizer, else model.llm.pretrained's directory (that
    LLM's own tokenizer); kind "hf" for a Hugging Face tokenizer directory, "sentencepiece" otherwise
    (None path: neither is set)."""
    from speechlm.data.hf_tokenizer import is_hf_tokenizer_dir
    from speechlm.data.tokenizer import SP_SAVED

    path = cfg.data.tokenizer or cfg.model.llm.pretrained
    if path is None:
        return None, "sentencepiece"
    if cfg.data.tokenizer is None:  # the LLM's own, even where its directory is absent (validate elsewhere)
        return str(path), "hf"
    p = Path(str(path))
    hf = is_hf_tokenizer_dir(p) and not (p / f"{SP_SAVED}.model").is_file()
    return str(path), "hf" if hf else "sentencepiece"


def check_tokenizer_choice(cfg: Any, kind: str) -> None:
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


def manifest_langs(*tables: Any) -> list[str]:
    """The sorted languages of the manifests' lang columns (the tags a Hugging Face tokenizer gets)."""
    import pyarrow.compute as pc

    langs: set[str] = set()
    for table in tables:
        if table is not None and "lang" in table.column_names:
            for chunk in table.column("lang").chunks:
                langs.update(str(x) for x in pc.unique(chunk).to_pylist() if x is not None)
    return sorted(langs)


def load_run_tokenizer(cfg: Any, langs: Any = ()) -> Any:
    """The run's tokenizer (`tokenizer_source`): a SentencePiece `Tokenizer`, or the LLM's `HFTokenizer`
    with <|audio|> and a tag per language of `langs` added. Errors name the key and the file."""
    from speechlm.data.hf_tokenizer import HFTokenizer

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


def check_llm(cfg: Any, tokenizer: Any) -> None:
    """model.llm.pretrained's files are whole, the run's tokenizer is that LLM's (a Hugging Face one; a
    SentencePiece model allowed by data.allow_sentencepiece_with_pretrained is not), and LoRA's target
    modules name modules of the LLM (`speechlm.model.llm_preflight.check_pretrained_llm`)."""
    from speechlm.model.llm_preflight import check_pretrained_llm

    check_pretrained_llm(cfg, tokenizer if tokenizer_source(cfg)[1] == "hf" else None)


def validate_llm(cfg: Any) -> list[str]:
    """`check_llm` for `speechlm validate`; a model.llm.pretrained absent here is a note, not an error."""
    pretrained = cfg.model.llm.pretrained
    if pretrained and not Path(pretrained).exists():
        return [
            f"model.llm.pretrained {pretrained} not checked (nor its tokenizer and LoRA targets): it does not exist here"
        ]
    path, kind = tokenizer_source(cfg)
    hf = pretrained and kind == "hf" and path is not None and Path(path).is_dir()
    check_llm(cfg, load_run_tokenizer(cfg) if hf else None)
    return []


def _run_template(cfg: Any) -> str:
    """data.chat_template: ``auto``/``none`` or the text of the template file it names."""
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


def build_run_prompt(cfg: Any, tokenizer: Any) -> Any:
    """The run's `speechlm.packing.prompt.PromptFormat` (data.chat_template, data.instruction, data.system_prompt)."""
    from speechlm.data.tokenizer import AUDIO
    from speechlm.packing.prompt import build_prompt_format

    template = _run_template(cfg)
    try:
        return build_prompt_format(
            tokenizer,
            instruction=cfg.data.instruction,
            system_prompt=cfg.data.system_prompt,
            chat_template=template,
            audio_token=AUDIO,
        )
    except ValueError as e:  # a template that cannot be split, a system prompt with no template
        raise UsageError(
            f"the prompt cannot be built (data.chat_template={cfg.data.chat_template}): {e}"
        ) from None


def build_run_renderer(cfg: Any, tokenizer: Any) -> Any:
    """The run's `speechlm.packing.prompt.ConversationRenderer` (data.chat_template, data.system_prompt,
    data.loss_turns, data.text_normalize), which every dataset of training and evaluation renders its
    rows with; its one-turn prompts are `build_run_prompt`'s (data.instruction is the datasets' default
    instruction)."""
    from speechlm.data.text import normalize_target
    from speechlm.data.tokenizer import AUDIO
    from speechlm.packing.prompt import ConversationRenderer

    return ConversationRenderer(
        tokenizer,
        system_prompt=cfg.data.system_prompt,
        chat_template=_run_template(cfg),
        loss_turns=cfg.data.loss_turns,
        audio_token=AUDIO,
        normalize=functools.partial(normalize_target, rule=cfg.data.text_normalize),
    )


def run_dataset(cfg: Any, table: Any, tokenizer: Any, **overrides: Any) -> Any:
    """A `SpeechDataset` over `table` as training and evaluation read it: the run's renderer, its
    default instruction, data.max_tokens/sample_rate/duration_tolerance (`overrides` replace them)."""
    from speechlm.data.dataset import SpeechDataset

    d = cfg.data
    options = {
        "max_tokens": d.max_tokens,
        "sample_rate": d.sample_rate,
        "duration_tolerance": d.duration_tolerance,
        "renderer": build_run_renderer(cfg, tokenizer),
        "instruction": d.instruction,
        **overrides,
    }
    return SpeechDataset(table, tokenizer, **options)


def tokenizer_summary(cfg: Any) -> dict[str, Any]:
    """The tokenizer facts the validator's tokenizer rules read (no file is loaded, only looked at):
    tokenizer_kind, llm_pretrained, chat_template (whether the HF tokenizer directory has one; None
    when unknown here) and the escape hatch."""
    from speechlm.data.hf_tokenizer import _read_json, read_chat_template

    path, kind = tokenizer_source(cfg)
    has_template: bool | None = None
    if kind == "hf" and path is not None and Path(path).is_dir():
        try:
            has_template = (
                read_chat_template(Path(path), _read_json(Path(path) / "tokenizer_config.json")) is not None
            )
        except DataError:
            has_template = None
    return {
        "tokenizer_kind": kind if path is not None else None,
        "tokenizer_path": path,
        "llm_pretrained": cfg.model.llm.pretrained,
        "chat_template": has_template,
        "chat_template_setting": cfg.data.chat_template,
        "allow_sentencepiece_with_pretrained": bool(cfg.data.allow_sentencepiece_with_pretrained),
    }


def tokenizer_prefix(path: Any) -> Path:
    """data.tokenizer without its .model/.vocab/.json suffix (the prefix `speechlm tokenizer train` wrote)."""
    p = Path(str(path))
    return p.with_suffix("") if p.suffix in (".model", ".vocab", ".json") else p


# --- transcripts, languages, the instruction ---------------------------------------------------------
def known_tags(tokenizer: Any) -> list[str]:
    """The `<|...|>` tags `tokenizer.encode` accepts: one per language, and `<|audio|>`."""
    from speechlm.data.tokenizer import AUDIO, format_lang_tag

    return [AUDIO, *(format_lang_tag(lang) for lang in tokenizer.langs)]


def _unknown_tags_in(text: str, known: set[str]) -> list[str]:
    return [m.group(0) for m in _TAG_RE.finditer(text) if m.group(0) not in known]


def check_instruction(instruction: str | None, tokenizer: Any) -> None:
    """data.instruction may only use tags the tokenizer knows (DI1); a UsageError otherwise."""
    if not instruction:
        return
    known = known_tags(tokenizer)
    bad = _unknown_tags_in(instruction, set(known))
    if bad:
        raise UsageError(
            f"data.instruction={instruction!r} contains the tag(s) {', '.join(dict.fromkeys(bad))}, which "
            f"tokenizer {tokenizer.path} does not know (it knows {', '.join(known)}); use one of those tags "
            "or plain text in data.instruction, or retrain the tokenizer with that language"
        )


def _row_name(table: Any, row: int) -> str:
    if "segment_id" in table.column_names:
        seg = table.column("segment_id")[row]
        if seg.is_valid:
            return f"row {row} (segment {seg.as_py()})"
    return f"row {row}"


def _null_problems(table: Any, name: str) -> list[str]:
    import pyarrow.compute as pc

    out = []
    for col in ("audio_filepath", "text", "lang"):
        if col not in table.column_names:
            continue
        column = table.column(col)
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            out.append(
                f"{name}, {_row_name(table, row)}: column {col} is null ({column.null_count} null row(s) "
                "in all); fix those rows or rebuild the manifest"
            )
    return out


def _language_problems(table: Any, name: str, tokenizer: Any) -> list[str]:
    import pyarrow as pa
    import pyarrow.compute as pc

    lang = table.column("lang")
    present: set[str] = set()
    for chunk in lang.chunks:
        present.update(x for x in pc.unique(chunk).to_pylist() if x is not None)
    unknown = sorted(present - set(tokenizer.langs))
    if not unknown:
        return []
    as_text = lang.cast(pa.string()) if pa.types.is_dictionary(lang.type) else lang
    parts = []
    for code in unknown:
        hits = pc.equal(as_text, code)
        parts.append(
            f"{code!r} ({pc.sum(hits).as_py()} row(s), first {_row_name(table, pc.index(hits, True).as_py())})"
        )
    return [
        f"{name} has language(s) that tokenizer {tokenizer.path} does not know: {'; '.join(parts)} (it knows "
        f"{', '.join(tokenizer.langs)}); retrain the tokenizer on a manifest with these languages "
        "(`speechlm tokenizer train --manifest ...`) or remove those rows"
    ]


def unknown_tag_rows(texts: Any, known: list[str]) -> tuple[int, list[int]]:
    """(rows whose text has a tag not in `known`, the first SHOW of them), scanning with pyarrow.compute.

    Each slice of SCAN_ROWS rows takes two passes of RE2 over the Arrow strings: the first keeps the
    rows that are plainly clean (an optional known leading tag, then no `<|`: nearly every row); the
    rest have their known tags removed and are searched for any tag left. Null texts count as clean
    here (`_null_problems` names them). Measured: 0.6-0.8 s per million 70-character texts, one CPU core
    (a one-pass replace-then-match over every row took 1.7 s).
    """
    import numpy as np
    import pyarrow.compute as pc

    known_re = "|".join(re.escape(t) for t in known)  # never empty: <|audio|> is always known
    clean_re = rf"^\s*(?:{known_re})?(?:[^<]|<[^|])*<?$"
    count, first = 0, []  # type: int, list[int]
    offset = 0
    for chunk in texts.chunks:
        for start in range(0, len(chunk), SCAN_ROWS):
            piece = chunk.slice(start, SCAN_ROWS)
            clean = pc.fill_null(pc.match_substring_regex(piece, clean_re), True)
            suspects = np.flatnonzero(~clean.to_numpy(zero_copy_only=False))
            if not len(suspects):
                continue
            rest = pc.replace_substring_regex(pc.take(piece, suspects), pattern=known_re, replacement="")
            hit = pc.fill_null(pc.match_substring_regex(rest, TAG_PATTERN), False)
            rows = suspects[hit.to_numpy(zero_copy_only=False)]
            count += len(rows)
            first.extend(int(offset + start + r) for r in rows[: SHOW - len(first)])
        offset += len(chunk)
    return count, first


def _tag_problems(table: Any, name: str, tokenizer: Any, column: str = "text") -> list[str]:
    known = known_tags(tokenizer)
    texts = table.column(column)
    count, rows = unknown_tag_rows(texts, known)
    if not count:
        return []
    quoted = []
    tags: dict[str, None] = {}
    for row in rows:
        text = texts[row].as_py()
        bad = _unknown_tags_in(text, set(known))
        tags.update(dict.fromkeys(bad))
        where = "" if column == "text" else f"column {column}, "
        quoted.append(f"{where}{_row_name(table, row)}: {', '.join(bad)} in {text[:60]!r}")
    return [
        f"{name}: {count} {'rows hold' if count > 1 else 'row holds'} a tag that tokenizer {tokenizer.path} does not "
        f"know ({', '.join(tags)}{', ...' if count > len(rows) else ''}; it knows {', '.join(known)}): "
        f"{'; '.join(quoted)}{'; ...' if count > len(rows) else ''}; fix those transcripts or retrain the "
        "tokenizer with those languages"
    ]


def check_table(table: Any, name: str, tokenizer: Any) -> list[str]:
    """Problems of one manifest against the tokenizer: null values, unknown languages, unknown tags (in the
    transcripts and in the optional instructions and answers)."""
    nulls = _null_problems(table, name)
    tags = [
        p
        for col in ("text", "instruction", "answer")
        if col in table.column_names
        for p in _tag_problems(table, name, tokenizer, col)
    ]
    return [*nulls, *_language_problems(table, name, tokenizer), *tags]


def coverage_problems(table: Any, name: str, tokenizer: Any, rule: str) -> list[str]:
    """Characters of the answers and transcripts of `table` that `tokenizer` cannot encode under the
    data.text_normalize rule `rule` (`speechlm.data.text_coverage`): they would be trained as <unk>."""
    from speechlm.data.text_coverage import coverage_problems as problems_of

    return problems_of(table, name, tokenizer, rule, lambda row: _row_name(table, row))


def uncovered_targets(table: Any, tokenizer: Any, rule: str) -> Any:
    """`speechlm.data.text_coverage.find_uncovered` with the rows named as the pre-flight names them."""
    from speechlm.data.text_coverage import find_uncovered

    return find_uncovered(table, tokenizer, rule, lambda row: _row_name(table, row))


def check_inputs(cfg: Any, train_table: Any, val_table: Any, tokenizer: Any) -> None:
    """Everything in the manifests and the instruction that the tokenizer must know, train and val.

    The instruction is a config value (UsageError); the manifests' problems are one DataError."""
    check_instruction(cfg.data.instruction, tokenizer)
    train_name = "data.input_cfg" if cfg.data.input_cfg is not None else f"manifest {cfg.data.train_manifest}"
    rule = cfg.data.text_normalize
    problems = check_table(train_table, train_name, tokenizer)
    problems += coverage_problems(train_table, train_name, tokenizer, rule)
    if val_table is not None:
        val_name = f"val manifest {cfg.data.val_manifest}"
        problems += check_table(val_table, val_name, tokenizer)
        problems += coverage_problems(val_table, val_name, tokenizer, rule)
    if problems:
        raise DataError(" ".join(p if p.endswith(".") else p + "." for p in problems))
    check_eval_metrics(cfg, train_table, val_table)


def check_eval_metrics(cfg: Any, train_table: Any, val_table: Any) -> None:
    """Every task of an evaluated split has a metric (trainer.eval_metrics), and trainer.best_metric is a
    metric the validation produces (when there is one): refused now, not at the first validation."""
    from speechlm.config import final_eval_split
    from speechlm.metrics import MetricSpec, table_pairs

    spec = MetricSpec.from_config(cfg)
    evaluated = {"val": (val_table, f"val manifest {cfg.data.val_manifest}")}
    split = final_eval_split(cfg)
    if split in ("train", "both") or cfg.trainer.val_train_batches > 0:
        train_name = "data.input_cfg" if cfg.data.input_cfg is not None else cfg.data.train_manifest
        why = (
            f"trainer.final_eval_split={split}" if split in ("train", "both") else "trainer.val_train_batches"
        )
        evaluated["train"] = (train_table, f"training data {train_name} ({why})")
    for table, where in evaluated.values():
        if table is not None:
            for task in sorted({task for task, _ in table_pairs(table)}):
                spec.check_task(task, where)
    if val_table is not None and cfg.trainer.val_every > 0:
        name = cfg.trainer.best_metric
        if name.startswith("train_") and cfg.trainer.val_train_batches == 0:
            raise UsageError(
                f"trainer.best_metric={name!r} is a training-split metric but trainer.val_train_batches=0 (the "
                "validation decodes no training rows): set trainer.val_train_batches=N, or name a val metric"
            )
        # a train_ key: the training rows are chosen in the val split's (task, language) proportions
        spec.check_best_metric(name.removeprefix("train_"), table_pairs(val_table), evaluated["val"][1])


# --- run dir and resume (train only) -----------------------------------------------------------------
def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def check_run_dir(run_dir: Path) -> None:
    """trainer.run_dir and its checkpoints folder are directories (or can be created) and are writable."""
    for path in (run_dir, run_dir / "checkpoints"):
        what = "trainer.run_dir" if path == run_dir else "the checkpoints folder of trainer.run_dir"
        if path.is_symlink() and not path.exists():
            raise RunDirError(
                f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist; create that "
                "folder, remove the link, or choose another trainer.run_dir"
            )
        if path.exists():
            if not path.is_dir():
                raise RunDirError(
                    f"{what} {path} exists and is not a directory; remove or rename that file, or choose "
                    "another trainer.run_dir"
                )
            if not _writable(path):
                raise RunDirError(
                    f"{what} {path} is not writable by this user; fix its permissions or choose another "
                    "trainer.run_dir"
                )
            continue
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise RunDirError(
                f"{what} {path} cannot be created: {parent} is not a directory; choose another trainer.run_dir"
            )
        if not _writable(parent):
            raise RunDirError(
                f"{what} {path} cannot be created: {parent} is not writable by this user; choose another "
                "trainer.run_dir"
            )
        return  # nothing below a folder still to be created can be in the way


def check_resume(resume: str | None, run_dir: Path) -> None:
    """An explicit trainer.resume path is a complete checkpoint (RunDirError), before the model is built.

    `auto` is resolved where the run resumes (it may legitimately find nothing)."""
    if resume in (None, "", "auto"):
        return
    from speechlm.train.checkpoint import resolve_resume

    try:
        resolve_resume(resume, run_dir, log=lambda _m: None)
    except FileNotFoundError as e:  # resolve_resume's "no checkpoint directory there"
        raise RunDirError(str(e)) from None


# --- the figures of the validator's data-side rules ---------------------------------------------------
def summarize(table: Any, cfg: Any) -> dict[str, Any]:
    """manifest_summary for the validator's data rules: n_rows, max_duration (seconds: the longest row the
    plan keeps, data.max_duration applied) with its encoder frames (max_encoder_frames), median_duration
    (of those rows) and, under a token
    budget, max_tokens (the longest row's audio + text + prompt tokens, as the sampler counts them)."""
    import numpy as np

    from parallel.frames import planned_encoder_frames
    from speechlm.data.sampler.build import token_cost_of

    durations = table.column("duration").to_numpy()
    if cfg.data.max_duration is not None:
        kept = durations[durations <= np.float32(cfg.data.max_duration)]
        if len(durations) and not len(kept):  # the sampler would raise this after the model is built
            from speechlm.data.sampler.epoch_plan import too_long_message

            raise DataError(too_long_message(durations, cfg.data.max_duration))
        durations = kept
    longest = float(durations.max()) if len(durations) else 0.0
    subsampling = token_cost_of(cfg.model).encoder_subsampling
    summary = {
        "n_rows": len(table),
        "max_duration": longest,
        "median_duration": float(np.median(durations)) if len(durations) else 0.0,
        "max_encoder_frames": planned_encoder_frames(longest, subsampling),
    }
    if cfg.sampler.max_batch_tokens is not None:
        from speechlm.data.sampler.build import longest_row_tokens

        summary["max_tokens"] = longest_row_tokens(cfg, table)
    return summary


def summarize_plan(cfg: Any, table: Any, world_size: int, *, dp_rank: int = 0) -> tuple[dict[str, Any], Any]:
    """(the plan's figures for `epoch-plan-too-short`, the sampler of `dp_rank`, or None when it has no plan).

    Call it once the validator's other rules pass (a valid layout and budget, enough rows): it builds
    epoch 0's plan as training does (`speechlm.data.sampler.build.build_sampler`), once, and returns
    `plan_micro_batches` (packed in the epoch) and `plan_batches_per_rank` (0 when the plan cannot give
    every dp rank a full optimizer step, which the sampler would raise on).
    """
    from parallel.mesh import ParallelDims
    from speechlm.data.sampler.build import build_sampler
    from speechlm.data.sampler.epoch_plan import EpochTooShortError

    p = cfg.parallel
    dims = ParallelDims(world_size, p.dp_replicate, p.dp_shard, p.cp_size, p.tp_size)
    sampler = build_sampler(cfg, table, dp_rank=dp_rank, dp_size=dims.dp)
    try:
        per_rank = len(sampler)  # builds epoch 0's plan
    except EpochTooShortError as e:
        return {"plan_micro_batches": e.n_batches, "plan_batches_per_rank": 0}, None
    packed = len(sampler.plan.batch_offsets) - 1
    return {"plan_micro_batches": packed, "plan_batches_per_rank": per_rank}, sampler


# --- speechlm validate -------------------------------------------------------------------------------
def validate_data(cfg: Any, manifest: str | None = None) -> tuple[dict[str, Any] | None, Any, Any, list[str]]:
    """The file checks of train for `speechlm validate`.

    Returns (manifest_summary or None, the config as checked, the train table or None, notes on what
    was skipped); `summarize_plan(config, table, ...)` gives the plan's figures once the other rules pass.

    `manifest` (--manifest) replaces the config's training data and must exist; otherwise the config's
    data.input_cfg or data.train_manifest is used when it exists. The tokenizer and val manifest are
    checked when they exist. Raises the same errors as train for the files it reads.
    """
    import dataclasses

    notes: list[str] = validate_llm(cfg)
    facts = tokenizer_summary(cfg)
    tok_facts = facts if facts["tokenizer_kind"] == "hf" or facts["llm_pretrained"] else {}
    if manifest is not None:
        data = dataclasses.replace(cfg.data, train_manifest=manifest, input_cfg=None)
        cfg = dataclasses.replace(cfg, data=data)
    elif cfg.data.input_cfg is None and not (
        cfg.data.train_manifest and Path(cfg.data.train_manifest).exists()
    ):
        where = (
            f"data.train_manifest {cfg.data.train_manifest} does not exist here"
            if cfg.data.train_manifest
            else "data.train_manifest is not set"
        )
        notes.append(
            f"data rules not run: {where}; pass --manifest M (or set data.train_manifest) to check the "
            "data as `speechlm train` does"
        )
        return tok_facts or None, cfg, None, notes
    if cfg.data.val_manifest and not Path(cfg.data.val_manifest).exists():
        notes.append(f"val manifest {cfg.data.val_manifest} not checked: it does not exist here")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_manifest=None))
    train_table, val_table = open_manifests(cfg)
    path, kind = tokenizer_source(cfg)
    found = path is not None and (Path(path).is_dir() or Path(f"{tokenizer_prefix(path)}.model").exists())
    refused = bool(cfg.model.llm.pretrained) and kind == "sentencepiece"
    if found and not (refused and not cfg.data.allow_sentencepiece_with_pretrained):
        tokenizer = load_run_tokenizer(cfg, manifest_langs(train_table, val_table))
        check_inputs(cfg, train_table, val_table, tokenizer)
        build_run_prompt(cfg, tokenizer)  # a template that cannot be split fails here, as in train
    elif found:
        notes.append("languages and tags not checked: the tokenizer is refused (see the findings)")
    else:
        notes.append(
            f"languages and tags not checked: data.tokenizer {cfg.data.tokenizer} does not exist here"
        )
    return {**summarize(train_table, cfg), **tok_facts}, cfg, train_table, notes
