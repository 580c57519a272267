"""The evaluation engine: greedy decoding and the metrics of each task per language over a manifest, sharded
over data-parallel ranks. Training's validation and final evaluation (`speechlm.train.evaluate`) and
`speechlm evaluate` (`speechlm.use.evaluation`) both run this `Evaluator`.

Sharding. The split's evaluation batches (every row once, sorted by duration: `build_eval_batches`)
are dealt round-robin to the dp ranks and padded with empty slots so that every rank holds the same
number (`shard_eval_batches`). CP and TP peers of one dp group get the same share and decode it
together. Every rank then runs the same sequence of forwards: one greedy decode per slot (an empty
slot, or a batch whose clips all failed to decode, decodes a dummy clip and discards it), and the
greedy loops step in lockstep through an all-reduced "anyone still decoding?" flag
(`speechlm.model.generation`). Under FSDP each forward all-gathers weights over the mesh, so
without this a rank that finished early would leave its peers waiting forever.

References. An utterance's reference is its manifest row's own answer (the transcript where the row
has none), never the decode of its token ids (a character the tokenizer lacks would come back as
`⁇`); reference and hypothesis both go through the run's `data.text_normalize` rule
(`speechlm.data.text.normalize_target`, the rule training encoded the answers under), then lose their
language tag.

Metrics from counts. Each utterance is scored by its task's metrics (`speechlm.metrics`: WER or CER,
BLEU and chrF, accuracy) into integer sufficient statistics, e.g. (errors = S + D + I, reference
words) for WER, sacrebleu's n-gram counts for BLEU; utterances whose normalised reference is empty
are not scored. The per-utterance rows are gathered to every rank, ordered as in the single-rank
run, and summed per (task, language): `asr/wer_hi` = sum errors / sum words of the Hindi ASR rows,
`ast/bleu` = BLEU of the summed n-gram counts of every AST row. Sums of integers do not depend on
the sharding, so the result equals the single-rank result exactly. ASR's word error rate is also
given under its old names `wer` and `wer_<lang>`.

The teacher-forced validation loss is sharded the same way: CE sums and labelled-token counts are
summed over the CP shards of each sequence and over the dp groups. So are the CTC sums (`ctc_per_token`)
and the audio reliance: each batch runs a second teacher-forced forward with its clips rotated by one
(`rotate_clips`: each sample hears another sample's clip), and each row's CE difference (from
`SpeechLLM.forward(per_seq=True)`) is summed per (task, language) and divided by the rows' labelled
tokens (`speechlm.use.eval_report.reliance_scores`; docs/metrics.md, "Audio reliance"). With joint
CTC/attention decoding (`model.decode_ctc_weight > 0`) each batch is also decoded by the LLM alone
(weight 0), its ASR rows scored under `llm_` keys (`llm_alone_scores`). Every collective here goes through
the run's one `parallel.collectives.Collectives` (`module.step_ctx.collectives`: training's
`StepContext`, or the `EvalContext` that `speechlm evaluate` gives its module): the lockstep flag
(`any`) and one `gather_objects` of every rank's share at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import pyarrow as pa
import torch

from parallel.collectives import Collectives
from parallel.frames import DUMMY_CLIP_SAMPLES, SAMPLE_RATE
from speechlm.config import ExperimentConfig, eval_batch_duration
from speechlm.data.dataset import Batch, SpeechDataset, build_dataloader
from speechlm.data.drops import drop_advice, drop_listing, drop_reasons
from speechlm.data.manifest import manifest_arrays
from speechlm.data.run_inputs import RunTokenizer, run_dataset
from speechlm.data.sampler.batching import batch_by_duration
from speechlm.data.text import decode_hypothesis, normalize_target, strip_lang_tag
from speechlm.errors import DataError, UsageError
from speechlm.metrics import DEFAULT_TASK, MetricSpec, aggregate, table_pairs
from speechlm.model.micro_losses import compute_micro_losses, count_ctc_tokens, count_targets
from speechlm.model.speech_llm import SpeechLLM
from speechlm.progress import Progress
from speechlm.use.eval_report import llm_alone_scores, reliance_scores, sum_over_tasks


class EvaluationInterrupted(Exception):
    """Every rank agreed to stop the evaluation (SIGTERM during it: `speechlm.train.preempt`)."""


class EvalLayout(Protocol):
    """What an evaluation reads from the layout of the module it evaluates: the one collectives object."""

    @property
    def collectives(self) -> Collectives: ...


@dataclass(frozen=True)
class EvalContext:
    """The layout `speechlm evaluate` gives the module it rebuilt (training's is its `StepContext`)."""

    collectives: Collectives = field(default_factory=Collectives)


class EvalModule(Protocol):
    """What an evaluation reads from the module it evaluates: training's `SpeechLLMModule`, or
    `speechlm.use.checkpoint.TrainedModule`."""

    @property
    def model(self) -> SpeechLLM: ...
    @property
    def step_ctx(self) -> EvalLayout: ...
    @property
    def device(self) -> torch.device: ...


def build_eval_batches(
    table: pa.Table,
    *,
    max_batch_duration: float,
    dp_rank: int = 0,
    dp_size: int = 1,
    max_utterances: int | None = None,
) -> list[list[int]]:
    """Deterministic, sequential evaluation batches (every row once, sorted by duration), dealt to dp ranks."""
    durations = manifest_arrays(table).durations
    return batch_by_duration(durations, max_batch_duration, max_utterances)[dp_rank::dp_size]


def shard_eval_batches(batches: list[list[int]], dp_rank: int, dp_size: int) -> list[list[int]]:
    """Rank ``dp_rank``'s share, round-robin, padded with empty slots to ``ceil(len / dp_size)``."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
    share = batches[dp_rank::dp_size]
    n_slots = -(-len(batches) // dp_size)
    return share + [[] for _ in range(n_slots - len(share))]


def dummy_batch(device: torch.device) -> Any:
    """One clip of silence (`parallel.frames.DUMMY_CLIP_SAMPLES`, 0.1 s), no reference: what an empty slot
    decodes to stay in lockstep."""
    n = DUMMY_CLIP_SAMPLES
    return Batch(
        audio=torch.zeros(1, n, device=device),
        audio_lens=torch.tensor([n], device=device),
        tokens=torch.zeros(1, 0, dtype=torch.int64, device=device),
        token_lens=torch.zeros(1, dtype=torch.int64, device=device),
        langs=[""],
        indices=[-1],
        durations=torch.tensor([n / SAMPLE_RATE], device=device),
    )


@torch.no_grad()
def decode_shard(
    model: SpeechLLM,
    batches: Iterable[Any],
    tokenizer: RunTokenizer,
    *,
    device: torch.device,
    comm: Collectives,
    max_new_tokens: int = 96,
    use_cache: bool = True,
    spec: MetricSpec | None = None,
    reference: Callable[[int], str] | None = None,
    text_normalize: str = "none",
) -> list[dict[str, Any]]:
    """Greedy-decode this rank's batches (lockstep) with `model.generate_for_batch`; one row per utterance:
    row, task, lang, ref, hyp, stats ({metric: statistics} under `spec`, default `MetricSpec.build()`;
    {} when the reference is empty), and for WER-scored rows errors and words (the WER statistics).

    The reference of manifest row r is `reference(r)`, the row's own answer or transcript text (`Evaluator`
    passes the dataset's); None (batches built without a manifest, in tests): the decode of the batch's
    target ids. Reference and hypothesis both go through the data.text_normalize rule `text_normalize`
    (`normalize_target`: what training encoded), then lose their language tag."""
    spec = spec or MetricSpec.build()
    rows: list[dict[str, Any]] = []
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            empty = len(batch) == 0  # padding slot or every clip dropped: decode a dummy, keep nothing
            batch = dummy_batch(device) if empty else batch.to(device)
            out_ids = model.generate_for_batch(
                batch, max_new_tokens=max_new_tokens, use_cache=use_cache, keep_going=comm.any
            )
            if empty:
                continue
            tasks = batch.tasks or [DEFAULT_TASK] * len(batch)
            for b in range(len(batch)):
                row_id = int(batch.indices[b])
                if reference is not None:
                    ref = reference(row_id)
                else:
                    ref = tokenizer.decode(batch.tokens[b, : int(batch.token_lens[b])].tolist())
                ref = strip_lang_tag(normalize_target(ref, text_normalize))
                hyp = normalize_target(decode_hypothesis(tokenizer, out_ids[b]), text_normalize)
                stats = spec.score_utterance(tasks[b], batch.langs[b], ref, hyp) or {}
                row = dict(row=row_id, task=tasks[b], lang=batch.langs[b], ref=ref, hyp=hyp)
                row["stats"] = stats
                if "wer" in stats:
                    row["errors"], row["words"] = stats["wer"]
                rows.append(row)
    finally:
        model.train(was_training)
    return rows


def rotate_clips(batch: Batch) -> Batch | None:
    """The batch with every clip's audio moved one place along the clip axis (clip c gets clip c-1's audio,
    the first gets the last's); the prompts, `clip_sample` and transcripts stay, so each sample hears
    another's audio (in a conversation of several clips, a clip may get another clip of its own sample).
    None for a batch of fewer than two clips: it cannot be rotated."""
    if batch.num_clips < 2:
        return None
    return replace(batch, audio=batch.audio.roll(1, dims=0), audio_lens=batch.audio_lens.roll(1, dims=0))


@dataclass
class SlotResult:
    """What one rank's share of the split gave: decoded rows, teacher-forced sums, drops."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    ce: float = 0.0
    n_tokens: int = 0
    ctc: float = 0.0  # summed CTC of the clips this rank encoded
    ctc_tokens: int = 0  # their CTC target tokens (the language tag left out)
    # audio reliance per (task, lang): summed CE with the clips rotated minus with their own (this rank's
    # share of each sequence), and the labelled tokens of those rows (whole micro-batches)
    reliance_ce: dict[tuple[str, str], float] = field(default_factory=dict)
    reliance_tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    llm_rows: list[dict[str, Any]] = field(default_factory=list)  # ASR rows decoded by the LLM alone
    dropped_rows: list[int] = field(default_factory=list)  # manifest rows requested but not decoded
    dropped_reasons: dict[str, int] = field(default_factory=dict)
    dropped_files: list[str] = field(default_factory=list)


class Evaluator:
    """Greedy decoding and each task's metrics per language over a manifest, each data-parallel rank decoding
    its share (module doc).

    The batches are streamed: each one is loaded, decoded and scored before the next is read, so a
    large split never sits in memory. ``last_decodes`` holds (lang, ref, hyp) of every decoded
    utterance, on every rank, in the order of a single-rank run (``last_tasks``: the task of each);
    ``last_counts`` the utterances scored and dropped per language (``scored``, ``dropped``) and per task
    and language (``scored_by_task``, ``dropped_by_task``), and the drop reasons, summed over the
    data-parallel ranks. The references are the rows' own text under `data.text_normalize` (module doc);
    the metrics and normalisation of each task are `MetricSpec.from_config(cfg)`.

    `data.max_dropped_fraction` applies to the split: more than that fraction unreadable, or nothing
    decodable at all, is a `DataError` naming the files (never a result computed from nothing).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        tokenizer: RunTokenizer,
        table: pa.Table,
        rank: int,
        max_batches: int | None | Literal["config"] = "config",
        *,
        split: str = "val",
        max_new_tokens: int = 96,
        max_utterances: int | None = None,
        rows: list[int] | None = None,
        template: str | None = None,
    ):
        self.cfg, self.tokenizer, self.table, self.rank = cfg, tokenizer, table, rank
        self.template = template  # data.chat_template's text as the run read it (None: read it here)
        self.rows = rows  # the manifest rows to score (`choose_train_rows`); None: every row
        self.max_new_tokens, self.max_utterances = max_new_tokens, max_utterances
        self.max_batches = cfg.trainer.val_max_batches if max_batches == "config" else max_batches
        self.split = split
        self.spec = MetricSpec.from_config(cfg)
        self.last_decodes: list[tuple[str, str, str]] = []
        self.last_tasks: list[str] = []
        self.last_rows: list[int] = []
        self.last_counts: dict[str, Any] = {"scored": {}, "dropped": {}, "dropped_reasons": {}}

    def plan(self) -> list[list[int]]:
        """The split's evaluation batches (manifest rows), cut to `trainer.val_max_batches`."""
        if self.max_batches is not None and self.max_batches < 0:
            raise UsageError(
                f"trainer.val_max_batches={self.max_batches} would evaluate no batch: give a number >= 1, or "
                f"null (or 0) for the whole split"
            )
        for task in sorted(
            {task for task, _ in table_pairs(self.table)}
        ):  # before any decoding, on every rank
            self.spec.check_task(task, f"the {self.split} split ({self.manifest_name()})")
        table = self.table if self.rows is None else self.table.take(self.rows)
        batches = build_eval_batches(
            table, max_batch_duration=eval_batch_duration(self.cfg), max_utterances=self.max_utterances
        )
        if self.rows is not None:  # positions in the subset -> manifest rows
            batches = [[self.rows[i] for i in b] for b in batches]
        if self.max_batches:
            batches = batches[: self.max_batches]
        if not batches:
            raise DataError(
                f"the {self.split} split ({self.manifest_name()}) has no utterance to evaluate: give a manifest "
                f"with rows (or turn this evaluation off)"
            )
        return batches

    def manifest_name(self) -> str:
        d = self.cfg.data
        name = str(d.val_manifest if self.split == "val" else (d.train_manifest or "data.input_cfg"))
        return name if self.rows is None else f"{len(self.rows)} rows of {name}"

    def __call__(
        self,
        module: EvalModule,
        *,
        stop: Callable[[], bool] | None = None,
        progress: bool = False,
        display: bool = False,
    ) -> dict[str, Any]:
        """Metrics of the split: loss, `<task>/<metric>` and `<task>/<metric>_<lang>` (`speechlm.metrics`),
        wer and wer_<lang> (ASR), utterances (scored), dropped (not readable).

        `progress` (final evaluation): a line on the split, then a progress display of the batches on a
        terminal (`speechlm.progress`), else a line per tenth of them (10 batches or more); `display`:
        the terminal display only (`speechlm evaluate`).

        `stop` (final evaluation): checked before each batch and agreed by every rank; when any rank
        says stop, every rank raises `EvaluationInterrupted` at the same batch."""
        # the run's renderer, as training reads
        ds = run_dataset(self.cfg, self.table, self.tokenizer, template=self.template)
        batches = self.plan()
        order = {row: i for i, row in enumerate(r for b in batches for r in b)}
        comm = module.step_ctx.collectives  # the run's one collectives object (ParallelDims.collectives)
        share = shard_eval_batches(batches, comm.dp_rank, comm.dp_size)
        if progress and self.rank == 0:
            print(
                f"final evaluation on the {self.split} split: {len(order)} utterances in {len(batches)} "
                f"batches ({len(share)} per data-parallel rank)",
                flush=True,
            )
        local = self.run_share(module, ds, share, comm, stop=stop, progress=progress, display=display)
        # one gather: the rows, counts and drops of each dp rank from its primary member; the CE sums
        # from every CP shard (TP peers hold the same CE: counted once)
        gathered = comm.gather_objects((comm.primary, comm.shard_primary, local))
        parts = [p for primary, _, p in gathered if primary]
        shards = [p for _, shard_primary, p in gathered if shard_primary]
        ce_total = sum(p.ce for p in shards)
        merged = sorted((r for p in parts for r in p.rows), key=lambda r: order[r["row"]])
        self.last_decodes = [(r["lang"], r["ref"], r["hyp"]) for r in merged]
        self.last_tasks = [r["task"] for r in merged]
        self.last_rows = [int(r["row"]) for r in merged]  # the manifest row of each of last_decodes
        self.last_counts = self.count(merged, parts)
        self.check_drops(len(order), parts, self.last_counts["dropped_reasons"])
        scores = aggregate((r["task"], r["lang"], r["stats"]) for r in merged if r["stats"])
        n_tok = sum(p.n_tokens for p in parts)
        extra = self.teacher_forced_scores(parts, shards)
        if any(p.llm_rows for p in parts):
            extra.update(llm_alone_scores([r for p in parts for r in p.llm_rows]))
        return {
            "loss": ce_total / max(n_tok, 1),
            **scores,
            **extra,
            "utterances": sum(self.last_counts["scored"].values()),
            "dropped": sum(self.last_counts["dropped"].values()),
        }

    @staticmethod
    def teacher_forced_scores(parts: list[SlotResult], shards: list[SlotResult]) -> dict[str, float]:
        """`ctc_per_token` (CTC head on) and the audio reliance keys (`reliance_scores`), from the CE and CTC
        sums of every shard (`shards`: one per CP rank of each dp group) and the counts of each dp group
        (`parts`)."""
        out: dict[str, float] = {}
        ctc_tokens = sum(p.ctc_tokens for p in parts)
        if ctc_tokens:
            out["ctc_per_token"] = sum(p.ctc for p in shards) / ctc_tokens
        ce: dict[tuple[str, str], float] = {}
        tokens: dict[tuple[str, str], int] = {}
        for p in shards:
            for k, v in p.reliance_ce.items():
                ce[k] = ce.get(k, 0.0) + v
        for p in parts:
            for k, n in p.reliance_tokens.items():
                tokens[k] = tokens.get(k, 0) + n
        return {**out, **reliance_scores(ce, tokens)}

    def run_share(
        self,
        module: EvalModule,
        ds: SpeechDataset,
        share: list[list[int]],
        comm: Collectives,
        *,
        stop: Callable[[], bool] | None,
        progress: bool,
        display: bool = False,
    ) -> SlotResult:
        """Load, decode and score this rank's slots one at a time (every rank runs the same forwards)."""
        out = SlotResult()
        every = max(1, len(share) // 10)
        t0 = time.time()
        bar = Progress(
            len(share),
            f"evaluating {self.split}",
            "batches",
            rank=self.rank,
            enabled=None if progress or display else False,
            leave=False,
        )
        try:
            for i, (want, batch) in enumerate(zip(share, self.load_slots(ds, share))):
                if stop is not None:
                    if comm.any(stop()):
                        raise EvaluationInterrupted(f"stopped at batch {i + 1} of {len(share)}")
                out.rows += self.decode(module, ds, batch, comm)
                model = module.model
                joint = float(model.decode_ctc_weight)
                if joint > 0 and getattr(model, "ctc_head", None) is not None:  # the LLM alone beside it
                    model.decode_ctc_weight = 0.0
                    try:
                        llm_rows = self.decode(module, ds, batch, comm)
                    finally:
                        model.decode_ctc_weight = joint
                    out.llm_rows += [r for r in llm_rows if r["task"] == DEFAULT_TASK]
                self.teacher_forced(module, batch, out)
                decoded = set(batch.indices)
                out.dropped_rows += [r for r in want if r not in decoded]
                for k, v in batch.dropped.items():
                    out.dropped_reasons[k] = out.dropped_reasons.get(k, 0) + int(v)
                out.dropped_files += list(batch.dropped_files)
                bar.update(1)
                if (
                    progress
                    and not bar.active
                    and self.rank == 0
                    and len(share) >= 10
                    and (i + 1) % every == 0
                ):
                    print(f"  evaluated {i + 1}/{len(share)} batches ({time.time() - t0:.0f} s)", flush=True)
        finally:
            bar.close()
        return out

    @staticmethod
    def load_slots(ds: SpeechDataset, share: list[list[int]]) -> Iterator[Any]:
        """This rank's batches, loaded one at a time; an empty slot (padding) gives an empty Batch."""
        real = [b for b in share if b]
        loaded = iter(build_dataloader(ds, real, num_workers=0)) if real else iter(())
        for want in share:  # the real batches come first, the padding slots last
            yield next(loaded) if want else Batch.empty()

    def decode(
        self, module: EvalModule, ds: SpeechDataset, batch: Batch, comm: Collectives
    ) -> list[dict[str, Any]]:
        """`decode_shard` of one batch, scored against the manifest's text (not the decode of its ids)."""
        return decode_shard(
            module.model,
            [batch],
            self.tokenizer,
            device=module.device,
            comm=comm,
            max_new_tokens=self.max_new_tokens,
            spec=self.spec,
            reference=lambda row: ds.conversation(row).answer,
            text_normalize=self.cfg.data.text_normalize,
        )

    @staticmethod
    def teacher_forced(module: EvalModule, batch: Batch, out: SlotResult) -> None:
        """Add one batch's teacher-forced sums to `out`: CE and labelled tokens (`loss`), CTC and its target
        tokens, and the audio reliance (module doc): a second forward of the batch with its clips rotated
        (`rotate_clips`), each row's CE difference summed per (task, lang). Every rank runs both forwards
        (FSDP and CP need the same collectives everywhere): an empty batch runs the weight-0 dummy twice, a
        batch of one clip runs the dummy as its second forward and counts nothing for the reliance."""
        model = module.model
        batch = batch.to(module.device)
        rotated = rotate_clips(batch) if len(batch) else None
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                own = compute_micro_losses(model, batch, per_seq=True)
                other = compute_micro_losses(
                    model, rotated if rotated is not None else Batch.empty().to(module.device), per_seq=True
                )
        finally:
            model.train(was_training)
        out.ce += float(own.ce_sum.double().cpu()) * own.weight
        out.n_tokens += count_targets(batch, model)
        if own.ctc_sum is not None and own.weight > 0:
            out.ctc += float(own.ctc_sum.double().cpu())
            out.ctc_tokens += count_ctc_tokens(batch, model.ctc_skip_leading)
        if rotated is None or own.ce_per_seq is None or other.ce_per_seq is None or own.placed is None:
            return
        delta = (other.ce_per_seq.double() - own.ce_per_seq.double()).cpu().tolist()
        tasks = batch.tasks or [DEFAULT_TASK] * len(batch)
        for b, d in enumerate(delta):
            key = (tasks[b], batch.langs[b])
            out.reliance_ce[key] = out.reliance_ce.get(key, 0.0) + d
            out.reliance_tokens[key] = out.reliance_tokens.get(key, 0) + own.placed.labelled[b]

    def count(self, merged: list[dict[str, Any]], parts: list[SlotResult]) -> dict[str, Any]:
        """Scored (decoded, non-empty reference) and dropped utterances per language and per (task, language)."""
        langs = self.table.column("lang")
        tasks = self.table.column("task") if "task" in self.table.column_names else None
        scored: dict[str, dict[str, int]] = {}
        empty_ref = 0
        for r in merged:
            if r["stats"]:
                per_lang = scored.setdefault(r["task"], {})
                per_lang[r["lang"]] = per_lang.get(r["lang"], 0) + 1
            else:
                empty_ref += 1  # decoded, but an empty reference has nothing to score
        dropped: dict[str, dict[str, int]] = {}
        reasons: dict[str, int] = {}
        for p in parts:
            for row in p.dropped_rows:
                lang = str(langs[row].as_py())
                task = (tasks[row].as_py() if tasks is not None else None) or DEFAULT_TASK
                per_lang = dropped.setdefault(str(task), {})
                per_lang[lang] = per_lang.get(lang, 0) + 1
            for k, v in p.dropped_reasons.items():
                reasons[k] = reasons.get(k, 0) + v
        counts: dict[str, Any] = {
            "scored": sum_over_tasks(scored),
            "dropped": sum_over_tasks(dropped),
            "dropped_reasons": reasons,
            "scored_by_task": scored,
            "dropped_by_task": dropped,
        }
        if empty_ref:
            counts["empty_reference"] = empty_ref
        return counts

    def check_drops(self, total: int, parts: list[SlotResult], reasons: dict[str, int]) -> None:
        """DataError when nothing of the split could be read, or more than data.max_dropped_fraction
        (`reasons`: the split's drop counts by reason, as `count` summed them)."""
        limit = float(self.cfg.data.max_dropped_fraction)
        files = [f for p in parts for f in p.dropped_files]
        n_dropped = sum(len(p.dropped_rows) for p in parts)
        listing = drop_listing(files)
        where = f"the {self.split} split ({self.manifest_name()})"
        why = drop_reasons(reasons)
        if n_dropped == total:
            raise DataError(
                f"every one of the {total} samples of {where} was dropped ({why}), so there is nothing to "
                f"evaluate:\n  {listing}\nTo go on: {drop_advice(reasons)}"
            )
        if n_dropped > limit * total:
            raise DataError(
                f"{n_dropped} of {total} samples of {where} were dropped ({why}), more than "
                f"data.max_dropped_fraction={limit}:\n  {listing}\nTo go on: {drop_advice(reasons)}; or raise "
                "data.max_dropped_fraction"
            )
