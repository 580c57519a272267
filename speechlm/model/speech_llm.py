"""The speech LLM: log-mel features -> audio encoder -> frame-stack projector -> decoder LLM (+ CTC head).

Letters: B batch, N audio samples, T feature frames, F mel bins, U encoder frames, E encoder width,
A_i projected audio frames of clip i, H LLM hidden, V vocabulary, L tokens, M labelled positions.

`forward(batch)` is the one training entry point: it returns a micro-batch's `MicroLosses` through
one path, whatever the layout (``self.cp_layout``, a `parallel.cp_layout.CPLayout`):

    build_prompts(tokens, token_lens)      -> [(ids_L, target_mask_L)]    self.prompt (a `PromptFormat`):
                                              [*prefix, <audio>, *middle, *target, *stop, *trailing]
    cp_layout.place(seq_lens)              -> plan: this rank's sequences, which are split, padded how
    encode_for_layout(audio, lens, plan)   -> EncoderOutput(embeds, enc_hidden, enc_lens_B, ctc_rows, ctc_weight)
                                              (encode_audio on this rank's clips, split ones gathered)
    pack_for_layout(prompts, enc, plan)    -> PackedBatch: pack_thd, then cp_layout.shard (or pack_bshd)
    forward_packed(packed)                 -> (ce_sum, n_labelled)        (or forward_padded)

With one CP rank the layout is `NullCPLayout` (every sequence whole, one encoder call, no sharding, no
CP attention context). Under context parallelism the training layer sets a `DynamicCPLayout` once
when it parallelizes the model: each clip is encoded on one CP rank, only the split sequences' clips
are gathered, each rank keeps its chunks of the split sequences and its whole ones, and the
attention backends get the layout's CP attention context. The model never touches
``torch.distributed`` and never asks which layout it holds.

Token cross-entropy is a sum over labelled positions (fp32), so the caller divides by the global
count. Only the labelled positions' logits are computed (``logits_to_keep``): most positions are
audio frames, and the fp32 copy of ``[M, V]`` is made once.

CTC: a linear head over the encoder frames (before the projector), over the text tokenizer's ids,
blank = ``ctc_blank_id`` (``pad_id`` for the SentencePiece tokenizer, the audio placeholder for a
pretrained LLM's tokenizer, whose pad may be its EOS: a blank must never be a target), summed over
utterances with ``zero_infinity``. `ctc_loss_sum` takes the batch's tokens as collated and drops the
leading language tag itself (``ctc_skip_leading=1``; 0 without tags): the tag has no acoustic
counterpart, the LLM predicts it.

Padding-free encoder (``model.encoder.packed``, on by default for Parakeet): features, encoder,
projector and the CTC head run on packed frames (`speechlm.model.packed_encoder`; ``enc_hidden`` is
then `PackedFrames`), equal per utterance to the padded path. Greedy decoding lives in
`speechlm.model.generation` (batched KV cache; the prefix-recompute decoder is kept as the oracle).

Conversation batches (``batch.prompt_ids`` set): the prompts come with the batch (one placeholder per
clip, the assistant turns labelled), the batch holds C clips (``clip_sample`` the row of each), the
placement stays per row and each clip is encoded where its row lives (`parallel.cp_layout.plan_for_clips`),
CTC is per clip (`forward`). `generate_for_batch` decodes each row from the start of its last answer.

FSDP2 hooks ``forward``; `generate_greedy` and `generate_for_batch` are the other entry points the
training layer registers (``register_fsdp_forward_method``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from parallel.clip_placement import ClipSharding
from parallel.cp_layout import CPLayout, CPPlan, NullCPLayout, dummy_clip, plan_for_clips
from speechlm.config import ModelConfig
from speechlm.model.attention import ensure_registered, get_backend
from speechlm.model.conversation_inputs import (
    batch_field,
    clips_per_sample,
    conversation_ctc_targets,
    conversation_prompts,
    conversation_seq_lens,
    last_answer_start,
    optional_field,
)
from speechlm.model.encoders import build_encoder
from speechlm.model.features import LogMelFeatures
from speechlm.model.flops import MicroWork, record_work
from speechlm.model.llm import build_llm
from speechlm.model.packed_encoder import PackedFrames
from speechlm.model.projector import FrameStackProjector, compute_stacked_lengths
from speechlm.model.sharded_encoder import ClipSlice
from speechlm.packing.prompt import PromptFormat
from speechlm.packing.thd import IGNORE_INDEX, PackedBatch, clip_offsets


@dataclass
class MicroLosses:
    """Loss sums of one micro-batch on this rank (the caller divides by the step's global counts)."""

    ce_sum: Tensor  # summed token cross-entropy of this rank's share (fp32)
    n_labelled: int  # labelled tokens of the whole micro-batch (before CP sharding)
    ctc_sum: Tensor | None  # summed CTC of the clips this rank encoded (None: CTC off)
    n_clips: int
    weight: float = 1.0  # 0 for the training layer's dummy micro-batch
    work: MicroWork | None = None  # what this rank computed, for the FLOP count (`speechlm.model.flops`)


@dataclass
class EncoderOutput:
    """A micro-batch's audio side on this rank: what `encode_audio` returns for every clip, and what
    `SpeechLLM.forward` gets back from its CP layout (`parallel.cp_layout.CPLayout.encode`)."""

    # per clip [A_i, H], ready to splice into the prompt; None where the clip lives on another CP rank
    embeds: list[Tensor | None]
    # encoder output of the clips this rank encoded (`ctc_rows`): PackedFrames ([sum U_b, E], the
    # padding-free encoder) or [B, U, E] (padded encoder; frames past each clip are zero)
    enc_hidden: PackedFrames | Tensor
    enc_lens_B: Tensor  # int64 encoder frames per clip of enc_hidden
    # the batch rows of enc_hidden's clips, in order (CP: only those this rank encoded, so each clip's
    # CTC counts once); empty: enc_hidden is a dummy clip's, kept in the graph with ctc_weight 0
    ctc_rows: list[int]
    ctc_weight: float = 1.0
    # a dummy clip's embeddings no sample uses (this rank has no clip: samples without audio); the
    # loss keeps them with weight 0 so the projector and encoder stay in every rank's backward
    unused: list[Tensor] = field(default_factory=list)
    # sharded clips (`SpeechLLM.finish_sharded`) whose CTC this rank computes: (batch row, the clip's
    # encoder frames [U, E], every rank's slice gathered)
    ctc_extra: list[tuple[int, Tensor]] = field(default_factory=list)
    # feature frames of the sharded clips' slices this rank encoded (the FLOP count)
    slice_feature_frames: list[int] = field(default_factory=list)
    # this rank's slices of the sharded clips as the encoder and projector left them: (encoder frames
    # [U, E], projected rows [P, H]) per clip, until `SpeechLLM.finish_sharded` hands them over
    slices: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    @property
    def enc_lens(self) -> Tensor:
        return self.enc_lens_B

    def embeds_of(self, clips: Sequence[int]) -> list[Tensor]:
        """The embeddings of ``clips``, which must all be on this rank."""
        out = [self.embeds[i] for i in clips]
        missing = [i for i, e in zip(clips, out) if e is None]
        if missing:
            raise ValueError(f"clips {missing} were encoded on another CP rank and not gathered to this one")
        return [e for e in out if e is not None]


def resolve_encoder_packed(model_cfg: ModelConfig, supports_packed: bool) -> bool:
    """``model.encoder.packed``: None means on where the encoder supports it; true where it does not
    is an error (the validator reports it before a run starts)."""
    want = model_cfg.encoder.packed
    if want is None:
        return supports_packed
    if want and not supports_packed:
        raise ValueError(
            f"model.encoder.packed=true but encoder.kind={model_cfg.encoder.kind!r} has no padding-free "
            "path; set model.encoder.packed=false (or leave it unset)"
        )
    return bool(want)


def _packed_to_time_major(x_UV: Tensor, lens_B: Tensor) -> Tensor:
    """Packed rows ``[sum U_b, V]`` -> ``[max U, B, V]`` (zeros past each clip, never read by the loss)."""
    B = lens_B.numel()
    max_len = int(lens_B.max()) if B else 0
    starts_B = torch.cumsum(lens_B, 0) - lens_B
    clip_U = torch.repeat_interleave(torch.arange(B, device=x_UV.device), lens_B, output_size=x_UV.shape[0])
    t_U = torch.arange(x_UV.shape[0], device=x_UV.device) - starts_B[clip_U]
    out = x_UV.new_zeros(max_len * B, x_UV.shape[1])
    return out.index_copy(0, t_U * B + clip_U, x_UV).view(max_len, B, x_UV.shape[1])


class SpeechLLM(nn.Module):
    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        vocab_size: int,
        pad_id: int,
        audio_id: int,
        prompt: PromptFormat | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        instruction_ids: Sequence[int] = (),
        ctc_skip_leading: int = 1,
        ctc_blank_id: int | None = None,
        added_token_ids: Sequence[int] = (),
    ) -> None:
        """``prompt``: the run's `PromptFormat`; without it, the plain form of ``bos_id``, ``eos_id``
        and ``instruction_ids``. ``added_token_ids``: ids the tokenizer added to a pretrained LLM's
        vocabulary (their embedding rows start at the mean of the others: `speechlm.model.llm`)."""
        super().__init__()
        if prompt is None:
            if eos_id is None:
                raise ValueError("SpeechLLM needs prompt=PromptFormat(...) or eos_id (and bos_id)")
            prompt = PromptFormat.plain(
                bos_id=bos_id, eos_id=eos_id, audio_id=audio_id, instruction_ids=instruction_ids
            )
        if prompt.audio_id != audio_id:
            raise ValueError(f"prompt.audio_id={prompt.audio_id} differs from audio_id={audio_id}")
        self.cfg = model_cfg
        self.vocab_size = vocab_size
        self.prompt = prompt
        self.pad_id, self.bos_id, self.eos_id, self.audio_id = pad_id, prompt.bos_id, prompt.eos_id, audio_id
        self.ctc_skip_leading = ctc_skip_leading
        self.added_token_ids = tuple(int(i) for i in added_token_ids)
        self.ctc_blank_id = pad_id if ctc_blank_id is None else int(ctc_blank_id)
        self.ctc_weight = model_cfg.ctc_weight
        # joint CTC/attention greedy decoding of transcripts (`_joint_ctc_pick`); transcribe/evaluate may set it
        self.decode_ctc_weight = float(model_cfg.decode_ctc_weight)
        self.decode_ctc_candidates = int(model_cfg.decode_ctc_candidates)
        self.backend = get_backend(model_cfg.attention_backend)
        attn_implementation = ensure_registered(model_cfg.attention_backend)

        self.encoder = build_encoder(model_cfg.encoder, dropout=model_cfg.dropout)
        self.features = LogMelFeatures(self.encoder.feature_settings)
        self.encoder_packed = resolve_encoder_packed(model_cfg, self.encoder.supports_packed)
        # The LLM's only dropout is attention dropout, which the THD reference/CP paths lack: keep it 0.
        self.llm = build_llm(
            model_cfg.llm,
            vocab_size=vocab_size,
            pad_id=pad_id,
            bos_id=prompt.bos_id,
            eos_id=prompt.eos_id,
            dropout=0.0,
            attn_implementation=attn_implementation,
            added_token_ids=added_token_ids,
        )
        self.projector = FrameStackProjector(
            self.encoder.output_dim,
            self.llm.config.hidden_size,
            model_cfg.projector_stack,
            model_cfg.projector_hidden,
            dropout=model_cfg.dropout,
        )
        self.ctc_head = nn.Linear(self.encoder.output_dim, vocab_size) if model_cfg.ctc_weight > 0 else None
        # one CP rank until the training layer sets its layout (`set_cp_layout`)
        self.cp_layout: CPLayout = NullCPLayout(tp=1, pad_to_multiple=model_cfg.pad_to_multiple)

    # ------------------------------------------------------------------------------------------
    # Audio side
    # ------------------------------------------------------------------------------------------

    def encode_audio(
        self,
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        *,
        freeze_encoder: bool = False,
        slices: Sequence[ClipSlice] = (),
    ) -> EncoderOutput:
        """Features → encoder → projector. ``freeze_encoder`` runs features and encoder without autograd
        (the first phase of the two-phase schedule); the projector always trains. With the padding-free
        encoder (``self.encoder_packed``) features, encoder and projector see packed frames only.
        ``slices``: slices of clips sharded over the CP group (`prepare_slices`), run in the same encoder
        call (`forward_with_slices`) and projector call; their (encoder frames, projected rows) come back
        in ``EncoderOutput.slices``."""
        packed = self.encoder_packed
        with torch.no_grad() if freeze_encoder else contextlib.nullcontext():
            if packed:
                feats, feat_lens_B = self.features.packed(audio_BN, audio_lens_B)
            else:
                feats, feat_lens_B = self.features(audio_BN, audio_lens_B)
            if slices:
                enc_hidden, enc_lens_B, slice_hidden = self.encoder.forward_with_slices(
                    feats, feat_lens_B, slices
                )
            else:
                enc_hidden, enc_lens_B = self.encoder(feats, feat_lens_B, packed=packed)
        if not slices:
            proj, proj_lens_B = self.projector(enc_hidden, enc_lens_B)
            return self._encoder_output(proj, proj_lens_B, enc_hidden, enc_lens_B, packed)
        # one projector call: the whole clips' frames, then each slice's (cut on the stack: exact)
        lens_all = torch.cat([enc_lens_B, enc_lens_B.new_tensor([int(h.shape[0]) for h in slice_hidden])])
        proj_all, proj_lens_all = self.projector(torch.cat([enc_hidden, *slice_hidden]), lens_all)
        n_clips = int(enc_lens_B.numel())
        rows = [int(n) for n in proj_lens_all.tolist()]
        proj_parts = torch.split(proj_all, [sum(rows[:n_clips]), *rows[n_clips:]])
        out = self._encoder_output(proj_parts[0], proj_lens_all[:n_clips], enc_hidden, enc_lens_B, packed)
        out.slices = list(zip(slice_hidden, proj_parts[1:], strict=True))
        return out

    @staticmethod
    def _encoder_output(
        proj: Tensor, proj_lens_B: Tensor, enc_hidden: Tensor, enc_lens_B: Tensor, packed: bool
    ) -> EncoderOutput:
        """`encode_audio`'s result for its whole clips: projected rows per clip, the encoder's frames."""
        rows = list(range(int(proj_lens_B.numel())))
        if packed:
            embeds: list[Tensor | None] = list(torch.split(proj, [int(n) for n in proj_lens_B.tolist()]))
            return EncoderOutput(embeds, PackedFrames(enc_hidden, enc_lens_B), enc_lens_B, rows)
        embeds = [proj[i, :n] for i, n in enumerate(proj_lens_B.tolist())]
        return EncoderOutput(embeds, enc_hidden, enc_lens_B, rows)

    def audio_embed_lengths(self, audio_lens_B: Tensor) -> list[int]:
        """Projected audio frames per clip, from the sample counts alone (host integers): what
        `encode_audio` will return, known before it runs (dynamic CP places sequences with it)."""
        from speechlm.model.features import compute_feature_lengths
        from speechlm.model.projector import compute_stacked_lengths

        feat = compute_feature_lengths(audio_lens_B.cpu(), self.encoder.feature_settings.hop_length)
        return [
            int(n) for n in compute_stacked_lengths(self.encoder.output_lengths(feat), self.projector.stack)
        ]

    def feature_frames(self, audio_lens_B: Tensor, rows: Sequence[int]) -> list[int]:
        """Feature frames of the clips `rows` (host integers, from the sample counts)."""
        from speechlm.model.features import compute_feature_lengths

        feat = compute_feature_lengths(audio_lens_B.cpu(), self.encoder.feature_settings.hop_length)
        return [int(feat[i]) for i in rows]

    def ctc_loss_sum(
        self,
        enc_hidden: PackedFrames | Tensor,
        enc_lens_B: Tensor,
        tokens_BL: Tensor,
        token_lens_B: Tensor,
        weights_B: Tensor | None = None,
    ) -> tuple[Tensor, int]:
        """Summed CTC loss over the batch (fp32, blank = ctc_blank_id, impossible alignments count 0).

        ``enc_hidden`` is `PackedFrames` (the head and log-softmax run on the real frames only; the
        loss kernel gets them laid out as ``[max U, B, V]`` and reads each clip's first U_b frames) or
        a padded ``[B, U, E]`` tensor. ``tokens_BL``/``token_lens_B`` are the batch's transcript tokens
        as collated, language tag first; the first ``ctc_skip_leading`` tokens (the tag) are dropped
        here (`ctc_targets`). ``weights_B``: a weight per clip (conversations: 0 for a clip without a
        transcript); None sums every clip.
        """
        log_probs_UBV = self.ctc_log_probs(enc_hidden, enc_lens_B)
        device = log_probs_UBV.device
        n_clips = int(enc_lens_B.numel())
        lens_B = enc_lens_B.to(device=device, dtype=torch.long)
        targets_BL, target_lens_B = self.ctc_targets(tokens_BL.to(device), token_lens_B.to(device))
        with torch.autocast(device_type=device.type, enabled=False):
            loss = nn.functional.ctc_loss(
                log_probs_UBV,
                targets_BL.to(torch.long),
                lens_B,
                target_lens_B,
                blank=self.ctc_blank_id,
                reduction="sum" if weights_B is None else "none",
                zero_infinity=True,
            )
            if weights_B is not None:
                loss = (loss * weights_B.to(device=device, dtype=loss.dtype)).sum()
        return loss, n_clips

    def ctc_log_probs(self, enc_hidden: PackedFrames | Tensor, enc_lens_B: Tensor) -> Tensor:
        """The CTC head's fp32 log-probabilities ``[max U, B, V]`` (zeros past each clip): what the loss
        (`ctc_loss_sum`) and joint decoding (`_joint_ctc_pick`) read. `PackedFrames`: the head and the
        log-softmax run on the real frames only; a padded ``[B, U, E]`` tensor: on every frame."""
        if self.ctc_head is None:
            raise RuntimeError("this model has no CTC head (model.ctc_weight=0)")
        log_probs = self._ctc_log_prob_rows(enc_hidden)
        if isinstance(enc_hidden, PackedFrames):
            return _packed_to_time_major(log_probs, enc_lens_B.to(device=log_probs.device, dtype=torch.long))
        return log_probs.transpose(0, 1)

    def _ctc_log_prob_rows(self, enc_hidden: PackedFrames | Tensor) -> Tensor:
        """The CTC head's fp32 log-probabilities in the frames' own layout: ``[sum U_b, V]`` packed, or
        ``[B, U, V]``."""
        assert self.ctc_head is not None
        hidden: Tensor = enc_hidden.data_UE if isinstance(enc_hidden, PackedFrames) else enc_hidden
        logits = self.ctc_head(hidden)  # in the compute dtype (autocast / FSDP params)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return logits.float().log_softmax(dim=-1)

    def ctc_targets(self, tokens_BL: Tensor, token_lens_B: Tensor) -> tuple[Tensor, Tensor]:
        """CTC targets from the collated tokens: drop the first ``ctc_skip_leading`` (the language tag)."""
        k = self.ctc_skip_leading
        lens_B = (token_lens_B.to(torch.long) - k).clamp(min=0)
        targets_BL = tokens_BL[:, k:]
        if targets_BL.shape[1] == 0:  # ctc_loss wants at least one column
            targets_BL = tokens_BL.new_full((tokens_BL.shape[0], 1), self.pad_id)
        return targets_BL, lens_B

    # ------------------------------------------------------------------------------------------
    # Text side
    # ------------------------------------------------------------------------------------------

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.llm.get_input_embeddings()(ids)

    def forward_packed(
        self, packed: PackedBatch, *, return_logits: bool = False
    ) -> tuple[Tensor, int] | Tensor:
        """Decode a THD ``PackedBatch`` (this rank's share under CP: its first ``cp_split_seqs`` sequences
        are split over the CP group); ``(ce_sum, n_labelled)``, or the ``[T, V]`` logits."""
        cu = packed.cu_seqlens
        kwargs: dict[str, Any] = dict(
            inputs_embeds=packed.inputs_embeds[None],
            position_ids=packed.position_ids[None],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=int(packed.max_seqlen),
            max_length_k=int(packed.max_seqlen),
        )
        from parallel.varlen_meta import build_varlen_meta

        # the pack's boundaries as host integers, read once here for every layer (one sync per micro-batch)
        meta = build_varlen_meta(cu, device=cu.device)
        kwargs["varlen_meta"] = meta
        # under CP: the split prefix (every sequence without dynamic CP) and its ring plans; None without CP
        n_split = len(meta.cu_q) - 1 if packed.cp_split_seqs is None else packed.cp_split_seqs
        kwargs["cp_context"] = self.cp_layout.attention_context(meta, n_split)
        if return_logits:
            return self.llm(**kwargs).logits[0]
        labels_T = packed.labels
        keep_M = torch.nonzero(labels_T != IGNORE_INDEX).flatten()
        logits_MV = self.llm(**kwargs, logits_to_keep=keep_M).logits[0]
        ce_sum = nn.functional.cross_entropy(logits_MV.float(), labels_T[keep_M], reduction="sum")
        return ce_sum, int(keep_M.numel())

    def forward_padded(self, padded: Any) -> tuple[Tensor, int]:
        """Decode a BSHD ``PaddedBatch`` with its padding mask; ``(ce_sum, n_labelled)``."""
        logits_BSV = self.llm(
            inputs_embeds=padded.inputs_embeds,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
        ).logits
        keep_BS = padded.labels != IGNORE_INDEX
        ce_sum = nn.functional.cross_entropy(
            logits_BSV[keep_BS].float(), padded.labels[keep_BS], reduction="sum"
        )
        return ce_sum, int(keep_BS.sum())

    # ------------------------------------------------------------------------------------------
    # The training entry point: one micro-batch to its loss sums
    # ------------------------------------------------------------------------------------------

    def build_prompts(self, tokens_BL: Tensor, token_lens_B: Tensor) -> list[tuple[Tensor, Tensor]]:
        """``[(ids_L, target_mask_L)]`` per utterance, in the run's `PromptFormat` (``self.prompt``)."""
        from speechlm.packing.prompt import build_prompts

        return build_prompts(tokens_BL, token_lens_B, prompt=self.prompt)

    def set_cp_layout(self, layout: CPLayout) -> None:
        """Called once by the training layer when it parallelizes this model (`parallel.cp_layout`)."""
        self.cp_layout = layout

    def encode_for_layout(
        self,
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        plan: CPPlan,
        *,
        freeze_encoder: bool = False,
        skip: Sequence[bool] = (),
        slices: Sequence[ClipSlice] = (),
    ) -> EncoderOutput:
        """`encode_audio` through the CP layout: this rank's clips, the split sequences' clips gathered;
        ``skip``: the clips sharded over the CP group, left None here; ``slices``: this rank's slices of
        them (`prepare_slices`), encoded and projected in the same encoder and projector calls as its whole
        clips (one call each per micro-batch on every rank, whatever the micro-batch holds, so FSDP's
        collectives of those units stay in step across data-parallel ranks); their outputs come back in
        ``EncoderOutput.slices`` for `finish_sharded`."""

        def encode_fn(a: Tensor, lens: Tensor) -> tuple[list[Tensor], Any]:
            out = self.encode_audio(a, lens, freeze_encoder=freeze_encoder, slices=slices)
            return out.embeds_of(out.ctc_rows), (out.enc_hidden, out.enc_lens_B, out.slices)

        res = self.cp_layout.encode(encode_fn, audio_BN, audio_lens_B, plan, skip)
        enc_hidden, enc_lens_B, slice_outs = res.extra
        enc = EncoderOutput(res.embeds, enc_hidden, enc_lens_B, res.clips, res.weight, res.unused)
        enc.slices = list(slice_outs)
        return enc

    def clip_sharding(self, audio_lens_B: Tensor) -> ClipSharding | None:
        """Which clips of a micro-batch the encoder shards over the CP group
        (`parallel.clip_placement.place_clips`, through the layout), or None when none is: one CP rank, an
        encoder that cannot shard a clip (full context, not padding-free), or no clip long enough."""
        halo = self.encoder.slice_halo
        if self.cp_layout.cp_size == 1 or halo is None or not self.encoder_packed:
            return None
        from parallel.clip_placement import short_clip_frames
        from speechlm.model.features import compute_feature_lengths

        feat = compute_feature_lengths(audio_lens_B.cpu(), self.encoder.feature_settings.hop_length)
        frames = [int(n) for n in self.encoder.output_lengths(feat)]
        sharding = self.cp_layout.clip_sharding(
            frames,
            min_frames=short_clip_frames(self.encoder.subsampling),
            min_slice=halo + self.projector.stack,  # a slice's halo, after the cut's stack alignment
        )
        return sharding if sharding.sharded_indices else None

    def prepare_slices(
        self, audio_BN: Tensor, audio_lens_B: Tensor, sharding: ClipSharding
    ) -> list[ClipSlice]:
        """This rank's slice of every clip ``sharding`` shards over the CP group, ready for the encoder:
        its contiguous encoder frames (`parallel.clip_placement.shard_bounds`, cut on the projector's
        stack) and the feature frames its subsampling reads (`LogMelFeatures.frames_of_clip`, the clip's
        normalisation statistics summed over the group; no gradient: features have no parameters)."""
        from parallel.clip_placement import shard_bounds
        from speechlm.model.sharded_encoder import feature_span

        lay, stack, sub = self.cp_layout, self.projector.stack, self.encoder.subsampling
        out = []
        for c in sharding.sharded_indices:
            n = int(audio_lens_B[c])
            lo, hi = shard_bounds(sharding.frames[c], lay.cp_size, align=stack)[lay.cp_rank]
            total = n // self.encoder.feature_settings.hop_length  # the clip's feature frames
            span = feature_span(lo, hi, (sub - 1).bit_length(), total)  # sub = 2 ** n_convs
            own = (min(lo * sub, total), min(hi * sub, total))  # the ranks' own frames partition the clip's
            with torch.no_grad():
                feats = self.features.frames_of_clip(audio_BN[c], n, span, own, lay.reduce_sum)
            out.append(ClipSlice(feats, (lo, hi), lay.halo(), span[0], total))
        return out

    def finish_sharded(
        self,
        enc: EncoderOutput,
        sharding: ClipSharding,
        plan: CPPlan,
        *,
        seq_of_clip: Sequence[int],
        offsets: Sequence[int],
    ) -> None:
        """The sharded clips' side of ``enc`` once the encoder and projector ran on this rank's slices (in
        the same calls as its whole clips: `encode_for_layout`, ``enc.slices``): the layout hands each
        clip's projected rows to the ranks whose LLM stream holds them (`parallel.clip_handover`) and, with
        a CTC head, gathers the slices' encoder frames for the rank that scores the clip's CTC (its owner
        in ``plan``). ``seq_of_clip[c]``: the sequence of clip c; ``offsets[c]``: the row of that sequence
        where the clip's first frame sits. Finally every output of the audio side passes through one
        autograd node (`CPLayout.tie`), which keeps the CP collectives of the backward in one order on
        every rank (docs/parallelism.md)."""
        from parallel.clip_handover import Handover, clip_needs
        from parallel.clip_placement import shard_bounds

        lay, stack = self.cp_layout, self.projector.stack
        cp, rank = lay.cp_size, lay.cp_rank
        padded = dict(zip(plan.indices, plan.padded_lengths))
        gathered, owners = plan.gathered, plan.clip_owners
        for c, (hidden_UE, proj_PH) in zip(sharding.sharded_indices, enc.slices, strict=True):
            bounds = shard_bounds(sharding.frames[c], cp, align=stack)
            rows = int(compute_stacked_lengths(torch.tensor([sharding.frames[c]]), stack)[0])
            have = [(a // stack, -(-b // stack)) for a, b in bounds]
            need = clip_needs(
                rows,
                int(offsets[c]),
                cp,
                split=bool(gathered[c]),
                padded_len=padded[seq_of_clip[c]] if gathered[c] else 0,
                owner=int(owners[c]),
            )
            enc.embeds[c] = lay.hand_over(proj_PH, Handover.build(rows, have, need))
            if self.ctc_head is not None:
                full_UE = lay.gather_slices(hidden_UE, [b - a for a, b in bounds])
                if owners[c] == rank:
                    enc.ctc_extra.append((c, full_UE))
                else:
                    enc.unused.append(full_UE)
            lo, hi = bounds[rank]
            enc.slice_feature_frames.append((hi - lo) * self.encoder.subsampling)
        enc.slices = []
        self._tie_audio_side(enc)

    def _tie_audio_side(self, enc: EncoderOutput) -> None:
        """Pass every tensor of ``enc`` that reaches the loss through `CPLayout.tie` (one autograd node), and
        keep one of them in the loss with weight 0 so that the node runs on every rank."""
        hidden = enc.enc_hidden
        data = hidden.data_UE if isinstance(hidden, PackedFrames) else hidden
        present = [(i, e) for i, e in enumerate(enc.embeds) if e is not None]
        slots = [i for i, _ in present]
        tensors = [data, *(e for _, e in present), *(h for _, h in enc.ctc_extra), *enc.unused]
        tied = iter(self.cp_layout.tie(tensors))
        data = next(tied)
        enc.enc_hidden = PackedFrames(data, hidden.lens_B) if isinstance(hidden, PackedFrames) else data
        for i in slots:
            enc.embeds[i] = next(tied)
        enc.ctc_extra = [(c, next(tied)) for c, _ in enc.ctc_extra]
        enc.unused = [next(tied) for _ in enc.unused] + [data]

    def ctc_of(
        self, enc: EncoderOutput, tokens_BL: Tensor, token_lens_B: Tensor, *, per_clip: bool = False
    ) -> Tensor:
        """Weighted CTC sum of the clips in ``enc`` (a dummy clip's with weight 0: the head stays in
        the graph, FSDP's reduce-scatter of it runs on every rank). ``per_clip`` (conversations): the
        rows of ``tokens_BL`` are clips, and a clip of length 0 (no transcript) gets weight 0."""
        weights = None
        if enc.ctc_rows:
            tokens, lens = tokens_BL[enc.ctc_rows], token_lens_B[enc.ctc_rows]
            if per_clip:
                weights = (lens > 0).to(torch.float32)
        else:
            n = len(enc.enc_lens_B)
            tokens = torch.full((n, 2), self.eos_id, dtype=torch.long, device=tokens_BL.device)
            lens = torch.full((n,), 2, dtype=torch.long, device=tokens_BL.device)
        if not enc.ctc_extra:
            ctc_sum, _ = self.ctc_loss_sum(enc.enc_hidden, enc.enc_lens_B, tokens, lens, weights)
            return ctc_sum * enc.ctc_weight
        # the sharded clips this rank scores join the same head call (FSDP: one call per rank, like its
        # peers), each with weight 1; the clips above keep theirs (times ctc_weight: 0 for a dummy)
        if not isinstance(enc.enc_hidden, PackedFrames):
            raise RuntimeError("a sharded clip needs the padding-free encoder (model.encoder.packed)")
        rows = [c for c, _ in enc.ctc_extra]
        extra_tokens, extra_lens = tokens_BL[rows], token_lens_B[rows]
        data = enc.enc_hidden.data_UE
        hidden = PackedFrames(
            torch.cat([data, *(h.to(data.dtype) for _, h in enc.ctc_extra)]),
            torch.cat(
                [enc.enc_lens_B, enc.enc_lens_B.new_tensor([int(h.shape[0]) for _, h in enc.ctc_extra])]
            ),
        )
        width = max(tokens.shape[1], extra_tokens.shape[1])
        all_tokens = torch.cat(
            [nn.functional.pad(t, (0, width - t.shape[1]), value=self.pad_id) for t in (tokens, extra_tokens)]
        )
        w_base = torch.ones(len(lens)) if weights is None else weights.float().cpu()
        w_extra = (extra_lens > 0).float().cpu() if per_clip else torch.ones(len(rows))
        all_w = torch.cat([w_base * enc.ctc_weight, w_extra])
        ctc_sum, _ = self.ctc_loss_sum(
            hidden, hidden.lens_B, all_tokens, torch.cat([lens, extra_lens]), all_w
        )
        return ctc_sum

    def forward(self, batch: Any, *, encoder_frozen: bool = False) -> MicroLosses:
        """One micro-batch (``audio`` [B, N], ``audio_lens`` [B], ``tokens`` [B, L] with the language tag
        first, ``token_lens`` [B]; attributes or mapping keys, already on the model's device) to its
        loss sums: place, encode, build prompts, pack (THD, rounded and CP-sharded per
        ``self.cp_layout``) or pad (BSHD), decode. Training, the teacher-forced validation loss and the
        tests all run this.

        A conversation batch (``prompt_ids`` set: `speechlm.data.dataset.Batch`) brings its own prompts
        (`conversation_prompts`) and C clips (``audio`` [C, N], ``clip_sample`` [C]); each clip is
        spliced at its placeholder, the CP plan is per sample and a clip lives where its sample lives
        (`parallel.cp_layout.plan_for_clips`), CTC runs per clip against ``ctc_tokens`` (clips of
        length 0 count nothing) and ``n_clips`` counts the clips with a CTC target.

        A frozen encoder runs without autograd inside `encode_audio`; the projector still trains."""
        lay = self.cp_layout
        if not self.cfg.packed_sequences and lay.cp_size > 1:
            raise ValueError(
                "model.packed_sequences=false (BSHD) with cp > 1: padding cannot be masked in the CP "
                "attention path; set model.packed_sequences=true"
            )
        audio_BN, audio_lens_B = batch_field(batch, "audio"), batch_field(batch, "audio_lens")
        # placement first, from lengths known before encoding
        audio_lens = self.audio_embed_lengths(audio_lens_B)
        clip_counts: list[int] | None = None
        if optional_field(batch, "prompt_ids") is not None:
            prompts, clip_sample = self.conversation_prompts(batch)
            clip_counts = clips_per_sample(clip_sample, len(prompts))
            seq_lens = conversation_seq_lens(prompts, clip_counts, audio_lens)
            plan = lay.place(seq_lens)
            enc_plan: CPPlan = plan_for_clips(plan, clip_sample, audio_lens, lay.cp_size)
            ctc_tokens, ctc_lens = conversation_ctc_targets(batch, len(clip_sample))
            n_clips = int((ctc_lens > 0).sum())
        else:
            tokens_BL, token_lens_B = batch_field(batch, "tokens"), batch_field(batch, "token_lens")
            prompts = self.build_prompts(tokens_BL, token_lens_B)
            seq_lens = [int(ids.shape[0]) - 1 + a for (ids, _), a in zip(prompts, audio_lens)]
            plan = enc_plan = lay.place(seq_lens)
            ctc_tokens, ctc_lens, n_clips = tokens_BL, token_lens_B, len(prompts)
        sharding = self.clip_sharding(audio_lens_B)
        skip = sharding.sharded if sharding is not None else ()
        slices = self.prepare_slices(audio_BN, audio_lens_B, sharding) if sharding is not None else []
        enc = self.encode_for_layout(
            audio_BN, audio_lens_B, enc_plan, freeze_encoder=encoder_frozen, skip=skip, slices=slices
        )
        if sharding is not None:
            seq_of_clip = list(range(len(prompts))) if clip_counts is None else list(clip_sample)
            self.finish_sharded(
                enc,
                sharding,
                enc_plan,
                seq_of_clip=seq_of_clip,
                offsets=clip_offsets(prompts, seq_of_clip, audio_lens, self.audio_id),
            )
        ctc_sum = None
        if self.ctc_head is not None:
            ctc_sum = self.ctc_of(enc, ctc_tokens, ctc_lens, per_clip=clip_counts is not None)
        if self.cfg.packed_sequences:
            packed = self.pack_for_layout(prompts, enc, plan, audio_BN.device, clip_counts)
            ce_sum, _ = self.forward_packed(packed)
            n_labelled = sum(int(mask.sum()) for _, mask in prompts)  # the whole micro-batch's
            local, n_split, computed = plan.indices, plan.n_split, int(packed.inputs_embeds.shape[0])
        else:
            from speechlm.packing.thd import pack_bshd

            padded = pack_bshd(
                prompts,
                enc.embeds_of(range(len(enc.embeds))),
                self.embed_tokens,
                audio_id=self.audio_id,
                pad_to_multiple=self.cfg.pad_to_multiple or lay.tp,
                clip_counts=clip_counts,
            )
            ce_sum, n_labelled = self.forward_padded(padded)
            local, n_split = list(range(len(prompts))), 0
            computed = int(padded.inputs_embeds.shape[0] * padded.inputs_embeds.shape[1])
        work = record_work(
            seq_lens,
            [int(mask.sum()) for _, mask in prompts],
            local,
            n_split,
            lay.cp_size,
            clip_frames=self.feature_frames(audio_lens_B, enc.ctc_rows) + enc.slice_feature_frames,
            computed_tokens=computed,
        )
        for e in enc.unused:  # weight 0: in the graph, counts nothing
            ce_sum = ce_sum + 0.0 * e.sum()
        return MicroLosses(
            ce_sum=ce_sum.float(), n_labelled=int(n_labelled), ctc_sum=ctc_sum, n_clips=n_clips, work=work
        )

    def conversation_prompts(self, batch: Any) -> tuple[list[tuple[Tensor, Tensor]], list[int]]:
        """``([(ids_L, target_mask_L)] per row, clip_sample)`` of a conversation batch: each row's
        rendered prompt (``prompt_ids``/``prompt_mask`` cut to ``prompt_lens``) and the row of each clip."""
        return conversation_prompts(batch, self.audio_id)

    def pack_for_layout(
        self,
        prompts: list[tuple[Tensor, Tensor]],
        enc: EncoderOutput,
        plan: CPPlan,
        device: torch.device,
        clip_counts: Sequence[int] | None = None,
    ) -> PackedBatch:
        """This rank's THD stream: its sequences of ``plan`` packed to their padded lengths, then its
        share of them (`CPLayout.shard`). ``clip_counts``: clips per sequence (None: one each)."""
        from speechlm.packing.thd import pack_thd

        local = plan.indices
        local_counts = None
        clips: Sequence[int] = local
        if clip_counts is not None:
            starts = [0]
            for k in clip_counts:
                starts.append(starts[-1] + k)
            clips = [c for i in local for c in range(starts[i], starts[i + 1])]
            local_counts = [clip_counts[i] for i in local]
        packed = pack_thd(
            [prompts[i] for i in local],
            enc.embeds_of(clips),
            self.embed_tokens,
            audio_id=self.audio_id,
            padded_lengths=plan.padded_lengths,
            clip_counts=local_counts,
            device=device,
        )
        parts, cu, max_len = self.cp_layout.shard(
            {"x": packed.inputs_embeds, "labels": packed.labels, "pos": packed.position_ids},
            packed.cu_seqlens,
            packed.max_seqlen,
            plan,
        )
        return PackedBatch(
            parts["x"],
            parts["labels"],
            parts["pos"],
            cu,
            max_len,
            packed.seq_lens,
            cp_split_seqs=plan.n_split,
        )

    # ------------------------------------------------------------------------------------------
    # Greedy decoding
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate_greedy(
        self,
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        *,
        max_new_tokens: int,
        lang_id: int | None = None,
        use_cache: bool = True,
        keep_going: Any = None,
    ) -> list[list[int]]:
        """Greedy transcripts: the prompt up to the transcript (``[*prefix, audio, *middle]`` of
        ``self.prompt``; plain form ``[bos, audio, *instruction]``), then the language tag, text, stop.

        ``lang_id`` forces the language tag (it is then the first returned token; leave it None when
        transcripts have no tag). Returned lists hold the generated ids without the stop token
        (``self.prompt.stop_id``: eos, or the chat template's end of turn); decoding stops there or
        after ``max_new_tokens`` tokens.
        ``use_cache``: batched KV-cache decoding (`speechlm.model.generation.greedy_with_cache`); False
        recomputes the prefix at every step (the oracle). ``keep_going``: the lockstep hook for
        sharded validation under FSDP (see that module).
        """
        return self._greedy_transcripts(
            audio_BN, audio_lens_B, max_new_tokens, lang_id, use_cache, keep_going
        )

    def _greedy_transcripts(
        self,
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        max_new_tokens: int,
        lang_id: int | None,
        use_cache: bool,
        keep_going: Any,
    ) -> list[list[int]]:
        """`generate_greedy`'s body (also `generate_for_batch`'s for one-clip batches: each FSDP entry
        method calls it, never the other entry method)."""
        was_training = self.training
        self.eval()
        try:
            device = next(self.parameters()).device
            enc = self.encode_audio(audio_BN.to(device), audio_lens_B.to(device))
            head_ids, tail_ids = self.prompt.generation_prompt
            forced = lang_id is not None and max_new_tokens > 0
            tag_ids = (int(lang_id),) if forced and lang_id is not None else ()
            head, tail, tag = self.embed_pieces([head_ids, tail_ids, tag_ids], device)
            prompts = [
                torch.cat([head, a.to(head.dtype), tail, tag]) for a in enc.embeds_of(range(len(enc.embeds)))
            ]
            budget, prefix = max_new_tokens, []
            if forced:
                budget, prefix = max_new_tokens - 1, list(tag_ids)
            pick = self._joint_ctc_pick(enc, skip=0 if forced else self.ctc_skip_leading)
            outputs = self._decode(prompts, budget, use_cache=use_cache, keep_going=keep_going, pick=pick)
            return [prefix + o for o in outputs]
        finally:
            self.train(was_training)

    def _joint_ctc_pick(
        self, enc: EncoderOutput, *, skip: int, clip_of_row: Sequence[int | None] | None = None
    ) -> Any:
        """The token picker of joint CTC/attention decoding (`speechlm.model.ctc_prefix`), or None: plain
        greedy (``decode_ctc_weight`` 0 or no CTC head). Decoding row ``b`` reads clip ``clip_of_row[b]``
        of ``enc`` (None: that row is the LLM's alone, e.g. a translation); default: row b, clip b."""
        weight = self.decode_ctc_weight
        if weight <= 0 or self.ctc_head is None:
            return None
        from speechlm.model.ctc_prefix import JointCTCScorer

        lens_C = enc.enc_lens_B.to(torch.long)
        if clip_of_row is None:
            clip_of_row = list(range(int(lens_C.numel())))
        if not any(c is not None for c in clip_of_row):
            return None
        # the log-probabilities stay in the frames' layout (at a 49k vocabulary a copy costs as much as
        # the decoding); each decoding row reads its clip's frames through a map of table rows
        logp = self._ctc_log_prob_rows(enc.enc_hidden)
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
            blank=self.ctc_blank_id,
            eos=self.prompt.stop_id,
            weight=weights,
            skip=skip,
            candidates=self.decode_ctc_candidates,
        )
        return scorer.step

    def _decode(
        self,
        prompts: list[Tensor],
        max_new_tokens: int,
        *,
        use_cache: bool,
        keep_going: Any,
        pick: Any = None,
    ) -> list[list[int]]:
        """Greedy continuations of the prompt embeddings (`speechlm.model.generation`); ``pick`` replaces
        the argmax (joint CTC/attention decoding)."""
        from speechlm.model.generation import greedy_recompute, greedy_with_cache

        kw: dict[str, Any] = dict(
            eos_id=self.prompt.stop_id, max_new_tokens=max_new_tokens, keep_going=keep_going, pick=pick
        )
        if use_cache and self.backend.caps.bshd:
            return greedy_with_cache(self.llm, self.embed_tokens, prompts, **kw)
        return greedy_recompute(self.llm, self.embed_tokens, prompts, thd=self.backend.caps.thd, **kw)

    @torch.no_grad()
    def generate_for_batch(
        self, batch: Any, *, max_new_tokens: int, use_cache: bool = True, keep_going: Any = None
    ) -> list[list[int]]:
        """Greedy answers for every row of a `speechlm.data.dataset.Batch` (ids without the stop token):
        a one-clip batch through `generate_greedy`; a conversation batch (``batch.prompt_ids`` set) from
        each row's prompt up to the start of its last target run (the last assistant answer; where two
        answers are labelled back to back, the place in that run where ``batch.tokens``, the last
        answer, starts: `last_answer_start`), each placeholder replaced by its clip's embeddings. ``use_cache``/``keep_going`` as in
        `generate_greedy`; the training layer registers this method with FSDP like it."""
        if getattr(batch, "prompt_ids", None) is None:
            return self._greedy_transcripts(
                batch.audio, batch.audio_lens, max_new_tokens, None, use_cache, keep_going
            )
        was_training = self.training
        self.eval()
        try:
            device = next(self.parameters()).device
            prompts, clip_sample = self.conversation_prompts(batch)
            counts = clips_per_sample(clip_sample, len(prompts))
            audio, audio_lens = batch.audio.to(device), batch.audio_lens.to(device)
            if not clip_sample:  # rows without audio: a dummy keeps FSDP's encoder collectives in step
                audio, audio_lens = dummy_clip(audio, audio_lens)
            enc = self.encode_audio(audio, audio_lens)
            embeds = enc.embeds_of(range(len(clip_sample)))
            answers = [t[: int(n)].tolist() for t, n in zip(batch.tokens.cpu(), batch.token_lens.cpu())]
            heads = [
                ids[: last_answer_start(ids, mask, answers[b], b)] for b, (ids, mask) in enumerate(prompts)
            ]
            starts = [sum(counts[:b]) for b in range(len(counts))]
            rows = self.splice_prompts(heads, [embeds[c : c + k] for c, k in zip(starts, counts)], device)
            # joint CTC decoding for the rows that transcribe their one clip (a translation's answer is
            # not the clip's transcript: the LLM alone decodes it)
            tasks = list(batch.tasks) or ["asr"] * len(rows)
            clip_of_row = [c if k == 1 and t == "asr" else None for c, k, t in zip(starts, counts, tasks)]
            pick = self._joint_ctc_pick(enc, skip=self.ctc_skip_leading, clip_of_row=clip_of_row)
            return self._decode(rows, max_new_tokens, use_cache=use_cache, keep_going=keep_going, pick=pick)
        finally:
            self.train(was_training)

    def embed_pieces(self, pieces: Sequence[Sequence[int] | Tensor], device: torch.device) -> list[Tensor]:
        """Each piece of token ids embedded (``[len, H]``), in ONE `embed_tokens` call: under FSDP every call
        all-gathers the embedding, so the count of calls must not depend on the batch's content (a rank
        decoding a dummy batch would otherwise wait in a collective its peers never reach)."""
        ids = [torch.as_tensor(p, dtype=torch.long).reshape(-1).cpu() for p in pieces]
        flat = self.embed_tokens(torch.cat(ids).to(device)) if ids else None
        if flat is None:
            return []
        return list(torch.split(flat, [int(t.numel()) for t in ids]))

    def splice_prompts(
        self, heads: Sequence[Tensor], clips: Sequence[Sequence[Tensor]], device: torch.device
    ) -> list[Tensor]:
        """``[P_b, H]`` per row: row ``b``'s text ids embedded (all rows in one `embed_pieces` call), each
        ``audio_id`` replaced by the row's next clip (clips past its last placeholder are not used)."""
        texts: list[Tensor] = []
        layout: list[list[int]] = []
        for ids_L in heads:
            ids_L = ids_L.cpu()
            where = torch.nonzero(ids_L == self.audio_id).flatten().tolist()
            bounds = [-1, *where, int(ids_L.numel())]
            layout.append(where)
            texts += [ids_L[bounds[j] + 1 : bounds[j + 1]] for j in range(len(bounds) - 1)]
        embedded = self.embed_pieces(texts, device)
        rows, t = [], 0
        for where, row_clips in zip(layout, clips):
            parts = [embedded[t]]
            for j in range(len(where)):
                parts += [row_clips[j].to(embedded[t].dtype), embedded[t + j + 1]]
            t += len(where) + 1
            rows.append(torch.cat(parts))
        return rows

    # ------------------------------------------------------------------------------------------
    # Parameters
    # ------------------------------------------------------------------------------------------

    def encoder_parameters(self) -> Iterator[nn.Parameter]:
        return self.encoder.parameters()

    def set_encoder_trainable(self, trainable: bool) -> None:
        for p in self.encoder.parameters():
            p.requires_grad_(trainable)

    def num_parameters(self, *, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
