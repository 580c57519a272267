"""Greedy decoding of a speech LLM: batched with a KV cache, and the prefix-recompute oracle.

Letters: B utterances, P prompt length (longest), H LLM hidden, V vocabulary.

Both decoders take per-utterance prompt embeddings ``[P_b, H]`` (``[bos, audio, *instruction]``,
optionally the forced language tag) and return the generated ids per utterance, without the eos.

`greedy_with_cache` (the default): the prompts are LEFT-padded to ``[B, P, H]`` with a ``[B, P]``
padding mask and position ids counted from each prompt's first real token, so every row's last
prompt token sits at column P-1. One prefill forward fills a transformers ``DynamicCache``; each
further step feeds one token per row (``[B, 1, H]``), extends the mask by a column of ones and
advances each row's position by one. The attention backend must take a padded batch (BSHD) with a
KV cache (queries aligned to the last keys); the reference and sdpa backends do. A clip that
reached eos or ``max_new_tokens`` leaves the batch and its rows of the cache
(``DynamicCache.reorder_cache``). Cost per token: one row against the cache, instead of the prefix.

`greedy_recompute` (the oracle the tests compare against): at every step the whole prefix of every
still-active utterance is recomputed as one packed THD batch (or padded, for BSHD-only backends).

``pick`` replaces the argmax (joint CTC/attention decoding: `speechlm.model.ctc_prefix`); it is called
once per step with the rows still in the batch (a lockstep rank's finished rows included, ignored).

Lockstep (``keep_going``). Under FSDP every forward of a sharded unit is a collective, so every rank
of the mesh must run the same number of forwards. With sharded validation the ranks decode different
utterances that finish at different steps. ``keep_going(local_active) -> bool`` (an all-reduce of a
flag, supplied by the training layer) is called once per step on every rank; a rank that is done
but told to go on runs its step on its finished rows (results ignored). None: local decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

KeepGoing = Callable[[bool], bool]
# ``pick(rows, logits_RV) -> ids [R]``: the next token of each decoding row (``rows`` index the prompts) from
# the LLM's logits at its last position; None: argmax. `speechlm.model.ctc_prefix.JointCTCScorer.step`.
Pick = Callable[[list[int], Tensor], Tensor]


def _choose(pick: Pick | None, rows: list[int], logits_RV: Tensor) -> Tensor:
    return logits_RV.argmax(dim=-1) if pick is None else pick(rows, logits_RV)


def cache_keyword(llm: Any) -> str:
    """The keyword the installed transformers takes the KV cache by: ``cache`` from 5.2x (where
    ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values`` before."""
    import inspect

    params = inspect.signature(llm.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _decide(local_active: bool, keep_going: KeepGoing | None) -> bool:
    return keep_going(local_active) if keep_going is not None else local_active


def greedy_with_cache(
    llm: Any,
    embed_tokens: Callable[[Tensor], Tensor],
    prompts: list[Tensor],
    *,
    eos_id: int,
    max_new_tokens: int,
    keep_going: KeepGoing | None = None,
    pick: Pick | None = None,
) -> list[list[int]]:
    from transformers import DynamicCache

    B = len(prompts)
    device, dtype = prompts[0].device, prompts[0].dtype
    lens = [int(p.shape[0]) for p in prompts]
    P = max(lens)
    x_BPH = prompts[0].new_zeros(B, P, prompts[0].shape[1])
    mask_BP = torch.zeros(B, P, dtype=torch.long, device=device)
    pos_BP = torch.zeros(B, P, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        x_BPH[b, P - lens[b] :] = p
        mask_BP[b, P - lens[b] :] = 1
        pos_BP[b, P - lens[b] :] = torch.arange(lens[b], device=device)
    outputs: list[list[int]] = [[] for _ in range(B)]
    done = [max_new_tokens <= 0] * B
    if not _decide(not all(done), keep_going):
        return outputs
    cache_kw = cache_keyword(llm)
    out = llm(
        inputs_embeds=x_BPH,
        attention_mask=mask_BP,
        position_ids=pos_BP,
        **{cache_kw: DynamicCache()},
        use_cache=True,
        logits_to_keep=1,
    )
    next_pos_B1 = pos_BP[:, -1:] + 1
    rows = list(range(B))  # clip of each cache row
    while True:
        next_ids = _choose(pick, rows, out.logits[:, -1])
        for j, t in enumerate(next_ids.tolist()):
            b = rows[j]
            if done[b]:
                continue
            if t == eos_id:
                done[b] = True
                continue
            outputs[b].append(int(t))
            done[b] = len(outputs[b]) >= max_new_tokens
        if not _decide(not all(done), keep_going):
            return outputs
        keep = [j for j, b in enumerate(rows) if not done[b]] or [0]  # lockstep only: one ignored row
        if len(keep) < len(rows):  # finished clips leave the batch and the cache
            idx = torch.tensor(keep, device=device)
            _returned_cache(out).reorder_cache(idx)
            mask_BP, next_pos_B1, next_ids = mask_BP[idx], next_pos_B1[idx], next_ids[idx]
            rows = [rows[j] for j in keep]
        mask_BP = torch.cat([mask_BP, mask_BP.new_ones(len(rows), 1)], dim=1)
        out = llm(
            inputs_embeds=embed_tokens(next_ids[:, None]).to(dtype),
            attention_mask=mask_BP,
            position_ids=next_pos_B1,
            **{cache_kw: _returned_cache(out)},
            use_cache=True,
            logits_to_keep=1,
        )
        next_pos_B1 = next_pos_B1 + 1


def _last_logits(llm: Any, embeds: list[Tensor], *, thd: bool) -> Tensor:
    """Logits ``[B, V]`` at the last position of each sequence (no cache; full recompute)."""
    lens = [int(e.shape[0]) for e in embeds]
    device = embeds[0].device
    if thd:
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(torch.tensor(lens, device=device), 0)
        positions_T = torch.cat([torch.arange(n, device=device) for n in lens])
        last = (cu[1:] - 1).to(torch.long)
        out = llm(
            inputs_embeds=torch.cat(embeds)[None],
            position_ids=positions_T[None],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(lens),
            max_length_k=max(lens),
            logits_to_keep=last,
        )
        return out.logits[0]
    S = max(lens)
    x_BSH = embeds[0].new_zeros(len(embeds), S, embeds[0].shape[1])
    mask_BS = torch.zeros(len(embeds), S, dtype=torch.long, device=device)
    for b, e in enumerate(embeds):
        x_BSH[b, : e.shape[0]] = e
        mask_BS[b, : e.shape[0]] = 1
    positions_BS = torch.arange(S, device=device).expand(len(embeds), S)
    logits_BSV = llm(inputs_embeds=x_BSH, attention_mask=mask_BS, position_ids=positions_BS).logits
    return logits_BSV[torch.arange(len(embeds), device=device), torch.tensor(lens, device=device) - 1]


def greedy_recompute(
    llm: Any,
    embed_tokens: Callable[[Tensor], Tensor],
    prompts: list[Tensor],
    *,
    eos_id: int,
    max_new_tokens: int,
    thd: bool,
    keep_going: KeepGoing | None = None,
    pick: Pick | None = None,
) -> list[list[int]]:
    seqs = list(prompts)
    outputs: list[list[int]] = [[] for _ in seqs]
    active = [i for i in range(len(seqs)) if max_new_tokens > 0]
    while _decide(bool(active), keep_going):
        rows = active or [0]  # a finished rank kept in lockstep recomputes one row, ignored
        next_ids = _choose(pick, rows, _last_logits(llm, [seqs[i] for i in rows], thd=thd)).tolist()
        new_emb = embed_tokens(torch.tensor(next_ids, device=seqs[0].device))
        still = []
        for j, i in enumerate(active):
            if next_ids[j] == eos_id:
                continue
            outputs[i].append(int(next_ids[j]))
            seqs[i] = torch.cat([seqs[i], new_emb[j : j + 1].to(seqs[i].dtype)])
            if len(outputs[i]) < max_new_tokens:
                still.append(i)
        active = still
    return outputs
