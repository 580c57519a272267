"""`data.input_cfg`: several datasets of any kind, weighted against each other, as one training index.

An entry is a dataset or a group::

    - path: /data/cv_hi            # any kind `detect.load_source` knows; `type` names it explicitly
      type: nemo_tarred            # optional
      weight: 2.0                  # optional; > 0
      lang: hi                     # optional: the language of rows that carry none
      name: cv_hi                  # optional: how plans and logs call it (default: the path)
      read_mode: streaming         # optional: this dataset's read mode (default data.read_mode)
      tags: [read, clean]          # optional, free-form, shown by `speechlm plan` (a mapping, as NeMo
                                   # writes it, is kept as ["key=value", ...])
      task: ast                    # optional: the task of rows that carry none (default "asr")
      prompt: Translate to English.  # optional: the instruction of rows that carry none (default
                                   # data.instruction); rows with a conversation keep their own turns
    - group: indic_asr             # a group splits its weight over its inputs
      weight: 1.0
      inputs: [ ... entries ... ]

A YAML file of entries (`data.input_cfg: mix.yaml`, `speechlm plan --input-cfg mix.yaml`) holds the
list, as NeMo's input_cfg files do, or the list under `input_cfg:` or under `data: input_cfg:` (the
form of an experiment config, as docs/data.md shows it). NeMo's own entry keys (`type: group` with a
nested `input_cfg`, `manifest_filepath`, `shar_path`) are not read: a dataset is a `path` of any kind.

Shares: at each level the entries' weights are normalised among siblings, so a dataset's share of
an epoch is the product of its normalised weights down the tree. Siblings of which none gives a
weight share in proportion to their utterance counts (the natural mix); siblings must either all
give a weight or none. The language temperature then applies inside each dataset
(`speechlm.data.sampler.mix`). A weight that is not > 0, an unknown key, a group without inputs or
a path that does not exist is an error naming the entry (``data.input_cfg[1].inputs[0]``).

`load_input_cfg` opens every dataset through the memory-mapped index cache, concatenates them
(zero-copy: one chunk per dataset), adds the ``dataset`` column and records the names and shares in
the table's metadata, from which `mix_of_table` rebuilds the `DatasetMix` anywhere (trainer,
`speechlm plan`). The ``dataset`` column says that a mix is expected: a table that has it but lost
the metadata (many Arrow operations drop schema metadata) is refused by `mix_of_table` and
`read_modes_of_table`, never planned as one unweighted dataset.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml

from speechlm.data.manifest.load import dictionary_codes
from speechlm.data.manifest.schema import (
    CONVERSATION_SCHEMA,
    LOCATOR_SCHEMA,
    MANIFEST_SCHEMA,
    ManifestError,
    llm_text_chars,
)
from speechlm.data.sampler import DatasetMix
from speechlm.data.sources.detect import SOURCE_TYPES
from speechlm.data.sources.mmap_cache import open_index

MIX_KEY = b"speechlm.input_cfg"
LEAF_KEYS = {"path", "type", "weight", "lang", "name", "tags", "read_mode", "task", "prompt"}
GROUP_KEYS = {"group", "weight", "inputs", "tags"}


@dataclass(frozen=True)
class InputLeaf:
    where: str  # data.input_cfg[i]... for errors
    path: str
    type: str | None
    weight: float | None
    lang: str | None
    name: str
    tags: tuple[str, ...] = ()
    read_mode: str | None = None  # "indexed" | "streaming"; None: data.read_mode
    task: str | None = None  # the task of this dataset's rows that name none
    prompt: str | None = None  # the instruction of this dataset's rows that give none


@dataclass(frozen=True)
class InputGroup:
    where: str
    name: str
    weight: float | None
    inputs: tuple[InputLeaf | InputGroup, ...] = field(default_factory=tuple)
    tags: tuple[str, ...] = ()


def _weight(entry: dict[str, Any], where: str) -> float | None:
    if "weight" not in entry or entry["weight"] is None:
        return None
    w = entry["weight"]
    if isinstance(w, bool) or not isinstance(w, int | float) or not np.isfinite(w) or w <= 0:
        raise ManifestError(
            f"{where}.weight={w!r}: a weight must be a number > 0 (leave the entry out to skip it)"
        )
    return float(w)


def _tags(entry: dict[str, Any], where: str) -> tuple[str, ...]:
    tags = entry.get("tags") or []
    if isinstance(tags, dict):  # NeMo writes tags as a mapping (`tags: {lang: en}`): kept as "lang=en"
        return tuple(f"{k}={v}" for k, v in tags.items())
    if isinstance(tags, str) or not isinstance(tags, list):
        raise ManifestError(f"{where}.tags={tags!r}: give a list of strings or a mapping")
    return tuple(str(t) for t in tags)


def _entries_of_file(doc: Any, path: Path) -> Any:
    """The list a YAML file of `data.input_cfg` holds: the list itself (as NeMo's input_cfg files do), or
    under `input_cfg:` (NeMo's key), or under `data: input_cfg:` (an experiment config's form, as
    docs/data.md shows it); a mapping with other keys is refused, naming the forms."""
    if isinstance(doc, dict) and set(doc) == {"data"} and isinstance(doc["data"], dict):
        doc = doc["data"]
    if isinstance(doc, dict) and set(doc) == {"input_cfg"}:
        return doc["input_cfg"]
    if isinstance(doc, dict):
        raise ManifestError(
            f"{path}: holds {', '.join(map(repr, sorted(doc)))}; a data.input_cfg file holds a list of datasets "
            "or groups, `input_cfg: [...]`, or `data: {input_cfg: [...]}` and nothing else (give a whole "
            "experiment config with --config instead)"
        )
    return doc


def parse_input_cfg(entries: Any, where: str = "data.input_cfg", base: Path | None = None) -> InputGroup:
    """The entries (a list, or a YAML file holding one) as a tree; ManifestError naming a bad entry."""
    if isinstance(entries, str | os.PathLike):
        path = Path(entries)
        try:
            entries = _entries_of_file(yaml.safe_load(path.read_text()), path)
        except (OSError, yaml.YAMLError) as e:
            raise ManifestError(f"{where}: cannot read {path} ({e})") from None
        base = path.resolve().parent
        where = str(path)
    if not isinstance(entries, list) or not entries:
        raise ManifestError(f"{where} must be a non-empty list of datasets or groups, got {entries!r}")
    return InputGroup(
        where, "<all>", None, tuple(_entry(e, f"{where}[{i}]", base) for i, e in enumerate(entries))
    )


def _entry(entry: Any, where: str, base: Path | None) -> InputLeaf | InputGroup:
    if not isinstance(entry, dict):
        raise ManifestError(
            f"{where} must be a mapping with 'path' (a dataset) or 'group' (a group), got {entry!r}"
        )
    if "group" in entry:
        unknown = sorted(set(entry) - GROUP_KEYS)
        if unknown:
            raise ManifestError(
                f"{where}: unknown key {unknown[0]!r}; a group takes {', '.join(sorted(GROUP_KEYS))}"
            )
        inputs = entry.get("inputs")
        if not isinstance(inputs, list) or not inputs:
            raise ManifestError(f"{where} (group {entry['group']!r}) needs a non-empty list 'inputs'")
        return InputGroup(
            where,
            str(entry["group"]),
            _weight(entry, where),
            tuple(_entry(e, f"{where}.inputs[{i}]", base) for i, e in enumerate(inputs)),
            _tags(entry, where),
        )
    unknown = sorted(set(entry) - LEAF_KEYS)
    if unknown:
        raise ManifestError(
            f"{where}: unknown key {unknown[0]!r}; a dataset takes {', '.join(sorted(LEAF_KEYS))}"
        )
    if "path" not in entry:
        raise ManifestError(f"{where} has neither 'path' (a dataset) nor 'group' (a group of datasets)")
    path = Path(str(entry["path"]))
    if not path.is_absolute() and base is not None:
        path = base / path
    if not path.exists():
        raise ManifestError(f"{where}: path {path} does not exist")
    mode = entry.get("read_mode")
    if mode is not None and mode not in ("indexed", "streaming"):
        raise ManifestError(f"{where}.read_mode={mode!r}: use 'indexed' or 'streaming' (or leave it out)")
    for key in ("task", "prompt"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise ManifestError(f"{where}.{key}={entry[key]!r}: give a string (or leave it out)")
    if entry.get("task") is not None and not str(entry["task"]).strip():
        raise ManifestError(f"{where}.task is empty: name the task (asr, ast, qa, ...) or leave it out")
    kind = entry.get("type")
    if kind is not None and kind not in SOURCE_TYPES:
        raise ManifestError(f"{where}.type={kind!r}: use one of {', '.join(SOURCE_TYPES)} (or leave it out)")
    return InputLeaf(
        where,
        str(path),
        kind,
        _weight(entry, where),
        str(entry["lang"]) if entry.get("lang") else None,
        str(entry.get("name") or path),
        _tags(entry, where),
        mode,
        entry.get("task"),
        entry.get("prompt"),
    )


def leaves(tree: InputGroup | InputLeaf) -> list[InputLeaf]:
    if isinstance(tree, InputLeaf):
        return [tree]
    return [leaf for child in tree.inputs for leaf in leaves(child)]


def compute_shares(tree: InputGroup, rows: dict[str, int]) -> dict[str, float]:
    """Each leaf's share of an epoch (by name), from the weights down the tree (see the docstring)."""
    out: dict[str, float] = {}

    def size(node: InputGroup | InputLeaf) -> int:
        return rows[node.name] if isinstance(node, InputLeaf) else sum(size(c) for c in node.inputs)

    def walk(node: InputGroup | InputLeaf, share: float) -> None:
        if isinstance(node, InputLeaf):
            out[node.name] = share
            return
        given = [c.weight is not None for c in node.inputs]
        if any(given) and not all(given):
            missing = next(c for c in node.inputs if c.weight is None)
            raise ManifestError(
                f"{missing.where} has no weight while its siblings in {node.where} have one: give every entry of "
                "a level a weight, or none (then they share by utterance count)"
            )
        raw = np.array([c.weight if c.weight is not None else size(c) for c in node.inputs], dtype=np.float64)
        if raw.sum() <= 0:
            raise ManifestError(f"{node.where}: the entries have no utterances to share")
        for child, w in zip(node.inputs, raw / raw.sum()):
            walk(child, share * float(w))

    walk(tree, 1.0)
    return out


def _defaulted(table: pa.Table, name: str, default: str | None) -> pa.ChunkedArray:
    """Column `name` of `table` as strings (all null where absent), its nulls filled with `default`."""
    if name in table.column_names:
        col = table.column(name).cast(pa.string())
    else:
        col = pa.chunked_array([pa.nulls(len(table), pa.string())])
    return col if default is None or not col.null_count else col.fill_null(default)


def _with_columns(
    table: pa.Table, dataset_code: int, names: list[str], leaf: InputLeaf | None = None
) -> pa.Table:
    """`table` in the common schema: every locator and conversation column present (null where absent;
    the entry's `task`/`prompt` filling the rows that carry none), the dataset."""
    n = len(table)
    columns = [table.column(f.name) for f in MANIFEST_SCHEMA]
    fields = list(MANIFEST_SCHEMA)
    for f in LOCATOR_SCHEMA:
        if f.name == "dataset":
            codes = pa.array(np.full(n, dataset_code, np.int16), pa.int16())
            columns.append(
                pa.chunked_array([pa.DictionaryArray.from_arrays(codes, pa.array(names, pa.string()))])
            )
        elif f.name in table.column_names:
            columns.append(table.column(f.name).cast(f.type))
        else:
            columns.append(pa.chunked_array([pa.nulls(n, f.type)]))
        fields.append(f)
    task, prompt = (leaf.task, leaf.prompt) if leaf is not None else (None, None)
    plain = _defaulted(table, "conversation", None).is_null()
    instruction = _defaulted(table, "instruction", None)
    for f in CONVERSATION_SCHEMA:
        if f.name == "instruction" and prompt:  # only rows of the transcription shape take the prompt
            columns.append(pc.if_else(pc.and_(plain, instruction.is_null()), prompt, instruction))
        else:
            columns.append(_defaulted(table, f.name, task if f.name == "task" else None))
        fields.append(f)
    if "text_chars" in table.column_names:
        chars = table.column("text_chars")
    else:
        chars = llm_text_chars(table)
    if prompt:
        extra = pc.if_else(pc.and_(plain, instruction.is_null()), len(prompt), 0)
        chars = pc.add(chars, extra.cast(pa.int32())).cast(pa.int32())
    columns.append(chars)
    fields.append(pa.field("text_chars", pa.int32(), nullable=False))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def load_input_cfg(entries: Any, *, cache_dir: str | os.PathLike[str] | None = None) -> pa.Table:
    """One training table over every dataset of `entries`, with the mix in its metadata."""
    tree = parse_input_cfg(entries)
    items = leaves(tree)
    names = [leaf.name for leaf in items]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ManifestError(f"data.input_cfg names two datasets {duplicate!r}: give them distinct 'name's")
    tables = []
    for code, leaf in enumerate(items):
        table = open_index(leaf.path, leaf.type, cache_dir=cache_dir, default_lang=leaf.lang)
        if len(table) == 0:
            raise ManifestError(f"{leaf.where}: {leaf.path} has no utterances")
        tables.append(_with_columns(table, code, names, leaf))
    shares = compute_shares(tree, {leaf.name: len(t) for leaf, t in zip(items, tables)})
    meta = {
        "names": names,
        "shares": [shares[n] for n in names],
        "paths": [leaf.path for leaf in items],
        "tags": [list(leaf.tags) for leaf in items],
        "read_modes": [leaf.read_mode for leaf in items],
    }
    combined = pa.concat_tables(tables)
    return combined.replace_schema_metadata({**(combined.schema.metadata or {}), MIX_KEY: json.dumps(meta)})


def _mix_meta(table: pa.Table) -> dict[str, Any] | None:
    """The mix `load_input_cfg` recorded, None for a table of one dataset; ManifestError when the rows
    say they belong to a mix (a non-null ``dataset`` column) but the mix is gone."""
    meta = (table.schema.metadata or {}).get(MIX_KEY)
    if meta is not None:
        info: dict[str, Any] = json.loads(meta)
        return info
    if "dataset" in table.column_names and table.column("dataset").null_count < len(table):
        raise ManifestError(
            "the training table has a 'dataset' column (its rows belong to a data.input_cfg mix) but not "
            f"the mix itself (names and weights, schema metadata {MIX_KEY.decode()!r}): an operation on "
            "the table (select, cast, concat, a parquet round trip through the index cache) dropped it, "
            "which would silently turn the weighted mix into plain temperature sampling. Pass the table "
            "that load_input_cfg returned unchanged (or train from data.input_cfg), or drop the "
            "'dataset' column to train on the rows without weights"
        )
    return None


def read_modes_of_table(table: pa.Table) -> list[str | None] | None:
    """Each dataset's own `read_mode` (None: the run's), in dataset-code order; None without a mix."""
    info = _mix_meta(table)
    return None if info is None else list(info.get("read_modes") or [])


def mix_of_table(table: pa.Table) -> Any:
    """The `DatasetMix` recorded by `load_input_cfg` (None for a table of one dataset)."""
    info = _mix_meta(table)
    if info is None:
        return None
    codes, present = dictionary_codes(table.column("dataset"))
    order = {name: i for i, name in enumerate(info["names"])}
    remap = np.array([order[name] for name in present], dtype=np.int16)
    return DatasetMix(remap[codes], tuple(info["names"]), tuple(info["shares"]))
