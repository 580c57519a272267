"""Joint CTC/attention greedy decoding: the LLM's next-token scores joined with the CTC head's prefix scores.

Letters: B clips, R rows still decoding, T encoder frames (longest clip), V vocabulary.

The CTC prefix score of a prefix ``g`` is the probability, under the CTC head, that the clip's transcript
starts with ``g`` (Watanabe et al., "Hybrid CTC/Attention Architecture for End-to-End Speech Recognition",
2017, eq. 51-59). For every row it keeps two arrays over the frames: ``r_n[t]`` and ``r_b[t]``, the
probability that frames ``0..t`` spell exactly ``g`` and end in a non-blank (resp. blank) frame. A
candidate token ``c`` extends ``g`` with

    phi[t] = r_b[t] + (r_n[t] if c != last(g) else 0)          (a repeat needs a blank in between)
    psi(g c) = [g empty] p_0(c) + sum_{t >= 1} phi[t-1] p_t(c)

and the stop token scores ``psi(g eos) = r_n[T-1] + r_b[T-1]``. Every candidate is scored in one pass
over the frames (``[R, T, V]``); the arrays of the chosen token follow from two linear recurrences,

    r_n'[t] = (r_n'[t-1] + phi[t-1]) p_t(c),     r_b'[t] = (r_b'[t-1] + r_n'[t-1]) p_t(blank),

computed without a loop over frames in log space (``log a_t = C_t + logcumsumexp_s(u_s - C_{s-1})`` with
``C`` the cumulative log-probabilities).

`JointCTCScorer.step` picks, for each row (``w`` may differ per clip), ``argmax_c (1 - w) log p_llm(c | g) + w (log psi(g c) - log
psi(g))``: ``w = 0`` is plain greedy decoding, ``w = 1`` greedy CTC prefix decoding with the LLM
unused. The first ``skip`` tokens of each row (the language tag, which CTC is not trained on: the
model's ``ctc_skip_leading``) are the LLM's alone and leave the CTC state as it was. Tokens the CTC head
cannot emit (the blank, and ids past the CTC vocabulary) are never picked once CTC scores count.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG = -1.0e30  # log of zero that stays finite through sums (no inf - inf)


class JointCTCScorer:
    """Greedy joint decoding state for B clips; `step` is called once per generated token."""

    def __init__(
        self,
        ctc_logp_BTV: Tensor,
        lens_B: Tensor,
        *,
        blank: int,
        eos: int,
        weight: float | Tensor,
        skip: int = 0,
    ) -> None:
        B, T, V = ctc_logp_BTV.shape
        weight_B = torch.as_tensor(weight, dtype=torch.float32).flatten().expand(B).clone()
        if B and not bool(((weight_B >= 0) & (weight_B <= 1)).all()):
            raise ValueError(f"the CTC weight of joint decoding must be in [0, 1], got {weight}")
        self.x_BTV = ctc_logp_BTV.float().clamp(min=_NEG)
        self.p_BTV = self.x_BTV.exp()
        self.lens_B = lens_B.to(device=self.x_BTV.device, dtype=torch.long)
        if B and (int(self.lens_B.min()) < 1 or int(self.lens_B.max()) > T):
            raise ValueError(f"clip lengths must be in [1, {T}] frames, got {self.lens_B.tolist()}")
        self.blank, self.eos, self.skip = int(blank), int(eos), int(skip)
        dev = self.x_BTV.device
        self.weight_B = weight_B.to(dev)  # per clip; 0: the LLM alone for that row
        valid_BT = torch.arange(T, device=dev)[None, :] < self.lens_B[:, None]
        self.valid_BT = valid_BT
        # the empty prefix: no non-blank frame yet; r_b[t] = every frame up to t blank
        self.r_n_BT = torch.full((B, T), _NEG, device=dev)
        self.r_b_BT = torch.cumsum(self.x_BTV[:, :, self.blank], dim=1)
        self.last_B = torch.full((B,), -1, dtype=torch.long, device=dev)
        self.log_psi_B = torch.zeros(B, device=dev)
        self.steps_B = torch.zeros(B, dtype=torch.long, device=dev)  # tokens generated per row

    @property
    def vocab_size(self) -> int:
        return int(self.x_BTV.shape[2])

    def prefix_scores(self, rows: Tensor) -> Tensor:
        """``[R, V]``: ``log psi(g c) - log psi(g)`` for every candidate ``c`` of each row's prefix ``g``
        (the eos column: the prefix is the whole transcript; the blank column: impossible).

        ``sum_t phi[t-1] p_t(c)`` is one batched product of the frames' weights and probabilities
        (``[R, 1, T] @ [R, T, V]``), scaled by each row's largest weight so nothing overflows."""
        p = self.p_BTV[rows]  # [R, T, V]
        r_n, r_b = self.r_n_BT[rows], self.r_b_BT[rows]
        valid = self.valid_BT[rows]
        R, T, V = p.shape
        last = self.last_B[rows]
        empty = last < 0  # no CTC token yet: the clip's first frame may start the prefix

        def weighted(phi_RT: Tensor) -> tuple[Tensor, Tensor]:
            # log-weights of frames 1..T-1 (phi at t-1) and of frame 0 (1 for the empty prefix), masked
            w = torch.full_like(phi_RT, _NEG)
            w[:, 1:] = phi_RT[:, :-1]
            w[:, 0] = torch.where(empty, torch.zeros_like(w[:, 0]), w[:, 0])
            w = w.masked_fill(~valid, _NEG)
            top = w.max(dim=1, keepdim=True).values
            return torch.exp(w - top), top

        a_RT, top_R1 = weighted(torch.logaddexp(r_n, r_b))  # phi for c != last
        psi_RV = torch.log(torch.bmm(a_RT[:, None, :], p)[:, 0].clamp(min=1e-38)) + top_R1
        if bool((~empty).any()):  # c == last: only a blank frame may separate the repeat
            idx = torch.nonzero(~empty).flatten()
            b_RT, btop_R1 = weighted(r_b[idx])
            p_last = p[idx, :, last[idx]]  # [K, T]
            psi_RV[idx, last[idx]] = torch.log((b_RT * p_last).sum(dim=1).clamp(min=1e-38)) + btop_R1[:, 0]
        psi_RV = psi_RV.clamp(min=_NEG)
        end = (self.lens_B[rows] - 1)[:, None]
        psi_RV[:, self.blank] = _NEG
        if self.eos < V:
            psi_RV[:, self.eos] = torch.logaddexp(r_n.gather(1, end), r_b.gather(1, end))[:, 0]
        return psi_RV - self.log_psi_B[rows][:, None]

    def step(self, rows: list[int], llm_logits_RV: Tensor) -> Tensor:
        """The next token of each row (``[R]`` ids; ``rows`` index the clips given at construction) from
        the LLM's logits at its last position; the rows' CTC states move on to the chosen tokens (a
        chosen eos ends the row: state unchanged)."""
        logp = torch.log_softmax(llm_logits_RV.float(), dim=-1)
        if not rows:
            return logp.argmax(dim=-1)
        r = torch.tensor(rows, dtype=torch.long, device=self.x_BTV.device)
        scored = (self.steps_B[r] >= self.skip) & (self.weight_B[r] > 0)
        total = logp.to(self.x_BTV.device)
        if bool(scored.any()):
            idx = torch.nonzero(scored).flatten()
            V = min(self.vocab_size, total.shape[1])
            ctc_all = self.prefix_scores(r[idx])
            ctc = ctc_all[:, :V]
            w = self.weight_B[r[idx]][:, None]
            joint = (1.0 - w) * total[idx, :V] + w * ctc
            if total.shape[1] > V:  # ids the CTC head has no column for
                pad = torch.full((len(idx), total.shape[1] - V), _NEG, device=total.device)
                joint = torch.cat([joint, pad], dim=1)
            total = total.clone()
            total[idx] = joint
            ids = total.argmax(dim=-1)
            self._advance(r[idx], ids[idx], ctc_all)
        else:
            ids = total.argmax(dim=-1)
        self.steps_B[r] += 1
        return ids.to(llm_logits_RV.device)

    def _advance(self, b_all: Tensor, c_all: Tensor, ctc_MV: Tensor) -> None:
        """Rows ``b_all`` chose ``c_all``; ``ctc_MV`` their prefix scores (`prefix_scores`)."""
        move = (c_all != self.eos) & (c_all < self.vocab_size) & (c_all != self.blank)
        if not bool(move.any()):
            return
        sel = torch.nonzero(move).flatten()
        b, c = b_all[sel], c_all[sel]
        xc = self.x_BTV[b, :, c]  # [M, T]: the chosen token's frames, without copying [M, T, V]
        xb = self.x_BTV[b, :, self.blank]
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
        psi = ctc_MV[sel, c] + self.log_psi_B[b]
        self.r_n_BT[b] = new_n.clamp(min=_NEG)
        self.r_b_BT[b] = new_b.clamp(min=_NEG)
        self.log_psi_B[b] = psi
        self.last_B[b] = c
