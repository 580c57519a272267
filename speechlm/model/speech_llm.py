"""The speech LLM: log-mel features -> audio encoder -> frame-stack projector -> decoder LLM (+ CTC head).

Letters: B batch, N audio samples, T feature frames, F mel bins, U encoder frames, E encoder width,
C clips, A_i projected audio frames of clip i, H LLM hidden, V vocabulary, L tokens, M labelled positions.

`forward(batch)` is the one training entry point: one shape of batch (rows of rendered prompts, one audio
placeholder per clip; a transcription row is the one-turn case, `conversation_inputs.as_conversation`),
one path whatever the layout (``self.cp_layout``, a `parallel.cp_layout.CPLayout`):

    audio_lengths(audio_lens)              -> every clip length as host integers (once per micro-batch)
    cp_layout.place(seq_lens)              -> plan: this rank's sequences, which are split, padded how
    cp_audio.encode_for_layout(...)        -> EncoderOutput (encode_audio on this rank's clips, split ones
                                              gathered; long clips sharded over the CP group: `cp_audio`)
    ctc.ctc_of(enc, ctc_tokens)            -> the clips' CTC sum (`speechlm.model.ctc`)
    llm_pass.decoder_pass(...)             -> pack_thd + cp_layout.shard (or pack_bshd), then the LLM's CE
    forward_packed(packed)                 -> (ce_sum, n_labelled)        (or forward_padded)

With one CP rank the layout is `NullCPLayout` (every sequence whole, one encoder call, no sharding, no
CP attention context). Under context parallelism the training layer sets a `DynamicCPLayout` once
when it parallelizes the model: each clip is encoded where its row lives, only the split sequences'
clips are gathered, each rank keeps its chunks of the split sequences and its whole ones, and the
attention backends get the layout's CP attention context. The model never touches
``torch.distributed`` and never asks which layout it holds.

Token cross-entropy is a sum over labelled positions (fp32), so the caller divides by the global
count. Only the labelled positions' logits are computed (``logits_to_keep``): most positions are
audio frames, and the fp32 copy of ``[M, V]`` is made once. The forward returns what it placed on this
rank (`flops.Placement`); the training layer counts the FLOPs from it.

Padding-free encoder (``model.encoder.packed``, on by default for Parakeet): features, encoder,
projector and the CTC head run on packed frames (`speechlm.model.packed_encoder`; ``enc_hidden`` is
then `PackedFrames`), equal per utterance to the padded path. Greedy decoding lives in
`speechlm.model.generation` (batched KV cache; the prefix-recompute decoder is kept as the oracle).

FSDP2 hooks ``forward``; `generate_greedy` and `generate_for_batch` are the other entry points the
training layer registers (``register_fsdp_forward_method``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from parallel.cp_layout import CPLayout, NullCPLayout
from parallel.varlen_meta import build_varlen_meta
from speechlm.config import ModelConfig
from speechlm.model import cp_audio, ctc, generation
from speechlm.model.attention import ensure_registered, get_backend
from speechlm.model.compression import compressed_output
from speechlm.model.conversation_inputs import (
    as_conversation,
    batch_field,
    conversation_ctc_targets,
)
from speechlm.model.cp_audio import audio_lengths
from speechlm.model.encoder_output import EncoderOutput, projected_output
from speechlm.model.encoders import build_encoder, resolve_encoder_packed
from speechlm.model.features import LogMelFeatures
from speechlm.model.flops import Placement
from speechlm.model.generation import KeepGoing
from speechlm.model.llm import build_llm
from speechlm.model.llm_pass import decoder_pass
from speechlm.model.oracle import fill_with_transcripts
from speechlm.model.packed_encoder import PackedFrames
from speechlm.model.projector import FrameStackProjector
from speechlm.model.row_ce import ce_of_rows, ce_of_sequences, to_micro_batch_rows
from speechlm.model.sharded_encoder import ClipSlice
from speechlm.packing.prompt import PromptFormat
from speechlm.packing.thd import IGNORE_INDEX, PackedBatch, PaddedBatch, clip_offsets


@dataclass
class MicroLosses:
    """Loss sums of one micro-batch on this rank (the caller divides by the step's global counts)."""

    ce_sum: Tensor  # summed token cross-entropy of this rank's share (fp32)
    n_labelled: int  # labelled tokens of the whole micro-batch (before CP sharding)
    ctc_sum: Tensor | None  # summed CTC of the clips this rank encoded (None: CTC off)
    n_clips: int  # clips with a CTC target
    weight: float = 1.0  # 0 for the training layer's dummy micro-batch
    # what this rank computed, from which the training layer counts the FLOPs (`speechlm.model.flops.work_of`)
    placed: Placement | None = None
    ce_per_seq: Tensor | None = None  # forward(per_seq=True): [B] each row's CE, this rank's share (`row_ce`)


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
        # joint CTC/attention greedy decoding of transcripts (`generation.joint_ctc_pick`); transcribe may set it
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
        # the projected frames' share of a compressed row beside the heard token's embedding, from 0
        # (`speechlm.model.compression.compressed_output`)
        self.audio_gate = nn.Parameter(torch.zeros(1)) if model_cfg.audio_token_embedding else None
        # one CP rank until the training layer sets its layout (`set_cp_layout`)
        self.cp_layout: CPLayout = NullCPLayout(tp=1, pad_to_multiple=model_cfg.pad_to_multiple)

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
        if self.cfg.audio_compression == "ctc":  # a sharded clip's slices: gathered, compressed whole
            sliced = [(h, s.counts, s.group) for h, s in zip(slice_hidden, slices)] if slices else []
            embed = self.embed_tokens if self.cfg.audio_token_embedding else None
            args = (self.ctc_head, self.projector, self.ctc_blank_id, enc_hidden, enc_lens_B, packed)
            gather = self.cp_layout.gather_slices
            return compressed_output(*args, embed, self.audio_gate, slices=sliced, gather=gather)
        return projected_output(
            self.projector, enc_hidden, enc_lens_B, packed, slice_hidden if slices else ()
        )

    def audio_embed_lengths(self, audio_lens_B: Tensor) -> list[int]:
        """Projected audio frames per clip, from the sample counts alone (host integers): what
        `encode_audio` will return, known before it runs (dynamic CP places sequences with it)."""
        return audio_lengths(self, audio_lens_B).embeds

    def ctc_loss_sum(
        self,
        enc_hidden: PackedFrames | Tensor,
        enc_lens_B: Tensor,
        tokens_BL: Tensor,
        token_lens_B: Tensor,
        weights_B: Tensor | None = None,
    ) -> tuple[Tensor, int]:
        """Summed CTC loss over the clips and their number (`speechlm.model.ctc.ctc_loss_sum`)."""
        return ctc.ctc_loss_sum(self, enc_hidden, enc_lens_B, tokens_BL, token_lens_B, weights_B)

    def ctc_targets(self, tokens_BL: Tensor, token_lens_B: Tensor) -> tuple[Tensor, Tensor]:
        """CTC targets from the collated tokens: drop the first ``ctc_skip_leading`` (the language tag)."""
        return ctc.ctc_targets(tokens_BL, token_lens_B, skip=self.ctc_skip_leading, pad_id=self.pad_id)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.llm.get_input_embeddings()(ids)

    def forward_packed(
        self, packed: PackedBatch, *, return_logits: bool = False, per_seq: bool = False
    ) -> tuple[Tensor, int, Tensor | None] | Tensor:
        """Decode a THD ``PackedBatch`` (this rank's share under CP: its first ``cp_split_seqs`` sequences
        are split over the CP group); ``(ce_sum, n_labelled, each sequence's CE if per_seq else None)``, or
        the ``[T, V]`` logits."""
        cu = packed.cu_seqlens
        # the pack's boundaries as host integers, read once here for every layer (one sync per micro-batch)
        meta = build_varlen_meta(cu, device=cu.device)
        # under CP: the split prefix (every sequence without dynamic CP) and its ring plans; None without CP
        n_split = len(meta.cu_q) - 1 if packed.cp_split_seqs is None else packed.cp_split_seqs
        kwargs: dict[str, Any] = dict(
            inputs_embeds=packed.inputs_embeds[None],
            position_ids=packed.position_ids[None],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=int(packed.max_seqlen),
            max_length_k=int(packed.max_seqlen),
            varlen_meta=meta,
            cp_context=self.cp_layout.attention_context(meta, n_split, packed.cp_degrees),
        )
        if return_logits:
            return self.llm(**kwargs).logits[0]
        labels_T = packed.labels
        keep_M = torch.nonzero(labels_T != IGNORE_INDEX).flatten()
        logits_MV = self.llm(**kwargs, logits_to_keep=keep_M).logits[0]
        ce_sum = nn.functional.cross_entropy(logits_MV.float(), labels_T[keep_M], reduction="sum")
        ce_N = ce_of_sequences(logits_MV, labels_T[keep_M], cu, keep_M) if per_seq else None
        return ce_sum, int(keep_M.numel()), ce_N

    def forward_padded(
        self, padded: PaddedBatch, *, per_seq: bool = False
    ) -> tuple[Tensor, int, Tensor | None]:
        """Decode a BSHD ``PaddedBatch`` with its padding mask; ``(ce_sum, n_labelled, each row's CE if
        per_seq else None)``."""
        logits_BSV = self.llm(
            inputs_embeds=padded.inputs_embeds,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
        ).logits
        keep_BS = padded.labels != IGNORE_INDEX
        ce_sum = nn.functional.cross_entropy(
            logits_BSV[keep_BS].float(), padded.labels[keep_BS], reduction="sum"
        )
        ce_B = ce_of_rows(logits_BSV, padded.labels, keep_BS) if per_seq else None
        return ce_sum, int(keep_BS.sum()), ce_B

    @property
    def align_skip(self) -> int | None:
        """The answer tokens before the first one an audio row stands for, with aligned audio positions
        (`speechlm.packing.positions`); None: sequential positions."""
        return self.ctc_skip_leading if self.cfg.audio_positions == "aligned" else None

    def set_cp_layout(self, layout: CPLayout) -> None:
        """Called once by the training layer when it parallelizes this model (`parallel.cp_layout`)."""
        self.cp_layout = layout

    def forward(
        self, batch: Any, *, encoder_frozen: bool = False, oracle: bool = False, per_seq: bool = False
    ) -> MicroLosses:
        """One micro-batch (`speechlm.data.dataset.Batch`, attributes or mapping keys, on the model's
        device; a batch of transcription rows is read as one-turn conversations: `as_conversation`) to its
        loss sums: place, encode, pack (THD, rounded and CP-sharded per ``self.cp_layout``) or pad (BSHD),
        decode. Training, the teacher-forced validation loss and the tests all run this.

        Each row brings its rendered prompt (`conversation_prompts`) and its clips (``audio`` [C, N],
        ``clip_sample`` [C]); each clip is spliced at its placeholder, the CP plan is per row and a clip
        lives where its row lives (`parallel.cp_layout.plan_for_clips`), CTC runs per clip against
        ``ctc_tokens`` (clips of length 0 count nothing) and ``n_clips`` counts the clips with a CTC target.
        A frozen encoder runs without autograd inside `encode_audio`; the projector still trains. ``oracle``:
        the transcripts fill the audio rows this time (``model.oracle_warmup_steps``, `speechlm.model.oracle`);
        ``per_seq``: also each row's CE (`MicroLosses.ce_per_seq`: validation's audio reliance)."""
        lay = self.cp_layout
        if not self.cfg.packed_sequences and lay.cp_size > 1:
            raise ValueError(
                "model.packed_sequences=false (BSHD) with cp > 1: padding cannot be masked in the CP "
                "attention path; set model.packed_sequences=true"
            )
        batch = as_conversation(batch, self.prompt)
        audio_BN, audio_lens_B = batch_field(batch, "audio"), batch_field(batch, "audio_lens")
        compressed = self.cfg.audio_compression != "none"
        # placement first, from lengths known before encoding (and before decoding: the data pipeline
        # decodes on each rank only the clips this plan gives it, `speechlm.data.local_decode`)
        ap = cp_audio.plan_audio(self, lay, batch, audio_id=self.audio_id, compressed=compressed)
        cp_audio.check_clips_present(batch, ap, lay)
        lens, prompts, clip_sample, clip_counts = ap.lens, ap.prompts, ap.clip_sample, ap.clip_counts
        seq_lens, plan, enc_plan, sharding = ap.seq_lens, ap.plan, ap.enc_plan, ap.sharding
        ctc_tokens, ctc_lens = conversation_ctc_targets(batch, len(clip_sample))
        skip = sharding.sharded if sharding is not None else ()
        slices = cp_audio.prepare_slices(self, lay, audio_BN, lens, sharding) if sharding is not None else []
        enc = cp_audio.encode_for_layout(
            self,
            lay,
            audio_BN,
            audio_lens_B,
            enc_plan,
            freeze_encoder=encoder_frozen,
            skip=skip,
            slices=slices,
        )
        if sharding is not None:
            offsets = clip_offsets(prompts, clip_sample, lens.embeds, self.audio_id)
            cp_audio.finish_sharded(
                self, lay, enc, sharding, enc_plan, seq_of_clip=clip_sample, offsets=offsets
            )
        if oracle or self.cfg.audio_prefix == "oracle":  # the transcript's embeddings (`model.oracle`)
            fill_with_transcripts(self, enc, ctc_tokens, ctc_lens)
        if compressed:  # the LLM's lengths are known now: place again with them
            seq_lens, plan = cp_audio.place_encoded(lay, enc, prompts, clip_counts)
        ctc_sum = ctc.ctc_of(self, enc, ctc_tokens, ctc_lens) if self.ctc_head is not None else None
        labelled = [int(mask.sum()) for _, mask in prompts]
        ce_sum, n_labelled, ce_local, local, _, computed, degrees = decoder_pass(
            self, lay, prompts, enc, plan, clip_counts, device=audio_BN.device, per_seq=per_seq
        )
        n_labelled = sum(labelled) if self.cfg.packed_sequences else n_labelled  # the whole micro-batch's
        for e in enc.unused:  # weight 0: in the graph, counts nothing
            ce_sum = ce_sum + 0.0 * e.sum()
        placed = Placement(
            seq_lens=seq_lens,
            labelled=labelled,
            local=list(local),
            degrees=list(degrees),
            cp=lay.cp_size,
            clip_frames=[lens.features[i] for i in enc.ctc_rows] + enc.slice_feature_frames,
            computed_tokens=computed,
        )
        n_clips = int((ctc_lens > 0).sum())
        out = MicroLosses(ce_sum.float(), int(n_labelled), ctc_sum, n_clips, placed=placed)
        out.ce_per_seq = to_micro_batch_rows(ce_local, local, len(prompts))  # None unless per_seq
        return out

    @torch.no_grad()
    def generate_greedy(
        self,
        audio_BN: Tensor,
        audio_lens_B: Tensor,
        *,
        max_new_tokens: int,
        lang_id: int | None = None,
        use_cache: bool = True,
        keep_going: KeepGoing | None = None,
    ) -> list[list[int]]:
        """Greedy transcripts of whole clips (`generation.generate_greedy`), ids without the stop token
        (``self.prompt.stop_id``), at most ``max_new_tokens``; ``lang_id`` forces the language tag (then the
        first returned token). ``use_cache``: batched KV-cache decoding; False recomputes the prefix at every
        step (the oracle). ``keep_going``: the lockstep hook for sharded validation under FSDP."""
        return generation.generate_greedy(
            self,
            audio_BN,
            audio_lens_B,
            max_new_tokens=max_new_tokens,
            lang_id=lang_id,
            use_cache=use_cache,
            keep_going=keep_going,
        )

    @torch.no_grad()
    def generate_for_batch(
        self, batch: Any, *, max_new_tokens: int, use_cache: bool = True, keep_going: KeepGoing | None = None
    ) -> list[list[int]]:
        """Greedy answers for every row of a `speechlm.data.dataset.Batch` (ids without the stop token),
        from each row's prompt up to the start of its last answer (`generation.generate_for_batch`).
        ``use_cache``/``keep_going`` as in `generate_greedy`; the training layer registers this method with
        FSDP like it."""
        return generation.generate_for_batch(
            self, batch, max_new_tokens=max_new_tokens, use_cache=use_cache, keep_going=keep_going
        )

    def encoder_parameters(self) -> Iterator[nn.Parameter]:
        return self.encoder.parameters()

    def set_encoder_trainable(self, trainable: bool) -> None:
        for p in self.encoder.parameters():
            p.requires_grad_(trainable)

    def num_parameters(self, *, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
