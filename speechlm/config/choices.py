"""The choice keys' types: one `Literal` each, the single list of the values that key admits.

A section field annotated with one of these is a choice key: its rule (`OneOf`) takes its choices from
the annotation (`speechlm.config.keys`), parsing refuses anything else (`speechlm.config.load`), and mypy
checks the code that compares against them.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from parallel.backend_caps import BACKENDS

ReadMode = Literal["indexed", "streaming"]
LossTurns = Literal["all", "last"]
LangTags = Literal["special", "none"]  # language tags: one added special token each, or none
# the rule every answer/transcript goes through in training and scoring (speechlm.data.text.normalize_target)
TextNormalize = Literal["none", "lower", "clean", "clean_lower"]
SampleRate = Literal[16000]  # the encoders' front end reads 16 kHz (model/features.py)
SamplerMode = Literal["temperature", "exhaustive"]
EncoderKind = Literal["parakeet", "whisper", "nemo"]
ConvNorm = Literal["auto", "layer_norm", "batch_norm"]
AudioCompression = Literal["none", "ctc"]  # the LLM's audio rows: every projected frame, or one per CTC token
AudioPositions = Literal["sequential", "aligned"]  # position ids of the audio rows
AudioPrefix = Literal["audio", "oracle"]  # what fills the audio rows: the projected audio, or the transcript
LLMFamily = Literal["llama", "qwen2"]  # speechlm/model/llm.py builds these from a config
LLMTrain = Literal["full", "frozen", "lora"]  # what trains in the LLM (speechlm/model/trainable.py)
EncoderTrain = Literal["full", "frozen"]
WhisperWindow = Literal[
    "full", "clip"
]  # a Whisper encoder's input: its 30 s window, or the clip's own frames
CTCReduction = Literal["clip", "token"]  # the auxiliary CTC's normaliser (speechlm/train/step.py)
# the capability table (parallel/backend_caps.py) owns the backends; this type must name the same ones
AttentionBackend = Literal["reference", "torch_varlen", "flex", "flash", "te", "sdpa"]
CPAttention = Literal["ring", "allgather"]
CPDegrees = Literal["all", "hybrid"]  # a split sequence over every CP rank, or over a sub-group of 2, 4, ...
Precision = Literal["auto", "32", "bf16"]
ResumeData = Literal["exact", "next_epoch"]
FinalEvalSplit = Literal["auto", "val", "train", "both", "none"]
SplitAuto = Literal["auto"]  # parallel.cp_split_threshold's word (else a token count)


def choices_of(tp: Any) -> tuple[Any, ...]:
    """The values a Literal type admits, in declaration order."""
    return typing.get_args(tp)


ATTENTION_BACKENDS: tuple[str, ...] = choices_of(AttentionBackend)
if set(ATTENTION_BACKENDS) != set(BACKENDS):  # pragma: no cover - a developer error, caught on import
    raise ImportError(
        f"speechlm.config.AttentionBackend {ATTENTION_BACKENDS} and parallel/backend_caps.py "
        f"{tuple(BACKENDS)} name different backends; add the new backend to both"
    )
ENCODER_KINDS: tuple[str, ...] = choices_of(EncoderKind)
LLM_FAMILIES: tuple[str, ...] = choices_of(LLMFamily)
