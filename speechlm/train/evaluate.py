"""Validation: greedy decoding and the metrics of each task per language, sharded over data-parallel ranks.

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

The training split beside the held-out one. A model that memorises scores well on the rows it trained on
and badly on new sentences, so the training split is scored too, on a subset that costs about what the
val split costs: `choose_train_rows` apportions N rows over the (task, language) groups of the training
split in the proportions of the val split's groups (largest remainders; a group with fewer training rows
gives all it has, a val group absent from training gives none) and takes each group's rows evenly spread
over its rows in manifest order (position floor((i + 0.5) * rows / k) of k), not the first N. The choice
depends only on the two manifests and N, so every rank and every validation of a run scores the same rows.
`trainer.final_eval_split=both` scores N = `trainer.final_eval_train_utterances` (default: the val split's
utterances) after the val split; `trainer.val_train_batches=K` scores, at each validation, the largest
such subset that fits in K decoding batches (`periodic_train_rows`), its keys prefixed `train_`.

The teacher-forced validation loss is sharded the same way: CE sums and labelled-token counts are
summed over the CP shards of each sequence and over the dp groups. Every collective here goes through
the run's one `parallel.collectives.Collectives` (the module's `step_ctx.collectives`): the lockstep
flag (`any`) and one `gather_objects` of every rank's share at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parallel.collectives import Collectives
from speechlm.config import TRAIN_PREFIX, ExperimentConfig
from speechlm.data.run_inputs import run_dataset
from speechlm.data.text import decode_hypothesis, normalize_target, strip_lang_tag
from speechlm.errors import DataError
from speechlm.metrics import (
    DEFAULT_TASK,
    METRICS,
    PERCENT_METRICS,
    MetricSpec,
    aggregate,
    split_metric_name,
    table_pairs,
    word_error_counts,
)
from speechlm.train.data import drop_advice, drop_listing, drop_reasons

__all__ = ["strip_lang_tag", "word_error_counts"]  # re-exported: the WER helpers' old home


def wer_from_counts(rows: Iterable[tuple[str, int, int]]) -> dict[str, float]:
    """Corpus WER overall (`wer`) and per language (`wer_<lang>`) from (lang, errors, words) rows of ASR
    utterances (a row with no reference words is not scored)."""
    scored = ((DEFAULT_TASK, lang, {"wer": (e, n)}) for lang, e, n in rows if n > 0)
    return {k: v for k, v in aggregate(scored).items() if "/" not in k}


def shard_eval_batches(batches: list[list[int]], dp_rank: int, dp_size: int) -> list[list[int]]:
    """Rank ``dp_rank``'s share, round-robin, padded with empty slots to ``ceil(len / dp_size)``."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
    share = batches[dp_rank::dp_size]
    n_slots = -(-len(batches) // dp_size)
    return share + [[] for _ in range(n_slots - len(share))]


def row_groups(table: Any) -> np.ndarray:
    """The (task, language) group of each manifest row as "task/lang" (no `task` column, or a null: asr)."""
    langs = [str(x) for x in table.column("lang").to_pylist()]
    tasks = table.column("task").to_pylist() if "task" in table.column_names else [None] * len(langs)
    return np.array([f"{t or DEFAULT_TASK}/{lang}" for t, lang in zip(tasks, langs)], dtype=object)


def apportion(counts: np.ndarray, n: int) -> np.ndarray:
    """`n` split in proportion to `counts` by largest remainders (ties: the earlier group), summing to n."""
    exact = n * counts / max(int(counts.sum()), 1)
    quota = np.floor(exact).astype(np.int64)
    extra = np.argsort(-(exact - quota), kind="stable")[: n - int(quota.sum())]
    quota[extra] += 1
    return quota


def choose_train_rows(train_groups: np.ndarray, val_groups: np.ndarray, n: int) -> list[int]:
    """At most `n` training rows, apportioned over the val split's (task, language) groups in its
    proportions, each group's rows evenly spread over its training rows (module doc); sorted."""
    names, counts = np.unique(val_groups.astype(str), return_counts=True)
    train = train_groups.astype(str)
    chosen = []
    for name, k in zip(names, apportion(counts, n)):
        rows = np.flatnonzero(train == name)
        k = min(int(k), len(rows))
        if k:
            chosen.append(rows[((np.arange(k) + 0.5) * len(rows) / k).astype(np.int64)])
    return sorted(int(r) for r in np.concatenate(chosen)) if chosen else []


def train_eval_rows(cfg: ExperimentConfig, train_table: Any, val_table: Any) -> list[int]:
    """The training rows `final_eval_split=both` scores: `trainer.final_eval_train_utterances` (default: the
    val split's utterances) chosen by `choose_train_rows`."""
    n = cfg.trainer.final_eval_train_utterances or len(val_table)
    train_groups, val_groups = row_groups(train_table), row_groups(val_table)
    return require_rows(choose_train_rows(train_groups, val_groups, n), val_groups)


def require_rows(rows: list[int], val_groups: np.ndarray) -> list[int]:
    """`rows`, or a DataError when no training row shares a (task, language) with the val split."""
    if not rows:
        raise DataError(
            f"no row of the training split has a (task, language) of the val split "
            f"({', '.join(sorted(set(val_groups.astype(str))))}), so there is no training subset to score beside "
            f"it: give a val manifest of the training languages, or turn the training-split scores off "
            f"(trainer.final_eval_split=val, trainer.val_train_batches=0)"
        )
    return rows


def periodic_train_rows(cfg: ExperimentConfig, train_table: Any, val_table: Any) -> list[int]:
    """The training rows each validation decodes (`trainer.val_train_batches` = K): the largest subset
    chosen by `choose_train_rows` whose decoding batches are at most K (a binary search over its size)."""
    import pyarrow as pa

    from speechlm.config import eval_batch_duration
    from speechlm.data.sampler.batching import batch_by_duration

    k, budget = cfg.trainer.val_train_batches, eval_batch_duration(cfg)
    train_groups, val_groups = row_groups(train_table), row_groups(val_table)
    durations = train_table.column("duration").cast(pa.float32()).to_numpy()  # as build_eval_batches reads

    def choose(m: int) -> list[int]:
        return choose_train_rows(train_groups, val_groups, m)

    def fits(m: int) -> bool:
        return len(batch_by_duration(durations[choose(m)], budget)) <= k

    shortest = float(durations.min()) if len(durations) else 1.0
    lo, hi = 1, min(len(durations), k * (int(budget / max(shortest, 1e-3)) + 1))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return require_rows(choose(lo), val_groups)


def with_prefix(scores: dict[str, Any], prefix: str = TRAIN_PREFIX) -> dict[str, Any]:
    """The scores of the training split as a validation logs them: `train_wer`, `train_asr/wer_hi`, ..."""
    return {prefix + k: v for k, v in scores.items()}


def with_train_split(val_eval: Callable[[Any], dict[str, Any]], train_eval: Any) -> Callable[[Any], dict]:
    """A validation that scores the val split, then (every rank, in lockstep) `train_eval`'s training rows,
    into one record: the val keys as they are, the training keys prefixed `train_`."""

    def evaluate(module: Any) -> dict[str, Any]:
        return {**val_eval(module), **with_prefix(train_eval(module))}

    return evaluate


DUMMY_SAMPLES = 1600  # 0.1 s of silence: what an empty slot decodes to stay in lockstep


def dummy_batch(device: torch.device) -> Any:
    """One clip of silence (`DUMMY_SAMPLES`), no reference: what an empty slot decodes to stay in lockstep."""
    from speechlm.data.dataset import Batch

    return Batch(
        audio=torch.zeros(1, DUMMY_SAMPLES, device=device),
        audio_lens=torch.tensor([DUMMY_SAMPLES], device=device),
        tokens=torch.zeros(1, 0, dtype=torch.int64, device=device),
        token_lens=torch.zeros(1, dtype=torch.int64, device=device),
        langs=[""],
        indices=[-1],
        durations=torch.tensor([DUMMY_SAMPLES / 16000.0], device=device),
    )


@torch.no_grad()
def decode_shard(
    model: Any,
    batches: Iterable[Any],
    tokenizer: Any,
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


def _cell(metric: str, value: float | None, width: int) -> str:
    if value is None:
        return "n/a".rjust(width)
    text = f"{100 * value:5.1f}%" if metric in PERCENT_METRICS else f"{value:5.1f}"
    return text.rjust(width)


LABELS = {"wer": "WER", "cer": "CER", "bleu": "BLEU", "chrf": "chrF", "accuracy": "accuracy"}


def format_eval_table(metrics: dict[str, Any], counts: dict[str, Any] | None = None) -> str:
    """The evaluation table: per task a block with one row per language, then `all`, one column per
    metric (WER/CER/accuracy in %, BLEU/chrF 0-100). An ASR-only run gets today's WER table, without a
    task heading. `counts` is `Evaluator.last_counts` (scored and dropped utterances per task and language,
    drop reasons) or a plain {lang: utterances} mapping; `metrics` may hold only `wer`/`wer_<lang>`."""
    if counts is not None and "scored" not in counts:
        counts = {"scored": counts, "dropped": {}, "dropped_reasons": {}}
    by_task: dict[str, dict[str, dict[str, float]]] = {}  # task -> metric -> lang ("" for all) -> value
    for key, value in metrics.items():
        task, _, name = key.rpartition("/")
        metric, _, lang = name.partition("_")
        if metric in METRICS and (task or (metric == "wer" and not any("/" in k for k in metrics))):
            by_task.setdefault(task or DEFAULT_TASK, {}).setdefault(metric, {})[lang] = value
    blocks = []
    for task in sorted(by_task, key=lambda t: (t != DEFAULT_TASK, t)):
        per_task = counts is not None and "scored_by_task" in counts
        scored = dict(
            (counts["scored_by_task"].get(task, {}) if per_task else counts["scored"]) if counts else {}
        )
        dropped = dict(
            (counts["dropped_by_task"].get(task, {}) if per_task else counts["dropped"]) if counts else {}
        )
        names = [m for m in METRICS if m in by_task[task]]
        widths = [max(6, len(LABELS[m])) for m in names]
        langs = sorted(
            {lang for m in names for lang in by_task[task][m] if lang} | {k for k, v in dropped.items() if v}
        )
        lines = [] if set(by_task) == {DEFAULT_TASK} else [f"task {task}:"]
        lines.append(
            "  ".join(
                ["language", "utterances", *(LABELS[m].ljust(w) for m, w in zip(names, widths))]
            ).rstrip()
        )
        lines.append("  ".join(["-" * 8, "-" * 10, *("-" * w for w in widths)]))
        for lang in [*langs, ""]:
            values = [by_task[task][m].get(lang) for m in names]
            if not lang and all(v is None for v in values):
                continue
            n = "" if counts is None else str(sum(scored.values()) if not lang else scored.get(lang, 0))
            cells = [_cell(m, v, w) for m, v, w in zip(names, values, widths)]
            note = f"  ({dropped[lang]} dropped)" if lang and dropped.get(lang) else ""
            lines.append(f"{lang or 'all':<8}  {n:>10}  " + "  ".join(cells) + note)
        blocks.append("\n".join(lines))
    out = "\n\n".join(blocks)
    n_dropped = int(sum(int(v) for v in counts["dropped"].values())) if counts is not None else 0
    if counts is not None and n_dropped:
        out += f"\ndropped (not scored): {n_dropped} utterances ({drop_reasons(counts['dropped_reasons'])})"
    return out


format_wer_table = format_eval_table  # its name before the metrics per task


@dataclass
class SlotResult:
    """What one rank's share of the split gave: decoded rows, teacher-forced sums, drops."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    ce: float = 0.0
    n_tokens: int = 0
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
        tokenizer: Any,
        table: Any,
        rank: int,
        max_batches: Any = "config",
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
        from speechlm.config import eval_batch_duration
        from speechlm.errors import UsageError
        from speechlm.train.data import build_eval_batches

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
        module: Any,
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
        ce_total = sum(p.ce for _, shard_primary, p in gathered if shard_primary)
        merged = sorted((r for p in parts for r in p.rows), key=lambda r: order[r["row"]])
        self.last_decodes = [(r["lang"], r["ref"], r["hyp"]) for r in merged]
        self.last_tasks = [r["task"] for r in merged]
        self.last_rows = [int(r["row"]) for r in merged]  # the manifest row of each of last_decodes
        self.last_counts = self.count(merged, parts)
        self.check_drops(len(order), parts, self.last_counts["dropped_reasons"])
        scores = aggregate((r["task"], r["lang"], r["stats"]) for r in merged if r["stats"])
        n_tok = sum(p.n_tokens for p in parts)
        return {
            "loss": ce_total / max(n_tok, 1),
            **scores,
            "utterances": sum(self.last_counts["scored"].values()),
            "dropped": sum(self.last_counts["dropped"].values()),
        }

    def run_share(
        self,
        module: Any,
        ds: Any,
        share: list[list[int]],
        comm: Collectives,
        *,
        stop: Callable[[], bool] | None,
        progress: bool,
        display: bool = False,
    ) -> SlotResult:
        """Load, decode and score this rank's slots one at a time (every rank runs the same forwards)."""
        import time

        from speechlm.progress import Progress

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
                        from speechlm.train.preempt import EvaluationInterrupted

                        raise EvaluationInterrupted(f"stopped at batch {i + 1} of {len(share)}")
                out.rows += decode_shard(
                    module.model,
                    [batch],
                    self.tokenizer,
                    device=module.device,
                    comm=comm,
                    max_new_tokens=self.max_new_tokens,
                    spec=self.spec,
                    reference=lambda row: ds.conversation(row).answer,  # the manifest's text, not its ids
                    text_normalize=self.cfg.data.text_normalize,
                )
                ce, n = self.batch_loss(module, batch)
                out.ce += ce
                out.n_tokens += n
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
    def load_slots(ds: Any, share: list[list[int]]) -> Iterator[Any]:
        """This rank's batches, loaded one at a time; an empty slot (padding) gives an empty Batch."""
        from speechlm.data.dataset import Batch, build_dataloader

        real = [b for b in share if b]
        loaded = iter(build_dataloader(ds, real, num_workers=0)) if real else iter(())
        for want in share:  # the real batches come first, the padding slots last
            yield next(loaded) if want else Batch.empty()

    def batch_loss(self, module: Any, batch: Any) -> tuple[float, int]:
        """Teacher-forced (CE sum, labelled tokens) of one batch; an empty one runs the weight-0 dummy."""
        from speechlm.train.step import compute_micro_losses, count_targets

        was_training = module.model.training
        module.model.eval()
        try:
            with torch.no_grad():
                losses = compute_micro_losses(module.model, batch.to(module.device))
        finally:
            module.model.train(was_training)
        return float(losses.ce_sum.double().cpu()) * losses.weight, count_targets(batch, module.model)

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


def sum_over_tasks(by_task: dict[str, dict[str, int]]) -> dict[str, int]:
    """{task: {lang: n}} -> {lang: n}."""
    out: dict[str, int] = {}
    for per_lang in by_task.values():
        for lang, n in per_lang.items():
            out[lang] = out.get(lang, 0) + n
    return out


def with_totals(per_lang: dict[str, int]) -> dict[str, int]:
    """{lang: n} and "all": their sum (eval.json's utterance counts)."""
    return {**per_lang, "all": sum(per_lang.values())}


def count_record(counts: dict[str, Any]) -> dict[str, Any]:
    """The utterance counts of eval.json and `speechlm evaluate --json`: per language (and all), per task."""
    tasks = sorted(set(counts["scored_by_task"]) | set(counts["dropped_by_task"]))
    record: dict[str, Any] = {
        "utterances": with_totals(counts["scored"]),
        "dropped": with_totals(counts["dropped"]),
        "dropped_reasons": counts["dropped_reasons"],
        "tasks": {
            t: {
                "utterances": with_totals(counts["scored_by_task"].get(t, {})),
                "dropped": with_totals(counts["dropped_by_task"].get(t, {})),
            }
            for t in tasks
        },
    }
    if counts.get("empty_reference"):
        record["empty_reference"] = counts["empty_reference"]
    return record


def final_evaluation(
    cfg: ExperimentConfig, inputs: Any, module: Any, run_dir: Path, result: dict[str, Any], rank: int
) -> dict[str, Any]:
    """Greedy decoding and the metrics of each task per language on `trainer.final_eval_split` after
    training; rank 0 prints the table and writes eval.json, eval_decodes.jsonl and the learning curve.
    Returns the evaluator's metrics (with `both`: the val split's, and the training subset's prefixed
    `train_`).

    `both` scores the val split, then `train_eval_rows` of the training split, and prints both tables (val
    first) and one line per language with the two side by side; eval.json holds the val record at the top
    level and the training one under `train`, eval_decodes.jsonl gives each decode's `split`.

    The trained weights are already saved when this runs (the end-of-training checkpoint); a SIGTERM
    during it stops it on every rank at the same batch (`EvaluationInterrupted`), with no eval.json (with
    `both`, nothing is written before both splits are scored)."""
    from speechlm.config import final_eval_split
    from speechlm.train.preempt import SIGTERM_FLAG

    split = final_eval_split(cfg)  # "auto" resolved: val when there is a val manifest, else none
    tables = {"train": inputs.train_table, "val": inputs.val_table}
    table = tables["val" if split == "both" else split] if split != "none" else None
    if table is None:
        if rank == 0:
            why = " and no data.val_manifest" if cfg.trainer.final_eval_split == "auto" else ""
            print(f"no final evaluation (trainer.final_eval_split={cfg.trainer.final_eval_split}{why})")
        return {}
    first = "val" if split == "both" else split
    template = inputs.chat_template
    evaluators = [
        Evaluator(cfg, inputs.tokenizer, table, rank, max_batches=None, split=first, template=template)
    ]
    if split == "both":
        rows = train_eval_rows(cfg, inputs.train_table, table)
        evaluators.append(
            Evaluator(
                cfg,
                inputs.tokenizer,
                inputs.train_table,
                rank,
                max_batches=None,
                split="train",
                rows=rows,
                template=template,
            )
        )
    scores = [ev(module, stop=lambda: SIGTERM_FLAG.requested, progress=True) for ev in evaluators]
    if rank == 0:
        records: list[dict[str, Any]] = []
        decodes: list[tuple[str, str, str]] = []
        tasks: list[str] = []
        splits: list[str] = []
        for ev, sc in zip(evaluators, scores):
            counts = ev.last_counts
            what = "WER" if set(counts["scored_by_task"]) <= {DEFAULT_TASK} else "metrics per task"
            print(
                f"\nfinal greedy {what} on the {ev.split} split after {result['steps']} steps "
                f"({result['train_minutes']:.1f} min):"
            )
            print(format_eval_table(sc, counts))
            records.append({"split": ev.split, **result, **sc, **count_record(counts)})
            decodes += ev.last_decodes
            tasks += ev.last_tasks
            splits += [ev.split] * len(ev.last_decodes)
        if len(scores) == 2:
            print("\nheld-out (val) and training-split scores side by side:")
            print(format_side_by_side(scores[0], scores[1]))
        record = records[0] if len(records) == 1 else {**records[0], "train": records[1]}
        write_eval_outputs(run_dir, record, decodes, tasks, splits=splits)
        from speechlm.train.plots import plot_learning_curve

        png = plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
        print(f"wrote {run_dir / 'eval.json'}, {png}")
    return scores[0] if len(scores) == 1 else {**scores[0], **with_prefix(scores[1])}


def format_side_by_side(val: dict[str, Any], train: dict[str, Any]) -> str:
    """One line per language (then `all`) with the val and training-split score of each per-language metric:
    `hi  val 12.3%  train 4.1%` for WER; `hi  ast/bleu  val 20.1  train 35.2` for another task's metric."""
    lines = []
    for overall in (False, True):
        for key in val:
            name = split_metric_name(key)
            if name is None or key.startswith("asr/wer") or (name[2] is None) != overall:
                continue  # not a metric; asr/wer* repeat wer*; per-language lines first, then the overall
            task, metric, lang = name
            what = "" if task is None else f"  {task}/{metric}"
            cells = [
                f"{s} {_cell(metric, d.get(key), 0).strip()}" for s, d in (("val", val), ("train", train))
            ]
            lines.append(f"{lang or 'all':<8}{what}  " + "  ".join(cells))
    return "\n".join(lines)


def write_eval_outputs(
    run_dir: Path,
    record: dict[str, Any],
    decodes: list[tuple[str, str, str]],
    tasks: list[str] | None = None,
    *,
    splits: list[str] | None = None,
) -> None:
    """eval.json and eval_decodes.jsonl (with `splits`, each decode names its `split`); a path that cannot
    be written (full disk, a folder in the way, no permission) is an OutputError naming it (the weights are
    in the end-of-training checkpoint)."""
    from speechlm.errors import OutputError

    path = run_dir / "eval.json"
    try:
        path.write_text(json.dumps(record, indent=2))
        path = run_dir / "eval_decodes.jsonl"
        with path.open("w") as f:
            for i, (lang, ref, hyp) in enumerate(decodes):
                task = tasks[i] if tasks else DEFAULT_TASK
                row = {"task": task, "lang": lang, "ref": ref, "hyp": hyp}
                if splits:
                    row = {"split": splits[i], **row}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    except OSError as e:
        raise OutputError(
            f"cannot write {path} ({e.strerror or e}); the trained weights are in {run_dir / 'checkpoints'} "
            f"(latest): free space or fix the path, then evaluate with trainer.resume=auto "
            f"trainer.validate_only=true"
        ) from None
