"""The `model` section and its parts: the audio encoder, the LLM (with its LoRA adapters), the projector,
packing, attention and the auxiliary CTC."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from parallel.clip_placement import slice_halo
from parallel.frames import PADDING_FREE_KINDS
from speechlm.config.choices import (
    AttentionBackend,
    AudioCompression,
    AudioPositions,
    AudioPrefix,
    ConvNorm,
    CTCReduction,
    EncoderKind,
    EncoderTrain,
    LLMFamily,
    LLMTrain,
    WhisperWindow,
)
from speechlm.config.keys import Section, key
from speechlm.config.rules import POS_INT, Flag, Names, Num, Seq, Text

# LoRA's default targets: every attention and MLP projection of Llama, Qwen2 and Qwen3
LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIZE = "model size"
BUILT_CONV_KERNEL = 9  # the conformer convolution's kernel of a Parakeet encoder built from sizes (transformers' default)  # the meaning of every size key of a model built from its config


@dataclass
class EncoderConfig(Section):
    KEY: ClassVar[str] = "model.encoder"

    kind: EncoderKind = key("parakeet", "audio encoder")
    pretrained: str | None = key(
        None,
        "local save_pretrained directory (parakeet, whisper) or .nemo file",
        Text(path=True, null="built from the sizes below"),
    )
    hidden_size: int = key(176, SIZE, POS_INT)
    num_layers: int = key(3, SIZE, POS_INT)
    num_heads: int = key(4, SIZE + " (divides hidden_size)", POS_INT)
    intermediate_size: int = key(704, SIZE, POS_INT)
    subsampling_conv_channels: int = key(64, SIZE, POS_INT)
    # 8 is 80 ms per encoder frame; 4 (40 ms) leaves room for CTC on subword pieces spoken fast
    subsampling_factor: int | None = key(
        None,
        "feature frames (10 ms) per encoder frame, a power of two (Parakeet built from sizes)",
        Num(lo=2, integer=True, null="8, FastConformer's; a pretrained encoder keeps its own"),
    )
    num_mel_bins: int = key(80, "mel bins of the front end", POS_INT)
    # layer_norm: over channels, per frame; batch_norm: frozen running stats
    conv_norm: ConvNorm = key(
        "auto",
        "normalisation in the Conformer conv module (auto: layer_norm from "
        "scratch, batch_norm for a pretrained encoder)",
    )
    # features, subsampling and conformer layers on real frames only; true with whisper/nemo: validator error
    packed: bool | None = key(
        None, "padding-free encoder", Flag(null="on where the encoder kind supports it")
    )
    train: EncoderTrain = key(
        "full",
        "full: the encoder trains (from optim.unfreeze_step); frozen: it never trains and runs without "
        "gradients (checkpoints hold a fingerprint of it, not its weights)",
    )
    whisper_window: WhisperWindow = key(
        "full",
        "kind=whisper: full runs the encoder on its 30 s window (as trained; exact); clip on each clip's own "
        "frames with the positional embedding sliced (whisper.cpp's audio_ctx): much faster on short clips, "
        "outputs differ (docs/pretrained.md)",
    )
    # NeMo's att_context_size, e.g. [128, 128] for long-form audio
    att_context_size: list[int] | None = key(
        None,
        "limited-context self-attention: [left, right] encoder frames each frame attends to on either side "
        "(a sliding window on the packed frames, as NeMo's Parakeet for long-form audio; parakeet, packed)",
        Seq(item=Num(lo=-1, integer=True), length=2, null="full context (as [-1, -1])"),
    )

    def limited_context(self) -> tuple[int, int] | None:
        """(left, right) frames of limited-context attention; None for full context (null or [-1, -1])."""
        if self.att_context_size is None or list(self.att_context_size) == [-1, -1]:
            return None
        left, right = self.att_context_size
        return int(left), int(right)

    def shard_min_slice(self, projector_stack: int) -> int | None:
        """The fewest encoder frames per rank with which training shards a long clip over the CP group
        (`parallel.clip_placement.place_clips`' ``min_slice``: the widest halo, here the window's sides or
        the half-width of a built encoder's kernel-9 convolution, plus the projector's stack), or None: this
        encoder encodes every clip whole (full context, not a padding-free Parakeet). The model computes the
        same from the built encoder (`AudioEncoder.slice_halo`), whose kernel a pretrained encoder sets."""
        window = self.limited_context()
        if window is None or self.kind not in PADDING_FREE_KINDS or self.packed is False:
            return None
        return slice_halo(window, BUILT_CONV_KERNEL) + projector_stack

    def problems(self) -> list[str]:
        out = []
        if self.pretrained is None and self.hidden_size % 2:
            out.append(
                f"model.encoder.hidden_size={self.hidden_size} must be even (sinusoidal/relative position "
                "embeddings split it in halves)"
            )
        if self.kind == "nemo" and self.pretrained is None:
            out.append(
                "model.encoder.kind='nemo' needs model.encoder.pretrained=<path of a .nemo file> (a NeMo encoder "
                "is only loaded, never built from sizes); or use kind parakeet or whisper"
            )
        if self.pretrained is not None and self.conv_norm == "layer_norm":
            out.append(
                f"model.encoder.conv_norm='layer_norm' with model.encoder.pretrained={self.pretrained!r}: the "
                "pretrained BatchNorm weights would be discarded; use conv_norm=auto or batch_norm"
            )
        if self.whisper_window != "full" and self.kind != "whisper":
            out.append(
                f"model.encoder.whisper_window={self.whisper_window!r} applies to kind='whisper' only "
                f"(kind={self.kind!r}): remove it"
            )
        factor = self.subsampling_factor
        if factor is not None and (self.kind != "parakeet" or self.pretrained is not None):
            out.append(
                f"model.encoder.subsampling_factor={factor} applies to a Parakeet encoder built from sizes only "
                f"(kind={self.kind!r}, pretrained={self.pretrained!r} has its own): remove it"
            )
        elif factor is not None and (factor < 2 or factor & (factor - 1)):
            out.append(
                f"model.encoder.subsampling_factor={factor} must be a power of two >= 2 (stride-2 convolutions), "
                "e.g. 4 or 8"
            )
        ctx = self.att_context_size
        if ctx is not None and list(ctx) != [-1, -1] and min(ctx) < 0:
            out.append(
                f"model.encoder.att_context_size={list(ctx)}: give two frame counts >= 0 ([left, right]), or "
                "[-1, -1] / null for full context (one unlimited side is not supported)"
            )
        elif (
            ctx is not None
            and list(ctx) != [-1, -1]
            and (self.kind not in PADDING_FREE_KINDS or self.packed is False)
        ):
            out.append(
                f"model.encoder.att_context_size={list(ctx)} (limited context) needs the padding-free Parakeet "
                f"encoder, not kind={self.kind!r} with packed={self.packed}: use kind=parakeet with packed unset "
                "or true, or att_context_size=null"
            )
        if self.pretrained is None and self.hidden_size % self.num_heads:
            out.append(
                f"model.encoder.hidden_size={self.hidden_size} is not a multiple of model.encoder.num_heads="
                f"{self.num_heads}: choose sizes with hidden_size = num_heads * head_dim"
            )
        return out


@dataclass
class LoRAConfig(Section):
    """LoRA adapters of the LLM (model.llm.train=lora), injected with peft (speechlm/model/trainable.py)."""

    KEY: ClassVar[str] = "model.llm.lora"

    rank: int = key(16, "rank of the LoRA adapters (model.llm.train=lora)", POS_INT)
    alpha: int = key(
        32, "LoRA scaling numerator: adapters' output times alpha / rank", Num(lo=0, lo_open=True)
    )
    # a source of randomness: 0 for exact tests
    dropout: float = key(
        0.05, "dropout on the LoRA adapters' input (0: no randomness)", Num(lo=0, hi=1, hi_open=True)
    )
    target_modules: list[str] = key(
        list(LORA_TARGETS_DEFAULT),
        "names of the LLM's linear layers that get adapters (the last part of a module path); the default "
        "fits Llama, Qwen2 and Qwen3",
        Names(),
    )


@dataclass
class LLMConfig(Section):
    KEY: ClassVar[str] = "model.llm"

    family: LLMFamily = key("llama", "LLM architecture when built from a config")
    pretrained: str | None = key(
        None,
        "local save_pretrained directory of a causal LM",
        Text(path=True, null="built from the sizes below"),
    )
    train: LLMTrain = key(
        "full",
        "full: every LLM parameter trains; frozen: none does; lora: only LoRA adapters (model.llm.lora) do. "
        "frozen/lora checkpoints hold what trains plus a fingerprint of the frozen base (docs/training-modes.md)",
    )
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # speechlm/model/trainable.py AddedTokenRows
    train_added_rows: bool = key(
        True,
        "with model.llm.train=frozen or lora, the embedding and LM-head rows of the tokens the run added to "
        "a pretrained LLM's vocabulary (the data.lang_tags=special language tags) still train; false: they "
        "stay at their initial mean, so the tags cannot be told apart",
    )
    hidden_size: int = key(256, SIZE + " (a multiple of num_heads)", POS_INT)
    num_layers: int = key(4, SIZE, POS_INT)
    num_heads: int = key(4, SIZE + " (a multiple of num_kv_heads)", POS_INT)
    num_kv_heads: int = key(4, SIZE + " (divides num_heads)", POS_INT)
    intermediate_size: int = key(704, SIZE, POS_INT)
    max_position_embeddings: int = key(4096, SIZE, POS_INT)

    def problems(self) -> list[str]:
        if self.pretrained is not None:  # a pretrained LLM brings its own sizes
            return []
        out = []
        if self.num_heads % self.num_kv_heads:
            out.append(
                f"model.llm.num_heads={self.num_heads} is not a multiple of model.llm.num_kv_heads="
                f"{self.num_kv_heads}: every key/value head serves the same number of query heads; choose "
                "num_kv_heads among the divisors of num_heads"
            )
        if self.hidden_size % self.num_heads:
            out.append(
                f"model.llm.hidden_size={self.hidden_size} is not a multiple of model.llm.num_heads="
                f"{self.num_heads}: choose sizes with hidden_size = num_heads * head_dim"
            )
        elif (self.hidden_size // self.num_heads) % 2:
            out.append(
                f"model.llm.hidden_size={self.hidden_size} / model.llm.num_heads={self.num_heads} gives an odd "
                f"head size ({self.hidden_size // self.num_heads}); rotary position embeddings need an even one"
            )
        return out


@dataclass
class ModelConfig(Section):
    KEY: ClassVar[str] = "model"

    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    projector_stack: int = key(2, "encoder frames stacked by the projector", POS_INT)
    projector_hidden: int = key(512, SIZE, POS_INT)
    audio_compression: AudioCompression = key(
        "none",
        "the LLM's audio rows: none (every projected frame) or ctc (one row per token the CTC head hears: "
        "blank frames dropped, repeated frames averaged; needs ctc_weight > 0 and projector_stack 1)",
    )
    oracle_warmup_steps: int = key(
        0,
        "the first this many optimizer steps fill the audio rows with the transcript's own embeddings (the "
        "oracle prefix), so the decoder learns to copy from its prefix while the CTC head leaves its blank "
        "plateau; validation decodes the audio (0: off)",
        Num(lo=0, integer=True),
    )
    audio_token_embedding: bool = key(
        False,
        "add to each CTC-compressed audio row the LLM's input embedding of the token the CTC head heard there "
        "(needs audio_compression ctc)",
    )
    audio_positions: AudioPositions = key(
        "sequential",
        "position ids of the audio rows: sequential, or aligned (row k of a clip at the position of the "
        "k-th token of the answer after it, past the language tag; needs audio_compression ctc)",
    )
    audio_prefix: AudioPrefix = key(
        "audio",
        "what fills the audio rows: audio (the projected clip), or oracle (the LLM's embeddings of the clip's "
        "transcript: a diagnostic of whether the decoder learns to copy from its prefix; evaluates, cannot "
        "transcribe)",
    )
    packed_sequences: bool = key(True, "THD packing (true) or padded BSHD (false)")
    # None: lcm(2*cp, cp*tp) (tp when cp=1); set e.g. 64 for tensor cores: a multiple of that unit
    pad_to_multiple: int | None = key(
        None,
        "pad the packed total (THD) or padded length (BSHD) to a multiple of this",
        Num(lo=1, integer=True, null="the smallest legal unit, lcm(2*cp, cp*tp)"),
    )
    attention_backend: AttentionBackend = key("reference", "attention kernel backend")
    dropout: float = key(
        0.0,
        "dropout probability (0 turns off every source of randomness in the forward)",
        Num(lo=0, hi=1, hi_open=True),
    )
    ctc_weight: float = key(
        0.3, "weight of the auxiliary CTC loss on the encoder output (0 disables it)", Num(lo=0)
    )
    ctc_reduction: CTCReduction = key(
        "clip",
        "the auxiliary CTC sum's normaliser: clip (divided by the step's clips; a clip's CTC grows with its "
        "length) or token (by its target tokens: long-form audio beside short clips)",
    )
    # 1 - it weighs the LLM's scores; > 0 needs ctc_weight > 0
    decode_ctc_weight: float = key(
        0.0,
        "weight of the CTC head's prefix scores in joint CTC/attention greedy decoding of transcripts "
        "(0: the LLM alone)",
        Num(lo=0, hi=1),
    )
    # as ESPnet's pre-beam does; 0 is T x V per step: slow at 49k ids
    decode_ctc_candidates: int = key(
        32,
        "tokens per step that joint CTC/attention decoding scores with CTC: the LLM's this many best, and the "
        "stop token (0: every token, exact but T x V work per step; a weight of 1 always scores every token)",
        Num(lo=0, integer=True),
    )

    def problems(self) -> list[str]:
        out = []
        if self.audio_compression == "ctc" and self.ctc_weight == 0:
            out.append(
                "model.audio_compression=ctc keeps the frames the CTC head hears, but model.ctc_weight=0 leaves "
                "the head out: set model.ctc_weight > 0 (e.g. 0.3), or model.audio_compression=none"
            )
        if self.audio_compression == "ctc" and self.projector_stack != 1:
            out.append(
                f"model.audio_compression=ctc gives the projector one frame per heard token; stacking "
                f"{self.projector_stack} of them would merge tokens: set model.projector_stack=1"
            )
        if self.audio_token_embedding and self.audio_compression != "ctc":
            out.append(
                "model.audio_token_embedding=true embeds the token the CTC head heard in each compressed row: "
                "set model.audio_compression=ctc (and model.projector_stack=1), or model.audio_token_embedding=false"
            )
        if self.audio_positions == "aligned" and self.audio_compression != "ctc":
            out.append(
                "model.audio_positions=aligned puts audio row k at the position of the answer's k-th token, "
                "which needs one row per token: set model.audio_compression=ctc, or model.audio_positions=sequential"
            )
        if self.decode_ctc_weight > 0 and self.ctc_weight == 0:
            return out + [
                f"model.decode_ctc_weight={self.decode_ctc_weight} needs the CTC head, but model.ctc_weight=0 "
                "leaves it out: set model.ctc_weight > 0 (the head is trained with it), or model.decode_ctc_weight=0 "
                "beside model.ctc_weight=0 (the LLM alone decodes)"
            ]
        return out
