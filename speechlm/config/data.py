"""The `data` and `sampler` sections: what the run reads, how each row becomes a prompt, how rows are batched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from speechlm.config.choices import LangTags, LossTurns, ReadMode, SampleRate, SamplerMode, TextNormalize
from speechlm.config.keys import Section, key
from speechlm.config.rules import POS_INT, SEED_MAX, InputList, Num, Seq, Text


@dataclass
class DataConfig(Section):
    KEY: ClassVar[str] = "data"
    # input paths: relative ones in a config file resolve against the file's folder, on the command line
    # against the working directory; stored absolute (docs/config.md)
    train_manifest: str | None = key(
        None,
        "training data: a manifest, shard folder, NeMo/WeNet/Lhotse source",
        Text(path=True, null="set data.input_cfg instead; one of the two is required to train"),
    )
    val_manifest: str | None = key(
        None, "validation data (any source kind)", Text(path=True, null="no validation")
    )
    # docs/pretrained-tokenizer.md
    tokenizer: str | None = key(
        None,
        "SentencePiece model (.model) built by `speechlm tokenizer train`, or a Hugging Face tokenizer "
        "directory (the pretrained LLM's, or one it was saved with)",
        Text(path=True, null="model.llm.pretrained's own tokenizer; required without it"),
    )
    lang_tags: LangTags = key(
        "special",
        "language tags in the transcript: 'special' (one added token per language, the first target "
        "token), 'none' (no tag; needs the LLM's tokenizer)",
    )
    system_prompt: str | None = key(None, "system turn of the chat template", Text(null="no system turn"))
    chat_template: str = key(
        "auto",
        "the prompt's chat template: 'auto' (the tokenizer's, if it has one), 'none' (plain "
        "[bos, audio, instruction, transcript, eos]) or a Jinja template file",
        Text(path=True, keywords=("auto", "none")),
    )
    allow_sentencepiece_with_pretrained: bool = key(
        False,
        "train model.llm.pretrained on a SentencePiece data.tokenizer's ids (not the LLM's own: its "
        "pretrained embeddings then mean other tokens)",
    )
    sample_rate: SampleRate = key(
        16000,  # model/features.py
        "audio is resampled to this rate (Hz); the encoders' front end reads 16 kHz",
    )
    max_tokens: int = key(512, "text tokens per utterance after tokenization", POS_INT)
    max_duration: float | None = key(
        None,
        "seconds: training rows longer than this are left out of every epoch plan, counted and shown by "
        "`speechlm plan` (validation and evaluation keep every row)",
        Num(
            lo=0,
            lo_open=True,
            null="no limit: every row is planned; one longer than the micro-batch budget forms a micro-batch "
            "of its own, given to the whole CP group",
        ),
    )
    num_workers: int = key(
        0, "DataLoader worker processes (0: load in the training process)", Num(lo=0, integer=True)
    )
    instruction: str = key(
        "",
        "optional instruction placed after the audio in the prompt (rows with an 'instruction' column, "
        "or an input_cfg entry's 'prompt', use theirs)",
        Text(),
    )
    # speechlm.packing.prompt.ConversationRenderer; a one-turn transcript has one assistant turn either way
    loss_turns: LossTurns = key(
        "all",
        "assistant turns of a multi-turn conversation that get the loss: 'all', or only the 'last' (the "
        "others are context)",
    )
    # speechlm.data.text.normalize_target; the pre-flight refuses characters the tokenizer lacks
    text_normalize: TextNormalize = key(
        "none",
        "the rule every answer and transcript goes through before training encodes it and evaluation scores "
        "it (reference and hypothesis alike; <|xx|> tags kept): 'none' (as written), 'lower' (lower-cased), "
        "'clean' (the cleaning of `speechlm manifest build`: punctuation, symbols and [..]/<..> annotations "
        "removed, case kept), 'clean_lower' (both); characters the tokenizer cannot encode after it are "
        "refused before step 1, never trained as <unk>",
    )
    # the stop names the files
    max_dropped_fraction: float = key(
        0.5,
        "fraction of a training micro-batch whose audio may be unreadable before "
        "the run stops (1: never stop)",
        Num(lo=0, hi=1),
    )
    # speechlm.data.local_decode: under CP, the placement is computed where the batch is built
    decode_local: bool = key(
        True,
        "under context parallelism, each CP rank decodes only the clips its encoder reads (its own, and the "
        "clips sharded over the group), their lengths read from the audio headers first; false: every CP and "
        "TP peer decodes the whole micro-batch. A clip whose decode fails on its rank is agreed over every "
        "rank, which re-read that step with every clip decoded and drop the row as without it (past "
        "data.max_dropped_fraction the step fails on every rank, naming the row)",
    )
    # speechlm.data.manifest.schema.duration_mismatch
    duration_tolerance: float = key(
        0.5,
        "seconds a decoded clip may differ from its manifest duration (or 10% of it, if more) before it is "
        "dropped as duration_mismatch",
        Num(lo=0),
    )
    # streaming (speechlm.data.sampler.streaming) reads per DataLoader worker, for filesystems where random
    # reads are slow; its buffers count utterances
    read_mode: ReadMode = key(
        "indexed", "'indexed': clips read by position; 'streaming': tar shards read front to back"
    )
    # speechlm/data/sources/input_cfg.py
    input_cfg: list[Any] | str | None = key(
        None,
        "several weighted datasets, replacing data.train_manifest (docs/data.md)",
        InputList(null="use data.train_manifest"),
    )
    shuffle_buffer: int = key(2000, "utterances in the streaming shuffle buffer", POS_INT)
    sort_buffer: int = key(500, "utterances in the streaming sort buffer", POS_INT)

    def problems(self) -> list[str]:
        if self.input_cfg is not None and self.train_manifest is not None:
            return [
                f"data.input_cfg and data.train_manifest={self.train_manifest!r} are both set: give the training "
                "data one way (add data.train_manifest=null, or make the manifest one entry of data.input_cfg)"
            ]
        return []


@dataclass
class SamplerConfig(Section):
    KEY: ClassVar[str] = "sampler"

    mode: SamplerMode = key(
        "temperature",
        "batch sampler: temperature-weighted languages or the exhaustive algorithm",
    )
    temperature: float = key(
        0.3, "language sampling temperature (p ~ n^T; 1: proportional, ->0: uniform)", Num(lo=0, lo_open=True)
    )
    max_batch_duration: float | None = key(
        90.0,
        "seconds of audio per micro-batch",
        Num(lo=0, lo_open=True, null="use sampler.max_batch_tokens"),
    )
    max_batch_tokens: int | None = key(
        None,
        "token budget per micro-batch (replaces max_batch_duration)",
        Num(lo=1, integer=True, null="budget in seconds"),
    )
    length_penalty: float = key(0.0, "quadratic length penalty of the token budget", Num(lo=0))
    bucket_boundaries: list[float] | None = key(
        None,
        "duration bucket edges in seconds",
        Seq(
            item=Num(lo=0, lo_open=True),
            increasing=True,
            nonempty=True,
            null="estimated from the training data: sampler.num_buckets buckets of equal total duration",
        ),
    )
    epoch_size: int | None = key(
        None,
        "utterances per epoch in temperature mode",
        Num(lo=1, integer=True, null="the manifest's size"),
    )
    seed: int = key(0, "seed of the epoch plans", Num(lo=0, hi=SEED_MAX, integer=True))
    num_buckets: int = key(
        30,
        "duration buckets estimated from the training data (sampler.bucket_boundaries=null)",
        Num(lo=1, hi=127, integer=True),
    )
