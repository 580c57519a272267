"""Token cost model: what one row costs against the batch budget, as exact integers.

A row costs its duration in seconds, or with a token budget (`max_batch_tokens`) its LLM tokens:
audio tokens = ceil(ceil(d * fps / subsampling) / projector_stack), plus text tokens, plus
`prompt_tokens`; cost = tokens + length_penalty * tokens^2 (the quadratic term charges long rows
for attention, whose work grows with length squared). The packer compares integers: costs in
microseconds or thousandths of a token, rounded up, against the budget rounded down.
`build.token_cost_of` fills the model in from the encoder (its subsampling) and the projector. Text tokens
are estimated from characters (`text_tokens_of`: ceil(chars / `CHARS_PER_TOKEN`)) where no tokenizer runs:
the sampler, `speechlm plan`, `manifest stats` and `speechlm estimate`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from parallel.frames import FEATURE_FRAMES_PER_SECOND, planned_encoder_frames

SECOND_UNITS = 1_000_000  # duration costs are integer microseconds
TOKEN_UNITS = 1_000  # token costs are integer thousandths of a token
PIECE_ROWS = 1 << 20  # rows per piece where a pass over all of them would need 10M-row temporaries


@dataclasses.dataclass(frozen=True)
class TokenCostModel:
    """Tokens one utterance puts into the LLM: audio after encoder + projector, text, prompt."""

    audio_frames_per_second: float = float(FEATURE_FRAMES_PER_SECOND)
    encoder_subsampling: int = 8
    projector_stack: int = 2
    prompt_tokens: int = 4

    def count_tokens(self, durations: np.ndarray, text_tokens: np.ndarray | None = None) -> np.ndarray:
        """Tokens per row (int64): ceil(ceil(d * fps / subsampling) / stack) + text + prompt."""
        encoded = planned_encoder_frames(
            np.asarray(durations, dtype=np.float64),
            self.encoder_subsampling,
            ceil=np.ceil,
            frames_per_second=self.audio_frames_per_second,
        )
        tokens = np.ceil(encoded / self.projector_stack).astype(np.int64)
        tokens += self.prompt_tokens
        if text_tokens is not None:
            tokens += np.asarray(text_tokens, dtype=np.int64)
        return tokens


def compute_row_sizes(
    durations: np.ndarray,
    token_lengths: np.ndarray | None,
    *,
    max_batch_tokens: int | None,
    length_penalty: float,
    token_cost: TokenCostModel,
) -> np.ndarray:
    """What the budget counts per row (float64): seconds, or tokens + penalty * tokens^2."""
    if max_batch_tokens is None:
        return np.asarray(durations, dtype=np.float64)
    tokens = token_cost.count_tokens(durations, token_lengths).astype(np.float64)
    if length_penalty:
        tokens += length_penalty * tokens * tokens
    return tokens


def quantize_costs(
    sizes: np.ndarray, budget: float, units: int, *, piece_rows: int = PIECE_ROWS
) -> tuple[np.ndarray, int]:
    """Integer costs (rounded up; int32 where they fit) and budget (rounded down), so sums are exact and
    never exceed the budget."""
    sizes = np.asarray(sizes)
    # int32 where every cost fits (half the memory of 10M rows; pack_greedy sums in int64); rounding is
    # monotonic, so the largest cost is that of the largest size
    small = sizes.size == 0 or float(np.ceil(float(np.max(sizes)) * units)) < 2**31
    costs = np.empty(sizes.shape, np.int32 if small else np.int64)
    for lo in range(0, len(sizes), piece_rows):  # in pieces: no float64 copy of 10M sizes
        scaled = sizes[lo : lo + piece_rows].astype(np.float64)
        scaled *= units
        costs[lo : lo + piece_rows] = np.ceil(scaled, out=scaled)
    return costs, int(math.floor(budget * units))


CHARS_PER_TOKEN = 3.0  # text characters per token (a small SentencePiece vocab)


def text_tokens_of(text_chars: np.ndarray, max_tokens: int | None = None) -> np.ndarray:
    """Estimated text tokens per row (int64): ceil(chars / CHARS_PER_TOKEN), at most `max_tokens`."""
    tokens = np.ceil(np.asarray(text_chars, dtype=np.float64) / CHARS_PER_TOKEN).astype(np.int64)
    return np.minimum(tokens, max_tokens) if max_tokens is not None else tokens
