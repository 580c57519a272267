"""The one sampler builder: experiment config + training index -> one data-parallel rank's sampler.

`speechlm train` (through `speechlm.preflight.checks.summarize_plan`) and `speechlm plan` both build their
sampler here, so the plan printed is the plan trained on, streaming read mode included. The steps,
each a function of its own:

1. `sampler_settings`: `SamplerSettings` from ``sampler.*``, ``trainer.grad_accum`` and the token
   cost model of the encoder (`token_cost_of`);
2. `sampler_inputs`: the per-row arrays the plan reads (durations, languages, text lengths), the
   dataset mix of a ``data.input_cfg`` and, when the run streams, the rows' places in their tar
   shards (`streaming_layout`);
3. `make_sampler`: the `DurationBucketBatchSampler` of one dp rank over those inputs, with the text
   tokens in the budget when the budget counts tokens.

Token cost. With ``sampler.max_batch_tokens`` a row costs the tokens it puts into the LLM: audio
tokens = ceil(ceil(seconds * frames/s / subsampling) / projector_stack), plus its text tokens, plus
the prompt. Every encoder kind reads 10 ms feature frames (100/s); the subsampling is the encoder's:
Whisper's conv stride gives 50 frames/s (2x), FastConformer (``parakeet``, ``nemo``) 12.5/s (8x; a
pretrained Parakeet directory's ``subsampling_factor`` wins). Text tokens are estimated from the
characters (ceil(chars / CHARS_PER_TOKEN), at most ``data.max_tokens``, the most a kept utterance
has): the index stores every text's length, so planning never tokenizes 10M texts. A duration budget
does not read the texts (nor put them into the sampler's fingerprint).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from parallel.frames import ENCODER_SUBSAMPLING, FEATURE_FRAMES_PER_SECOND
from speechlm.data.manifest.load import manifest_arrays, task_codes
from speechlm.data.sampler.cost import TokenCostModel, text_tokens_of
from speechlm.data.sampler.mix import DatasetMix
from speechlm.data.sampler.settings import SamplerSettings
from speechlm.data.sampler.stateful import DurationBucketBatchSampler, StreamingLayout
from speechlm.data.sources.input_cfg import mix_of_table, read_modes_of_table

if TYPE_CHECKING:
    from speechlm.config import ExperimentConfig, ModelConfig
    from speechlm.data.manifest.schema import RowContents


# --- 1. settings --------------------------------------------------------------------------------
def encoder_subsampling(kind: str, pretrained: str | None = None, factor: int | None = None) -> int:
    """Feature frames per encoder frame of encoder `kind`: `factor` (model.encoder.subsampling_factor) when
    set, else a pretrained Parakeet's own factor, else the kind's."""
    if factor is not None:
        return int(factor)
    if kind not in ENCODER_SUBSAMPLING:
        raise ValueError(f"model.encoder.kind={kind!r}: use one of {', '.join(ENCODER_SUBSAMPLING)}")
    if kind == "parakeet" and pretrained and (Path(pretrained) / "config.json").is_file():
        saved = json.loads((Path(pretrained) / "config.json").read_text())
        factor = saved.get(
            "subsampling_factor", (saved.get("encoder_config") or {}).get("subsampling_factor")
        )
        if factor:
            return int(factor)
    return ENCODER_SUBSAMPLING[kind]


def token_cost_of(model: ModelConfig) -> TokenCostModel:
    """The tokens an utterance puts into the LLM under `model` (its encoder and projector)."""
    return TokenCostModel(
        audio_frames_per_second=float(FEATURE_FRAMES_PER_SECOND),
        encoder_subsampling=encoder_subsampling(
            model.encoder.kind, model.encoder.pretrained, model.encoder.subsampling_factor
        ),
        projector_stack=model.projector_stack,
    )


def sampler_settings(cfg: ExperimentConfig, *, dp_size: int) -> SamplerSettings:
    """The settings of ``sampler.*`` for `dp_size` ranks, with the encoder's token cost model and the
    ``data.max_duration`` limit."""
    settings = SamplerSettings.from_config(
        cfg.sampler, dp_size=dp_size, grad_accum=cfg.trainer.grad_accum, token_cost=token_cost_of(cfg.model)
    )
    return dataclasses.replace(settings, max_duration=cfg.data.max_duration)


# --- 2. inputs ----------------------------------------------------------------------------------
@dataclasses.dataclass
class SamplerInputs:
    """The per-row arrays a plan reads, and what a mix or the streaming read mode adds to them."""

    durations: np.ndarray  # float32 [N] seconds
    lang_codes: np.ndarray  # int16 or int32 [N], index into lang_names
    lang_names: list[str]  # sorted
    text_chars: np.ndarray | None  # int32 [N] characters of `text`, when the manifest has it
    mix: DatasetMix | None = None  # the dataset weights of a data.input_cfg
    streaming: StreamingLayout | None = None  # the rows' places in their shards, when the run streams
    task_codes: np.ndarray | None = None  # int16 [N] into task_names; None: every row is "asr"
    task_names: list[str] = dataclasses.field(default_factory=list)
    # clips, clips with a CTC target and answer characters per row (`manifest.schema.RowContents`): filled
    # by the plan (`plan_inputs.plan_inputs_of_table`) for a manifest with conversation columns, never by
    # training; None: not computed, or one transcribed clip a row
    contents: RowContents | None = None


def sampler_inputs(cfg: ExperimentConfig, table: pa.Table) -> SamplerInputs:
    """The inputs of `table` (any index: `open_index`, `load_input_cfg`) under `cfg.data`."""
    arr = manifest_arrays(table)
    tasks = task_codes(table)
    return SamplerInputs(
        durations=arr.durations,
        lang_codes=arr.lang_codes,
        lang_names=list(arr.lang_names),
        text_chars=arr.text_lengths,
        mix=mix_of_table(table),
        streaming=streaming_layout(cfg, table),
        task_codes=None if tasks is None else tasks[0],
        task_names=[] if tasks is None else tasks[1],
    )


def streams(cfg: ExperimentConfig, table: pa.Table) -> bool:
    """Whether the run's or any ``data.input_cfg`` dataset's read mode is streaming."""
    d = cfg.data
    if d.read_mode not in ("indexed", "streaming"):
        raise ValueError(f"data.read_mode={d.read_mode!r}: use 'indexed' (default) or 'streaming'")
    per_dataset = [m or d.read_mode for m in (read_modes_of_table(table) or [])]
    return "streaming" in (per_dataset or [d.read_mode])


def streaming_layout(cfg: ExperimentConfig, table: pa.Table) -> StreamingLayout | None:
    """The rows' places in their tar shards when `data.read_mode` is streaming (None when indexed).

    Rows of a tar shard share its code and are ordered by byte offset; rows that are plain files
    (no tar), and rows of `data.input_cfg` datasets whose own `read_mode` is indexed, get a shard of
    their own (-1), so they are spread like indexed-mode reads. The streaming plan is used when the
    run's or any dataset's read mode is streaming.
    """
    if not streams(cfg, table):
        return None
    d = cfg.data
    n = len(table)
    codes = np.full(n, -1, np.int64)
    positions = np.zeros(n, np.int64)
    if "tar_path" in table.column_names:
        col = table.column("tar_path").combine_chunks()
        if not pa.types.is_dictionary(col.type):
            col = pc.dictionary_encode(col)
        codes = col.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        positions = table.column("offset").fill_null(0).to_numpy().astype(np.int64)
    per_dataset = [m or d.read_mode for m in (read_modes_of_table(table) or [])]
    if "indexed" in per_dataset:  # those datasets' rows are spread like indexed reads
        indexed = np.flatnonzero(np.array([m == "indexed" for m in per_dataset]))
        codes[np.isin(mix_of_table(table).dataset_codes, indexed)] = -1
    return StreamingLayout(
        codes,
        positions,
        streams_per_rank=max(1, d.num_workers),
        shuffle_buffer=d.shuffle_buffer,
        sort_buffer=d.sort_buffer,
    )


# --- 3. the sampler -----------------------------------------------------------------------------
def make_sampler(
    settings: SamplerSettings,
    inputs: SamplerInputs,
    *,
    dp_rank: int,
    epoch: int = 0,
    max_text_tokens: int | None = None,
) -> DurationBucketBatchSampler:
    """The sampler of `dp_rank` over `inputs`; a token budget counts the text tokens too."""
    token_lengths = None
    if settings.max_batch_tokens is not None and inputs.text_chars is not None:
        token_lengths = text_tokens_of(inputs.text_chars, max_text_tokens)
    return DurationBucketBatchSampler(
        inputs.durations,
        inputs.lang_codes,
        inputs.lang_names,
        settings,
        token_lengths=token_lengths,
        dp_rank=dp_rank,
        epoch=epoch,
        streaming=inputs.streaming,
        mix=inputs.mix,
    )


def build_sampler(
    cfg: ExperimentConfig, table: pa.Table, *, dp_rank: int, dp_size: int
) -> DurationBucketBatchSampler:
    """The sampler of one data-parallel rank as training uses it (steps 1-3 of the module docstring)."""
    return make_sampler(
        sampler_settings(cfg, dp_size=dp_size),
        sampler_inputs(cfg, table),
        dp_rank=dp_rank,
        max_text_tokens=cfg.data.max_tokens,
    )


def longest_row_tokens(cfg: ExperimentConfig, table: pa.Table) -> int:
    """The most tokens (audio + text + prompt) one row of `table` costs under `cfg`'s token cost model:
    the figure the validator's token rule compares with ``sampler.max_batch_tokens``."""
    if not len(table):
        return 0
    arr = manifest_arrays(table)
    text = text_tokens_of(arr.text_lengths, cfg.data.max_tokens)
    return int(token_cost_of(cfg.model).count_tokens(arr.durations, text).max())
