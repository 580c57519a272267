"""The oracle prefix (``model.audio_prefix: oracle``): each clip's projected audio replaced by the LLM's own
embeddings of the clip's transcript, a diagnostic of the decoder's half of the problem.

A speech LLM transcribes only if its decoder can find, in the audio rows before the answer, the token it
must write next. The oracle hands it the best such rows there can be, the transcript's own token
embeddings, through the same splice, packing, positions, masks, THD/BSHD and CP paths, and greedy decoding
through the same rows: if the decoder cannot learn to copy from them quickly, it will not learn to read
audio (docs/training.md, "The LLM alone"). With ``model.audio_compression: ctc`` a clip's oracle has one
row per transcript token (what perfect compression would give; a clip without a transcript keeps one zero
row, as compression keeps one row); otherwise it keeps the clip's length, the tokens first and zeros after
(tokens past the clip's rows are cut).

The encoder and projector still run (their output joins the loss with weight 0, so every parameter has a
gradient, as FSDP and DDP need) and the CTC loss still trains them. The transcript is the clip's CTC
target past the first ``skip`` tokens (the language tag); decoding needs it, so the oracle evaluates and
validates but cannot transcribe new audio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from speechlm.config import ModelConfig
from speechlm.model.encoder_output import EncoderOutput


class OracleModel(Protocol):
    """What the oracle reads of the model (`SpeechLLM` has it)."""

    cfg: ModelConfig

    @property
    def ctc_skip_leading(self) -> int: ...
    def embed_tokens(self, ids: Tensor) -> Tensor: ...


def apply_oracle(
    enc: EncoderOutput,
    embed_tokens: Callable[[Tensor], Tensor],
    tokens_CL: Tensor,
    lens_C: Tensor,
    *,
    skip: int,
    one_row_per_token: bool,
) -> None:
    """Replace ``enc.embeds`` (the clips on this rank) by the transcripts' embeddings, in place; the replaced
    rows join ``enc.unused``. One `embed_tokens` call whatever the batch holds (FSDP gathers on each)."""
    present = [c for c, e in enumerate(enc.embeds) if e is not None]
    lens = [max(int(lens_C[c]) - skip, 0) for c in present]
    ids = [tokens_CL[c, skip : skip + n] for c, n in zip(present, lens)]
    flat = embed_tokens(
        torch.cat([i.reshape(-1) for i in ids] or [tokens_CL.new_zeros(0)]).to(tokens_CL.device)
    )
    pieces = torch.split(flat, lens)
    for c, piece in zip(present, pieces):
        old = enc.embeds[c]
        assert old is not None  # present
        rows = max(int(piece.shape[0]), 1) if one_row_per_token else int(old.shape[0])
        new = old.new_zeros(rows, old.shape[1])
        n = min(rows, int(piece.shape[0]))
        new = torch.cat([piece[:n].to(old.dtype), new[n:]])
        enc.unused.append(old)
        enc.embeds[c] = new


def fill_with_transcripts(model: OracleModel, enc: EncoderOutput, tokens_CL: Tensor, lens_C: Tensor) -> None:
    """`apply_oracle` with the model's embedding, language-tag skip and row rule (one row per token with
    ``model.audio_compression``)."""
    one_row = model.cfg.audio_compression != "none"
    apply_oracle(
        enc, model.embed_tokens, tokens_CL, lens_C, skip=model.ctc_skip_leading, one_row_per_token=one_row
    )
