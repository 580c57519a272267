"""CTC-compressed audio rows: one LLM row per token the CTC head hears, not one per encoder frame.

Letters: B clips, U encoder frames (packed, ``sum U_b``), E encoder width, R kept rows (``sum R_b``).

``model.audio_compression: ctc`` (`SpeechLLM.encode_audio`) reads the CTC head's argmax on every encoder
frame, cuts each clip into runs of frames with the same argmax, drops the runs whose argmax is the blank and
replaces each remaining run by the mean of its frames. The projector then sees one frame per emitted CTC
token, in order: a clip of ``n`` heard tokens gives about ``n`` rows where it gave ``U / stack`` before
(40 ms frames: about 25 rows per second, a few per second after compression). This is the blank-removal and
merge of decoder-only ASR with CTC prompts (Tsunoo et al., 2024) with the averaging of the "CTC compressor"
(Gaido et al., 2021). The argmax carries no gradient; the mean does (each frame of a kept run gets
``1 / len`` of its row's gradient), so the LLM's loss still trains the encoder through the kept frames.

A clip sharded over the CP group (a long clip of the limited-context padding-free encoder) is compressed
whole, as one process compresses it: each rank runs the CTC head on its own slice (in the one head call
with its whole clips' frames), the slices' frames and argmax labels are all-gathered (`compressed_output`;
the frames' all-gather is the one the clip's CTC loss needs anyway), and every rank compresses the whole
clip, so a run that crosses a slice cut stays one row and the all-blank rule sees the whole clip. Every
rank projects the clip's few compressed rows (docs/parallelism.md, "CTC-compressed audio under CP").

A clip whose frames are all blank (the CTC head before it leaves its blank plateau, or silence) keeps ONE
row, the mean of all its frames, so every clip reaches the LLM and the projector stays in the graph. A clip
of 0 frames keeps 0 rows. The function is pure (tensors in, tensors out) and runs on the device of its input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from speechlm.model.encoder_output import EncoderOutput
from speechlm.model.packed_encoder import PackedFrames
from speechlm.model.projector import FrameStackProjector


def ctc_runs(labels_U: Tensor, lens_B: Tensor, blank: int) -> tuple[Tensor, Tensor, Tensor]:
    """Which row each frame goes to: ``(row_of_frame [U] (-1: dropped), rows_B [B], frames_of_row [R])``.

    Runs are cut where the argmax label changes and at every clip boundary; a run of blanks is dropped,
    except that a clip with no other run keeps all its frames as one row (module docstring)."""
    device = labels_U.device
    lens_B = lens_B.to(device=device, dtype=torch.long)
    B, U = int(lens_B.numel()), int(labels_U.numel())
    if int(lens_B.sum()) != U:
        raise ValueError(f"{U} frame labels for clips of {int(lens_B.sum())} frames in all")
    if U == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, torch.zeros(B, dtype=torch.long, device=device), empty
    clip_U = torch.repeat_interleave(torch.arange(B, device=device), lens_B, output_size=U)
    clip_start = torch.zeros(U, dtype=torch.bool, device=device)
    clip_start[(torch.cumsum(lens_B, 0) - lens_B)[lens_B > 0]] = True
    new_run = clip_start.clone()
    new_run[1:] |= labels_U[1:] != labels_U[:-1]
    heard_U = labels_U != blank
    heard_B = torch.zeros(B, dtype=torch.long, device=device).index_add_(0, clip_U, heard_U.long())
    silent_U = (heard_B == 0)[clip_U]  # frames of clips that heard nothing: one run, kept
    new_run &= ~silent_U | clip_start
    keep_U = heard_U | silent_U
    run_U = torch.cumsum(new_run.long(), 0) - 1
    starts = torch.nonzero(new_run).flatten()
    keep_run = keep_U[starts]
    row_of_run = torch.cumsum(keep_run.long(), 0) - 1
    row_of_frame = torch.where(keep_U, row_of_run[run_U], torch.full_like(run_U, -1))
    rows_B = torch.zeros(B, dtype=torch.long, device=device).index_add_(0, clip_U[starts], keep_run.long())
    kept = row_of_frame[keep_U]
    frames_of_row = torch.bincount(kept, minlength=int(keep_run.sum()))
    return row_of_frame, rows_B, frames_of_row


def compress_frames(frames_UE: Tensor, labels_U: Tensor, lens_B: Tensor, blank: int) -> tuple[Tensor, Tensor]:
    """Packed encoder frames ``[sum U_b, E]`` -> ``([sum R_b, E], R_b)``: the mean of each kept run
    (`ctc_runs`), clips in order."""
    runs = ctc_runs(labels_U, lens_B, blank)
    return _mean_of_runs(frames_UE, runs), runs[1]


def _mean_of_runs(frames_UE: Tensor, runs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    row_of_frame, _, frames_of_row = runs
    keep = row_of_frame >= 0
    out = frames_UE.new_zeros(int(frames_of_row.numel()), frames_UE.shape[1])
    out = out.index_add(0, row_of_frame[keep], frames_UE[keep])
    return out / frames_of_row.clamp(min=1).to(out.dtype)[:, None]


def heard_tokens(labels_U: Tensor, lens_B: Tensor, blank: int) -> Tensor:
    """Per kept row (`ctc_runs`), the token the CTC head heard there, or -1 for the one row of a clip that
    heard nothing."""
    return _token_of_runs(labels_U, ctc_runs(labels_U, lens_B, blank), blank)


def _token_of_runs(labels_U: Tensor, runs: tuple[Tensor, Tensor, Tensor], blank: int) -> Tensor:
    row_of_frame, _, frames_of_row = runs
    keep = row_of_frame >= 0
    out = labels_U.new_full((int(frames_of_row.numel()),), -1)
    out = out.index_copy(0, row_of_frame[keep].flip(0), labels_U[keep].flip(0))  # a run's frames share it
    return torch.where(out == blank, -1, out)


def frame_labels(ctc_head: nn.Module, frames_UE: Tensor) -> Tensor:
    """The CTC head's argmax per frame (no gradient): which token, or the blank, each frame hears."""
    with torch.no_grad():
        return ctc_head(frames_UE).argmax(dim=-1)


def compressed_output(
    ctc_head: nn.Module | None,
    projector: FrameStackProjector,
    blank: int,
    enc_hidden: Tensor,
    enc_lens_B: Tensor,
    packed: bool,
    embed_tokens: Callable[[Tensor], Tensor] | None = None,
    gate: Tensor | None = None,
    *,
    slices: Sequence[tuple[Tensor, Sequence[int], tuple[int, int]]] = (),
    gather: Callable[[Tensor, Sequence[int], tuple[int, int]], Tensor] | None = None,
) -> EncoderOutput:
    """`SpeechLLM.encode_audio`'s result with ``model.audio_compression: ctc``: the encoder's frames kept as
    they are (the CTC loss and joint decoding read them), the projector run on the compressed frames.
    ``embed_tokens`` (``model.audio_token_embedding``): each row also gets the LLM's input embedding of the
    token the CTC head heard there (none for a clip's silent row), in one call whatever the batch holds, and
    the projected frames are scaled by ``gate`` (a learnt scalar that starts at 0: the rows start as the
    heard tokens' embeddings, at the scale the decoder knows, and the acoustic side grows in as it helps).
    ``slices``: this rank's slice ``[U_r, E]`` of each clip sharded over the CP group, with the encoder
    frames of every rank's slice (rank order) and the group's ranks (`ClipSlice.group`); ``gather`` (`CPLayout.gather_slices`, differentiable) brings
    each whole clip's frames and labels to every rank, where it is compressed and projected in the same
    calls as the whole clips; ``(frames [U, E], rows)`` of each comes back in ``EncoderOutput.slices`` with
    ``slices_whole`` set. The head runs once (FSDP: one call per micro-batch, whatever it holds)."""
    if ctc_head is None:
        raise ValueError("model.audio_compression=ctc needs the CTC head: set model.ctc_weight > 0")
    if projector.stack != 1:
        raise ValueError(f"model.audio_compression=ctc needs model.projector_stack=1, not {projector.stack}")
    lens_B = enc_lens_B.to(device=enc_hidden.device, dtype=torch.long)
    if packed:
        frames_UE = enc_hidden
    else:  # padded [B, U, E]: the real frames, clip after clip
        valid_BU = torch.arange(enc_hidden.shape[1], device=enc_hidden.device)[None, :] < lens_B[:, None]
        frames_UE = enc_hidden[valid_BU]
    n_whole, n_frames = int(lens_B.numel()), int(frames_UE.shape[0])
    labels_U = frame_labels(ctc_head, torch.cat([frames_UE, *(h.to(frames_UE.dtype) for h, _, _ in slices)]))
    sharded = []  # each sharded clip whole: (frames, labels), every rank's slice gathered
    if slices:
        if gather is None:
            raise ValueError("compressing a clip sharded over the CP group needs the layout's gather")
        cuts = [n_frames, *(int(h.shape[0]) for h, _, _ in slices)]
        labels_U, *slice_labels = torch.split(labels_U, cuts)
        for (h, counts, group), lab in zip(slices, slice_labels, strict=True):
            sharded.append((gather(h, counts, group), gather(lab[:, None], counts, group)[:, 0]))
        # the sharded clips after the whole ones, as further clips of the same calls
        frames_UE = torch.cat([frames_UE, *(f.to(frames_UE.dtype) for f, _ in sharded)])
        labels_U = torch.cat([labels_U, *(lab.to(labels_U.dtype) for _, lab in sharded)])
        lens_B = torch.cat([lens_B, lens_B.new_tensor([int(f.shape[0]) for f, _ in sharded])])
    runs = ctc_runs(labels_U, lens_B, blank)  # once: the rows' frames and their tokens both read it
    rows_B = runs[1]
    proj_RH, _ = projector(_mean_of_runs(frames_UE, runs), rows_B)
    if embed_tokens is not None:
        heard_R = _token_of_runs(labels_U, runs, blank)
        tok_RH = embed_tokens(heard_R.clamp(min=0)) * (heard_R >= 0)[:, None]
        if gate is not None:
            proj_RH = proj_RH * gate.to(proj_RH.dtype)
        proj_RH = proj_RH + tok_RH.to(proj_RH.dtype)
    parts = list(torch.split(proj_RH, [int(n) for n in rows_B.tolist()]))
    embeds: list[Tensor | None] = list(parts[:n_whole])
    hidden: PackedFrames | Tensor = PackedFrames(enc_hidden, enc_lens_B) if packed else enc_hidden
    out = EncoderOutput(embeds, hidden, enc_lens_B, list(range(n_whole)))
    out.slices = [(f, rows) for (f, _), rows in zip(sharded, parts[n_whole:], strict=True)]
    out.slices_whole = bool(sharded)
    return out
