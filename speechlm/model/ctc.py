"""The CTC side of a speech LLM: a linear head over the encoder frames (before the projector), over the
text tokenizer's ids, and its loss.

Letters: B clips, U encoder frames, E encoder width, V vocabulary, L target tokens.

blank = the model's ``ctc_blank_id`` (``pad_id`` for the SentencePiece tokenizer, the audio placeholder for a
pretrained LLM's tokenizer, whose pad may be its EOS: a blank must never be a target); the loss is summed
over clips with ``zero_infinity``. The targets are the batch's tokens as collated, language tag first:
`ctc_targets` drops the leading ``ctc_skip_leading`` tokens (the tag has no acoustic counterpart, the LLM
predicts it).

The encoder frames come as `PackedFrames` (the padding-free encoder: the head and the log-softmax run on
the real frames only, laid out as ``[max U, B, V]`` for the loss kernel) or a padded ``[B, U, E]`` tensor.
Every function takes the model (`SpeechLLM`, seen as a `CTCModel`) for its head, blank, pad and skip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from speechlm.model.packed_encoder import PackedFrames

if TYPE_CHECKING:
    from speechlm.model.encoder_output import EncoderOutput


class CTCModel(Protocol):
    """What the CTC functions read of the model (`SpeechLLM` has it)."""

    @property
    def ctc_head(self) -> nn.Linear | None: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def ctc_blank_id(self) -> int: ...
    @property
    def ctc_skip_leading(self) -> int: ...


def packed_to_time_major(x_UV: Tensor, lens_B: Tensor) -> Tensor:
    """Packed rows ``[sum U_b, V]`` -> ``[max U, B, V]`` (zeros past each clip, never read by the loss)."""
    B = lens_B.numel()
    max_len = int(lens_B.max()) if B else 0
    starts_B = torch.cumsum(lens_B, 0) - lens_B
    clip_U = torch.repeat_interleave(torch.arange(B, device=x_UV.device), lens_B, output_size=x_UV.shape[0])
    t_U = torch.arange(x_UV.shape[0], device=x_UV.device) - starts_B[clip_U]
    out = x_UV.new_zeros(max_len * B, x_UV.shape[1])
    return out.index_copy(0, t_U * B + clip_U, x_UV).view(max_len, B, x_UV.shape[1])


def ctc_log_prob_rows(model: CTCModel, enc_hidden: PackedFrames | Tensor) -> Tensor:
    """The CTC head's fp32 log-probabilities in the frames' own layout: ``[sum U_b, V]`` packed, or
    ``[B, U, V]``."""
    if model.ctc_head is None:
        raise RuntimeError("this model has no CTC head (model.ctc_weight=0)")
    hidden: Tensor = enc_hidden.data_UE if isinstance(enc_hidden, PackedFrames) else enc_hidden
    logits = model.ctc_head(hidden)  # in the compute dtype (autocast / FSDP params)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return logits.float().log_softmax(dim=-1)


def ctc_log_probs(model: CTCModel, enc_hidden: PackedFrames | Tensor, enc_lens_B: Tensor) -> Tensor:
    """The CTC head's fp32 log-probabilities ``[max U, B, V]`` (zeros past each clip): what the loss reads."""
    log_probs = ctc_log_prob_rows(model, enc_hidden)
    if isinstance(enc_hidden, PackedFrames):
        return packed_to_time_major(log_probs, enc_lens_B.to(device=log_probs.device, dtype=torch.long))
    return log_probs.transpose(0, 1)


def ctc_targets(tokens_BL: Tensor, token_lens_B: Tensor, *, skip: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """CTC targets from the collated tokens: drop the first ``skip`` (the language tag)."""
    lens_B = (token_lens_B.to(torch.long) - skip).clamp(min=0)
    targets_BL = tokens_BL[:, skip:]
    if targets_BL.shape[1] == 0:  # ctc_loss wants at least one column
        targets_BL = tokens_BL.new_full((tokens_BL.shape[0], 1), pad_id)
    return targets_BL, lens_B


def ctc_loss_sum(
    model: CTCModel,
    enc_hidden: PackedFrames | Tensor,
    enc_lens_B: Tensor,
    tokens_BL: Tensor,
    token_lens_B: Tensor,
    weights_B: Tensor | None = None,
) -> tuple[Tensor, int]:
    """Summed CTC loss over the clips (fp32, impossible alignments count 0) and their number.
    ``weights_B``: a weight per clip (0 for a clip without a transcript); None sums every clip."""
    log_probs_UBV = ctc_log_probs(model, enc_hidden, enc_lens_B)
    device = log_probs_UBV.device
    n_clips = int(enc_lens_B.numel())
    if log_probs_UBV.shape[0] == 0:
        # every clip has 0 frames (a CP rank may encode only such clips): nothing to score, and ctc_loss
        # refuses an empty input; the sum (0) keeps the head in the graph
        return log_probs_UBV.sum(), n_clips
    lens_B = enc_lens_B.to(device=device, dtype=torch.long)
    targets_BL, target_lens_B = ctc_targets(
        tokens_BL.to(device), token_lens_B.to(device), skip=model.ctc_skip_leading, pad_id=model.pad_id
    )
    with torch.autocast(device_type=device.type, enabled=False):
        loss = nn.functional.ctc_loss(
            log_probs_UBV,
            targets_BL.to(torch.long),
            lens_B,
            target_lens_B,
            blank=model.ctc_blank_id,
            reduction="sum" if weights_B is None else "none",
            zero_infinity=True,
        )
        if weights_B is not None:
            loss = (loss * weights_B.to(device=device, dtype=loss.dtype)).sum()
    return loss, n_clips


def ctc_of(model: CTCModel, enc: EncoderOutput, tokens_CL: Tensor, token_lens_C: Tensor) -> Tensor:
    """Weighted CTC sum of the clips in ``enc`` against their transcripts (a row per clip; a clip of length
    0, no transcript, gets weight 0). A dummy clip's counts with weight 0: the head stays in the graph, so
    FSDP's reduce-scatter of it runs on every rank. The sharded clips this rank scores (``enc.ctc_extra``)
    join the same head call (FSDP: one call per rank, like its peers), each with weight 1 where it has a
    transcript."""
    weights = None
    if enc.ctc_rows:
        tokens, lens = tokens_CL[enc.ctc_rows], token_lens_C[enc.ctc_rows]
        weights = (lens > 0).to(torch.float32)
    else:
        n = len(enc.enc_lens_B)
        tokens = torch.full((n, 2), model.eos_id, dtype=torch.long, device=tokens_CL.device)
        lens = torch.full((n,), 2, dtype=torch.long, device=tokens_CL.device)
    if not enc.ctc_extra:
        ctc_sum, _ = ctc_loss_sum(model, enc.enc_hidden, enc.enc_lens_B, tokens, lens, weights)
        return ctc_sum * enc.ctc_weight
    if not isinstance(enc.enc_hidden, PackedFrames):
        raise RuntimeError("a sharded clip needs the padding-free encoder (model.encoder.packed)")
    rows = [c for c, _ in enc.ctc_extra]
    extra_tokens, extra_lens = tokens_CL[rows], token_lens_C[rows]
    data = enc.enc_hidden.data_UE
    hidden = PackedFrames(
        torch.cat([data, *(h.to(data.dtype) for _, h in enc.ctc_extra)]),
        torch.cat([enc.enc_lens_B, enc.enc_lens_B.new_tensor([int(h.shape[0]) for _, h in enc.ctc_extra])]),
    )
    width = max(tokens.shape[1], extra_tokens.shape[1])
    all_tokens = torch.cat(
        [nn.functional.pad(t, (0, width - t.shape[1]), value=model.pad_id) for t in (tokens, extra_tokens)]
    )
    w_base = torch.ones(len(lens)) if weights is None else weights.float().cpu()
    all_w = torch.cat([w_base * enc.ctc_weight, (extra_lens > 0).float().cpu()])
    ctc_sum, _ = ctc_loss_sum(model, hidden, hidden.lens_B, all_tokens, torch.cat([lens, extra_lens]), all_w)
    return ctc_sum
