"""The model of a run, built from its config and its tokenizer's ids: what training
(`speechlm.train.module.SpeechLLMModule`) and a checkpoint's reader (`speechlm.use.checkpoint`) both build.

`build_speech_llm` makes the `SpeechLLM` and marks what trains (`apply_train_modes`: full, frozen or
LoRA, before any parallelism). Its parameters are named ``model.<name>`` in checkpoints (the training
module holds it as ``.model``): `frozen_state_keys` gives those names of the frozen parameters, which
checkpoints leave out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from speechlm.config import ModelConfig
from speechlm.model.speech_llm import SpeechLLM
from speechlm.model.trainable import apply_train_modes, train_modes_of

if TYPE_CHECKING:
    from speechlm.packing.prompt import PromptFormat


class TokenIds(Protocol):
    """What the model needs from the run's tokenizer (`speechlm.data.run_inputs.TokenizerInfo`)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def audio_id(self) -> int: ...
    @property
    def instruction_ids(self) -> tuple[int, ...]: ...
    @property
    def prompt(self) -> PromptFormat | None: ...
    @property
    def ctc_blank_id(self) -> int | None: ...
    @property
    def ctc_skip_leading(self) -> int: ...
    @property
    def added_token_ids(self) -> tuple[int, ...]: ...


def build_speech_llm(cfg: ModelConfig, tok: TokenIds) -> SpeechLLM:
    """The run's `SpeechLLM` with what trains marked (before parallelism)."""
    model = SpeechLLM(
        cfg,
        vocab_size=tok.vocab_size,
        pad_id=tok.pad_id,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        audio_id=tok.audio_id,
        instruction_ids=tok.instruction_ids,
        prompt=tok.prompt,
        ctc_blank_id=tok.ctc_blank_id,
        ctc_skip_leading=tok.ctc_skip_leading,
        added_token_ids=tok.added_token_ids,
    )
    apply_train_modes(model, cfg)  # what trains: full, frozen or LoRA (before parallelism)
    return model


def frozen_state_keys(model: SpeechLLM) -> frozenset[str]:
    """The checkpoint names (``model.<name>``) of `model`'s frozen parameters (left out of checkpoints)."""
    return frozenset(f"model.{name}" for name in train_modes_of(model).frozen)
