"""Validation: greedy decoding and word error rate per language, sharded over data-parallel ranks.

Sharding. The split's evaluation batches (every row once, sorted by duration: `build_eval_batches`)
are dealt round-robin to the dp ranks and padded with empty slots so that every rank holds the same
number (`shard_eval_batches`). CP and TP peers of one dp group get the same share and decode it
together. Every rank then runs the same sequence of forwards: one greedy decode per slot (an empty
slot, or a batch whose clips all failed to decode, decodes a dummy clip and discards it), and the
greedy loops step in lockstep through an all-reduced "anyone still decoding?" flag
(`speechlm.model.generation`). Under FSDP each forward all-gathers weights over the mesh, so
without this a rank that finished early would leave its peers waiting forever.

WER from counts. Each utterance contributes (errors = S + D + I, reference words) computed by
jiwer (an empty hypothesis is scored as the one word ``<empty>``; utterances with an empty
reference are skipped). The per-utterance rows are gathered to every rank, ordered as in the
single-rank run, and summed per language: WER = sum errors / sum words. Sums of integers do not
depend on the sharding, so the result equals the single-rank result exactly.

The teacher-forced validation loss is sharded the same way: CE sums and labelled-token counts are
summed over the CP shards of each sequence and over the dp groups.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jiwer
import torch


def strip_lang_tag(text: str) -> str:
    text = text.strip()
    if text.startswith("<|") and "|>" in text:
        text = text[text.index("|>") + 2 :]
    return " ".join(text.split())


def word_error_counts(ref: str, hyp: str) -> tuple[int, int]:
    """(errors S + D + I, reference words) of one utterance; (0, 0) for an empty reference."""
    if not ref.strip():
        return 0, 0
    out = jiwer.process_words(ref, hyp if hyp.strip() else "<empty>")
    errors = out.substitutions + out.deletions + out.insertions
    return int(errors), int(out.hits + out.substitutions + out.deletions)


def wer_from_counts(rows: Iterable[tuple[str, int, int]]) -> dict[str, float]:
    """Corpus WER overall (`wer`) and per language (`wer_<lang>`) from (lang, errors, words) rows."""
    errors: dict[str, int] = defaultdict(int)
    words: dict[str, int] = defaultdict(int)
    for lang, e, n in rows:
        errors[lang] += e
        words[lang] += n
    if not words:
        return {}
    out = {"wer": sum(errors.values()) / max(sum(words.values()), 1) if sum(words.values()) else 0.0}
    for lang in sorted(words):
        out[f"wer_{lang}"] = errors[lang] / words[lang] if words[lang] else 0.0
    return out


def wer_by_language(refs: list[str], hyps: list[str], langs: list[str]) -> dict[str, float]:
    """Corpus WER overall (`wer`) and per language (`wer_<lang>`), in [0, inf)."""
    return wer_from_counts((lang, *word_error_counts(r, h)) for r, h, lang in zip(refs, hyps, langs))


def shard_eval_batches(batches: list[list[int]], dp_rank: int, dp_size: int) -> list[list[int]]:
    """Rank ``dp_rank``'s share, round-robin, padded with empty slots to ``ceil(len / dp_size)``."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
    share = batches[dp_rank::dp_size]
    n_slots = -(-len(batches) // dp_size)
    return share + [[] for _ in range(n_slots - len(share))]


@dataclass
class EvalComm:
    """The collectives validation needs; the defaults are a single process."""

    dp_rank: int = 0
    dp_size: int = 1
    primary: bool = True  # this rank reports its dp group's decodes (cp_rank == tp_rank == 0)
    keep_going: Callable[[bool], bool] | None = None  # all ranks: is any rank still decoding?
    gather: Callable[[Any], list[Any]] = field(default=lambda x: [x])  # all ranks' objects, rank order
    sum_over_cp: Callable[..., tuple[torch.Tensor, ...]] = field(default=lambda *xs: xs)

    @staticmethod
    def from_dims(dims: Any, rank: int, device: torch.device, sum_over_cp: Any = None) -> EvalComm:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return EvalComm()

        def keep_going(local_active: bool) -> bool:
            flag = torch.tensor([1 if local_active else 0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        return EvalComm(
            dp_rank=dims.dp_rank(rank),
            dp_size=dims.dp,
            primary=dims.cp_rank(rank) == 0 and dims.tp_rank(rank) == 0,
            keep_going=keep_going,
            gather=gather,
            sum_over_cp=sum_over_cp or (lambda *xs: xs),
        )


DUMMY_SAMPLES = 1600  # 0.1 s of silence: what an empty slot decodes to stay in lockstep


@torch.no_grad()
def decode_shard(
    model: Any,
    batches: Iterable[Any],
    tokenizer: Any,
    *,
    device: torch.device,
    comm: EvalComm,
    max_new_tokens: int = 96,
    use_cache: bool = True,
) -> list[dict[str, Any]]:
    """Greedy-decode this rank's batches (lockstep); one row per utterance: row, lang, ref, hyp, counts."""
    rows: list[dict[str, Any]] = []
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            if len(batch) == 0:  # padding slot or every clip dropped: decode a dummy, keep nothing
                audio = torch.zeros(1, DUMMY_SAMPLES, device=device)
                model.generate_greedy(
                    audio,
                    torch.tensor([DUMMY_SAMPLES], device=device),
                    max_new_tokens=max_new_tokens,
                    use_cache=use_cache,
                    keep_going=comm.keep_going,
                )
                continue
            batch = batch.to(device)
            out_ids = model.generate_greedy(
                batch.audio,
                batch.audio_lens,
                max_new_tokens=max_new_tokens,
                use_cache=use_cache,
                keep_going=comm.keep_going,
            )
            for b in range(len(batch)):
                n = int(batch.token_lens[b])
                ref = strip_lang_tag(tokenizer.decode(batch.tokens[b, :n].tolist()))
                hyp = strip_lang_tag(tokenizer.decode(list(out_ids[b])))
                errors, words = word_error_counts(ref, hyp)
                rows.append(
                    dict(
                        row=int(batch.indices[b]),
                        lang=batch.langs[b],
                        ref=ref,
                        hyp=hyp,
                        errors=errors,
                        words=words,
                    )
                )
    finally:
        model.train(was_training)
    return rows


def gather_decodes(rows: list[dict[str, Any]], comm: EvalComm, order: dict[int, int]) -> list[dict[str, Any]]:
    """Every dp group's rows on every rank (one copy per group), in the single-rank order ``order``."""
    parts = comm.gather((comm.primary, rows))
    merged = [r for primary, part in parts if primary for r in part]
    return sorted(merged, key=lambda r: order[r["row"]])


def decode_batches(
    model: Any,
    batches: Iterable[Any],
    tokenizer: Any,
    *,
    device: torch.device,
    max_new_tokens: int = 96,
    max_batches: int | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """Single-process greedy decoding of every batch: (references, hypotheses, languages)."""
    chosen = (b for i, b in enumerate(batches) if max_batches is None or i < max_batches)
    rows = decode_shard(
        model, chosen, tokenizer, device=device, comm=EvalComm(), max_new_tokens=max_new_tokens
    )
    return [r["ref"] for r in rows], [r["hyp"] for r in rows], [r["lang"] for r in rows]


def format_wer_table(metrics: dict[str, float], counts: dict[str, int] | None = None) -> str:
    rows = [(k[4:], v) for k, v in metrics.items() if k.startswith("wer_")]
    lines = ["language  utterances  WER", "--------  ----------  ------"]
    for lang, v in rows:
        n = "" if counts is None else str(counts.get(lang, ""))
        lines.append(f"{lang:<8}  {n:>10}  {100 * v:5.1f}%")
    if "wer" in metrics:
        total = "" if counts is None else str(sum(counts.values()))
        lines.append(f"{'all':<8}  {total:>10}  {100 * metrics['wer']:5.1f}%")
    return "\n".join(lines)


class Evaluator:
    """Greedy WER per language over a manifest, each data-parallel rank decoding its share (module doc).

    ``last_decodes`` holds (lang, ref, hyp) of every utterance of the split, on every rank, in the
    order of a single-rank run.
    """

    def __init__(
        self, cfg: Any, tokenizer: Any, table: Any, dims: Any, rank: int, max_batches: Any = "config"
    ):
        self.cfg, self.tokenizer, self.table, self.dims, self.rank = cfg, tokenizer, table, dims, rank
        self.max_batches = cfg.trainer.val_max_batches if max_batches == "config" else max_batches
        self.last_decodes: list[tuple[str, str, str]] = []

    def __call__(self, module: Any) -> dict[str, float]:
        from speechlm.config import eval_batch_duration
        from speechlm.data.dataset import Batch, SpeechDataset, build_dataloader
        from speechlm.train.data import build_eval_batches

        ds = SpeechDataset(
            self.table,
            self.tokenizer,
            max_tokens=self.cfg.data.max_tokens,
            sample_rate=self.cfg.data.sample_rate,
            duration_tolerance=self.cfg.data.duration_tolerance,
        )
        batches = build_eval_batches(self.table, max_batch_duration=eval_batch_duration(self.cfg))
        if self.max_batches:
            batches = batches[: self.max_batches]
        order = {row: i for i, row in enumerate(r for b in batches for r in b)}
        comm = EvalComm.from_dims(self.dims, self.rank, module.device, module.step_ctx.sum_over_cp)
        share = shard_eval_batches(batches, comm.dp_rank, comm.dp_size)
        real = [b for b in share if b]
        loaded = list(build_dataloader(ds, real, num_workers=0)) if real else []
        slots = loaded + [Batch.empty() for _ in range(len(share) - len(real))]  # padding slots come last
        rows = decode_shard(module.model, slots, self.tokenizer, device=module.device, comm=comm)
        merged = gather_decodes(rows, comm, order)
        self.last_decodes = [(r["lang"], r["ref"], r["hyp"]) for r in merged]
        wer = wer_from_counts((r["lang"], r["errors"], r["words"]) for r in merged)
        return {"loss": self.teacher_forced_loss(module, slots, comm), **wer}

    def teacher_forced_loss(self, module: Any, slots: list[Any], comm: EvalComm) -> float:
        """Token cross-entropy per labelled token over the split, sharded like the decoding."""
        from speechlm.train.step import compute_micro_losses, count_targets

        was_training = module.model.training
        module.model.eval()
        ce = torch.zeros((), dtype=torch.float64)
        n = 0
        try:
            with torch.no_grad():
                for batch in slots:  # an empty slot runs the weight-0 dummy (same forwards on every rank)
                    losses = compute_micro_losses(module.model, batch.to(module.device))
                    ce += losses.ce_sum.double().cpu() * losses.weight
                    n += count_targets(batch, module.model)
        finally:
            module.model.train(was_training)
        (ce,) = comm.sum_over_cp(ce)  # CP ranks each hold a shard of every sequence
        totals = comm.gather((comm.primary, float(ce), n))
        ce_total = sum(c for primary, c, _ in totals if primary)
        n_total = sum(k for primary, _, k in totals if primary)
        return ce_total / max(n_total, 1)


def final_evaluation(
    cfg: Any, inputs: Any, module: Any, run_dir: Path, result: dict[str, Any], rank: int
) -> dict[str, Any]:
    """Greedy WER per language on `trainer.final_eval_split` after training; rank 0 prints the table
    and writes eval.json, eval_decodes.jsonl and the learning curve. Returns the WER metrics."""
    from speechlm.config import final_eval_split

    split = final_eval_split(cfg)  # "auto" resolved: val when there is a val manifest, else none
    table = {"train": inputs.train_table, "val": inputs.val_table}.get(split)
    if table is None:
        if rank == 0:
            why = " and no data.val_manifest" if cfg.trainer.final_eval_split == "auto" else ""
            print(f"no final evaluation (trainer.final_eval_split={cfg.trainer.final_eval_split}{why})")
        return {}
    final_eval = Evaluator(cfg, inputs.tokenizer, table, inputs.dims, rank, max_batches=None)
    wer = final_eval(module)
    if rank == 0:
        counts: dict[str, int] = {}
        for lang in table.column("lang").to_pylist():
            counts[lang] = counts.get(lang, 0) + 1
        print(
            f"\nfinal greedy WER on the {split} split after {result['steps']} steps "
            f"({result['train_minutes']:.1f} min):"
        )
        print(format_wer_table(wer, counts))
        (run_dir / "eval.json").write_text(json.dumps({"split": split, **result, **wer}, indent=2))
        with (run_dir / "eval_decodes.jsonl").open("w") as f:
            for lang, ref, hyp in final_eval.last_decodes:
                f.write(json.dumps({"lang": lang, "ref": ref, "hyp": hyp}, ensure_ascii=False) + "\n")
        from speechlm.train.plots import plot_learning_curve

        png = plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png")
        print(f"wrote {run_dir / 'eval.json'}, {png}")
    return wer
