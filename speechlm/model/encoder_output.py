"""`EncoderOutput`: a micro-batch's audio side on this rank, the one type the encoder, the CP layout, the CTC
and the packing pass along (`SpeechLLM.encode_audio`, `speechlm.model.cp_audio`, `speechlm.model.ctc`).

Letters: B clips, U encoder frames, E encoder width, A_i projected rows of clip i, H LLM hidden, P rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from speechlm.model.packed_encoder import PackedFrames


@dataclass
class EncoderOutput:
    """A micro-batch's audio side on this rank: what `SpeechLLM.encode_audio` returns for every clip, and
    what `encode_for_layout` gets back from the CP layout (`parallel.cp_layout.CPLayout.encode`)."""

    # per clip [A_i, H], ready to splice into the prompt; None where the clip lives on another CP rank
    embeds: list[Tensor | None]
    # encoder output of the clips this rank encoded (`ctc_rows`): PackedFrames ([sum U_b, E], the
    # padding-free encoder) or [B, U, E] (padded encoder; frames past each clip are zero)
    enc_hidden: PackedFrames | Tensor
    enc_lens_B: Tensor  # int64 encoder frames per clip of enc_hidden
    # the batch rows of enc_hidden's clips, in order (CP: only those this rank encoded, so each clip's
    # CTC counts once); empty: enc_hidden is a dummy clip's, kept in the graph with ctc_weight 0
    ctc_rows: list[int]
    ctc_weight: float = 1.0
    # a dummy clip's embeddings no sample uses (this rank has no clip: samples without audio); the
    # loss keeps them with weight 0 so the projector and encoder stay in every rank's backward
    unused: list[Tensor] = field(default_factory=list)
    # sharded clips (`finish_sharded`) whose CTC this rank computes: (batch row, the clip's encoder
    # frames [U, E], every rank's slice gathered)
    ctc_extra: list[tuple[int, Tensor]] = field(default_factory=list)
    # feature frames of the sharded clips' slices this rank encoded (the FLOP count)
    slice_feature_frames: list[int] = field(default_factory=list)
    # this rank's slices of the sharded clips as the encoder and projector left them: (encoder frames
    # [U, E], projected rows [P, H]) per clip, until `finish_sharded` hands them over
    slices: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # True: each entry of ``slices`` is the whole clip, on every rank (its frames gathered, its compressed
    # rows: CTC compression, `speechlm.model.compression.gather_sharded_clip`), not this rank's slice
    slices_whole: bool = False

    @property
    def enc_lens(self) -> Tensor:
        return self.enc_lens_B

    def embeds_of(self, clips: Sequence[int]) -> list[Tensor]:
        """The embeddings of ``clips``, which must all be on this rank."""
        out = [self.embeds[i] for i in clips]
        missing = [i for i, e in zip(clips, out) if e is None]
        if missing:
            raise ValueError(f"clips {missing} were encoded on another CP rank and not gathered to this one")
        return [e for e in out if e is not None]


def whole_clips_output(
    proj: Tensor, proj_lens_B: Tensor, enc_hidden: Tensor, enc_lens_B: Tensor, packed: bool
) -> EncoderOutput:
    """`SpeechLLM.encode_audio`'s result for its whole clips: projected rows per clip, the encoder's frames
    (`PackedFrames` from the padding-free encoder)."""
    rows = list(range(int(proj_lens_B.numel())))
    if packed:
        embeds: list[Tensor | None] = list(torch.split(proj, [int(n) for n in proj_lens_B.tolist()]))
        return EncoderOutput(embeds, PackedFrames(enc_hidden, enc_lens_B), enc_lens_B, rows)
    embeds = [proj[i, :n] for i, n in enumerate(proj_lens_B.tolist())]
    return EncoderOutput(embeds, enc_hidden, enc_lens_B, rows)


def projected_output(
    projector: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    enc_hidden: Tensor,
    enc_lens_B: Tensor,
    packed: bool,
    slice_hidden: Sequence[Tensor] = (),
) -> EncoderOutput:
    """The projector on the whole clips' frames and each CP slice's (``slice_hidden``), in ONE call (a slice
    is cut on the stack: exact); the slices' (frames, projected rows) in ``EncoderOutput.slices``."""
    if not slice_hidden:
        proj, proj_lens_B = projector(enc_hidden, enc_lens_B)
        return whole_clips_output(proj, proj_lens_B, enc_hidden, enc_lens_B, packed)
    lens_all = torch.cat([enc_lens_B, enc_lens_B.new_tensor([int(h.shape[0]) for h in slice_hidden])])
    proj_all, proj_lens_all = projector(torch.cat([enc_hidden, *slice_hidden]), lens_all)
    n_clips = int(enc_lens_B.numel())
    rows = [int(n) for n in proj_lens_all.tolist()]
    proj_parts = torch.split(proj_all, [sum(rows[:n_clips]), *rows[n_clips:]])
    out = whole_clips_output(proj_parts[0], proj_lens_all[:n_clips], enc_hidden, enc_lens_B, packed)
    out.slices = list(zip(slice_hidden, proj_parts[1:], strict=True))
    return out
