"""Each sequence's own cross-entropy, beside the micro-batch's sum (`SpeechLLM.forward(per_seq=True)`).

Validation's audio reliance (`speechlm.use.evaluator`) compares each row's teacher-forced CE with its own
clips against the same row with another sample's clips, per (task, language), so it needs the CE of every
sequence, not only their sum. Letters: M labelled positions, V vocabulary, N sequences of this rank's
stream, B rows of the micro-batch.

Under context parallelism a rank holds its chunks of each split sequence (and the whole sequences placed
on it): the CE of its labelled rows, summed per sequence, is its share of that sequence's CE, and the
shares summed over the CP group give the whole (as the CE sums are summed). The labels are shifted before
sharding, so a labelled row belongs to the sequence whose ``cu_seqlens`` span holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def ce_of_sequences(logits_MV: Tensor, labels_M: Tensor, cu_seqlens: Tensor, rows_M: Tensor) -> Tensor:
    """[N] fp32: the summed token CE of each sequence of a THD stream with boundaries ``cu_seqlens`` ([N + 1]),
    from the logits and labels of its labelled rows ``rows_M``."""
    cu = cu_seqlens.to(device=rows_M.device, dtype=rows_M.dtype)
    return _sum_per(logits_MV, labels_M, torch.searchsorted(cu[1:], rows_M, right=True), len(cu) - 1)


def ce_of_rows(logits_BSV: Tensor, labels_BS: Tensor, keep_BS: Tensor) -> Tensor:
    """[B] fp32: the summed token CE of each row of a BSHD batch over its labelled positions ``keep_BS``."""
    return _sum_per(logits_BSV[keep_BS], labels_BS[keep_BS], keep_BS.nonzero()[:, 0], int(keep_BS.shape[0]))


def _sum_per(logits_MV: Tensor, labels_M: Tensor, group_M: Tensor, n: int) -> Tensor:
    ce_M = nn.functional.cross_entropy(logits_MV.float(), labels_M, reduction="none")
    return ce_M.new_zeros(n).index_add_(0, group_M.to(ce_M.device), ce_M)


def to_micro_batch_rows(ce_N: Tensor | None, local: Sequence[int], n_rows: int) -> Tensor | None:
    """[B]: the CE of this rank's sequences (``local``: the micro-batch row of each, in stream order) at their
    rows, 0 for the rows placed on another CP rank; None for None (``per_seq`` off)."""
    if ce_N is None:
        return None
    return ce_N.new_zeros(n_rows).index_add_(0, torch.tensor(list(local), device=ce_N.device), ce_N)
