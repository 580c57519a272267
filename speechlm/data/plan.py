"""`speechlm plan`: show one epoch's plan before training on it.

Builds the sampler training builds (`speechlm.data.sampler.build`: the same settings, token cost model,
dataset mix and, when ``data.read_mode`` streams, the streaming plan) and prints its epoch:

- micro-batches per dp rank and optimizer steps per epoch (micro-batches / grad_accum);
- audio hours per optimizer step, summed over all dp ranks;
- the language mix of the plan (utterances and hours) next to the natural and the target shares;
- per duration bucket: utterances, micro-batches, hours;
- the padding efficiency (real tokens / computed tokens) of a padded BSHD batch, which computes
  B * max_len per micro-batch, and of a packed THD batch, which computes the sum of the lengths
  plus the CP/TP rounding of `speechlm.packing.thd.round_lengths`. Token counts per utterance follow
  the sampler's token cost model (audio + prompt) plus its estimate of the text tokens,
  ceil(characters / CHARS_PER_TOKEN), when the manifest has a `text` column.

`--json FILE` writes the summary plus `ranks`: one list per dp rank of micro-batches, each a list
of manifest row indices, in consumption order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from parallel.clip_placement import short_clip_frames  # stdlib only
from parallel.cp_placement import place_sequences  # stdlib only
from parallel.frames import planned_encoder_frames  # stdlib only
from parallel.rounding import rounding_unit, sequence_multiple
from speechlm.data.plan_inputs import plan_inputs_of_input_cfg, plan_inputs_of_table, read_plan_columns
from speechlm.data.sampler import EpochPlan, SamplerSettings, assign_buckets, compute_language_targets
from speechlm.data.sampler.build import (
    CHARS_PER_TOKEN,
    SamplerInputs,
    make_sampler,
    sampler_settings,
    text_tokens_of,
)
from speechlm.progress import Progress


def plan_inputs(req: PlanRequest) -> tuple[SamplerInputs, Callable[[], np.ndarray] | None]:
    """The inputs `req` plans: its data.input_cfg, or its manifest (read as training reads it when the
    run streams: the streaming plan needs every row's tar and offset from the index). With the function
    that reads their text lengths when those are still to read (`read_plan_columns`)."""
    if req.input_cfg is not None:
        return plan_inputs_of_input_cfg(req.input_cfg, req.cfg), None
    if req.cfg is not None and req.cfg.data.read_mode == "streaming":
        from speechlm.data.sources.mmap_cache import open_index

        return plan_inputs_of_table(open_index(req.manifest), req.cfg), None
    return read_plan_columns(req.manifest)


def cp_padding(
    lengths: np.ndarray, batch_offsets: np.ndarray, cp: int, tp: int, threshold: int | str, pair_cost: float
) -> dict[str, Any]:
    """THD figures of every micro-batch under the CP placement of `parallel.cp_placement` (threshold 0:
    every sequence split, the `speechlm.packing.thd.round_lengths` rule): computed tokens with this
    threshold and with 0, the busiest rank's modelled cost over the mean (summed over micro-batches,
    so it is the step-time overhead of imbalance), and the tokens whose K/V travel on the ring.

    Only a threshold other than 0 at cp > 1 needs the placement itself, one micro-batch at a time
    (`place_sequences`, as training calls it). Everything else is closed-form and vectorised: at cp = 1
    every sequence stays whole on the one rank (only the micro-batch's total is padded to a multiple of
    tp), and splitting every sequence pads each to a multiple of 2*cp and the total to
    `rounding_unit(cp, tp)`, which balances the ranks exactly and puts every token on the ring."""
    split_all = packed_tokens(lengths, batch_offsets, cp, tp)
    if cp == 1 or threshold == 0:
        return {
            "computed": split_all,
            "computed_split_all": split_all,
            "max_over_mean": 1.0,
            "ring_tokens": split_all if cp > 1 else 0,
        }
    computed = ring = 0
    worst = mean = 0.0
    for lo, hi in zip(batch_offsets[:-1].tolist(), batch_offsets[1:].tolist()):
        if hi == lo:
            continue
        p = place_sequences(lengths[lo:hi].tolist(), cp, threshold=threshold, tp=tp, pair_cost=pair_cost)
        computed += p.computed_tokens()
        ring += p.ring_tokens()
        worst += max(p.loads)
        mean += sum(p.loads) / cp
    return {
        "computed": computed,
        "computed_split_all": split_all,
        "max_over_mean": worst / mean if mean else 1.0,
        "ring_tokens": ring,
    }


def packed_tokens(lengths: np.ndarray, batch_offsets: np.ndarray, cp: int, tp: int) -> int:
    """Tokens THD computes over all micro-batches when every sequence is rounded by
    `speechlm.packing.thd.round_lengths` (each to a multiple of `sequence_multiple(cp)`, each micro-batch's
    total to a multiple of `rounding_unit(cp, tp)`): at cp = 1, the real tokens plus the tp padding."""
    offsets = np.asarray(batch_offsets, np.int64)
    starts = offsets[:-1][offsets[1:] > offsets[:-1]]  # empty micro-batches compute nothing
    if not len(starts):
        return 0
    chunk, unit = sequence_multiple(cp), rounding_unit(cp, tp)
    ends = np.append(starts[1:], offsets[-1])  # a micro-batch runs to the next non-empty one's start
    step = max(1, CHUNK * len(starts) // max(1, int(offsets[-1])))  # micro-batches in ~CHUNK rows
    computed = 0
    for k0 in range(0, len(starts), step):  # reduceat's int64 copy of 10M int32 lengths would be 80 MB
        lo, hi = int(starts[k0]), int(ends[min(k0 + step, len(starts)) - 1])
        padded = lengths[lo:hi]
        if chunk > 1:
            padded = -(-padded // chunk) * chunk
        totals = np.add.reduceat(padded, starts[k0 : k0 + step] - lo, dtype=np.int64)
        computed += int((-(-totals // unit) * unit).sum())
    return computed


CHUNK = 1 << 20  # rows per piece where the summary needs wide temporaries


def count_by(codes: np.ndarray, n: int, weights: np.ndarray | None = None) -> np.ndarray:
    """`np.bincount(codes, weights, minlength=n)` a million rows at a time: bincount widens small codes
    to intp and weights to float64, which for 10M rows would be 160 MB of temporaries at the peak."""
    total = np.zeros(n, np.float64 if weights is not None else np.int64)
    for lo in range(0, len(codes), CHUNK):
        w = None if weights is None else weights[lo : lo + CHUNK]
        total += np.bincount(codes[lo : lo + CHUNK], w, minlength=n)
    return total


def batch_pieces(offsets: np.ndarray) -> list[tuple[int, int]]:
    """Ranges [b0, b1) of micro-batches (bounds `offsets`, as in `PlannedRows`) of about `CHUNK` rows
    each, so that per-row float64 temporaries stay small."""
    n_batches = len(offsets) - 1
    step = max(1, CHUNK // max(1, int(offsets[-1]) // max(1, n_batches)))
    return [(b0, min(n_batches, b0 + step)) for b0 in range(0, n_batches, step)]


def _used_rows(plan: EpochPlan, used: np.ndarray, lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The rows of the micro-batches `used` (back to back), gathered a million at a time."""
    rows = np.empty(int(offsets[-1]), plan.rows.dtype)
    starts = plan.batch_offsets[used]
    step = max(1, CHUNK // max(1, int(lengths.mean()) if len(lengths) else 1))
    for b0 in range(0, len(used), step):
        b1 = min(len(used), b0 + step)
        lo, hi = int(offsets[b0]), int(offsets[b1])
        take = np.repeat(starts[b0:b1] - offsets[b0:b1], lengths[b0:b1]) + np.arange(lo, hi)
        rows[lo:hi] = plan.rows[take]
    return rows


def summarize_plan(
    plan: EpochPlan,
    inputs: SamplerInputs,
    settings: SamplerSettings,
    *,
    cp_size: int = 1,
    tp_size: int = 1,
    cp_split_threshold: int | str = 0,
    pair_cost: float = 0.0,
    max_text_tokens: int | None = None,
    shard_min_slice: int | None = None,
) -> dict[str, Any]:
    """The figures `speechlm plan` prints, as a JSON-ready dict (without `ranks`); ``shard_min_slice``:
    `encoder_sharding_figures`'."""
    used = PlannedRows.of(plan, inputs)
    steps = plan.batches_per_rank // settings.grad_accum
    languages, datasets = mix_figures(used, inputs, settings.temperature)
    tokens = planned_tokens(used, inputs, settings, max_text_tokens)
    total_hours = float(used.durations.sum(dtype=np.float64)) / 3600
    return {
        "mode": plan.mode,
        "epoch": plan.epoch,
        "seed": plan.seed,
        "manifest_rows": plan.manifest_rows,
        "dp_size": plan.dp_size,
        "grad_accum": settings.grad_accum,
        "micro_batches_per_rank": plan.batches_per_rank,
        "optimizer_steps_per_epoch": steps,
        "planned_utterances": int(len(used.rows)),
        "planned_hours": total_hours,
        "dropped_utterances": int(len(plan.rows) - len(used.rows)),
        "max_duration": settings.max_duration,
        "too_long_utterances": plan.too_long,
        "over_budget": over_budget_figures(used, tokens, settings),
        "encoder_sharding": encoder_sharding_figures(
            used, settings.token_cost.encoder_subsampling, cp_size, shard_min_slice
        ),
        "audio_hours_per_step": total_hours / steps if steps else 0.0,
        "languages": languages,
        "tasks": task_figures(used, inputs),
        "datasets": datasets,
        "buckets": bucket_figures(used, inputs, settings.boundaries),
        "padding": {
            **padding_figures(
                tokens, used, cp_size, tp_size, cp_split_threshold, pair_cost, inputs.text_chars is not None
            ),
            "bshd_audio_efficiency": padded_audio_efficiency(used),
        },
    }


@dataclass(frozen=True)
class PlannedRows:
    """The rows of the micro-batches every dp rank gets, back to back, with their micro-batch bounds."""

    rows: np.ndarray  # [R] manifest rows
    lengths: np.ndarray  # [M] rows per micro-batch
    offsets: np.ndarray  # [M + 1] where each micro-batch starts in `rows`
    durations: np.ndarray  # float32 [R] (10M rows stay small; the sums run in float64)
    lang_codes: np.ndarray  # [R]

    @classmethod
    def of(cls, plan: EpochPlan, inputs: SamplerInputs) -> PlannedRows:
        used = plan.rank_batches.reshape(-1)
        lengths = plan.batch_offsets[used + 1] - plan.batch_offsets[used]
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        rows = _used_rows(plan, used, lengths, offsets)
        return cls(rows, lengths, offsets, inputs.durations[rows], inputs.lang_codes[rows])


def over_budget_figures(used: PlannedRows, tokens: np.ndarray, settings: SamplerSettings) -> dict[str, Any]:
    """The micro-batches of one utterance over the budget (long-form audio: such a row is packed alone, and
    the whole CP group trains on it): their count, hours and the longest one's seconds. `tokens` per planned
    row as `planned_tokens` counts them; a token budget compares them with the length penalty, as the
    sampler does."""
    first = used.offsets[:-1]
    if settings.max_batch_tokens is not None:
        t = tokens[first].astype(np.float64)
        over = (t + settings.length_penalty * t * t > settings.max_batch_tokens) & (used.lengths == 1)
    else:
        over = (used.durations[first] > np.float32(settings.max_batch_duration or 0.0)) & (used.lengths == 1)
    seconds = used.durations[first[over]].astype(np.float64)
    return {
        "micro_batches": int(over.sum()),
        "hours": float(seconds.sum()) / 3600,
        "longest_s": float(seconds.max()) if len(seconds) else 0.0,
    }


def encoder_sharding_figures(
    used: PlannedRows, subsampling: int, cp: int, min_slice: int | None = None
) -> dict[str, Any]:
    """The clips `parallel.clip_placement.place_clips` shards over the CP group, over all planned
    micro-batches (vectorised, a million rows at a time; one clip per row): their count and hours. Zero
    at cp = 1, where nothing is computed. ``min_slice``: the encoder's (`EncoderConfig.shard_min_slice`);
    None: it cannot shard a clip (full context), the count is then of the clips the rule would shard with
    limited context, and ``sharded_in_training`` is false."""
    min_frames = short_clip_frames(subsampling)
    clips, seconds = 0, 0.0
    for b0, b1 in batch_pieces(used.offsets) if cp > 1 else ():
        lo, hi = int(used.offsets[b0]), int(used.offsets[b1])
        durations = used.durations[lo:hi]
        frames = planned_encoder_frames(durations.astype(np.float64), subsampling, ceil=np.ceil)
        totals = np.add.reduceat(frames, used.offsets[b0:b1] - lo)  # whole numbers: exact in float64
        sharded = (frames > min_frames) & (frames * cp > np.repeat(totals, used.lengths[b0:b1]))
        sharded &= np.floor(frames / cp) >= (min_slice or 0)
        clips += int(sharded.sum())
        seconds += float(durations[sharded].sum(dtype=np.float64))
    return {
        "cp_size": cp,
        "min_frames": min_frames,
        "clips": clips,
        "hours": seconds / 3600,
        "sharded_in_training": min_slice is not None,
    }


def mix_figures(
    used: PlannedRows, inputs: SamplerInputs, temperature: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per language, per dataset of a mix): natural and target shares next to what the plan uses."""
    n_langs = len(inputs.lang_names)
    natural = count_by(inputs.lang_codes, n_langs)
    targets = compute_language_targets(natural, temperature)
    datasets = []
    if inputs.mix is not None:  # the targets are per (dataset, language) cell: add them up both ways
        from speechlm.data.sampler.mix import mix_groups

        _, _, cells = mix_groups(inputs.lang_codes, n_langs, inputs.mix, temperature)
        targets = cells.reshape(len(inputs.mix.names), n_langs).sum(axis=0)
        datasets = dataset_figures(used, inputs.mix)
    utt = count_by(used.lang_codes, n_langs)
    hours = count_by(used.lang_codes, n_langs, used.durations) / 3600
    languages = [
        {
            "lang": name,
            "natural_share": natural[i] / natural.sum(),
            "target_share": float(targets[i]),
            "planned_utterances": int(utt[i]),
            "planned_share": utt[i] / max(utt.sum(), 1),
            "planned_hours": float(hours[i]),
            "planned_hours_share": hours[i] / max(hours.sum(), 1e-12),
        }
        for i, name in enumerate(inputs.lang_names)
    ]
    return languages, datasets


def task_figures(used: PlannedRows, inputs: SamplerInputs) -> list[dict[str, Any]]:
    """Per task (the ``task`` column; every row "asr" without one): natural share and what the plan uses;
    with conversation columns also the planned samples' clips, clips with a CTC target and answer tokens
    (estimated as the sampler does: characters / CHARS_PER_TOKEN)."""
    names = inputs.task_names or ["asr"]
    if inputs.task_codes is None:  # every row "asr": nothing to count
        natural = np.array([len(inputs.durations)])
        planned = np.zeros(len(used.rows), np.int64)
        utt = np.array([len(used.rows)])
        hours = np.array([used.durations.sum(dtype=np.float64) / 3600])
    else:
        natural = count_by(inputs.task_codes, len(names))
        planned = inputs.task_codes[used.rows]
        utt = count_by(planned, len(names))
        hours = count_by(planned, len(names), used.durations) / 3600
    contents = inputs.contents
    per_task: dict[str, np.ndarray] = {}
    if contents is not None:
        for key in ("clips", "ctc_clips", "answer_chars"):
            per_task[key] = count_by(
                planned, len(names), getattr(contents, key)[used.rows].astype(np.float64)
            )
    return [
        {
            "task": name,
            "natural_share": natural[i] / max(natural.sum(), 1),
            "planned_share": utt[i] / max(utt.sum(), 1),
            "planned_utterances": int(utt[i]),
            "planned_hours_share": hours[i] / max(hours.sum(), 1e-12),
            "planned_hours": float(hours[i]),
            **(
                {
                    "planned_clips": int(per_task["clips"][i]),
                    "planned_clips_with_transcript": int(per_task["ctc_clips"][i]),
                    "planned_answer_tokens_est": math.ceil(per_task["answer_chars"][i] / CHARS_PER_TOKEN),
                }
                if per_task
                else {}
            ),
        }
        for i, name in enumerate(names)
    ]


def dataset_figures(used: PlannedRows, mix: Any) -> list[dict[str, Any]]:
    """Per dataset of a `data.input_cfg`: rows, natural and target shares, and what the plan uses."""
    n_sets = len(mix.names)
    set_codes = np.asarray(mix.dataset_codes)
    set_rows = count_by(set_codes, n_sets)
    planned = set_codes[used.rows]
    set_utt = count_by(planned, n_sets)
    set_hours = count_by(planned, n_sets, used.durations) / 3600
    return [
        {
            "dataset": name,
            "rows": int(set_rows[d]),
            "natural_share": set_rows[d] / max(set_rows.sum(), 1),
            "target_share": float(mix.shares[d]),
            "planned_utterances": int(set_utt[d]),
            "planned_share": set_utt[d] / max(set_utt.sum(), 1),
            "planned_hours": float(set_hours[d]),
        }
        for d, name in enumerate(mix.names)
    ]


def bucket_figures(
    used: PlannedRows, inputs: SamplerInputs, bucket_boundaries: tuple[float, ...]
) -> list[dict[str, Any]]:
    """Per duration bucket (of each micro-batch's first row): utterances, micro-batches, hours."""
    first_rows = used.rows[used.offsets[:-1]]
    batch_bucket = assign_buckets(inputs.durations[first_rows], bucket_boundaries)
    edges = [0.0, *bucket_boundaries, math.inf]
    n_buckets = len(edges) - 1
    b_utt = np.bincount(batch_bucket, used.lengths, minlength=n_buckets).astype(np.int64)
    b_batches = np.bincount(batch_bucket, minlength=n_buckets)
    batch_seconds = batch_sums(used.durations, used.offsets)
    b_hours = np.bincount(batch_bucket, batch_seconds, minlength=n_buckets) / 3600
    return [
        {
            "from_s": edges[b],
            "to_s": None if math.isinf(edges[b + 1]) else edges[b + 1],
            "utterances": int(b_utt[b]),
            "micro_batches": int(b_batches[b]),
            "hours": float(b_hours[b]),
        }
        for b in range(n_buckets)
    ]


def batch_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """float64 sum of `values` per micro-batch (offsets as in `PlannedRows`), a million rows at a time."""
    sums = np.zeros(len(offsets) - 1, np.float64)
    nonempty = np.flatnonzero(offsets[1:] > offsets[:-1])
    step = max(1, CHUNK // max(1, int(np.diff(offsets).mean()) if len(offsets) > 1 else 1))
    for b0 in range(0, len(nonempty), step):
        b = nonempty[b0 : b0 + step]
        lo, hi = int(offsets[b[0]]), int(offsets[b[-1] + 1])
        sums[b] = np.add.reduceat(values[lo:hi].astype(np.float64), offsets[b] - lo)
    return sums


def padded_audio_efficiency(used: PlannedRows) -> float:
    """Real audio over padded audio of the planned micro-batches: each padded (BSHD) micro-batch holds B
    clips of its longest clip's length, as the encoder's padded input does (Lhotse's measure)."""
    if not len(used.rows):
        return 1.0
    longest = np.maximum.reduceat(used.durations, used.offsets[:-1]).astype(np.float64)
    padded = float((longest * used.lengths).sum())
    return float(batch_sums(used.durations, used.offsets).sum()) / padded if padded > 0 else 1.0


def planned_tokens(
    used: PlannedRows, inputs: SamplerInputs, settings: SamplerSettings, max_text_tokens: int | None
) -> np.ndarray:
    """Tokens per planned row (int32) by the sampler's token cost model, text estimated as it does."""
    tokens = np.empty(len(used.rows), np.int32)
    for lo in range(0, len(used.rows), CHUNK):  # in pieces: the float64 temporaries stay small
        text = None
        if inputs.text_chars is not None:
            text = text_tokens_of(inputs.text_chars[used.rows[lo : lo + CHUNK]], max_text_tokens)
        tokens[lo : lo + CHUNK] = settings.token_cost.count_tokens(used.durations[lo : lo + CHUNK], text)
    return tokens


def padding_figures(
    tokens: np.ndarray,
    used: PlannedRows,
    cp_size: int,
    tp_size: int,
    cp_split_threshold: int | str,
    pair_cost: float,
    text_estimated: bool,
) -> dict[str, Any]:
    """Real over computed tokens of padded BSHD and packed THD micro-batches, and the CP placement's."""
    real = int(tokens.sum(dtype=np.int64))
    offsets = used.offsets
    longest = np.maximum.reduceat(tokens, offsets[:-1]) if len(tokens) else np.zeros(0, np.int64)
    bshd = int((used.lengths * longest.astype(np.int64)).sum())
    cp = cp_padding(tokens, offsets, cp_size, tp_size, cp_split_threshold, pair_cost)
    thd = cp["computed"]
    return {
        "real_tokens": real,
        "bshd_computed_tokens": bshd,
        "thd_computed_tokens": thd,
        "bshd_efficiency": real / max(bshd, 1),
        "thd_efficiency": real / max(thd, 1),
        "cp_size": cp_size,
        "tp_size": tp_size,
        "cp_split_threshold": cp_split_threshold,
        "thd_efficiency_split_all": real / max(cp["computed_split_all"], 1),
        "cp_max_over_mean": cp["max_over_mean"],
        "cp_ring_token_share": cp["ring_tokens"] / max(thd, 1),
        "text_tokens_estimated": text_estimated,
        "chars_per_token": CHARS_PER_TOKEN,
    }


def format_summary(s: dict[str, Any], manifest: str, budget: str) -> str:
    lines = [
        f"manifest {manifest}: {s['manifest_rows']:,} utterances; mode {s['mode']}, epoch {s['epoch']}, "
        f"seed {s['seed']}, budget {budget}",
        f"dp ranks {s['dp_size']}, grad_accum {s['grad_accum']}: {s['micro_batches_per_rank']:,} micro-batches per "
        f"rank, {s['optimizer_steps_per_epoch']:,} optimizer steps per epoch",
        f"planned {s['planned_utterances']:,} utterances, {s['planned_hours']:.2f} h "
        f"({s['dropped_utterances']:,} dropped by the lockstep trims); "
        f"{s['audio_hours_per_step']:.4f} h of audio per optimizer step (all dp ranks)",
        "",
        f"{'lang':<10}{'natural':>9}{'target':>9}{'planned':>9}{'utterances':>12}{'hours %':>9}{'hours':>10}",
    ]
    for r in s["languages"]:
        lines.append(
            f"{r['lang']:<10}{100 * r['natural_share']:>8.2f}%{100 * r['target_share']:>8.2f}%"
            f"{100 * r['planned_share']:>8.2f}%{r['planned_utterances']:>12,}"
            f"{100 * r['planned_hours_share']:>8.2f}%{r['planned_hours']:>10.2f}"
        )
    tasks = s.get("tasks") or []
    contents = bool(tasks) and "planned_clips" in tasks[0]
    if tasks and ([r["task"] for r in tasks] != ["asr"] or contents):  # a plain ASR plan prints as before
        more = f"{'clips':>10}{'w/ transcript':>15}{'answer tok~':>13}" if contents else ""
        lines += [
            "",
            f"{'task':<10}{'natural':>9}{'planned':>9}{'samples':>12}{'hours %':>9}{'hours':>10}{more}",
        ]
        for r in tasks:
            extra = (
                f"{r['planned_clips']:>10,}{r['planned_clips_with_transcript']:>15,}"
                f"{r['planned_answer_tokens_est']:>13,}"
                if contents
                else ""
            )
            lines.append(
                f"{r['task']:<10}{100 * r['natural_share']:>8.2f}%{100 * r['planned_share']:>8.2f}%"
                f"{r['planned_utterances']:>12,}{100 * r['planned_hours_share']:>8.2f}%{r['planned_hours']:>10.2f}"
                f"{extra}"
            )
        if contents:
            lines.append(
                "  (w/ transcript: clips with a CTC target; answer tok~: answer characters / CHARS_PER_TOKEN)"
            )
    if s.get("datasets"):
        lines += [
            "",
            f"{'dataset':<24}{'rows':>10}{'natural':>9}{'target':>9}{'planned':>9}{'utterances':>12}{'hours':>10}",
        ]
        for r in s["datasets"]:
            lines.append(
                f"{r['dataset'][-24:]:<24}{r['rows']:>10,}{100 * r['natural_share']:>8.2f}%{100 * r['target_share']:>8.2f}%"
                f"{100 * r['planned_share']:>8.2f}%{r['planned_utterances']:>12,}{r['planned_hours']:>10.2f}"
            )
    over, shard = s.get("over_budget") or {}, s.get("encoder_sharding") or {}
    long_form = [  # long-form audio (issue 25): each line only when its count is not 0
        over.get("micro_batches")
        and (
            f"long utterances: {over['micro_batches']:,} micro-batches hold one utterance over the budget "
            f"({over['hours']:.2f} h, the longest {over['longest_s']:g} s); each is a micro-batch of its own, "
            "given to the whole CP group"
        ),
        shard.get("clips")
        and (
            f"encoder sharding (cp {shard['cp_size']}): {shard['clips']:,} clip{'s' if shard['clips'] != 1 else ''} "
            f"({shard['hours']:.2f} h) longer than "
            f"{shard['min_frames']} encoder frames and than their micro-batch's encoder frames / cp: "
            + (
                "the encoder shards each over the CP group (a contiguous slice of its frames per rank)"
                if shard.get("sharded_in_training")
                else "the encoder has full context (model.encoder.att_context_size unset), so each is encoded "
                "whole on one rank; set model.encoder.att_context_size (e.g. [128,128]) to shard them over "
                "the CP group"
            )
        ),
        s.get("too_long_utterances")
        and (
            f"left out: {s['too_long_utterances']:,} utterances longer than data.max_duration="
            f"{s['max_duration']:g} s"
        ),
    ]
    lines += [line for line in long_form if line]
    lines += [""]
    if s.get("bucket_source"):
        lines.append(f"{len(s['buckets'])} duration buckets: {s['bucket_source']}")
    lines.append(f"{'bucket':<16}{'utterances':>12}{'micro-batches':>15}{'hours':>10}")
    for b in s["buckets"]:
        span = f"{b['from_s']:g}-{b['to_s']:g} s" if b["to_s"] is not None else f">= {b['from_s']:g} s"
        lines.append(f"{span:<16}{b['utterances']:>12,}{b['micro_batches']:>15,}{b['hours']:>10.2f}")
    p = s["padding"]
    text = (
        f"text ~ chars/{p['chars_per_token']:g}"
        if p["text_tokens_estimated"]
        else "no text column: audio+prompt"
    )
    lines += [
        "",
        f"padding efficiency (real / computed tokens; {text}; cp {p['cp_size']}, tp {p['tp_size']}):",
        f"  BSHD (B x max_len): {100 * p['bshd_efficiency']:.1f}%   THD (packed): {100 * p['thd_efficiency']:.1f}%",
        f"  padded audio (B x longest clip, real seconds / padded seconds): {100 * p['bshd_audio_efficiency']:.1f}%",
    ]
    if p["cp_size"] > 1:
        lines += [
            f"  CP placement (cp_split_threshold={p['cp_split_threshold']}): busiest rank / mean "
            f"{p['cp_max_over_mean']:.3f}; {100 * p['cp_ring_token_share']:.1f}% of the tokens on the ring; "
            f"splitting every utterance: THD {100 * p['thd_efficiency_split_all']:.1f}%",
        ]
    return "\n".join(lines)


@dataclass(frozen=True)
class PlanRequest:
    """What `speechlm plan` plans: the sampler settings, and the manifest, epoch and cp/tp around them."""

    settings: SamplerSettings
    manifest: Any
    epoch: int
    cp_size: int
    tp_size: int
    cp_split_threshold: int | str = 0  # tokens, or "auto"
    pair_cost: float = 0.0  # attention pair cost in token units: 1 / (6 * LLM hidden size)
    input_cfg: Any = None  # data.input_cfg entries (or a YAML file of them) instead of one manifest
    cfg: Any = None  # the speechlm.config.ExperimentConfig: data.read_mode, data.max_tokens, ...

    def as_json(self) -> dict[str, Any]:
        """The `settings` entry of the JSON plan: every value above, flat, lists for tuples."""
        values = {f.name: getattr(self.settings, f.name) for f in fields(self.settings)}
        values["bucket_boundaries"] = list(self.settings.boundaries)
        del values["token_cost"]  # its projector_stack comes last, as a flag of its own
        return {
            "manifest": self.manifest,
            **values,
            "epoch": self.epoch,
            "cp_size": self.cp_size,
            "tp_size": self.tp_size,
            "cp_split_threshold": self.cp_split_threshold,
            "projector_stack": self.settings.token_cost.projector_stack,
            "encoder_subsampling": self.settings.token_cost.encoder_subsampling,
        }


def resolve_request(args: argparse.Namespace) -> PlanRequest:
    """Defaults, then the config file (if any), then the flags."""
    from speechlm.config import load_config

    cfg = load_config(args.config)
    dp = cfg.parallel.dp_replicate * (cfg.parallel.dp_shard if cfg.parallel.dp_shard > 0 else 1)
    settings = sampler_settings(cfg, dp_size=dp)
    flags = {
        key: getattr(args, key)
        for key in ("dp_size", "grad_accum", "mode", "temperature", "seed", "epoch_size")
        if getattr(args, key) is not None
    }
    if args.max_duration is not None:
        flags["max_duration"] = args.max_duration
    if args.max_batch_tokens is not None:
        flags["max_batch_tokens"] = args.max_batch_tokens
    elif args.max_batch_duration is not None:
        flags["max_batch_duration"], flags["max_batch_tokens"] = args.max_batch_duration, None
    settings = replace(settings, **flags)
    cp = args.cp_size if args.cp_size is not None else cfg.parallel.cp_size
    threshold = (
        args.cp_split_threshold if args.cp_split_threshold is not None else cfg.parallel.cp_split_threshold
    )
    manifest = args.manifest if args.manifest is not None else cfg.data.train_manifest
    input_cfg = (
        args.input_cfg if args.input_cfg is not None else (None if args.manifest else cfg.data.input_cfg)
    )
    if manifest is None and input_cfg is None:  # no default data (the config's paths are optional)
        from speechlm.config import ConfigError

        raise ConfigError(
            "no training data to plan: pass --manifest PATH (or --input-cfg), or set data.train_manifest in "
            f"{args.config or 'the --config file'}"
        )
    return PlanRequest(
        settings=settings,
        manifest=manifest,
        epoch=args.epoch if args.epoch is not None else 0,
        cp_size=cp,
        tp_size=args.tp_size if args.tp_size is not None else cfg.parallel.tp_size,
        cp_split_threshold=threshold,
        pair_cost=1.0 / (6 * cfg.model.llm.hidden_size),
        input_cfg=input_cfg,
        cfg=cfg,
    )


def run_plan(args: argparse.Namespace) -> int:
    try:
        req = resolve_request(args)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"speechlm plan: {e}", file=sys.stderr)
        return 1
    # the phases, on a terminal only (speechlm.progress): reading 10M rows and planning take seconds
    bar = Progress(4 if args.json else 3, "plan", "phases", leave=False)
    with bar, bar.heartbeat():
        return plan_and_report(args, req, bar)


def plan_and_report(args: argparse.Namespace, req: PlanRequest, bar: Progress) -> int:
    """`speechlm plan` after its arguments are resolved: read, plan, summarize, print (and --json)."""
    bar.phase("reading the manifest")
    settings = req.settings
    try:
        inputs, read_text = plan_inputs(req)
        if read_text is not None and settings.max_batch_tokens is not None:  # the plan needs them
            inputs, read_text = replace(inputs, text_chars=read_text()), None
    except (OSError, ValueError) as e:
        bar.close()
        print(f"speechlm plan: {e}", file=sys.stderr)
        return 1
    bar.phase(f"planning {len(inputs.durations):,} utterances")
    # a budget of seconds plans without the text lengths: a second thread reads them meanwhile (decoding
    # the texts and building the plan both run mostly outside the GIL, in Arrow and numpy)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-texts") as pool:
        text_chars = pool.submit(read_text) if read_text is not None else None
        try:  # the sampler training builds (rank 0's; the plan covers every dp rank)
            sampler = make_sampler(
                settings, inputs, dp_rank=0, epoch=req.epoch, max_text_tokens=req.cfg.data.max_tokens
            )
            plan = sampler.plan
            if text_chars is not None:
                inputs = replace(inputs, text_chars=text_chars.result())
        except (OSError, ValueError) as e:
            bar.close()
            print(f"speechlm plan: {e}", file=sys.stderr)
            return 1
    estimated = settings.bucket_boundaries is None  # sampler.bucket_boundaries=null: the sampler's estimate
    settings = replace(settings, bucket_boundaries=sampler.settings.bucket_boundaries)
    req = replace(req, settings=settings)
    bar.phase("summarizing")
    summary = summarize_plan(
        plan,
        inputs,
        settings,
        cp_size=req.cp_size,
        tp_size=req.tp_size,
        cp_split_threshold=req.cp_split_threshold,
        pair_cost=req.pair_cost,
        max_text_tokens=req.cfg.data.max_tokens,
        shard_min_slice=req.cfg.model.encoder.shard_min_slice(req.cfg.model.projector_stack),
    )
    summary["bucket_source"] = (
        f"estimated from the data (sampler.num_buckets={settings.num_buckets}, equal total duration each)"
        if estimated
        else "sampler.bucket_boundaries"
    )
    budget = (
        f"{settings.max_batch_tokens} tokens (length penalty {settings.length_penalty:g})"
        if settings.max_batch_tokens is not None
        else f"{settings.max_batch_duration:g} s"
    )
    source = "data.input_cfg" if req.input_cfg is not None else str(req.manifest)
    if args.json:
        bar.phase(f"writing {args.json}")
        summary["manifest"] = source
        summary["settings"] = req.as_json()
        summary["ranks"] = [
            [b.tolist() for b in _split_batches(*plan.rank_rows(r))] for r in range(plan.dp_size)
        ]
    bar.close()  # the display's line is erased before the report
    print(format_summary(summary, source, budget))
    warning = trim_warning(plan, settings.grad_accum)
    summary["warnings"] = [warning] if warning else []
    if warning:
        print(f"\n{warning}", file=sys.stderr)
    if args.json:
        try:
            write_whole(Path(args.json), summary)
        except OSError as e:
            print(f"speechlm plan: cannot write {args.json}: {e}", file=sys.stderr)
            return 1
        print(f"\nwrote {args.json}")
    return 0


def write_whole(path: Path, data: Any) -> None:
    """Write `data` as JSON to a temporary file beside `path`, then move it over `path`: a plan stopped
    mid-write (SIGTERM, SIGKILL, a full disk) leaves the previous file, or none, never half a plan."""
    import os

    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


TRIM_WARN_SHARE = 0.05  # `plan` warns when the lockstep trims drop more than this share of the epoch


def trim_warning(plan: EpochPlan, grad_accum: int, fixes: str = "plan") -> str | None:
    """A warning naming the count and the fixes when the lockstep trims drop more than `TRIM_WARN_SHARE`
    of the utterances the epoch drew (every dp rank gets the same number of micro-batches, a multiple of
    grad_accum: the rest of the packed micro-batches is left out); None below it. `fixes`: "plan" names
    `speechlm plan`'s flags, "train" the config keys."""
    drawn = len(plan.rows)
    used = plan.rank_batches.reshape(-1)
    kept = int((plan.batch_offsets[used + 1] - plan.batch_offsets[used]).sum())
    dropped = drawn - kept
    if not drawn or dropped / drawn <= TRIM_WARN_SHARE:
        return None
    packed, dp, per_rank = len(plan.batch_offsets) - 1, plan.dp_size, plan.batches_per_rank
    names = (
        ("--dp-size", "--grad-accum", "--max-batch-duration / --max-batch-tokens")
        if fixes == "plan"
        else (
            "parallel.dp_shard x dp_replicate",
            "trainer.grad_accum",
            "sampler.max_batch_duration / max_batch_tokens",
        )
    )
    return (
        f"WARNING: the lockstep trims drop {dropped:,} of the epoch's {drawn:,} utterances "
        f"({100 * dropped / drawn:.0f}%, more than {100 * TRIM_WARN_SHARE:g}%): the epoch packs "
        f"{packed:,} micro-batches, and each of the {dp} dp ranks gets the same number, a "
        f"multiple of grad_accum={grad_accum} ({per_rank:,} each), so {packed - dp * per_rank:,} are "
        f"left out every epoch. To train on them: use fewer dp ranks ({names[0]}) or a smaller grad_accum "
        f"({names[1]}), or a smaller micro-batch budget ({names[2]}: more, smaller micro-batches), or "
        "more data."
    )


def _threshold(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: use auto, 0 or a number of tokens")
    return value


def _split_batches(rows: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return np.split(rows, offsets[1:-1])


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print an epoch plan: batches, steps, language mix, padding",
        description=__doc__.split("\n")[0],
    )
    p.add_argument(
        "--config", help="experiment YAML; its data/sampler/trainer/parallel fields are the defaults"
    )
    p.add_argument(
        "--manifest",
        help="training data of any kind: manifest, shard folder, ... (default: data.train_manifest)",
    )
    p.add_argument(
        "--input-cfg", metavar="FILE.yaml", help="a data.input_cfg list of weighted datasets instead"
    )
    p.add_argument(
        "--dp-size", type=int, help="data-parallel ranks (default: parallel.dp_replicate * dp_shard)"
    )
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--max-batch-duration", type=float, metavar="S", help="seconds of audio per micro-batch"
    )
    budget.add_argument("--max-batch-tokens", type=int, metavar="N", help="tokens per micro-batch instead")
    p.add_argument(
        "--max-duration",
        type=float,
        metavar="S",
        help="leave rows longer than S seconds out of the plan (default data.max_duration: no limit)",
    )
    p.add_argument("--mode", choices=("temperature", "exhaustive"))
    p.add_argument("--temperature", type=float, help="language temperature T (<= 0: uniform)")
    p.add_argument("--epoch-size", type=int, help="utterances per epoch in temperature mode")
    p.add_argument("--seed", type=int)
    p.add_argument("--epoch", type=int)
    p.add_argument("--cp-size", type=int, help="context-parallel degree for the THD rounding")
    p.add_argument("--tp-size", type=int, help="tensor-parallel degree for the THD rounding")
    p.add_argument(
        "--cp-split-threshold",
        type=_threshold,
        metavar="auto|N",
        help="dynamic CP: split utterances longer than N tokens (0: all; default parallel.cp_split_threshold)",
    )
    p.add_argument("--json", metavar="FILE", help="write the summary and every rank's micro-batches")
    p.set_defaults(func=run_plan)
