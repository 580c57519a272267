"""Typed experiment config: dataclasses composed into one `ExperimentConfig`.

YAML is for storage; dotted overrides (`model.packed_sequences=true`) change single fields on the
command line (`split_override` reads them, for every command). Unknown keys are errors that name the
key and list the valid ones, so a typo never silently falls back to a default. A choice field is a
`Literal` type, refused while parsing when the value is not one of its members; each section's
`validate()` checks its keys' ranges (`FIELDS`) and the rules among them, and `ExperimentConfig.validate()`
the rules across sections. Rules of the parallel layout live in the validator (parallel/validator/).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from parallel.backend_caps import BACKENDS
from speechlm.errors import EXIT_DATA, UsageError
from speechlm.metrics import METRICS, NORMALIZE_OPS, check_metric_name

# --- choice fields: one Literal type each, the single source of the allowed values --------------------
# `FIELDS` reads them (`OneOf(choices=choices_of(T))`), parsing refuses anything else (`_coerce`), and
# mypy checks the code that compares against them.
ReadMode = Literal["indexed", "streaming"]
LossTurns = Literal["all", "last"]
LangTags = Literal["special", "none"]  # language tags: one added special token each, or none
# the rule every answer/transcript goes through in training and scoring (speechlm.data.text.normalize_target)
TextNormalize = Literal["none", "lower", "clean", "clean_lower"]
SampleRate = Literal[16000]  # the encoders' front end reads 16 kHz (model/features.py)
SamplerMode = Literal["temperature", "exhaustive"]
EncoderKind = Literal["parakeet", "whisper", "nemo"]
ConvNorm = Literal["auto", "layer_norm", "batch_norm"]
LLMFamily = Literal["llama", "qwen2"]  # speechlm/model/llm.py builds these from a config
LLMTrain = Literal["full", "frozen", "lora"]  # what trains in the LLM (speechlm/model/trainable.py)
EncoderTrain = Literal["full", "frozen"]
CTCReduction = Literal["clip", "token"]  # the auxiliary CTC's normaliser (speechlm/train/step.py)
# LoRA's default targets: every attention and MLP projection of Llama, Qwen2 and Qwen3
LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the capability table (parallel/backend_caps.py) owns the backends; this type must name the same ones
AttentionBackend = Literal["reference", "torch_varlen", "flex", "flash", "te", "sdpa"]
CPAttention = Literal["ring", "allgather"]
Precision = Literal["auto", "32", "bf16"]
ResumeData = Literal["exact", "next_epoch"]
FinalEvalSplit = Literal["auto", "val", "train", "both", "none"]
SplitAuto = Literal["auto"]  # parallel.cp_split_threshold's word (else a token count)


TRAIN_PREFIX = "train_"  # validation keys of the training split (trainer.val_train_batches): train_wer, ...


def choices_of(tp: Any) -> tuple[Any, ...]:
    """The values a Literal type admits, in declaration order."""
    return typing.get_args(tp)


ATTENTION_BACKENDS: tuple[str, ...] = choices_of(AttentionBackend)
if set(ATTENTION_BACKENDS) != set(BACKENDS):  # pragma: no cover - a developer error, caught on import
    raise ImportError(
        f"speechlm.config.AttentionBackend {ATTENTION_BACKENDS} and parallel/backend_caps.py "
        f"{tuple(BACKENDS)} name different backends; add the new backend to both"
    )


class ConfigError(UsageError):
    """A config file or override that cannot be applied; the message names the file and key."""


class MissingInputError(ConfigError):
    """A config key names an input file that does not exist: a data problem (exit 1), named by its key."""

    exit_code = EXIT_DATA


class Section:
    """A config section: `validate()` checks each key against its `FIELDS` entry in declaration order (a
    sub-section through its own `validate()`), then the section's own rules across its keys (`problems`)."""

    KEY: ClassVar[str] = ""  # dotted prefix of the section's keys ("model.encoder")

    def validate(self, origin: Mapping[str, str] | None = None) -> None:
        """Raise `ConfigError` on the first bad value; `origin` maps dotted keys to where they were set
        (None: not known, e.g. a config built in code; a key missing from it: the default)."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value.validate(origin)
            else:
                _check_key(f"{self.KEY}.{f.name}", value, origin)
        for problem in self.problems():
            raise ConfigError(problem)

    def problems(self) -> list[str]:
        """Rules that tie keys of this section together (each message names every key involved)."""
        return []


@dataclass
class DataConfig(Section):
    KEY: ClassVar[str] = "data"
    # input paths: relative ones in a config file resolve against the file's folder, on the command line
    # against the working directory; stored absolute (docs/config.md)
    train_manifest: str | None = None  # required unless data.input_cfg is set
    val_manifest: str | None = None  # None: no validation
    # a SentencePiece .model (from-scratch LLM) or a Hugging Face tokenizer directory; None with
    # model.llm.pretrained: that LLM's own tokenizer (docs/pretrained-tokenizer.md)
    tokenizer: str | None = None
    lang_tags: LangTags = "special"
    system_prompt: str | None = None  # a system turn of the chat template (needs one)
    chat_template: str = "auto"  # auto | none | a Jinja file replacing the tokenizer's template
    # train a pretrained LLM on a SentencePiece model's ids anyway (they mean other tokens to it)
    allow_sentencepiece_with_pretrained: bool = False
    sample_rate: SampleRate = 16000  # the encoders' front end reads 16 kHz (model/features.py)
    max_tokens: int = 512  # text tokens per utterance after tokenization (longer ones dropped, counted)
    # seconds: training rows longer than this are left out of every epoch plan (counted, shown by `speechlm
    # plan`); None: no limit, a row over the micro-batch budget forms a micro-batch of its own (long-form audio)
    max_duration: float | None = None
    num_workers: int = 0
    instruction: str = ""  # optional instruction placed after the audio in the prompt
    # the assistant turns a conversation is trained on: "all" of them, or only the "last" (the others
    # are context); a one-turn transcript has one either way (speechlm.packing.prompt.ConversationRenderer)
    loss_turns: LossTurns = "all"
    # the rule answers and transcripts go through before they are encoded (training) and scored (refs
    # and hyps): speechlm.data.text.normalize_target; the pre-flight refuses characters the tokenizer lacks
    text_normalize: TextNormalize = "none"
    # unreadable/missing audio is dropped and counted; more than this fraction of one training micro-batch
    # dropped stops the run with the file names (1.0: never stop)
    max_dropped_fraction: float = 0.5
    # seconds a decoded clip may differ from its manifest duration (or 10% of it, if more)
    # before it is dropped as duration_mismatch (speechlm.data.manifest.schema.duration_mismatch)
    duration_tolerance: float = 0.5
    # "indexed": the sampler's epoch plan, each clip read by position (tar member or file); "streaming":
    # tar shards read front to back per DataLoader worker, for filesystems where random reads are slow
    # (speechlm.data.sampler.streaming); buffers in utterances
    read_mode: ReadMode = "indexed"
    # several datasets weighted against each other (speechlm/data/sources/input_cfg.py): a list of
    # {path, type?, weight?, lang?, name?, tags?} or {group, weight?, inputs: [...]}, or a YAML file of
    # one; replaces train_manifest
    input_cfg: list[Any] | str | None = None
    shuffle_buffer: int = 2000
    sort_buffer: int = 500

    def problems(self) -> list[str]:
        if self.input_cfg is not None and self.train_manifest is not None:
            return [
                f"data.input_cfg and data.train_manifest={self.train_manifest!r} are both set: give the training "
                "data one way (add data.train_manifest=null, or make the manifest one entry of data.input_cfg)"
            ]
        return []


@dataclass
class SamplerConfig(Section):
    KEY: ClassVar[str] = "sampler"

    mode: SamplerMode = "temperature"  # "temperature" (default) or "exhaustive" (the inherited algorithm)
    temperature: float = 0.3
    max_batch_duration: float | None = 90.0  # seconds of audio per micro-batch
    max_batch_tokens: int | None = None  # token budget instead of seconds (overrides duration)
    length_penalty: float = 0.0  # quadratic length penalty for the token budget
    # duration bucket edges in seconds; null (default): num_buckets equal-duration quantiles of the data
    bucket_boundaries: list[float] | None = None
    epoch_size: int | None = None  # utterances per epoch in temperature mode (default: manifest size)
    seed: int = 0
    num_buckets: int = 30  # buckets estimated from the training data when bucket_boundaries is null


@dataclass
class EncoderConfig(Section):
    KEY: ClassVar[str] = "model.encoder"

    kind: EncoderKind = "parakeet"  # "parakeet", "whisper" or "nemo"
    pretrained: str | None = None  # local directory (transformers) or .nemo file
    hidden_size: int = 176
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 704
    subsampling_conv_channels: int = 64
    # feature frames (10 ms) per encoder frame of a Parakeet encoder built from sizes: 8 (80 ms, FastConformer's),
    # 4 (40 ms: room for CTC on subword pieces spoken fast) or another power of two; None: 8 (a pretrained
    # encoder keeps its own)
    subsampling_factor: int | None = None
    num_mel_bins: int = 80
    # normalisation in the Conformer conv module: "auto" (layer_norm from scratch, batch_norm for a
    # pretrained encoder), "layer_norm" (over channels, per frame) or "batch_norm" (frozen running stats)
    conv_norm: ConvNorm = "auto"
    # padding-free encoder (features, subsampling, conformer layers on real frames only); None: on
    # where the encoder kind supports it (parakeet), off elsewhere. true with whisper/nemo: validator error
    packed: bool | None = None
    # "full": trained (from optim.unfreeze_step); "frozen": never trained, run without gradients
    train: EncoderTrain = "full"
    # limited-context self-attention, [left, right] encoder frames each frame sees on either side (NeMo's
    # att_context_size, e.g. [128, 128] for long-form audio); None or [-1, -1]: full context. Parakeet, packed
    att_context_size: list[int] | None = None

    def limited_context(self) -> tuple[int, int] | None:
        """(left, right) frames of limited-context attention; None for full context (null or [-1, -1])."""
        if self.att_context_size is None or list(self.att_context_size) == [-1, -1]:
            return None
        left, right = self.att_context_size
        return int(left), int(right)

    def shard_min_slice(self, projector_stack: int) -> int | None:
        """The fewest encoder frames per rank with which training shards a long clip over the CP group
        (`parallel.clip_placement.place_clips`' ``min_slice``: the widest halo, here the window's sides or
        the half-width of a built encoder's kernel-9 convolution, plus the projector's stack), or None: this
        encoder encodes every clip whole (full context, not a padding-free Parakeet). The model computes the
        same from the built encoder (`AudioEncoder.slice_halo`), whose kernel a pretrained encoder sets."""
        window = self.limited_context()
        if window is None or self.kind != "parakeet" or self.packed is False:
            return None
        return max(*window, 4) + projector_stack

    def problems(self) -> list[str]:
        out = []
        if self.pretrained is None and self.hidden_size % 2:
            out.append(
                f"model.encoder.hidden_size={self.hidden_size} must be even (sinusoidal/relative position "
                "embeddings split it in halves)"
            )
        if self.kind == "nemo" and self.pretrained is None:
            out.append(
                "model.encoder.kind='nemo' needs model.encoder.pretrained=<path of a .nemo file> (a NeMo encoder "
                "is only loaded, never built from sizes); or use kind parakeet or whisper"
            )
        if self.pretrained is not None and self.conv_norm == "layer_norm":
            out.append(
                f"model.encoder.conv_norm='layer_norm' with model.encoder.pretrained={self.pretrained!r}: the "
                "pretrained BatchNorm weights would be discarded; use conv_norm=auto or batch_norm"
            )
        factor = self.subsampling_factor
        if factor is not None and (self.kind != "parakeet" or self.pretrained is not None):
            out.append(
                f"model.encoder.subsampling_factor={factor} applies to a Parakeet encoder built from sizes only "
                f"(kind={self.kind!r}, pretrained={self.pretrained!r} has its own): remove it"
            )
        elif factor is not None and (factor < 2 or factor & (factor - 1)):
            out.append(
                f"model.encoder.subsampling_factor={factor} must be a power of two >= 2 (stride-2 convolutions), "
                "e.g. 4 or 8"
            )
        ctx = self.att_context_size
        if ctx is not None and list(ctx) != [-1, -1] and min(ctx) < 0:
            out.append(
                f"model.encoder.att_context_size={list(ctx)}: give two frame counts >= 0 ([left, right]), or "
                "[-1, -1] / null for full context (one unlimited side is not supported)"
            )
        elif ctx is not None and list(ctx) != [-1, -1] and (self.kind != "parakeet" or self.packed is False):
            out.append(
                f"model.encoder.att_context_size={list(ctx)} (limited context) needs the padding-free Parakeet "
                f"encoder, not kind={self.kind!r} with packed={self.packed}: use kind=parakeet with packed unset "
                "or true, or att_context_size=null"
            )
        if self.pretrained is None and self.hidden_size % self.num_heads:
            out.append(
                f"model.encoder.hidden_size={self.hidden_size} is not a multiple of model.encoder.num_heads="
                f"{self.num_heads}: choose sizes with hidden_size = num_heads * head_dim"
            )
        return out


@dataclass
class LoRAConfig(Section):
    """LoRA adapters of the LLM (model.llm.train=lora), injected with peft (speechlm/model/trainable.py)."""

    KEY: ClassVar[str] = "model.llm.lora"

    rank: int = 16
    alpha: int = 32  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.05  # dropout on the adapters' input (a source of randomness: 0 for exact tests)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS_DEFAULT))


@dataclass
class LLMConfig(Section):
    KEY: ClassVar[str] = "model.llm"

    family: LLMFamily = "llama"  # "llama" or "qwen2" when built from a config
    pretrained: str | None = None  # local directory for AutoModelForCausalLM
    train: LLMTrain = "full"  # "full", "frozen" (no parameter trains) or "lora" (adapters only)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # frozen/lora: the rows of the tokens the run added (language tags) still train (their embedding and
    # LM-head rows; speechlm/model/trainable.py AddedTokenRows)
    train_added_rows: bool = True
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 4096

    def problems(self) -> list[str]:
        if self.pretrained is not None:  # a pretrained LLM brings its own sizes
            return []
        out = []
        if self.num_heads % self.num_kv_heads:
            out.append(
                f"model.llm.num_heads={self.num_heads} is not a multiple of model.llm.num_kv_heads="
                f"{self.num_kv_heads}: every key/value head serves the same number of query heads; choose "
                "num_kv_heads among the divisors of num_heads"
            )
        if self.hidden_size % self.num_heads:
            out.append(
                f"model.llm.hidden_size={self.hidden_size} is not a multiple of model.llm.num_heads="
                f"{self.num_heads}: choose sizes with hidden_size = num_heads * head_dim"
            )
        elif (self.hidden_size // self.num_heads) % 2:
            out.append(
                f"model.llm.hidden_size={self.hidden_size} / model.llm.num_heads={self.num_heads} gives an odd "
                f"head size ({self.hidden_size // self.num_heads}); rotary position embeddings need an even one"
            )
        return out


@dataclass
class ModelConfig(Section):
    KEY: ClassVar[str] = "model"

    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    projector_stack: int = 2  # frames stacked by the projector
    projector_hidden: int = 512
    packed_sequences: bool = True  # THD packing (true) or padded BSHD (false)
    # multiple of the packed total (THD) or of the padded length (BSHD); None: the smallest legal one,
    # lcm(2*cp, cp*tp) (tp when cp=1). Set e.g. 64 for tensor cores; it must be a multiple of that unit.
    pad_to_multiple: int | None = None
    attention_backend: AttentionBackend = "reference"
    dropout: float = 0.0  # 0 turns off every source of randomness in the forward pass
    ctc_weight: float = 0.3  # auxiliary CTC loss on the encoder output; 0 disables it
    # the CTC sum's normaliser: "clip" (per clip; a clip's loss grows with its length) or "token" (per
    # target token: a 10-minute clip weighs by its transcript, not 100 times a 5 s clip's)
    ctc_reduction: CTCReduction = "clip"
    # transcripts decoded by joint CTC/attention greedy search: this weight on the CTC head's prefix
    # scores, 1 - it on the LLM's (0: the LLM alone; needs ctc_weight > 0)
    decode_ctc_weight: float = 0.0
    # joint decoding scores the LLM's this many best tokens (and the stop token) with CTC prefix scores
    # at each step, as ESPnet's pre-beam does; 0: every token (T x V per step: slow at 49k ids)
    decode_ctc_candidates: int = 32

    def problems(self) -> list[str]:
        if self.decode_ctc_weight > 0 and self.ctc_weight == 0:
            return [
                f"model.decode_ctc_weight={self.decode_ctc_weight} needs the CTC head, but model.ctc_weight=0 "
                "leaves it out: set model.ctc_weight > 0 (the head is trained with it), or model.decode_ctc_weight=0 "
                "beside model.ctc_weight=0 (the LLM alone decodes)"
            ]
        return []


@dataclass
class ParallelConfig(Section):
    KEY: ClassVar[str] = "parallel"

    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world size
    cp_size: int = 1
    tp_size: int = 1
    cp_attention: CPAttention = "ring"  # "ring" or "allgather" (reference backend under CP)
    # dynamic CP: sequences longer than this many tokens are split over the CP group, shorter ones live
    # whole on one CP rank; "auto": per micro-batch, split the fewest longest ones that keep the CP
    # ranks' modelled cost within 5% of the mean; 0 splits all (the layout before dynamic CP)
    cp_split_threshold: int | SplitAuto = "auto"
    activation_checkpointing: bool = False


@dataclass
class OptimConfig(Section):
    KEY: ClassVar[str] = "optim"

    lr: float = 1e-3
    encoder_lr: float | None = None  # default: lr
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    unfreeze_step: int = 0  # encoder frozen before this optimizer step (0: never frozen)
    encoder_warmup_steps: int = 0


@dataclass
class TrainerConfig(Section):
    KEY: ClassVar[str] = "trainer"

    max_steps: int = 1000
    max_minutes: float | None = None  # wall-clock limit (checked between optimizer steps)
    grad_accum: int = 1
    precision: Precision = "auto"  # "auto" (bf16 where supported), "32", "bf16"
    seed: int = 0
    run_dir: str = "runs/demo"
    log_every: int = 1
    val_every: int = 0  # optimizer steps; 0 disables periodic validation
    val_max_batches: int | None = None
    # decoding batches of a fixed subset of the TRAINING split greedy-decoded at each validation too, logged
    # as train_wer, train_wer_<lang>, train_<task>/<metric> beside the val metrics; 0: off
    val_train_batches: int = 0
    # seconds of audio per greedy-decoding batch (validation, final WER); None: 4x sampler.max_batch_duration.
    # Decoding keeps no activations for backward, so its batches can be larger than training's, and the
    # KV-cache decoder gains most from wide batches (docs/benchmarks.md, greedy decoding)
    eval_batch_duration: float | None = None
    ckpt_every: int = 0  # optimizer steps; 0 disables periodic checkpoints
    keep_last: int = 2
    # a validation metric (speechlm/metrics.py): loss, wer[_<lang>] or <task>/<metric>[_<lang>]; lower is
    # better for loss/wer/cer, higher for bleu/chrf/accuracy
    best_metric: str = "wer"
    early_stopping_patience: int = 0  # validations without improvement; 0 disables
    resume: str | None = None  # "auto" or a checkpoint directory
    # "exact": continue the saved epoch plan at the next unconsumed micro-batch (same dp size, seed and
    # manifest required); "next_epoch": restore model, optimizer and step but start the data at the next
    # epoch — for resuming into a different data-parallel layout, where the old plan has no meaning
    resume_data: ResumeData = "exact"
    validate_only: bool = (
        False  # evaluate only (restoring trainer.resume if set): no optimizer step, no backward
    )
    # the split scored into eval.json: "auto" (val when data.val_manifest is set, else none), "val",
    # "train" (the demo: WER on the training utterances), "both" (val, then a subset of train) or "none"
    final_eval_split: FinalEvalSplit = "auto"
    # training utterances the "both" evaluation scores (None: as many as the val split has), spread over the
    # (task, language) groups in the val split's proportions (speechlm/train/evaluate.py, train_eval_rows)
    final_eval_train_utterances: int | None = None
    # metrics and text normalisation per task (speechlm/metrics.py, docs/metrics.md): {task: [names]}, each
    # entry replacing that task's default; languages scored by character error rate where a task asks for wer
    eval_metrics: dict[str, list[str]] = field(default_factory=dict)
    eval_normalize: dict[str, list[str]] = field(default_factory=dict)
    eval_cer_langs: list[str] = field(default_factory=list)
    # peak dense TFLOP/s of one device, the figure MFU is measured against (None: from the table of
    # speechlm/model/flops.py by the device: h100, h200, a100, cpu; another GPU then logs no MFU)
    peak_tflops: float | None = None
    # a new run in a run_dir that holds another run moves that run to RUN_DIR.old-<UTC time> (never deleted)
    overwrite: bool = False

    def problems(self) -> list[str]:
        out = []
        if self.early_stopping_patience > 0 and self.val_every == 0:
            out.append(
                f"trainer.early_stopping_patience={self.early_stopping_patience} but trainer.val_every=0 (no "
                "validation, so it could never stop early): set trainer.val_every=N, or "
                "trainer.early_stopping_patience=0"
            )
        # val_train_batches rides on the periodic validation: trainer.val_every=0 turns both off (a config that
        # sets it, like configs/demo.yaml, stays usable with validation off)
        return out


@dataclass
class ExperimentConfig(Section):
    """The whole experiment; `validate()` checks every section, then the rules across sections."""

    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def problems(self) -> list[str]:
        d, t = self.data, self.trainer
        out = []
        if d.val_manifest is None:
            if t.final_eval_split in ("val", "both"):
                out.append(
                    f"trainer.final_eval_split={t.final_eval_split!r} but data.val_manifest is not set: set "
                    "data.val_manifest=PATH, or use trainer.final_eval_split=train or none"
                )
            if t.val_every > 0:
                out.append(
                    f"trainer.val_every={t.val_every} but data.val_manifest is not set, so nothing would be "
                    "validated: set data.val_manifest=PATH, or trainer.val_every=0"
                )
        return out


# --- valid values: one table, keyed by dotted key ---------------------------------------------------
# `check_config` (run by `load_config`, so by `speechlm validate`, `speechlm train` and every tool that
# loads a config) checks every key against its entry; docs/config.md is generated from it
# (scripts/gen_config_docs.py). A new field without an entry fails tests/bad_input/test_config_ranges.py.

ENCODER_KINDS: tuple[str, ...] = choices_of(EncoderKind)
LLM_FAMILIES: tuple[str, ...] = choices_of(LLMFamily)
SEED_MAX = 2**32 - 1  # numpy's seed range


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Rule(abc.ABC):
    """The valid values of one key (abstract: Num, OneOf, Flag, ... implement both methods)."""

    doc: str  # one line of meaning (docs/config.md)

    @abc.abstractmethod
    def check(self, value: Any) -> str | None:
        """None, or why `value` is refused."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The valid values in words (docs/config.md and error messages)."""


@dataclass(frozen=True)
class Num(Rule):
    """A finite number within bounds (NaN and infinities are refused); `null` admits None."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False
    null: str = ""  # non-empty: None is valid and means this
    integer: bool = False

    def check(self, value: Any) -> str | None:
        if value is None:
            return None if self.null else "a value is required (null is not allowed)"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a {'whole number' if self.integer else 'number'}"
        if not math.isfinite(value):
            return "must be a finite number"
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return "out of range" if low or high else None

    def describe(self) -> str:
        kind = "integer" if self.integer else "number"
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        text = f"{kind} {' and '.join(b for b in (lo, hi) if b)}" if lo or hi else f"finite {kind}"
        return text + (f", or null ({self.null})" if self.null else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class OneOf(Rule):
    """One of a fixed set; `advice` maps common wrong spellings to the right one."""

    choices: tuple[Any, ...] = ()
    advice: tuple[tuple[str, str], ...] = ()

    def check(self, value: Any) -> str | None:
        if value in self.choices:
            return None
        tip = dict(self.advice).get(str(value).lower())
        return f"not a valid choice ({tip})" if tip else "not a valid choice"

    def describe(self) -> str:
        return "one of " + ", ".join(_show(c) for c in self.choices)


@dataclass(frozen=True)
class Text(Rule):
    """Free text or a path; `path`: an input path (resolved, see `resolve_config_paths`)."""

    null: str = ""  # non-empty: None is valid and means this
    path: bool = False
    keywords: tuple[str, ...] = ()  # values that are not paths (e.g. resume=auto)

    def check(self, value: Any) -> str | None:
        if value is None:
            return None if self.null else "a value is required (null is not allowed)"
        if not isinstance(value, str):
            return "must be a string"
        if self.path and not value.strip():
            return "an empty path; give a path or null"
        return None

    def describe(self) -> str:
        what = "a path" if self.path else "any text"
        if self.keywords:
            what = " or ".join(repr(k) for k in self.keywords) + f" or {what}"
        return what + (f", or null ({self.null})" if self.null else "")


@dataclass(frozen=True)
class Flag(Rule):
    """true or false (or null, when `null` says what that means)."""

    null: str = ""

    def check(self, value: Any) -> str | None:
        if value is None and self.null:
            return None
        return None if isinstance(value, bool) else "must be true or false"

    def describe(self) -> str:
        return "true or false" + (f", or null ({self.null})" if self.null else "")


@dataclass(frozen=True)
class Seq(Rule):
    """A list of numbers, each valid under `item`; optionally of a fixed length, strictly increasing."""

    item: Num = field(default_factory=lambda: Num(""))
    length: int | None = None
    increasing: bool = False
    nonempty: bool = False
    null: str = ""  # non-empty: None is valid and means this

    def check(self, value: Any) -> str | None:
        if value is None and self.null:
            return None
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        if self.length is not None and len(value) != self.length:
            return f"must have {self.length} items, got {len(value)}"
        if self.nonempty and not value:
            return "must not be empty"
        for i, v in enumerate(value):
            if self.item.check(v) is not None:
                return f"item {i} ({_show(v)}) is {self.item.check(v)}"
        if self.increasing and any(b <= a for a, b in zip(value, value[1:], strict=False)):
            return "must be strictly increasing"
        return None

    def describe(self) -> str:
        n = f"{self.length} " if self.length is not None else ""
        inc = ", strictly increasing" if self.increasing else ""
        null = f", or null ({self.null})" if self.null else ""
        return f"a list of {n}numbers, each a {self.item.describe()}{inc}{null}"


@dataclass(frozen=True)
class Names(Rule):
    """A list of non-empty names (strings); non-empty unless `nonempty` is False."""

    nonempty: bool = True

    def check(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)) or (self.nonempty and not value):
            return f"must be a {'non-empty ' if self.nonempty else ''}list of names"
        bad = [v for v in value if not isinstance(v, str) or not v.strip()]
        return f"item {_show(bad[0])} is not a name" if bad else None

    def describe(self) -> str:
        if not self.nonempty:
            return "a list of names such as [zh, ja], or []"
        return "a non-empty list of names such as [q_proj, v_proj]"


@dataclass(frozen=True)
class TaskLists(Rule):
    """A mapping {task: [names]}, each name one of `choices` (each list non-empty if `nonempty`)."""

    choices: tuple[str, ...] = ()
    nonempty: bool = False

    def check(self, value: Any) -> str | None:
        if not isinstance(value, Mapping):
            return "must be a mapping {task: [names]}"
        for task, names in value.items():
            if not isinstance(task, str) or not task.strip() or "/" in task:
                return f"task {_show(task)} is not a task name (non-empty, without '/')"
            if not isinstance(names, (list, tuple)) or (self.nonempty and not names):
                return f"{task}: must be a {'non-empty ' if self.nonempty else ''}list"
            bad = [n for n in names if n not in self.choices]
            if bad:
                return f"{task}: {_show(bad[0])} is not one of {', '.join(self.choices)}"
        return None

    def describe(self) -> str:
        lst = "a non-empty list" if self.nonempty else "a list"
        return f"a mapping {{task: [names]}} ({lst} of {', '.join(self.choices)} per task), or {{}} (the defaults)"


@dataclass(frozen=True)
class MetricName(Rule):
    """A validation metric name: 'loss', 'wer[_<lang>]' or '<task>/<metric>[_<lang>]' (speechlm.metrics), or
    one of them prefixed 'train_' (the training-split metrics of trainer.val_train_batches)."""

    def check(self, value: Any) -> str | None:
        if not isinstance(value, str):
            return "must be a metric name"
        return check_metric_name(value.removeprefix(TRAIN_PREFIX))

    def describe(self) -> str:
        return (
            "'wer', 'loss', 'wer_<lang>' or '<task>/<metric>[_<lang>]' with metric one of "
            + ", ".join(METRICS)
            + " (e.g. 'asr/wer', 'asr/wer_hi', 'ast/bleu', 'qa/accuracy'); any of them prefixed 'train_' "
            "(e.g. 'train_wer') names the training-split metric of trainer.val_train_batches"
        )


@dataclass(frozen=True)
class Either(Rule):
    """Valid under any of `rules` (e.g. 'auto' or a number)."""

    rules: tuple[Rule, ...] = ()

    def check(self, value: Any) -> str | None:
        reasons = [r.check(value) for r in self.rules]
        return None if any(r is None for r in reasons) else next(r for r in reasons if r)

    def describe(self) -> str:
        return "; or ".join(r.describe() for r in self.rules)


@dataclass(frozen=True)
class InputList(Rule):
    """data.input_cfg: a list of dataset entries, a YAML file of one, or null."""

    null: str = ""

    def check(self, value: Any) -> str | None:
        if value is None or isinstance(value, list):
            return None
        if isinstance(value, str):
            return None if value.strip() else "an empty path; give a path or null"
        return "must be a list of entries or the path of a YAML file"

    def describe(self) -> str:
        return (
            "a list of {path, type?, weight?, lang?, name?, tags?} or {group, weight?, inputs} entries, "
            + (f"or a path of a YAML file of one, or null ({self.null})")
        )


_POS_INT = Num("", lo=1, integer=True)
_SIZE = "model size"

FIELDS: dict[str, Rule] = {
    # data
    "data.train_manifest": Text(
        "training data: a manifest, shard folder, NeMo/WeNet/Lhotse source",
        path=True,
        null="set data.input_cfg instead; one of the two is required to train",
    ),
    "data.val_manifest": Text("validation data (any source kind)", path=True, null="no validation"),
    "data.tokenizer": Text(
        "SentencePiece model (.model) built by `speechlm tokenizer train`, or a Hugging Face tokenizer "
        "directory (the pretrained LLM's, or one it was saved with)",
        path=True,
        null="model.llm.pretrained's own tokenizer; required without it",
    ),
    "data.lang_tags": OneOf(
        "language tags in the transcript: 'special' (one added token per language, the first target "
        "token), 'none' (no tag; needs the LLM's tokenizer)",
        choices=choices_of(LangTags),
    ),
    "data.system_prompt": Text("system turn of the chat template", null="no system turn"),
    "data.chat_template": Text(
        "the prompt's chat template: 'auto' (the tokenizer's, if it has one), 'none' (plain "
        "[bos, audio, instruction, transcript, eos]) or a Jinja template file",
        path=True,
        keywords=("auto", "none"),
    ),
    "data.allow_sentencepiece_with_pretrained": Flag(
        "train model.llm.pretrained on a SentencePiece data.tokenizer's ids (not the LLM's own: its "
        "pretrained embeddings then mean other tokens)"
    ),
    "data.sample_rate": OneOf(
        "audio is resampled to this rate (Hz); the encoders' front end reads 16 kHz",
        choices=choices_of(SampleRate),
    ),
    "data.max_tokens": Num("text tokens per utterance after tokenization", lo=1, integer=True),
    "data.max_duration": Num(
        "seconds: training rows longer than this are left out of every epoch plan, counted and shown by "
        "`speechlm plan` (validation and evaluation keep every row)",
        lo=0,
        lo_open=True,
        null="no limit: every row is planned; one longer than the micro-batch budget forms a micro-batch "
        "of its own, given to the whole CP group",
    ),
    "data.num_workers": Num(
        "DataLoader worker processes (0: load in the training process)", lo=0, integer=True
    ),
    "data.instruction": Text(
        "optional instruction placed after the audio in the prompt (rows with an 'instruction' column, "
        "or an input_cfg entry's 'prompt', use theirs)"
    ),
    "data.loss_turns": OneOf(
        "assistant turns of a multi-turn conversation that get the loss: 'all', or only the 'last' (the "
        "others are context)",
        choices=choices_of(LossTurns),
    ),
    "data.text_normalize": OneOf(
        "the rule every answer and transcript goes through before training encodes it and evaluation scores "
        "it (reference and hypothesis alike; <|xx|> tags kept): 'none' (as written), 'lower' (lower-cased), "
        "'clean' (the cleaning of `speechlm manifest build`: punctuation, symbols and [..]/<..> annotations "
        "removed, case kept), 'clean_lower' (both); characters the tokenizer cannot encode after it are "
        "refused before step 1, never trained as <unk>",
        choices=choices_of(TextNormalize),
    ),
    "data.max_dropped_fraction": Num(
        "fraction of a training micro-batch whose audio may be unreadable before "
        "the run stops (1: never stop)",
        lo=0,
        hi=1,
    ),
    "data.duration_tolerance": Num(
        "seconds a decoded clip may differ from its manifest duration (or 10% of it, if more) before it is "
        "dropped as duration_mismatch",
        lo=0,
    ),
    "data.read_mode": OneOf(
        "'indexed': clips read by position; 'streaming': tar shards read front to back",
        choices=choices_of(ReadMode),
    ),
    "data.input_cfg": InputList(
        "several weighted datasets, replacing data.train_manifest (docs/data.md)",
        null="use data.train_manifest",
    ),
    "data.shuffle_buffer": Num("utterances in the streaming shuffle buffer", lo=1, integer=True),
    "data.sort_buffer": Num("utterances in the streaming sort buffer", lo=1, integer=True),
    # sampler
    "sampler.mode": OneOf(
        "batch sampler: temperature-weighted languages or the exhaustive algorithm",
        choices=choices_of(SamplerMode),
    ),
    "sampler.temperature": Num(
        "language sampling temperature (p ~ n^T; 1: proportional, ->0: uniform)", lo=0, lo_open=True
    ),
    "sampler.max_batch_duration": Num(
        "seconds of audio per micro-batch", lo=0, lo_open=True, null="use sampler.max_batch_tokens"
    ),
    "sampler.max_batch_tokens": Num(
        "token budget per micro-batch (replaces max_batch_duration)",
        lo=1,
        integer=True,
        null="budget in seconds",
    ),
    "sampler.length_penalty": Num("quadratic length penalty of the token budget", lo=0),
    "sampler.bucket_boundaries": Seq(
        "duration bucket edges in seconds",
        item=Num("", lo=0, lo_open=True),
        increasing=True,
        nonempty=True,
        null="estimated from the training data: sampler.num_buckets buckets of equal total duration",
    ),
    "sampler.num_buckets": Num(
        "duration buckets estimated from the training data (sampler.bucket_boundaries=null)",
        lo=1,
        hi=127,
        integer=True,
    ),
    "sampler.epoch_size": Num(
        "utterances per epoch in temperature mode", lo=1, integer=True, null="the manifest's size"
    ),
    "sampler.seed": Num("seed of the epoch plans", lo=0, hi=SEED_MAX, integer=True),
    # model.encoder
    "model.encoder.kind": OneOf("audio encoder", choices=ENCODER_KINDS),
    "model.encoder.pretrained": Text(
        "local save_pretrained directory (parakeet, whisper) or .nemo file",
        path=True,
        null="built from the sizes below",
    ),
    "model.encoder.hidden_size": Num(_SIZE, lo=1, integer=True),
    "model.encoder.num_layers": Num(_SIZE, lo=1, integer=True),
    "model.encoder.num_heads": Num(_SIZE + " (divides hidden_size)", lo=1, integer=True),
    "model.encoder.intermediate_size": Num(_SIZE, lo=1, integer=True),
    "model.encoder.subsampling_conv_channels": Num(_SIZE, lo=1, integer=True),
    "model.encoder.subsampling_factor": Num(
        "feature frames (10 ms) per encoder frame, a power of two (Parakeet built from sizes)",
        lo=2,
        integer=True,
        null="8, FastConformer's; a pretrained encoder keeps its own",
    ),
    "model.encoder.num_mel_bins": Num("mel bins of the front end", lo=1, integer=True),
    "model.encoder.conv_norm": OneOf(
        "normalisation in the Conformer conv module (auto: layer_norm from "
        "scratch, batch_norm for a pretrained encoder)",
        choices=choices_of(ConvNorm),
    ),
    "model.encoder.packed": Flag("padding-free encoder", null="on where the encoder kind supports it"),
    "model.encoder.att_context_size": Seq(
        "limited-context self-attention: [left, right] encoder frames each frame attends to on either side "
        "(a sliding window on the packed frames, as NeMo's Parakeet for long-form audio; parakeet, packed)",
        item=Num("", lo=-1, integer=True),
        length=2,
        null="full context (as [-1, -1])",
    ),
    "model.encoder.train": OneOf(
        "full: the encoder trains (from optim.unfreeze_step); frozen: it never trains and runs without "
        "gradients (checkpoints hold a fingerprint of it, not its weights)",
        choices=choices_of(EncoderTrain),
    ),
    # model.llm
    "model.llm.family": OneOf("LLM architecture when built from a config", choices=LLM_FAMILIES),
    "model.llm.pretrained": Text(
        "local save_pretrained directory of a causal LM", path=True, null="built from the sizes below"
    ),
    "model.llm.train": OneOf(
        "full: every LLM parameter trains; frozen: none does; lora: only LoRA adapters (model.llm.lora) do. "
        "frozen/lora checkpoints hold what trains plus a fingerprint of the frozen base (docs/training-modes.md)",
        choices=choices_of(LLMTrain),
    ),
    "model.llm.train_added_rows": Flag(
        "with model.llm.train=frozen or lora, the embedding and LM-head rows of the tokens the run added to "
        "a pretrained LLM's vocabulary (the data.lang_tags=special language tags) still train; false: they "
        "stay at their initial mean, so the tags cannot be told apart"
    ),
    "model.llm.lora.rank": Num("rank of the LoRA adapters (model.llm.train=lora)", lo=1, integer=True),
    "model.llm.lora.alpha": Num(
        "LoRA scaling numerator: adapters' output times alpha / rank", lo=0, lo_open=True
    ),
    "model.llm.lora.dropout": Num(
        "dropout on the LoRA adapters' input (0: no randomness)", lo=0, hi=1, hi_open=True
    ),
    "model.llm.lora.target_modules": Names(
        "names of the LLM's linear layers that get adapters (the last part of a module path); the default "
        "fits Llama, Qwen2 and Qwen3"
    ),
    "model.llm.hidden_size": Num(_SIZE + " (a multiple of num_heads)", lo=1, integer=True),
    "model.llm.num_layers": Num(_SIZE, lo=1, integer=True),
    "model.llm.num_heads": Num(_SIZE + " (a multiple of num_kv_heads)", lo=1, integer=True),
    "model.llm.num_kv_heads": Num(_SIZE + " (divides num_heads)", lo=1, integer=True),
    "model.llm.intermediate_size": Num(_SIZE, lo=1, integer=True),
    "model.llm.max_position_embeddings": Num(_SIZE, lo=1, integer=True),
    # model
    "model.projector_stack": Num("encoder frames stacked by the projector", lo=1, integer=True),
    "model.projector_hidden": Num(_SIZE, lo=1, integer=True),
    "model.packed_sequences": Flag("THD packing (true) or padded BSHD (false)"),
    "model.pad_to_multiple": Num(
        "pad the packed total (THD) or padded length (BSHD) to a multiple of this",
        lo=1,
        integer=True,
        null="the smallest legal unit, lcm(2*cp, cp*tp)",
    ),
    "model.attention_backend": OneOf("attention kernel backend", choices=ATTENTION_BACKENDS),
    "model.ctc_reduction": OneOf(
        "the auxiliary CTC sum's normaliser: clip (divided by the step's clips; a clip's CTC grows with its "
        "length) or token (by its target tokens: long-form audio beside short clips)",
        choices=choices_of(CTCReduction),
    ),
    "model.dropout": Num(
        "dropout probability (0 turns off every source of randomness in the forward)",
        lo=0,
        hi=1,
        hi_open=True,
    ),
    "model.ctc_weight": Num("weight of the auxiliary CTC loss on the encoder output (0 disables it)", lo=0),
    "model.decode_ctc_weight": Num(
        "weight of the CTC head's prefix scores in joint CTC/attention greedy decoding of transcripts "
        "(0: the LLM alone)",
        lo=0,
        hi=1,
    ),
    "model.decode_ctc_candidates": Num(
        "tokens per step that joint CTC/attention decoding scores with CTC: the LLM's this many best, and the "
        "stop token (0: every token, exact but T x V work per step; a weight of 1 always scores every token)",
        lo=0,
        integer=True,
    ),
    # parallel
    "parallel.dp_replicate": Num("data-parallel replicas (HSDP outer dimension)", lo=1, integer=True),
    "parallel.dp_shard": Either("FSDP shards", rules=(OneOf("", choices=(-1,)), _POS_INT)),
    "parallel.cp_size": Num("context-parallel group size", lo=1, integer=True),
    "parallel.tp_size": Num("tensor-parallel group size", lo=1, integer=True),
    "parallel.cp_attention": OneOf("attention under CP (reference backend)", choices=choices_of(CPAttention)),
    "parallel.cp_split_threshold": Either(
        "sequences longer than this many tokens are split over the CP group (0: all; auto: per micro-batch)",
        rules=(OneOf("", choices=choices_of(SplitAuto)), Num("", lo=0, integer=True)),
    ),
    "parallel.activation_checkpointing": Flag("recompute activations in the backward pass"),
    # optim
    "optim.lr": Num("peak learning rate", lo=0, lo_open=True),
    "optim.encoder_lr": Num("peak learning rate of the encoder", lo=0, lo_open=True, null="optim.lr"),
    "optim.weight_decay": Num("AdamW weight decay", lo=0),
    "optim.betas": Seq("AdamW betas", item=Num("", lo=0, hi=1, hi_open=True), length=2),
    "optim.warmup_steps": Num("linear warmup steps before the cosine decay", lo=0, integer=True),
    "optim.min_lr_ratio": Num("final learning rate as a fraction of the peak", lo=0, hi=1),
    "optim.grad_clip": Num("gradient norm limit (0: no clipping)", lo=0),
    "optim.unfreeze_step": Num(
        "encoder frozen before this optimizer step (0: never frozen)", lo=0, integer=True
    ),
    "optim.encoder_warmup_steps": Num("warmup of the encoder after it is unfrozen", lo=0, integer=True),
    # trainer
    "trainer.max_steps": Num("optimizer steps (0: evaluate the untrained model)", lo=0, integer=True),
    "trainer.max_minutes": Num(
        "wall-clock limit, checked between optimizer steps (0: no limit)", lo=0, null="no limit"
    ),
    "trainer.grad_accum": Num("micro-batches per optimizer step", lo=1, integer=True),
    "trainer.peak_tflops": Num(
        "peak dense TFLOP/s of one device, what MFU is measured against",
        lo=0,
        lo_open=True,
        null="from the device table (speechlm/model/flops.py)",
    ),
    "trainer.precision": OneOf(
        "'auto': bf16 where supported (CUDA), else fp32; '32': fp32; 'bf16': bf16 compute (FSDP2 mixed precision when the model is sharded, autocast otherwise; never both)",
        choices=choices_of(Precision),
        advice=(
            ("bf16-mixed", "bf16-mixed: use trainer.precision=bf16"),
            ("bf16-true", "bf16-true: use trainer.precision=bf16 (parameters stay fp32)"),
            ("16-mixed", "16-mixed: fp16 is not supported; use trainer.precision=bf16 or 32"),
            ("16", "16: fp16 is not supported; use trainer.precision=bf16 or 32"),
            ("fp16", "fp16 is not supported; use trainer.precision=bf16 or 32"),
            ("32-true", "32-true: use trainer.precision=32"),
            ("fp32", "fp32: use trainer.precision=32"),
            ("64", "64: fp64 is not supported; use trainer.precision=32"),
        ),
    ),
    "trainer.seed": Num("seed of the model initialisation and dropout", lo=0, hi=SEED_MAX, integer=True),
    "trainer.run_dir": Text("output folder of the run (resolves against the working directory)"),
    "trainer.log_every": Num("optimizer steps between metrics.jsonl rows", lo=1, integer=True),
    "trainer.val_every": Num(
        "optimizer steps between validations (0: off; needs data.val_manifest)", lo=0, integer=True
    ),
    "trainer.val_max_batches": Num(
        "decoding batches per validation", lo=1, integer=True, null="the whole validation split"
    ),
    "trainer.val_train_batches": Num(
        "decoding batches of a fixed, per-language proportional subset of the training split decoded at each "
        "validation too (train_wer, train_wer_<lang>; 0: off; needs trainer.val_every)",
        lo=0,
        integer=True,
    ),
    "trainer.eval_batch_duration": Num(
        "seconds of audio per greedy-decoding batch", lo=0, lo_open=True, null="4x sampler.max_batch_duration"
    ),
    "trainer.ckpt_every": Num("optimizer steps between checkpoints (0: off)", lo=0, integer=True),
    "trainer.keep_last": Num("periodic checkpoints kept (older ones are deleted)", lo=1, integer=True),
    "trainer.best_metric": MetricName(
        "validation metric whose best value (lowest for loss/wer/cer, highest for bleu/chrf/accuracy) is kept "
        "as checkpoints/best and watched by early stopping; it must be one the validation split produces"
    ),
    "trainer.early_stopping_patience": Num(
        "validations without improvement before stopping (0: off)", lo=0, integer=True
    ),
    "trainer.resume": Text(
        "'auto' (latest checkpoint of run_dir, if any) or a checkpoint directory",
        path=True,
        keywords=("auto",),
        null="start fresh",
    ),
    "trainer.resume_data": OneOf(
        "'exact': continue the saved epoch plan; 'next_epoch': start the data at "
        "the next epoch (another data-parallel layout)",
        choices=choices_of(ResumeData),
    ),
    "trainer.validate_only": Flag("evaluate only (restoring trainer.resume if set): no optimizer step"),
    "trainer.final_eval_split": OneOf(
        "split scored into eval.json after training ('auto': val when data.val_manifest is set, else none; "
        "'both': val, then a subset of train of trainer.final_eval_train_utterances)",
        choices=choices_of(FinalEvalSplit),
    ),
    "trainer.final_eval_train_utterances": Num(
        "training utterances scored by final_eval_split=both, in the val split's (task, language) proportions",
        lo=1,
        integer=True,
        null="as many as the val split has",
    ),
    "trainer.eval_metrics": TaskLists(
        "metrics per task, replacing that task's default (asr: [wer], ast: [bleu, chrf], qa/lid/cls: "
        "[accuracy]); docs/metrics.md",
        choices=METRICS,
        nonempty=True,
    ),
    "trainer.eval_normalize": TaskLists(
        "text normalisation per task before scoring, replacing that task's default (asr, ast: [], qa/lid/cls: "
        "[lowercase, strip_punct]); whitespace is always collapsed",
        choices=NORMALIZE_OPS,
    ),
    "trainer.eval_cer_langs": Names(
        "languages scored by character error rate (cer) where their task asks for wer (codes in any case: EN "
        "is en)",
        nonempty=False,
    ),
    "trainer.overwrite": Flag(
        "a new run in a run_dir that holds another run moves that run aside to RUN_DIR.old-<UTC time> "
        "(never deleted); false: such a start is refused"
    ),
}


# keys that existed once: a config that still sets one is refused with this advice instead of "unknown key"
REMOVED_KEYS: dict[str, str] = {
    "model.encoder.tensor_parallel": "was removed (issue 21): the audio encoder is never tensor-parallel (FSDP "
    "shards it, CP splits its clips; only the LLM is split over tp), and the key only changed which head counts "
    "the validator checked; delete it from the config",
}


def _removed(where: str, key: str) -> ConfigError:
    return ConfigError(f"{where}: {key} {REMOVED_KEYS[key]}")


def leaf_keys(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config (the fields that are not sections)."""
    out = []
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            out += leaf_keys(tp, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            out.append(prefix + name)
    return out


def get_key(cfg: Any, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _set_key(cfg: Any, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    obj = cfg
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def _absolute(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)


def _resolve_input_entries(entries: list[Any], base: Path) -> list[Any]:
    """Inline data.input_cfg entries with their `path`s made absolute (groups recursively)."""
    out = []
    for e in entries:
        if isinstance(e, dict):
            e = dict(e)
            if isinstance(e.get("path"), str) and e["path"].strip():
                e["path"] = _absolute(e["path"], base)
            if isinstance(e.get("inputs"), list):
                e["inputs"] = _resolve_input_entries(e["inputs"], base)
        out.append(e)
    return out


def resolve_path_value(key: str, value: Any, base: Path) -> Any:
    """An input path of `key` made absolute against `base`; other keys and values unchanged."""
    rule = FIELDS.get(key)
    if isinstance(rule, InputList):
        if isinstance(value, list):
            return _resolve_input_entries(value, base)
        rule = Text("", path=True)
    if not (isinstance(rule, Text) and rule.path) or not isinstance(value, str) or not value.strip():
        return value
    if value in rule.keywords:
        return value
    return _absolute(value, base)


def resolve_config_paths(cfg: ExperimentConfig, base: Path, keys: typing.Iterable[str] | None = None) -> None:
    """Make the input paths of `cfg` (all, or those in `keys`) absolute against `base`, in place."""
    for key in FIELDS if keys is None else keys:
        value = get_key(cfg, key)
        resolved = resolve_path_value(key, value, base)
        if resolved is not value:
            _set_key(cfg, key, resolved)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_error(where: str, key: str, value: Any, what: str) -> str:
    rule = FIELDS.get(key)
    valid = f"; use {rule.describe()} ({rule.doc})" if rule is not None else ""
    return f"{where}: {key}={_show(value)} must be {what}{valid}"


def _coerce_choice(value: Any, choices: tuple[Any, ...], key: str, where: str) -> Any:
    """A value of a Literal field: one of `choices` (a number read by YAML matches a string choice such as
    trainer.precision's "32"), or a ConfigError with the FIELDS message (its hints for near misses)."""
    for choice in choices:
        if isinstance(choice, str) and not isinstance(value, (dict, list, bool)) and str(value) == choice:
            return choice
        if not isinstance(choice, str) and type(value) is type(choice) and value == choice:
            return choice
    rule = FIELDS.get(key)
    if rule is None:
        raise ConfigError(_type_error(where, key, value, "one of " + ", ".join(_show(c) for c in choices)))
    reason = rule.check(value) or "not a valid choice"
    raise ConfigError(f"{where}: {key}={_show(value)}: {reason}; use {rule.describe()} ({rule.doc})")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Convert a YAML/override value to the declared type, or raise naming the key."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return _coerce_choice(value, args, key, where)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r} for '{key}'")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(_type_error(where, key, value, "a mapping of keys"))
        return _from_dict(tp, value, where, prefix=key + ".")  # type: ignore[arg-type]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(_type_error(where, key, value, "true or false"))
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(_type_error(where, key, value, "an integer"))
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(_type_error(where, key, value, "an integer")) from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(_type_error(where, key, value, "a number")) from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(_type_error(where, key, value, "a string"))
        return str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ConfigError(_type_error(where, key, value, "a list such as [1, 2]")) from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(_type_error(where, key, value, "a list"))
        inner = args[0] if args else Any
        items = [_coerce(v, inner, key, where) if inner is not Any else v for v in value]
        return tuple(items) if origin is tuple else items
    return value


def _from_dict(cls: type, data: dict[str, Any], where: str, prefix: str = "") -> Any:
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    for name in unknown:
        if prefix + name in REMOVED_KEYS:
            raise _removed(where, prefix + name)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key '{prefix}{unknown[0]}'; valid keys under "
            f"'{prefix.rstrip('.') or '<root>'}' are: {', '.join(sorted(types_))}"
        )
    kwargs = {k: _coerce(v, types_[k], prefix + k, where) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)

    def fix(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: fix(v) for k, v in d.items()}
        if isinstance(d, tuple):
            return [fix(v) for v in d]
        return d

    return fix(out)


def is_override(word: str) -> bool:
    """A command-line word that is a dotted override (KEY=VALUE) rather than an option or a file."""
    return "=" in word and not word.startswith("-")


def split_override(text: str, where: str = "command line") -> tuple[str, str]:
    """`a.b.c=value` -> ("a.b.c", "value"): the one reader of dotted overrides (train, validate, plan, sweep
    specs and filters). The key is stripped; the value is kept as written (`apply_override` reads it as YAML)."""
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"{where}: override {text!r} must look like key.path=value")
    return key.strip(), raw


def apply_override(cfg: ExperimentConfig, override: str, where: str = "command line") -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML then type-checked."""
    key, raw = split_override(override, where)
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        types_ = _field_types(type(obj))
        if part not in types_:
            if ".".join(parts[: i + 1]) in REMOVED_KEYS:
                raise _removed(where, ".".join(parts[: i + 1]))
            parent = ".".join(parts[:i]) or "<root>"
            raise ConfigError(
                f"{where}: unknown key '{key}'; valid keys under '{parent}' are: {', '.join(sorted(types_))}"
            )
        if i == len(parts) - 1:
            tp = types_[part]
            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError as e:
                if tp is not str and str not in typing.get_args(tp):
                    problem = " ".join(str(getattr(e, "problem", None) or e).split())
                    raise ConfigError(_type_error(where, key, raw, f"valid YAML ({problem})")) from None
                value = raw  # a string field takes the text as written
            if tp is str and not isinstance(value, str):
                value = raw  # keep strings such as "32" verbatim
            value = _coerce(value, types_[part], key, where)
            # an input path on the command line resolves against the working directory
            setattr(obj, part, resolve_path_value(key, value, Path.cwd()))
            if dataclasses.is_dataclass(value):  # a whole section: the paths inside it too
                resolve_config_paths(cfg, Path.cwd(), [k for k in FIELDS if k.startswith(key + ".")])
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"{where}: '{'.'.join(parts[: i + 1])}' is not a section")


# the top-level keys of a sweep spec (speechlm.sweep.spec): such a file given as a config is named as one
SWEEP_SPEC_KEYS = ("base", "overrides", "grid", "jobs", "gpus_per_job")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Load a YAML config (or the defaults when `path` is None), apply dotted overrides, check every value.

    Input paths (`FIELDS` entries with `path=True`) are stored absolute: those of the file resolve
    against the file's folder, those of overrides against the working directory."""
    cfg = ExperimentConfig()
    origin: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"{p}: cannot read config ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not a text file ({e.reason} at byte {e.start})") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({e})") from None
        if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
            raise ConfigError(
                f"{p}: this is a data.input_cfg list (datasets with path/weight), not a config; use it as "
                f"data.input_cfg={p} with a config, e.g. `configs/demo.yaml data.train_manifest=null "
                f"data.input_cfg={p}`"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        if set(data) <= set(SWEEP_SPEC_KEYS) and ("grid" in data or "jobs" in data):
            raise ConfigError(
                f"{p}: this is a sweep spec (base, grid, jobs), not a config; `speechlm sweep init {p} --out DIR` "
                "writes one config per job (docs/sweep.md)"
            )
        cfg = _from_dict(ExperimentConfig, data, str(p))
        resolve_config_paths(cfg, p.resolve().parent)
        origin = {key: f"in {p}" for key in _keys_in(data)}
    for ov in overrides:
        apply_override(cfg, ov)
        origin[split_override(ov)[0]] = "on the command line"
    check_config(cfg, origin)
    return cfg


def _keys_in(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in FIELDS:
            out += _keys_in(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def _check_key(key: str, value: Any, origin: Mapping[str, str] | None) -> None:
    """`value` against the `FIELDS` entry of `key`; the message says where the value was set."""
    rule = FIELDS[key]
    reason = rule.check(value)
    if reason is not None:
        where = "" if origin is None else f" (set {origin[key]})" if key in origin else " (the default)"
        raise ConfigError(f"{key}={_show(value)}{where}: {reason}; use {rule.describe()} ({rule.doc})")


def check_config(cfg: ExperimentConfig, origin: Mapping[str, str] | None = None) -> None:
    """`cfg.validate(origin)`: every section's keys against `FIELDS` and its own rules, then the rules
    across sections.

    The parallel layout rules (sizes against the world size, backends, ...) live in the validator.
    `origin` maps dotted keys to where they were set (a file or the command line) for the message.
    """
    cfg.validate(origin)


# the rules of the sections' `problems`, for docs/config.md
CROSS_FIELD_RULES = (
    "`data.train_manifest` and `data.input_cfg` are exclusive (set the other to `null`); training needs "
    "one of them and `data.tokenizer` or `model.llm.pretrained` (checked when a run starts, not by `speechlm "
    "validate` of a layout)",
    "`trainer.final_eval_split: val` (or `both`) and `trainer.val_every > 0` need `data.val_manifest`",
    "`trainer.early_stopping_patience > 0` and `trainer.val_train_batches > 0` need `trainer.val_every > 0`",
    "a model built from its sizes (no `pretrained`): `llm.num_heads` a multiple of `llm.num_kv_heads`, "
    "`llm.hidden_size` a multiple of `llm.num_heads` with an even head size (rotary embeddings), "
    "`encoder.hidden_size` even and a multiple of `encoder.num_heads`",
    "`model.encoder.kind: nemo` needs `model.encoder.pretrained`; `conv_norm: layer_norm` cannot be used with a "
    "pretrained encoder",
    "the parallel layout (sizes against the world size, heads against `tp_size`, backends, padding units) "
    "is checked by the validator: docs/validator.md",
)


def require_inputs(cfg: ExperimentConfig) -> None:
    """What training reads and has no default: the training data and the tokenizer."""
    if cfg.data.train_manifest is None and cfg.data.input_cfg is None:
        raise ConfigError(
            "no training data: set data.train_manifest=PATH (a manifest, shard folder, NeMo manifest, ...) "
            "or data.input_cfg (several weighted datasets) in the config or on the command line"
        )
    if cfg.data.tokenizer is None and cfg.model.llm.pretrained is None:
        raise ConfigError(
            "no tokenizer: set data.tokenizer=PATH (a .model file; build one with `speechlm tokenizer train`), "
            "or model.llm.pretrained=DIR to use that LLM's own tokenizer"
        )
    # input paths that are set must exist (trainer.resume is checked by the resume code, which knows
    # what a checkpoint is); named resolved, so a wrong folder shows
    for key in ("data.train_manifest", "data.val_manifest", "data.tokenizer", "data.input_cfg",
                "model.encoder.pretrained", "model.llm.pretrained"):  # fmt: skip
        value = get_key(cfg, key)
        if isinstance(value, str) and not Path(value).exists():
            make = {
                "data.tokenizer": "; train one with `speechlm tokenizer train`",
                "data.train_manifest": "; build one with `speechlm manifest build`",
                "data.val_manifest": "; build one with `speechlm manifest build` (or set it to null)",
            }.get(key, "")
            raise MissingInputError(
                f"{key}={value} does not exist{make}; a relative path in a config file resolves against "
                "the file's folder, one on the command line against the working directory"
            )


def final_eval_split(cfg: ExperimentConfig) -> str:
    """The split the final evaluation scores: "train", "val", "both" or "none" ("auto": val if there is one)."""
    split = cfg.trainer.final_eval_split
    if split == "auto":
        return "val" if cfg.data.val_manifest is not None else "none"
    return split


def eval_batch_duration(cfg: ExperimentConfig) -> float:
    """Seconds of audio per greedy-decoding batch: `trainer.eval_batch_duration`, else 4x the training budget."""
    if cfg.trainer.eval_batch_duration is not None:
        return float(cfg.trainer.eval_batch_duration)
    return 4.0 * float(cfg.sampler.max_batch_duration or 60.0)


def clone(cfg: ExperimentConfig) -> ExperimentConfig:
    return copy.deepcopy(cfg)
