"""Joint CTC/attention greedy decoding (`speechlm.model.ctc_prefix`): prefix scores against brute force."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

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
        sc._advance(rows, torch.tensor([c, c]), scores[:, c])
    got = sc.prefix_scores(rows) + sc.log_psi_B[rows][:, None]
    # the candidates' path scores the same: every id, in a different order per row
    cand = torch.tensor([[3, 2, 1, 0], [0, 2, 3, 1]])
    assert torch.allclose(sc.prefix_scores(rows, cand) + sc.log_psi_B[rows][:, None], got.gather(1, cand))
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


def decode_rows(
    sc: JointCTCScorer, order: Iterable[int], llm_steps: Iterable[torch.Tensor]
) -> dict[int, list[int]]:
    """Greedy decoding of rows ``order``, step s reading every row's LLM logits from ``llm_steps[s]``
    (``[B, V]``); a row that picks eos leaves the batch, as in `speechlm.model.generation`."""
    outs: dict[int, list[int]] = {b: [] for b in order}
    active = list(outs)
    for llm_BV in llm_steps:
        if not active:
            break
        ids = sc.step(active, llm_BV[active]).tolist()
        still = []
        for b, t in zip(active, ids):
            if t != sc.eos:
                outs[b].append(t)
                still.append(b)
        active = still
    return outs


def test_rows_decode_independently_and_in_any_order() -> None:
    V, blank, eos = 6, 0, 5
    logp = random_logp(3, 6, V, seed=7)
    lens = torch.tensor([6, 4, 5])
    llm = torch.randn(3, V, generator=torch.Generator().manual_seed(1))

    def decode(order: list[int]) -> dict[int, list[int]]:
        sc = JointCTCScorer(logp, lens, blank=blank, eos=eos, weight=0.5)
        return decode_rows(sc, order, [llm] * 5)

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
    with pytest.raises(ValueError, match="candidates"):
        JointCTCScorer(logp, torch.tensor([3]), blank=0, eos=3, weight=0.5, candidates=-1)


def walk_and_compare(
    sc: JointCTCScorer, rows: torch.Tensor, steps: list[list[int]], cand: torch.Tensor
) -> None:
    """Advance ``rows`` through ``steps`` (one token per row per step); at every prefix, the candidates'
    scores equal the whole vocabulary's columns of them."""
    for tokens in [*steps, None]:
        full = sc.prefix_scores(rows)
        got = sc.prefix_scores(rows, cand)
        assert got.shape == cand.shape
        assert torch.allclose(got, full.gather(1, cand), rtol=1e-5, atol=1e-5)
        if tokens is not None:
            c = torch.tensor(tokens)
            sc._advance(rows, c, full.gather(1, c[:, None])[:, 0])


def test_candidate_scores_equal_the_whole_vocabularys_columns() -> None:
    """Three clips of different lengths, prefixes with repeats; the candidates hold each row's last token,
    the eos and the blank (scored as the whole vocabulary scores them: end of transcript, impossible)."""
    V, T, blank, eos = 12, 9, 0, 11
    logp = random_logp(3, T, V, seed=3)
    lens = torch.tensor([9, 5, 7])
    sc = JointCTCScorer(logp, lens, blank=blank, eos=eos, weight=0.5, candidates=4)
    rows = torch.tensor([2, 0, 1])
    cand = torch.tensor([[4, 4, 0, 11, 7], [3, 5, 9, 11, 1], [2, 4, 6, 8, 10]])
    walk_and_compare(sc, rows, [[4, 3, 2], [4, 3, 6], [7, 5, 6]], cand)
    assert float(sc.prefix_scores(rows, cand)[0, 2]) < -1e20  # the blank: impossible


def decode(
    logp: torch.Tensor,
    lens: torch.Tensor,
    llm_steps: torch.Tensor,
    *,
    blank: int,
    eos: int,
    weight: float,
    **kw: int,
) -> list[list[int]]:
    """Greedy joint decoding of every clip with the LLM's logits of step s given as ``llm_steps[s]``
    (``[S, B, V]``); finished rows leave the batch, as in `speechlm.model.generation`."""
    sc = JointCTCScorer(logp, lens, blank=blank, eos=eos, weight=weight, **kw)
    return list(decode_rows(sc, range(logp.shape[0]), llm_steps).values())


@pytest.mark.parametrize("weight", [0.3, 0.7, 1.0])
def test_candidates_covering_the_vocabulary_decode_as_the_whole_vocabulary(weight: float) -> None:
    """K >= V - 1 (every id but the blank) runs the candidates' path and gives the whole vocabulary's
    hypotheses, a batch of clips of different lengths, one leaving the batch before the others."""
    V, T, B, blank, eos = 16, 12, 4, 0, 15
    logp = random_logp(B, T, V, seed=11)
    lens = torch.tensor([12, 6, 9, 3])
    g = torch.Generator().manual_seed(5)
    llm = torch.randn(10, B, V, generator=g) * 3
    full = decode(logp, lens, llm, blank=blank, eos=eos, weight=weight, candidates=0)
    for k in (V - 1, V, 100):
        assert decode(logp, lens, llm, blank=blank, eos=eos, weight=weight, candidates=k) == full
    assert len({len(o) for o in full}) > 1  # the clips stopped at different steps


def spelled(frames: list[int], V: int, sure: float = 8.0) -> torch.Tensor:
    """``[T, V]`` CTC log-probabilities that spell ``frames`` (one id per frame, blank between repeats)."""
    logp = torch.full((len(frames), V), -sure)
    logp[torch.arange(len(frames)), torch.tensor(frames)] = 0.0
    return torch.log_softmax(logp, dim=-1)


def test_default_candidates_give_the_whole_vocabularys_hypotheses_where_ctc_and_llm_agree() -> None:
    """A 2000-id vocabulary, two clips of different lengths whose CTC posteriors spell a transcript; the LLM
    ranks the CTC's next token among its best few (not first) over random noise elsewhere. The default
    (32 candidates) then picks every token as scoring all 2000 does, and stops where it does."""
    from speechlm.config import ModelConfig

    V, blank, eos = 2000, 0, 1
    words = [[17, 1500, 1500, 42, 999], [256, 7, 1999]]
    frames = [[17, 17, 0, 1500, 0, 1500, 42, 0, 999, 0], [256, 0, 7, 7, 1999, 0, 0]]
    T = max(len(f) for f in frames)
    logp = torch.full((2, T, V), -30.0)
    logp[:, :, blank] = 0.0
    for b, f in enumerate(frames):
        logp[b, : len(f)] = spelled(f, V, sure=20.0)
    lens = torch.tensor([len(f) for f in frames])
    g = torch.Generator().manual_seed(0)
    steps = 8
    llm = torch.randn(steps, 2, V, generator=g)
    ranks = [0, 5, 1, 20, 3, 9]  # the CTC's next token among the LLM's best few, not always its first
    for b, w in enumerate(words):
        for s, tok in enumerate([*w, eos]):
            llm[s, b, tok] = llm[s, b].sort(descending=True).values[ranks[s]] - 1e-3
    k = ModelConfig().decode_ctc_candidates
    assert 0 < k < V
    full = decode(logp, lens, llm, blank=blank, eos=eos, weight=0.7, candidates=0)
    assert full == words
    assert decode(logp, lens, llm, blank=blank, eos=eos, weight=0.7, candidates=k) == full
    plain = [o[: len(w)] for o, w in zip(decode(logp, lens, llm, blank=blank, eos=eos, weight=0.0), words)]
    assert plain != words  # the LLM alone does not spell them: the CTC scores decide


def test_the_stop_token_is_scored_even_when_the_llm_ranks_it_last() -> None:
    """The CTC head says the transcript is complete; the LLM puts eos below its K best. The candidates
    hold eos anyway, so decoding stops where the whole vocabulary's decoding stops."""
    V, blank, eos = 50, 0, 49
    frames = [5, 0, 9, 9]
    logp = spelled(frames, V)[None]
    llm = torch.zeros(6, 1, V)
    llm[:, 0, 30:40] = 1.0  # the LLM's ten best: ids 30..39
    llm[:, 0, 5] = llm[:, 0, 9] = 0.5
    llm[:, 0, eos] = -5.0
    lens = torch.tensor([len(frames)])
    full = decode(logp, lens, llm, blank=blank, eos=eos, weight=0.9, candidates=0)
    assert full == [[5, 9]]
    assert decode(logp, lens, llm, blank=blank, eos=eos, weight=0.9, candidates=12) == full


def test_a_weight_of_one_scores_every_token_whatever_the_candidates() -> None:
    """With the LLM unused its ranking says nothing: a weight-1 row scores the whole vocabulary, so two
    candidates from a flat LLM do not hide the CTC transcript."""
    V, blank, eos = 30, 0, 29
    frames = [21, 0, 21, 0, 13]
    logp = spelled(frames, V)[None]
    llm = torch.zeros(6, 1, V)
    lens = torch.tensor([len(frames)])
    assert decode(logp, lens, llm, blank=blank, eos=eos, weight=1.0, candidates=2) == [[21, 21, 13]]
    assert decode(logp, lens, llm, blank=blank, eos=eos, weight=0.9, candidates=2) != [[21, 21, 13]]


def test_equal_scores_go_to_the_lowest_id_as_in_the_whole_vocabulary() -> None:
    """The LLM ties three tokens for first and the CTC head cannot tell them apart: the candidates' argmax
    takes the lowest id, as the whole vocabulary's does (topk returns them in no set order)."""
    V, blank, eos = 8, 0, 7
    logp = torch.log_softmax(torch.zeros(1, 4, V), dim=-1)  # every token alike
    llm = torch.zeros(3, 1, V)
    llm[:, 0, [6, 2, 5]] = 1.0
    lens = torch.tensor([4])
    full = decode(logp, lens, llm, blank=blank, eos=eos, weight=0.5, candidates=0)
    assert full[0][:2] == [2, 5]  # 2 again would be a repeat, which needs a blank between
    assert decode(logp, lens, llm, blank=blank, eos=eos, weight=0.5, candidates=3) == full


@pytest.mark.parametrize("candidates", [0, 3])
def test_a_hypothesis_that_outran_its_clip_follows_the_llm_and_never_emits_the_blank(candidates: int) -> None:
    """Two frames spell one token; the stop id lies past the CTC vocabulary, so nothing the CTC head
    scores is possible after the second token: the LLM decides from there (the blank, whose scores would
    tie with every other impossible token's, is never picked)."""
    V, blank, eos = 6, 0, 6  # the LLM has 7 ids, the CTC head 6
    logp = spelled([2, 0], V)[None]
    llm = torch.zeros(5, 1, V + 1)
    llm[:, 0, blank] = 3.0  # the LLM itself favours the blank id: never emitted while CTC scores count
    llm[:, 0, 4] = 2.0
    llm[:, 0, 2] = 1.0
    got = decode(logp, torch.tensor([2]), llm, blank=blank, eos=eos, weight=0.5, candidates=candidates)
    assert got == [[2, 4, 4, 4, 4]]
