"""Which clips of a micro-batch this CP rank must decode, decided where the batch is built (issue 40).

Under dynamic CP a clip is encoded on one rank (or, long, sharded over the group), yet lockstep hands every
CP and TP peer the whole micro-batch. The model's placement is a pure function of lengths known before any
audio is decoded: the clips' sample counts (read from the audio headers, `speechlm.data.audio.probe_length`)
and the rendered prompts. `ClipPlanner` runs that same placement (`cp_audio.plan_audio`) in the data
loader, on a picklable copy of what it reads of the model (`ModelShape`: the feature hop, the encoder's
stride-2 convolutions, its slice halo, the projector's stack) and a CP layout without a process group
(`parallel.cp_layout.DynamicCPLayout.for_planning`), and answers, per clip, whether this rank's encoder
reads it (`AudioPlan.readers`). The loader decodes those only (`speechlm.data.local_decode`); the model
checks, before it encodes, that every clip it reads was decoded (`cp_audio.check_clips_present`).

TP peers of a CP rank have the same CP rank, so each computes the same answer and decodes the same clips:
no collective in the data path, no broadcast of audio over the TP group (decoding a clip costs less CPU than
the copy would cost memory bandwidth and a blocking exchange every micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parallel.cp_layout import CPLayout
from speechlm.model.conversation_inputs import as_conversation
from speechlm.model.cp_audio import plan_audio
from speechlm.model.encoders.base import stride2_conv_lengths
from speechlm.model.features import FeatureSettings
from speechlm.packing.prompt import PromptFormat

__all__ = ["ClipPlanner", "ModelShape"]


@dataclass(frozen=True)
class _EncoderShape:
    feature_settings: FeatureSettings
    n_convs: int
    subsampling: int
    slice_halo: int | None

    def output_lengths(self, feat_lens_B: Tensor) -> Tensor:
        return stride2_conv_lengths(feat_lens_B, self.n_convs)


@dataclass(frozen=True)
class _ProjectorShape:
    stack: int


@dataclass(frozen=True)
class ModelShape:
    """What the audio placement reads of a `SpeechLLM` (the `cp_audio.AudioModel` attributes it uses),
    as plain values: a DataLoader worker gets this, never the model's weights."""

    encoder: _EncoderShape
    projector: _ProjectorShape
    encoder_packed: bool

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """The shape of ``model``; a ValueError when its encoder's frame arithmetic is not a stack of
        stride-2 convolutions (the planner would place clips where the model does not)."""
        enc = model.encoder
        n_convs = (int(enc.subsampling) - 1).bit_length()
        shape = _EncoderShape(enc.feature_settings, n_convs, int(enc.subsampling), enc.slice_halo)
        probe = torch.arange(0, 20000, 7)
        if not torch.equal(shape.output_lengths(probe), enc.output_lengths(probe)):
            raise ValueError(
                f"{type(enc).__name__}.output_lengths is not {n_convs} stride-2 convolutions: the data "
                "pipeline cannot place its clips before decoding; set data.decode_local=false"
            )
        return cls(shape, _ProjectorShape(int(model.projector.stack)), bool(model.encoder_packed))


@dataclass(frozen=True)
class ClipPlanner:
    """``planner(batch)`` -> per clip of ``batch`` (a collated `Batch` whose ``audio_lens`` are known and whose
    audio need not be), whether CP rank ``layout.cp_rank``'s encoder reads it (module docstring)."""

    shape: ModelShape
    layout: CPLayout  # without a process group: placement only
    prompt: PromptFormat
    audio_id: int
    compressed: bool

    @classmethod
    def of(cls, model: Any, layout: CPLayout) -> ClipPlanner:
        """The planner of ``model`` (a `SpeechLLM`) under ``layout`` (its CP rank's, placement only)."""
        compressed = model.cfg.audio_compression != "none"
        return cls(ModelShape.of(model), layout, model.prompt, int(model.audio_id), compressed)

    @property
    def cp_size(self) -> int:
        return int(self.layout.cp_size)

    def __call__(self, batch: Any) -> list[bool]:
        batch = as_conversation(batch, self.prompt)
        plan = plan_audio(self.shape, self.layout, batch, audio_id=self.audio_id, compressed=self.compressed)
        rank = self.layout.cp_rank
        return [rank in ranks for ranks in plan.readers(self.layout.cp_size)]
