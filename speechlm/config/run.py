"""The `parallel`, `optim` and `trainer` sections: the layout of the ranks, the optimizer and schedule, and
how a run steps, validates, checkpoints and evaluates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speechlm.config.choices import (
    CPAttention,
    CPDegrees,
    FinalEvalSplit,
    Precision,
    ResumeData,
    SplitAuto,
    choices_of,
)
from speechlm.config.keys import Section, key
from speechlm.config.rules import (
    POS_INT,
    SEED_MAX,
    Either,
    MetricName,
    Names,
    Num,
    OneOf,
    Seq,
    TaskLists,
    Text,
)
from speechlm.metrics import METRICS, NORMALIZE_OPS


@dataclass
class ParallelConfig(Section):
    KEY: ClassVar[str] = "parallel"

    dp_replicate: int = key(1, "data-parallel replicas (HSDP outer dimension)", POS_INT)
    # -1: whatever is left of the world size
    dp_shard: int = key(-1, "FSDP shards", Either(rules=(OneOf(choices=(-1,)), POS_INT)))
    cp_size: int = key(1, "context-parallel group size", POS_INT)
    tp_size: int = key(1, "tensor-parallel group size", POS_INT)
    cp_attention: CPAttention = key("ring", "attention under CP (reference backend)")
    # dynamic CP: shorter sequences live whole on one CP rank; "auto" splits the fewest longest ones that keep
    # the CP ranks' modelled cost within 5% of the mean; 0 is the layout before dynamic CP
    cp_split_threshold: int | SplitAuto = key(
        "auto",
        "sequences longer than this many tokens are split over the CP group (0: all; auto: per micro-batch)",
        Either(rules=(OneOf(choices=choices_of(SplitAuto)), Num(lo=0, integer=True))),
    )
    cp_degrees: CPDegrees = key(
        "all",
        "a split sequence spans every CP rank (all), or an aligned sub-group of 2, 4, ..., cp (hybrid)",
    )
    activation_checkpointing: bool = key(False, "recompute activations in the backward pass")


@dataclass
class OptimConfig(Section):
    KEY: ClassVar[str] = "optim"

    lr: float = key(1e-3, "peak learning rate", Num(lo=0, lo_open=True))
    encoder_lr: float | None = key(
        None, "peak learning rate of the encoder", Num(lo=0, lo_open=True, null="optim.lr")
    )
    weight_decay: float = key(0.01, "AdamW weight decay", Num(lo=0))
    betas: tuple[float, float] = key(
        (0.9, 0.98), "AdamW betas", Seq(item=Num(lo=0, hi=1, hi_open=True), length=2)
    )
    warmup_steps: int = key(50, "linear warmup steps before the cosine decay", Num(lo=0, integer=True))
    min_lr_ratio: float = key(0.1, "final learning rate as a fraction of the peak", Num(lo=0, hi=1))
    grad_clip: float = key(1.0, "gradient norm limit (0: no clipping)", Num(lo=0))
    unfreeze_step: int = key(
        0, "encoder frozen before this optimizer step (0: never frozen)", Num(lo=0, integer=True)
    )
    encoder_warmup_steps: int = key(0, "warmup of the encoder after it is unfrozen", Num(lo=0, integer=True))


@dataclass
class TrainerConfig(Section):
    KEY: ClassVar[str] = "trainer"

    max_steps: int = key(1000, "optimizer steps (0: evaluate the untrained model)", Num(lo=0, integer=True))
    max_minutes: float | None = key(
        None, "wall-clock limit, checked between optimizer steps (0: no limit)", Num(lo=0, null="no limit")
    )
    grad_accum: int = key(1, "micro-batches per optimizer step", POS_INT)
    precision: Precision = key(
        "auto",
        "'auto': bf16 where supported (CUDA), else fp32; '32': fp32; 'bf16': bf16 compute (FSDP2 mixed precision when the model is sharded, autocast otherwise; never both)",
        OneOf(
            advice=(
                ("bf16-mixed", "bf16-mixed: use trainer.precision=bf16"),
                ("bf16-true", "bf16-true: use trainer.precision=bf16 (parameters stay fp32)"),
                ("16-mixed", "16-mixed: fp16 is not supported; use trainer.precision=bf16 or 32"),
                ("16", "16: fp16 is not supported; use trainer.precision=bf16 or 32"),
                ("fp16", "fp16 is not supported; use trainer.precision=bf16 or 32"),
                ("32-true", "32-true: use trainer.precision=32"),
                ("fp32", "fp32: use trainer.precision=32"),
                ("64", "64: fp64 is not supported; use trainer.precision=32"),
            ),
        ),
    )
    seed: int = key(0, "seed of the model initialisation and dropout", Num(lo=0, hi=SEED_MAX, integer=True))
    run_dir: str = key(
        "runs/demo", "output folder of the run (resolves against the working directory)", Text()
    )
    log_every: int = key(1, "optimizer steps between metrics.jsonl rows", POS_INT)
    val_every: int = key(
        0, "optimizer steps between validations (0: off; needs data.val_manifest)", Num(lo=0, integer=True)
    )
    val_max_batches: int | None = key(
        None, "decoding batches per validation", Num(lo=1, integer=True, null="the whole validation split")
    )
    # logged as train_wer, train_wer_<lang>, train_<task>/<metric> beside the val metrics
    val_train_batches: int = key(
        0,
        "decoding batches of a fixed, per-language proportional subset of the training split decoded at each "
        "validation too (train_wer, train_wer_<lang>; 0: off; needs trainer.val_every)",
        Num(lo=0, integer=True),
    )
    # decoding keeps no activations for backward, so its batches can be larger than training's, and the
    # KV-cache decoder gains most from wide batches (docs/benchmarks.md, greedy decoding)
    eval_batch_duration: float | None = key(
        None,
        "seconds of audio per greedy-decoding batch",
        Num(lo=0, lo_open=True, null="4x sampler.max_batch_duration"),
    )
    ckpt_every: int = key(0, "optimizer steps between checkpoints (0: off)", Num(lo=0, integer=True))
    keep_last: int = key(2, "periodic checkpoints kept (older ones are deleted)", POS_INT)
    # a name of speechlm/metrics.py: loss, wer[_<lang>] or <task>/<metric>[_<lang>]
    best_metric: str = key(
        "wer",
        "validation metric whose best value (lowest for loss/wer/cer, highest for bleu/chrf/accuracy) is kept "
        "as checkpoints/best and watched by early stopping; it must be one the validation split produces",
        MetricName(),
    )
    early_stopping_patience: int = key(
        0, "validations without improvement before stopping (0: off)", Num(lo=0, integer=True)
    )
    resume: str | None = key(
        None,
        "'auto' (latest checkpoint of run_dir, if any) or a checkpoint directory",
        Text(path=True, keywords=("auto",), null="start fresh"),
    )
    # "exact" needs the same dp size, seed and manifest; "next_epoch" restores model, optimizer and step, for
    # resuming into a different data-parallel layout, where the old plan has no meaning
    resume_data: ResumeData = key(
        "exact",
        "'exact': continue the saved epoch plan; 'next_epoch': start the data at "
        "the next epoch (another data-parallel layout)",
    )
    validate_only: bool = key(False, "evaluate only (restoring trainer.resume if set): no optimizer step")
    # "train" is the demo's: WER on the training utterances
    final_eval_split: FinalEvalSplit = key(
        "auto",
        "split scored into eval.json after training ('auto': val when data.val_manifest is set, else none; "
        "'both': val, then a subset of train of trainer.final_eval_train_utterances)",
    )
    # spread over the (task, language) groups (speechlm/train/eval_rows.py, train_eval_rows)
    final_eval_train_utterances: int | None = key(
        None,
        "training utterances scored by final_eval_split=both, in the val split's (task, language) proportions",
        Num(lo=1, integer=True, null="as many as the val split has"),
    )
    # speechlm/metrics.py, docs/metrics.md
    eval_metrics: dict[str, list[str]] = key(
        {},
        "metrics per task, replacing that task's default (asr: [wer], ast: [bleu, chrf], qa/lid/cls: "
        "[accuracy]); docs/metrics.md",
        TaskLists(choices=METRICS, nonempty=True),
    )
    eval_normalize: dict[str, list[str]] = key(
        {},
        "text normalisation per task before scoring, replacing that task's default (asr, ast: [], qa/lid/cls: "
        "[lowercase, strip_punct]); whitespace is always collapsed",
        TaskLists(choices=NORMALIZE_OPS),
    )
    eval_cer_langs: list[str] = key(
        [],
        "languages scored by character error rate (cer) where their task asks for wer (codes in any case: EN "
        "is en)",
        Names(nonempty=False),
    )
    # None: the table of speechlm/model/flops.py by device (h100, h200, a100, cpu); another GPU logs no MFU
    peak_tflops: float | None = key(
        None,
        "peak dense TFLOP/s of one device, what MFU is measured against",
        Num(lo=0, lo_open=True, null="from the device table (speechlm/model/flops.py)"),
    )
    overwrite: bool = key(
        False,
        "a new run in a run_dir that holds another run moves that run aside to RUN_DIR.old-<UTC time> "
        "(never deleted); false: such a start is refused",
    )

    def problems(self) -> list[str]:
        out = []
        if self.early_stopping_patience > 0 and self.val_every == 0:
            out.append(
                f"trainer.early_stopping_patience={self.early_stopping_patience} but trainer.val_every=0 (no "
                "validation, so it could never stop early): set trainer.val_every=N, or "
                "trainer.early_stopping_patience=0"
            )
        # val_train_batches rides on the periodic validation: trainer.val_every=0 turns both off (a config that
        # sets it, like configs/demo.yaml, stays usable with validation off)
        return out
