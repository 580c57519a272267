"""Joint CTC/attention greedy decoding (`speechlm.model.ctc_prefix`): prefix scores against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from speechlm.model.ctc_prefix import JointCTCScorer


def collapse(path: tuple[int, ...], blank: int) -> tuple[int, ...]:
    out, prev = [], None
    for t in path:
        if t != prev and t != blank:
            out.append(t)
        prev = t
    return tuple(out)


def brute_prefix_prob(logp_TV: torch.Tensor, prefix: tuple[int, ...], blank: int, *, exact: bool) -> float:
    """Sum of P(alignment) over every alignment of the T frames whose collapse starts with `prefix`
    (equals it, with `exact`)."""
    T, V = logp_TV.shape
    p = logp_TV.exp().double()
    total = 0.0
    for path in itertools.product(range(V), repeat=T):
        out = collapse(path, blank)
        if (out == prefix) if exact else (out[: len(prefix)] == prefix):
            total += math.prod(float(p[t, v]) for t, v in enumerate(path))
    return total


def random_logp(B: int, T: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(B, T, V, generator=g) * 2, dim=-1)


@pytest.mark.parametrize("prefix", [(), (1,), (1, 1), (2, 1), (1, 2, 1)])
def test_prefix_scores_equal_brute_force(prefix: tuple[int, ...]) -> None:
    # vocabulary: 0 blank, 1 and 2 tokens, 3 eos (never emitted by CTC: probability ~0 from the head)
    V, T, blank, eos = 4, 5, 0, 3
    logp = random_logp(2, T, V, seed=len(prefix))
    logp[:, :, eos] = -1e4
    logp = torch.log_softmax(logp, dim=-1)
    lens = torch.tensor([T, T - 1])
    sc = JointCTCScorer(logp, lens, blank=blank, eos=eos, weight=1.0)
    rows = torch.tensor([0, 1])
    for c in prefix:  # walk the prefix through the scorer's own state updates
        scores = sc.prefix_scores(rows)
        sc._advance(rows, torch.tensor([c, c]), scores)
    got = sc.prefix_scores(rows) + sc.log_psi_B[rows][:, None]
    for b in range(2):
        n = int(lens[b])
        for c in (1, 2):
            want = brute_prefix_prob(logp[b, :n], (*prefix, c), blank, exact=False)
            assert math.isclose(math.exp(float(got[b, c])), want, rel_tol=1e-4, abs_tol=1e-12), (b, c)
        want_end = brute_prefix_prob(logp[b, :n], prefix, blank, exact=True)
        assert math.isclose(math.exp(float(got[b, eos])), want_end, rel_tol=1e-4, abs_tol=1e-12), b
        assert float(got[b, blank]) < -1e20  # the blank is never a token


def test_weight_one_decodes_the_ctc_transcript_and_zero_follows_the_llm() -> None:
    # a clip whose CTC posteriors spell 2 1 1 (blank between the repeats), then ends
    V, blank, eos = 5, 0, 4
    frames = [2, 2, 0, 1, 0, 1, 0]
    logp = torch.full((1, len(frames), V), -8.0)
    for t, v in enumerate(frames):
        logp[0, t, v] = 0.0
    logp = torch.log_softmax(logp, dim=-1)
    llm = torch.zeros(1, V)
    llm[0, 3] = 5.0  # the LLM alone always says 3

    def run(weight: float, skip: int = 0) -> list[int]:
        sc = JointCTCScorer(logp, torch.tensor([len(frames)]), blank=blank, eos=eos, weight=weight, skip=skip)
        out = []
        for _ in range(6):
            t = int(sc.step([0], llm)[0])
            if t == eos:
                break
            out.append(t)
        return out

    assert run(1.0) == [2, 1, 1]
    assert run(0.7) == [2, 1, 1]  # CTC's certainty outweighs the LLM
    assert run(0.0) == [3, 3, 3, 3, 3, 3]
    # the first token (the language tag) is the LLM's alone and leaves the CTC state untouched
    assert run(1.0, skip=1) == [3, 2, 1, 1]


def test_rows_decode_independently_and_in_any_order() -> None:
    V, blank, eos = 6, 0, 5
    logp = random_logp(3, 6, V, seed=7)
    lens = torch.tensor([6, 4, 5])
    llm = torch.randn(3, V, generator=torch.Generator().manual_seed(1))

    def decode(order: list[int]) -> dict[int, list[int]]:
        sc = JointCTCScorer(logp, lens, blank=blank, eos=eos, weight=0.5)
        outs: dict[int, list[int]] = {b: [] for b in order}
        active = list(order)
        for _ in range(5):
            if not active:
                break
            ids = sc.step(active, llm[active]).tolist()
            still = []
            for b, t in zip(active, ids):
                if t != eos:
                    outs[b].append(t)
                    still.append(b)
            active = still
        return outs

    together = decode([0, 1, 2])
    for b in range(3):
        assert decode([b])[b] == together[b]
    assert decode([2, 0, 1]) == together


def test_bad_arguments_are_refused() -> None:
    logp = random_logp(1, 3, 4, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        JointCTCScorer(logp, torch.tensor([3]), blank=0, eos=3, weight=1.5)
    with pytest.raises(ValueError, match="clip lengths"):
        JointCTCScorer(logp, torch.tensor([4]), blank=0, eos=3, weight=0.5)
