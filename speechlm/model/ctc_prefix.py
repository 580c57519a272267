"""Joint CTC/attention greedy decoding: the LLM's next-token scores joined with the CTC head's prefix scores.

Letters: B clips, R rows still decoding, T encoder frames (longest clip), V vocabulary, K candidates.

The CTC prefix score of a prefix ``g`` is the probability, under the CTC head, that the clip's transcript
starts with ``g`` (Watanabe et al., "Hybrid CTC/Attention Architecture for End-to-End Speech Recognition",
2017, eq. 51-59). For every row it keeps two arrays over the frames: ``r_n[t]`` and ``r_b[t]``, the
probability that frames ``0..t`` spell exactly ``g`` and end in a non-blank (resp. blank) frame. A
candidate token ``c`` extends ``g`` with

    phi[t] = r_b[t] + (r_n[t] if c != last(g) else 0)          (a repeat needs a blank in between)
    psi(g c) = [g empty] p_0(c) + sum_{t >= 1} phi[t-1] p_t(c)

and the stop token scores ``psi(g eos) = r_n[T-1] + r_b[T-1]``. The candidates of all rows are scored in
one pass over the frames (``[R, T, K]``); the arrays of the chosen token follow from two linear
recurrences,

    r_n'[t] = (r_n'[t-1] + phi[t-1]) p_t(c),     r_b'[t] = (r_b'[t-1] + r_n'[t-1]) p_t(blank),

computed without a loop over frames in log space (``log a_t = C_t + logcumsumexp_s(u_s - C_{s-1})`` with
``C`` the cumulative log-probabilities).

`JointCTCScorer.step` picks, for each row (``w`` may differ per clip), ``argmax_c (1 - w) log p_llm(c | g) + w (log psi(g c) - log
psi(g))``: ``w = 0`` is plain greedy decoding, ``w = 1`` greedy CTC prefix decoding with the LLM
unused. The first ``skip`` tokens of each row (the language tag, which CTC is not trained on: the
model's ``ctc_skip_leading``) are the LLM's alone and leave the CTC state as it was. Tokens the CTC head
cannot emit (the blank, and ids past the CTC vocabulary) are never picked once CTC scores count. A row
whose every candidate is impossible under CTC (the hypothesis outran the clip's frames while the stop
token is not in the CTC vocabulary) follows the LLM from there, the blank still left out.

Candidates (``candidates`` = K, the model's ``decode_ctc_candidates``). Scoring every token costs
``T x V`` per row and step (at SmolLM2's 49k ids, 15 times the LLM's own decoding). As ESPnet's
pre-beam does, the argmax runs over the LLM's K best tokens (the blank left out) plus the stop token,
and only those get CTC prefix scores: ``T x (K + 1)`` per row and step. K = 0 scores every token, and a
row with ``w = 1`` always does (its LLM scores say nothing about which tokens to score).

When the K-candidate pick equals the whole-vocabulary pick. Let S be the candidates, ``a(c)`` the LLM's
log-probabilities, ``a_K`` the K-th largest (the blank left out), ``b(c) = log psi(g c) - log psi(g)``.
Every alignment whose collapse starts with ``g`` either spells ``g`` exactly or goes on with exactly one
next token, so ``psi(g eos) + sum_c psi(g c) <= psi(g)``: the CTC scores of the next tokens are
probabilities (``b <= 0``) and a token outside S has ``b(c) <= log m`` with ``m = 1 - sum_{c in S}
exp(b(c))`` (eos included), while ``a(c) <= a_K``. So every token outside S scores at most
``(1 - w) a_K + w log m``, and whenever the best candidate scores at least that, the two picks are the
same token (equal scores go to the lowest id in both; a tie at the LLM's K-th place is cut in
``topk``'s order). That holds for any S covering every token the CTC head can emit (K >= V - 1: the same
hypotheses, `tests/model/test_ctc_prefix.py`), and when the CTC head and the LLM agree on the next token:
a CTC-certain token in S leaves m near 0. The picks differ only where a token the LLM ranks below its
K-th has a CTC score above the chosen candidate's by more than ``(1 - w) / w`` times the gap between
their LLM log-probabilities: the CTC head sure of a token the LLM all but rules out.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG = -1.0e30  # log of zero that stays finite through sums (no inf - inf)


class JointCTCScorer:
    """Greedy joint decoding state for B clips; `step` is called once per generated token.

    ``candidates``: the LLM's K best tokens scored per row and step (0: every token); see the module."""

    def __init__(
        self,
        ctc_logp: Tensor,
        lens_B: Tensor,
        *,
        blank: int,
        eos: int,
        weight: float | Tensor,
        skip: int = 0,
        candidates: int = 0,
        frames_BT: Tensor | None = None,
    ) -> None:
        """``ctc_logp``: the CTC log-probabilities ``[B, T, V]``, or, with ``frames_BT``, a table of frames
        ``[N, V]`` (e.g. the encoder's packed frames, never copied) and ``frames_BT[b, t]`` the table row
        of clip b's frame t (past a clip's length: any row, its values are not used)."""
        if frames_BT is None:
            B, T, V = ctc_logp.shape
            table_NV = ctc_logp.reshape(B * T, V)
            frames_BT = torch.arange(B * T, device=ctc_logp.device).view(B, T)
        else:
            (B, T), V = frames_BT.shape, ctc_logp.shape[1]
            table_NV = ctc_logp
        weight_B = torch.as_tensor(weight, dtype=torch.float32).flatten().expand(B).clone()
        if B and not bool(((weight_B >= 0) & (weight_B <= 1)).all()):
            raise ValueError(f"the CTC weight of joint decoding must be in [0, 1], got {weight}")
        if int(candidates) != candidates or candidates < 0:
            raise ValueError(
                f"the candidates of joint decoding must be a whole number >= 0, got {candidates}"
            )
        self.candidates = int(candidates)
        self.table_NV = table_NV.float().contiguous()  # read by gathers; clamped where read (-inf)
        self._p_NV: Tensor | None = None  # its probabilities, made on the first whole-vocabulary step
        dev = self.table_NV.device
        self.lens_B = lens_B.to(device=dev, dtype=torch.long)
        if B and (int(self.lens_B.min()) < 1 or int(self.lens_B.max()) > T):
            raise ValueError(f"clip lengths must be in [1, {T}] frames, got {self.lens_B.tolist()}")
        self.frames_BT = frames_BT.to(device=dev, dtype=torch.long)
        self.blank, self.eos, self.skip = int(blank), int(eos), int(skip)
        self.weight_B = weight_B.to(dev)  # per clip; 0: the LLM alone for that row
        valid_BT = torch.arange(T, device=dev)[None, :] < self.lens_B[:, None]
        self.valid_BT = valid_BT
        all_B = torch.arange(B, device=dev)
        self.x_blank_BT = self._gather(all_B, torch.full((B, 1), self.blank, device=dev))[:, :, 0]
        # the empty prefix: no non-blank frame yet; r_b[t] = every frame up to t blank
        self.r_n_BT = torch.full((B, T), _NEG, device=dev)
        self.r_b_BT = torch.cumsum(self.x_blank_BT, dim=1)
        self.last_B = torch.full((B,), -1, dtype=torch.long, device=dev)
        self.log_psi_B = torch.zeros(B, device=dev)
        self.steps_B = torch.zeros(B, dtype=torch.long, device=dev)  # tokens generated per row

    @property
    def vocab_size(self) -> int:
        return int(self.table_NV.shape[1])

    def _gather(self, rows: Tensor, cols_RK: Tensor) -> Tensor:
        """``[R, T, K]``: the log-probabilities of ids ``cols_RK`` at every frame of each row's clip (a
        gather of R x T x K values from the table, whatever its size)."""
        flat = self.frames_BT[rows][:, :, None] * self.vocab_size + cols_RK[:, None, :]
        return self.table_NV.view(-1)[flat].clamp(min=_NEG)

    def _frame_weights(self, phi_RT: Tensor, empty_R: Tensor, valid_RT: Tensor) -> tuple[Tensor, Tensor]:
        """The frames' weights ``phi[t-1]`` (frame 0: 1 for the empty prefix), masked to each clip and
        scaled by the row's largest (``[R, T]``, and that largest in log ``[R, 1]``) so nothing overflows."""
        w = torch.full_like(phi_RT, _NEG)
        w[:, 1:] = phi_RT[:, :-1]
        w[:, 0] = torch.where(empty_R, torch.zeros_like(w[:, 0]), w[:, 0])
        w = w.masked_fill(~valid_RT, _NEG)
        top = w.max(dim=1, keepdim=True).values
        return torch.exp(w - top), top

    def prefix_scores(self, rows: Tensor, cand_RK: Tensor | None = None) -> Tensor:
        """``log psi(g c) - log psi(g)`` for candidates ``c`` of each row's prefix ``g``: ``[R, K]`` for the
        ids ``cand_RK``, or ``[R, V]`` for every id (None). The eos id scores the prefix as the whole
        transcript; the blank is impossible.

        ``sum_t phi[t-1] p_t(c)`` is one batched product of the frames' weights and the candidates'
        probabilities (``[R, 1, T] @ [R, T, K]``)."""
        r_n, r_b = self.r_n_BT[rows], self.r_b_BT[rows]
        valid = self.valid_BT[rows]
        last = self.last_B[rows]
        empty = last < 0  # no CTC token yet: the clip's first frame may start the prefix
        if cand_RK is None:
            if self._p_NV is None:
                self._p_NV = self.table_NV.clamp(min=_NEG).exp()
            p = self._p_NV[self.frames_BT[rows]]  # [R, T, V]
            cand = torch.arange(self.vocab_size, device=p.device)[None, :]
        else:
            p = self._gather(rows, cand_RK).exp()  # [R, T, K]
            cand = cand_RK
        a_RT, top_R1 = self._frame_weights(torch.logaddexp(r_n, r_b), empty, valid)  # phi for c != last
        psi = torch.log(torch.bmm(a_RT[:, None, :], p)[:, 0].clamp(min=1e-38)) + top_R1
        if bool((~empty).any()):  # c == last: only a blank frame may separate the repeat
            b_RT, btop_R1 = self._frame_weights(r_b, empty, valid)
            p_last = self._gather(rows, last.clamp(min=0)[:, None])[:, :, 0].exp()  # [R, T]
            rep_R = torch.log((b_RT * p_last).sum(dim=1).clamp(min=1e-38)) + btop_R1[:, 0]
            psi = torch.where(cand == last[:, None], rep_R[:, None], psi)
        psi = psi.clamp(min=_NEG)
        end = (self.lens_B[rows] - 1)[:, None]
        end_R1 = torch.logaddexp(r_n.gather(1, end), r_b.gather(1, end))
        psi = torch.where(cand == self.eos, end_R1, psi)
        psi = torch.where(cand == self.blank, torch.full_like(psi, _NEG), psi)
        return psi - self.log_psi_B[rows][:, None]

    def _candidate_ids(self, llm_SV: Tensor, weight_S: Tensor) -> Tensor | None:
        """``[S, K + 1]``: each row's K best tokens by the LLM's scores ``llm_SV`` (the blank left out) and
        the eos id; None: score every token (K = 0, or a row with weight 1)."""
        S, V = llm_SV.shape
        if self.candidates == 0 or bool((weight_S >= 1).any()):
            return None
        k = min(self.candidates, V - (self.blank < V))
        cand = llm_SV.topk(min(k + 1, V), dim=1).indices  # one spare, in case the blank is among them
        if self.blank < V:  # the blank moves last (the others keep their order), then the spare goes
            cand = cand.gather(1, torch.argsort((cand == self.blank).to(torch.int8), dim=1, stable=True))
        cand = cand[:, :k]
        if self.eos < V:  # the stop token is always scored: the CTC head says when the transcript is complete
            cand = torch.cat([cand, cand.new_full((S, 1), self.eos)], dim=1)
        return cand

    def step(self, rows: list[int], llm_logits_RV: Tensor) -> Tensor:
        """The next token of each row (``[R]`` ids; ``rows`` index the clips given at construction) from
        the LLM's logits at its last position; the rows' CTC states move on to the chosen tokens (a
        chosen eos ends the row: state unchanged).

        The LLM's log-softmax subtracts the same normaliser from every token of a row, which moves no
        argmax, so its logits stand in for its log-probabilities: with K candidates the only ``[R, V]``
        work per step is the top-K, as plain greedy decoding's argmax."""
        z = llm_logits_RV.float().to(self.table_NV.device)
        if not rows:
            return z.argmax(dim=-1)
        r = torch.tensor(rows, dtype=torch.long, device=z.device)
        scored = (self.steps_B[r] >= self.skip) & (self.weight_B[r] > 0)
        if not bool(scored.any()):
            self.steps_B[r] += 1
            return z.argmax(dim=-1).to(llm_logits_RV.device)
        every = bool(scored.all())
        ids = torch.empty(len(rows), dtype=torch.long, device=z.device) if every else z.argmax(dim=-1)
        idx = torch.nonzero(scored).flatten()
        b = r[idx]
        z_S = z if every else z[idx]
        V = min(self.vocab_size, z.shape[1])
        w = self.weight_B[b][:, None]
        cand = self._candidate_ids(z_S[:, :V], w)
        ctc = self.prefix_scores(b, cand)
        if cand is None:
            cand = torch.arange(V, device=z.device).expand(len(idx), V)
            llm = z_S[:, :V]
        else:
            llm = z_S.gather(1, cand)
        joint = (1.0 - w) * llm + w * ctc
        # no candidate is possible under CTC (the hypothesis outran the clip's frames, and the stop
        # token is not among them): the CTC scores cannot tell the tokens apart, so the LLM picks
        lost = (ctc + self.log_psi_B[b][:, None]).max(dim=1).values <= _NEG / 2
        if bool(lost.any()):
            alone = llm.masked_fill(cand == self.blank, -torch.inf)
            joint = torch.where(lost[:, None], alone, joint)
        # the best candidate; among equal scores the lowest id, as an argmax over the vocabulary does
        best = joint == joint.max(dim=1, keepdim=True).values
        pos = torch.where(best, cand, V).argmin(dim=1, keepdim=True)
        chosen = cand.gather(1, pos)[:, 0]
        ids[idx] = chosen
        self._advance(b, chosen, ctc.gather(1, pos)[:, 0])
        self.steps_B[r] += 1
        return ids.to(llm_logits_RV.device)

    def _advance(self, b_all: Tensor, c_all: Tensor, score_all: Tensor) -> None:
        """Rows ``b_all`` chose ``c_all``, whose prefix scores (`prefix_scores`) are ``score_all``."""
        move = (c_all != self.eos) & (c_all < self.vocab_size) & (c_all != self.blank)
        if not bool(move.any()):
            return
        sel = torch.nonzero(move).flatten()
        b, c = b_all[sel], c_all[sel]
        xc = self._gather(b, c[:, None])[:, :, 0]  # [M, T]: the chosen token's frames
        xb = self.x_blank_BT[b]
        r_n, r_b = self.r_n_BT[b], self.r_b_BT[b]
        both = torch.logaddexp(r_n, r_b)
        phi = torch.where((c == self.last_B[b])[:, None], r_b, both)
        empty = self.last_B[b] < 0
        C = torch.cumsum(xc, dim=1)
        u = torch.full_like(xc, _NEG)
        u[:, 0] = torch.where(empty, torch.zeros_like(xc[:, 0]), torch.full_like(xc[:, 0], _NEG))
        u[:, 1:] = phi[:, :-1] - C[:, :-1]
        new_n = C + torch.logcumsumexp(u, dim=1)
        D = torch.cumsum(xb, dim=1)
        w = torch.full_like(xc, _NEG)
        w[:, 1:] = new_n[:, :-1] - D[:, :-1]
        new_b = D + torch.logcumsumexp(w, dim=1)
        psi = score_all[sel] + self.log_psi_B[b]
        self.r_n_BT[b] = new_n.clamp(min=_NEG)
        self.r_b_BT[b] = new_b.clamp(min=_NEG)
        self.log_psi_B[b] = psi
        self.last_B[b] = c
