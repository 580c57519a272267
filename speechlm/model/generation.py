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

`generate_greedy` and `generate_for_batch` (the model's two decoding entry points) build the prompts: each
row's text ids embedded in one call (`embed_pieces`), each audio placeholder replaced by its clip's
embeddings (`splice_prompts`); a transcription is the one-turn case (``[*prefix, audio, *middle]`` of the
model's `PromptFormat`, then the forced language tag if any).

Under CP (``model.cp_layout``) every peer decodes the same batch: a clip the layout shards is encoded slice
by slice over the group and gathered (`speechlm.model.cp_audio.encode_for_decoding`), so a long clip is
encoded as training encodes it and every peer then decodes it whole.

Lockstep (``keep_going``). Under FSDP every forward of a sharded unit is a collective, so every rank
of the mesh must run the same number of forwards. With sharded validation the ranks decode different
utterances that finish at different steps. ``keep_going(local_active) -> bool`` (an all-reduce of a
flag, supplied by the training layer) is called once per step on every rank; a rank that is done
but told to go on runs its step on its finished rows (results ignored). None: local decision.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from parallel.cp_layout import CPLayout, dummy_clip
from speechlm.config import ModelConfig
from speechlm.model.conversation_inputs import (
    as_conversation,
    clips_per_sample,
    conversation_ctc_targets,
    conversation_prompts,
    last_answer_start,
    optional_field,
)
from speechlm.model.cp_audio import AudioModel, encode_for_decoding
from speechlm.model.ctc import ctc_log_prob_rows
from speechlm.model.ctc_prefix import JointCTCScorer
from speechlm.model.encoder_output import EncoderOutput
from speechlm.model.oracle import fill_with_transcripts
from speechlm.model.packed_encoder import PackedFrames
from speechlm.packing.positions import align_audio_positions
from speechlm.packing.prompt import PromptFormat
from speechlm.packing.thd import expand_prompt

KeepGoing = Callable[[bool], bool]
# ``pick(rows, logits_RV) -> ids [R]``: the next token of each decoding row (``rows`` index the prompts) from
# the LLM's logits at its last position; None: argmax. `speechlm.model.ctc_prefix.JointCTCScorer.step`.
Pick = Callable[[list[int], Tensor], Tensor]


class DecodingModel(AudioModel, Protocol):
    """What greedy decoding reads of the model (`SpeechLLM` has it)."""

    training: bool
    cfg: ModelConfig
    cp_layout: CPLayout  # a long clip the layout would shard is encoded sharded (`encode_for_decoding`)

    @property
    def prompt(self) -> PromptFormat: ...
    @property
    def ctc_skip_leading(self) -> int: ...
    @property
    def audio_id(self) -> int: ...
    @property
    def decode_ctc_weight(self) -> float: ...
    @property
    def decode_ctc_candidates(self) -> int: ...
    @property
    def align_skip(self) -> int | None: ...
    @property
    def backend(self) -> Any: ...
    @property
    def llm(self) -> Any: ...
    def embed_tokens(self, ids: Tensor) -> Tensor: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...


def _choose(pick: Pick | None, rows: list[int], logits_RV: Tensor) -> Tensor:
    return logits_RV.argmax(dim=-1) if pick is None else pick(rows, logits_RV)


def cache_keyword(llm: Any) -> str:
    """The keyword the installed transformers takes the KV cache by: ``cache`` from 5.2x (where
    ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values`` before."""
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
    positions: Sequence[Tensor] | None = None,
) -> list[list[int]]:
    from transformers import (
        DynamicCache,  # lazy: transformers (seconds to import; commands that build no model skip it)
    )

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
        pos_BP[b, P - lens[b] :] = torch.arange(lens[b], device=device) if positions is None else positions[b]
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
    next_pos_B1 = torch.tensor(lens, dtype=torch.long, device=device)[
        :, None
    ]  # text positions count every row
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


def _last_logits(
    llm: Any, embeds: list[Tensor], *, thd: bool, positions: list[Tensor] | None = None
) -> Tensor:
    """Logits ``[B, V]`` at the last position of each sequence (no cache; full recompute); ``positions``:
    each sequence's position ids (None: ``0..n-1``)."""
    lens = [int(e.shape[0]) for e in embeds]
    device = embeds[0].device
    if positions is None:
        positions = [torch.arange(n, device=device) for n in lens]
    if thd:
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(torch.tensor(lens, device=device), 0)
        positions_T = torch.cat([p.to(device) for p in positions])
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
    positions_BS = torch.arange(S, device=device).expand(len(embeds), S).clone()
    for b, p in enumerate(positions):
        positions_BS[b, : p.shape[0]] = p.to(device)
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
    positions: Sequence[Tensor] | None = None,
) -> list[list[int]]:
    seqs = list(prompts)
    device = seqs[0].device
    pos = (
        [torch.arange(int(p.shape[0]), device=device) for p in seqs] if positions is None else list(positions)
    )
    outputs: list[list[int]] = [[] for _ in seqs]
    active = [i for i in range(len(seqs)) if max_new_tokens > 0]
    while _decide(bool(active), keep_going):
        rows = active or [0]  # a finished rank kept in lockstep recomputes one row, ignored
        last = _last_logits(llm, [seqs[i] for i in rows], thd=thd, positions=[pos[i] for i in rows])
        next_ids = _choose(pick, rows, last).tolist()
        new_emb = embed_tokens(torch.tensor(next_ids, device=seqs[0].device))
        still = []
        for j, i in enumerate(active):
            if next_ids[j] == eos_id:
                continue
            outputs[i].append(int(next_ids[j]))
            pos[i] = torch.cat([pos[i], pos[i].new_tensor([int(seqs[i].shape[0])])])  # text: the row count
            seqs[i] = torch.cat([seqs[i], new_emb[j : j + 1].to(seqs[i].dtype)])
            if len(outputs[i]) < max_new_tokens:
                still.append(i)
        active = still
    return outputs


def generate_greedy(
    model: DecodingModel,
    audio_BN: Tensor,
    audio_lens_B: Tensor,
    *,
    max_new_tokens: int,
    lang_id: int | None,
    use_cache: bool,
    keep_going: KeepGoing | None,
) -> list[list[int]]:
    """Greedy transcripts of whole clips (`SpeechLLM.generate_greedy`): each clip's prompt up to its
    transcript, then the language tag (forced when ``lang_id`` is given: it is then the first returned
    token), text, stop."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        if model.cfg.audio_prefix == "oracle":
            raise ValueError(
                "model.audio_prefix=oracle decodes from the transcript, which new audio does not have: "
                "evaluate a manifest (speechlm evaluate), or set model.audio_prefix=audio"
            )
        enc = encode_for_decoding(model, model.cp_layout, audio_BN.to(device), audio_lens_B.to(device))
        head_ids, tail_ids = model.prompt.generation_prompt
        forced = lang_id is not None and max_new_tokens > 0
        tag_ids = [int(lang_id)] if forced and lang_id is not None else []
        head = torch.tensor([*head_ids, model.audio_id, *tail_ids, *tag_ids], dtype=torch.long)
        clips = enc.embeds_of(range(len(enc.embeds)))
        rows = splice_prompts(model, [head] * len(clips), [[a] for a in clips], device)
        pick = joint_ctc_pick(model, enc, skip=0 if forced else model.ctc_skip_leading)
        budget = max_new_tokens - 1 if forced else max_new_tokens
        heads = [head] * len(clips)
        positions = prompt_positions(model, heads, None, [[a] for a in clips], skip=0 if forced else None)
        outputs = decode(
            model, rows, budget, use_cache=use_cache, keep_going=keep_going, pick=pick, positions=positions
        )
        return [tag_ids + o for o in outputs]
    finally:
        model.train(was_training)


def generate_for_batch(
    model: DecodingModel, batch: Any, *, max_new_tokens: int, use_cache: bool, keep_going: KeepGoing | None
) -> list[list[int]]:
    """Greedy answers for every row of a batch (`SpeechLLM.generate_for_batch`): each row's prompt up to
    the start of its last target run (the last assistant answer; where two answers are labelled back to
    back, the place in that run where ``batch.tokens``, the last answer, starts: `last_answer_start`), each
    placeholder replaced by its clip's embeddings. A row that transcribes its one clip decodes jointly with
    the CTC head (``decode_ctc_weight``); a translation's answer is not the clip's transcript: the LLM
    alone decodes it."""
    batch = as_conversation(batch, model.prompt)
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        prompts, clip_sample = conversation_prompts(batch, model.audio_id)
        counts = clips_per_sample(clip_sample, len(prompts))
        audio, audio_lens = batch.audio.to(device), batch.audio_lens.to(device)
        if not clip_sample:  # rows without audio: a dummy keeps FSDP's encoder collectives in step
            audio, audio_lens = dummy_clip(audio, audio_lens)
        enc = encode_for_decoding(model, model.cp_layout, audio, audio_lens)
        if model.cfg.audio_prefix == "oracle" and clip_sample:  # as training's forward (`model.oracle`)
            fill_with_transcripts(model, enc, *conversation_ctc_targets(batch, len(clip_sample)))
        embeds = enc.embeds_of(range(len(clip_sample)))
        answers = [t[: int(n)].tolist() for t, n in zip(batch.tokens.cpu(), batch.token_lens.cpu())]
        heads = [ids[: last_answer_start(ids, mask, answers[b], b)] for b, (ids, mask) in enumerate(prompts)]
        starts = [sum(counts[:b]) for b in range(len(counts))]
        row_clips = [embeds[c : c + k] for c, k in zip(starts, counts)]
        rows = splice_prompts(model, heads, row_clips, device)
        masks = [mask[: len(h)] for h, (_, mask) in zip(heads, prompts)]
        positions = prompt_positions(model, heads, masks, row_clips)
        tasks = list(optional_field(batch, "tasks") or ()) or ["asr"] * len(rows)
        clip_of_row = [c if k == 1 and t == "asr" else None for c, k, t in zip(starts, counts, tasks)]
        pick = joint_ctc_pick(model, enc, skip=model.ctc_skip_leading, clip_of_row=clip_of_row)
        return decode(
            model,
            rows,
            max_new_tokens,
            use_cache=use_cache,
            keep_going=keep_going,
            pick=pick,
            positions=positions,
        )
    finally:
        model.train(was_training)


def joint_ctc_pick(
    model: DecodingModel, enc: EncoderOutput, *, skip: int, clip_of_row: Sequence[int | None] | None = None
) -> Pick | None:
    """The token picker of joint CTC/attention decoding (`speechlm.model.ctc_prefix`), or None: plain
    greedy (``decode_ctc_weight`` 0 or no CTC head). Decoding row ``b`` reads clip ``clip_of_row[b]`` of
    ``enc`` (None: that row is the LLM's alone, e.g. a translation); default: row b, clip b."""
    weight = model.decode_ctc_weight
    if weight <= 0 or model.ctc_head is None:
        return None
    lens_C = enc.enc_lens_B.to(torch.long)
    if clip_of_row is None:
        clip_of_row = list(range(int(lens_C.numel())))
    if not any(c is not None for c in clip_of_row):
        return None
    # the log-probabilities stay in the frames' layout (at a 49k vocabulary a copy costs as much as the
    # decoding); each decoding row reads its clip's frames through a map of table rows
    logp = ctc_log_prob_rows(model, enc.enc_hidden)
    lens_C = lens_C.to(logp.device)
    T = int(lens_C.max())
    t_T = torch.arange(T, device=logp.device)
    if isinstance(enc.enc_hidden, PackedFrames):
        start_C = torch.cumsum(lens_C, 0) - lens_C
    else:  # padded [C, U, V]
        start_C = torch.arange(len(lens_C), device=logp.device) * logp.shape[1]
        logp = logp.reshape(-1, logp.shape[-1])
    frames_CT = start_C[:, None] + torch.minimum(t_T[None, :], lens_C[:, None] - 1)
    take = torch.tensor([0 if c is None else c for c in clip_of_row], device=logp.device)
    weights = torch.tensor([0.0 if c is None else weight for c in clip_of_row])
    scorer = JointCTCScorer(
        logp,
        lens_C[take],
        frames_BT=frames_CT[take],
        blank=model.ctc_blank_id,
        eos=model.prompt.stop_id,
        weight=weights,
        skip=skip,
        candidates=model.decode_ctc_candidates,
    )
    return scorer.step


def decode(
    model: DecodingModel,
    prompts: list[Tensor],
    max_new_tokens: int,
    *,
    use_cache: bool,
    keep_going: KeepGoing | None,
    pick: Pick | None = None,
    positions: Sequence[Tensor] | None = None,
) -> list[list[int]]:
    """Greedy continuations of the prompt embeddings; ``pick`` replaces the argmax (joint decoding);
    ``positions``: the prompts' position ids (`prompt_positions`; None: sequential)."""
    kw: dict[str, Any] = dict(
        eos_id=model.prompt.stop_id,
        max_new_tokens=max_new_tokens,
        keep_going=keep_going,
        pick=pick,
        positions=positions,
    )
    if use_cache and model.backend.caps.bshd:
        return greedy_with_cache(model.llm, model.embed_tokens, prompts, **kw)
    return greedy_recompute(model.llm, model.embed_tokens, prompts, thd=model.backend.caps.thd, **kw)


def embed_pieces(
    model: DecodingModel, pieces: Sequence[Sequence[int] | Tensor], device: torch.device
) -> list[Tensor]:
    """Each piece of token ids embedded (``[len, H]``), in ONE `embed_tokens` call: under FSDP every call
    all-gathers the embedding, so the count of calls must not depend on the batch's content (a rank
    decoding a dummy batch would otherwise wait in a collective its peers never reach)."""
    ids = [torch.as_tensor(p, dtype=torch.long).reshape(-1).cpu() for p in pieces]
    if not ids:
        return []
    flat = model.embed_tokens(torch.cat(ids).to(device))
    return list(torch.split(flat, [int(t.numel()) for t in ids]))


def splice_prompts(
    model: DecodingModel, heads: Sequence[Tensor], clips: Sequence[Sequence[Tensor]], device: torch.device
) -> list[Tensor]:
    """``[P_b, H]`` per row: row ``b``'s text ids embedded (all rows in one `embed_pieces` call), each
    ``audio_id`` replaced by the row's next clip (clips past its last placeholder are not used)."""
    texts: list[Tensor] = []
    layout: list[list[int]] = []
    for ids_L in heads:
        ids_L = ids_L.cpu()
        where = torch.nonzero(ids_L == model.audio_id).flatten().tolist()
        bounds = [-1, *where, int(ids_L.numel())]
        layout.append(where)
        texts += [ids_L[bounds[j] + 1 : bounds[j + 1]] for j in range(len(bounds) - 1)]
    embedded = embed_pieces(model, texts, device)
    rows, t = [], 0
    for where, row_clips in zip(layout, clips):
        parts = [embedded[t]]
        for j in range(len(where)):
            parts += [row_clips[j].to(embedded[t].dtype), embedded[t + j + 1]]
        t += len(where) + 1
        rows.append(torch.cat(parts))
    return rows


def prompt_positions(
    model: DecodingModel,
    heads: Sequence[Tensor],
    masks: Sequence[Tensor] | None,
    clips: Sequence[Sequence[Tensor]],
    *,
    skip: int | None = None,
) -> list[Tensor] | None:
    """Position ids of the spliced prompts (`splice_prompts`) when the model aligns its audio rows with
    their answers (``model.align_skip``, `speechlm.packing.positions`), as training laid them out; None:
    sequential. ``masks``: each head's target mask (earlier answers of a conversation); ``skip``: the answer
    tokens already in the prompt count (a forced language tag: 0); default ``model.align_skip``."""
    align = model.align_skip
    if align is None:
        return None
    out = []
    for b, ids_L in enumerate(heads):
        ids_L = ids_L.cpu()
        lens = [int(c.shape[0]) for c in clips[b][: int((ids_L == model.audio_id).sum())]]
        mask_L = torch.zeros(ids_L.shape, dtype=torch.bool) if masks is None else masks[b].cpu().bool()
        _, target_T, audio_T = expand_prompt(b, (ids_L, mask_L), lens, model.audio_id, one_clip=False)
        n = int(audio_T.numel())
        positions = torch.arange(n)
        seq_of = torch.zeros(n, dtype=torch.long)
        out.append(
            align_audio_positions(
                positions, audio_T, target_T, seq_of, lens, [n], skip=align if skip is None else skip
            )
        )
    return out
