"""Each CP rank decodes only the clips its encoder reads (issue 40; ``data.decode_local``).

Shapes: C clips of a micro-batch, N audio samples.

Lockstep gives every CP and TP peer the same micro-batch. Today each peer also decoded every clip of it,
although under dynamic CP a clip is encoded on one rank (or sharded over the group). The placement is a
pure function of lengths known before decoding, so:

    SpeechDataset(defer_audio=True)[i]   the row's texts checked and rendered, each clip's length read
                                         from its header (`audio.probe_length`); the length checks of
                                         today (missing, empty, cut beyond the end, duration mismatch)
                                         drop the row on every rank alike
    LocalCollator(pad_id, planner)       the Batch as today, its ``audio_lens`` from the headers; then
                                         ``planner(batch)`` (`speechlm.model.clip_planner.ClipPlanner`: the
                                         model's own placement, on this rank) says which clips this rank
                                         reads; those are decoded, the others' rows of ``audio`` stay
                                         empty and ``audio_present`` says so (the model refuses to encode
                                         one: `cp_audio.check_clips_present`)

The batch, its rows, lengths, drop counts and so the losses are those of decoding everything: a row is
dropped for what every rank can see (its texts, its header). A clip that fails only when decoded (a
stream broken past its header, as the demo corpus holds, NaN samples, a length other than its header's)
is seen by its encoding rank alone, which cannot drop its row without the ranks' batches parting. It marks
the micro-batch (``Batch.local_failure``, the row named in a warning); the step's agreement (one flag in
its all-reduce, `speechlm.train.module.SpeechLLMModule._agree_step`) has every rank read that step's rows
again with every clip decoded (`speechlm.train.data.StepLoader.redecode`), so the row is dropped and
counted as today, and a micro-batch with too much unreadable fails the step on every rank with the rows
named (``data.max_dropped_fraction``), as today. The cost: one step decoded whole, per broken clip.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from speechlm.data.audio import AudioDecodeError
from speechlm.data.batch import Batch, Collator
from speechlm.data.samples import DroppedSample, PendingClip, Sample
from speechlm.data.sources.members import MemberError

__all__ = ["LocalCollator", "Planner", "decode_clips"]

logger = logging.getLogger(__name__)

Planner = Callable[[Batch], list[bool]]


def decode_clips(pending: Sequence[PendingClip], needed: Sequence[bool]) -> tuple[list[Any], str | None]:
    """The decoded samples of the ``needed`` clips (None for the others), and the first failure's message
    (a decode error, or a length other than the header's), None when all decoded."""
    out: list[Any] = [None] * len(pending)
    for c, (clip, want) in enumerate(zip(pending, needed, strict=True)):
        if not want:
            continue
        try:
            audio_N = clip.load()
        except (FileNotFoundError, AudioDecodeError, MemberError) as e:
            return out, f"{clip.where} fails to decode on the CP rank that encodes it ({e})"
        if audio_N.size != clip.samples:
            return out, (
                f"{clip.where} decodes to {audio_N.size} samples, but its header says {clip.samples} (the CP "
                "placement was made from the header)"
            )
        out[c] = torch.from_numpy(audio_N)
    return out, None


class LocalCollator(Collator):
    """collate_fn of `SpeechDataset(defer_audio=True)`: the Batch of `Collator`, with this rank's clips
    decoded (module docstring). ``planner``: collated batch -> per clip, whether this rank reads it."""

    def __init__(self, pad_id: int, planner: Planner) -> None:
        super().__init__(pad_id)
        self.planner = planner

    def __repr__(self) -> str:
        return f"LocalCollator(pad_id={self.pad_id}, planner={self.planner!r})"

    def __call__(self, items: Sequence[Sample | DroppedSample]) -> Batch:
        batch = super().__call__(items)
        if batch.is_empty:
            return batch
        pending = [p for s in items if isinstance(s, Sample) for p in s.pending]
        if len(pending) != batch.num_clips:
            raise ValueError(
                "LocalCollator collates samples read with SpeechDataset(defer_audio=True); got "
                f"{len(pending)} pending clips for {batch.num_clips} clips"
            )
        needed = [bool(x) for x in self.planner(batch)]
        decoded, error = decode_clips(pending, needed)
        width = max((int(a.numel()) for a in decoded if a is not None), default=0)
        audio_CN = torch.zeros(batch.num_clips, width, dtype=torch.float32)
        for c, a in enumerate(decoded):
            if a is not None:
                audio_CN[c, : a.numel()] = a
        present = torch.tensor([a is not None for a in decoded], dtype=torch.bool)
        rows = [x.index for x in items]
        if error is not None:
            logger.warning("%s; the step's micro-batches are decoded whole on every rank", error)
        return replace(batch, audio=audio_CN, audio_present=present, source_rows=rows, local_failure=error)
