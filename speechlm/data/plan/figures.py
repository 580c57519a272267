"""The figures of `speechlm plan` (`speechlm.data.plan`): what one epoch's plan holds, per dp rank, language,
task, dataset and duration bucket, and its padding under BSHD and THD (with the CP placement), as a
JSON-ready dict. Everything here is vectorised over the planned rows, a million at a time (`CHUNK`), so a
10M-row plan stays in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from parallel.clip_placement import short_clip_frames  # stdlib only
from parallel.cp_placement import place_hybrid, place_sequences  # stdlib only
from parallel.frames import planned_encoder_frames  # stdlib only
from parallel.rounding import rounding_unit, sequence_multiple
from speechlm.data.sampler import EpochPlan, SamplerSettings, assign_buckets, compute_language_targets
from speechlm.data.sampler.cost import CHARS_PER_TOKEN, text_tokens_of
from speechlm.data.sampler.mix import mix_groups

if TYPE_CHECKING:  # pyarrow, at run time imported only once a plan runs
    from speechlm.data.sampler.build import SamplerInputs


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
    figures = {"computed": 0, "ring_tokens": 0, "worst": 0.0, "mean": 0.0}
    for lo, hi in zip(batch_offsets[:-1].tolist(), batch_offsets[1:].tolist()):
        if hi == lo:
            continue
        p = place_sequences(lengths[lo:hi].tolist(), cp, threshold=threshold, tp=tp, pair_cost=pair_cost)
        _add_placement(figures, p.computed_tokens(), p.ring_tokens(), p.loads)
    return {
        "computed": figures["computed"],
        "computed_split_all": split_all,
        "max_over_mean": figures["worst"] / figures["mean"] if figures["mean"] else 1.0,
        "ring_tokens": figures["ring_tokens"],
    }


def _add_placement(figures: dict[str, Any], computed: int, ring: int, loads: tuple[float, ...]) -> None:
    figures["computed"] += computed
    figures["ring_tokens"] += ring
    figures["worst"] += max(loads)
    figures["mean"] += sum(loads) / len(loads)


def cp_layouts(
    lengths: np.ndarray,
    batch_offsets: np.ndarray,
    cp: int,
    tp: int,
    pair_cost: float,
    known: dict[int | str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """The three CP placements of every micro-batch side by side (cp > 1), each as real/computed tokens
    (``efficiency``), the busiest rank's modelled cost over the mean summed over micro-batches
    (``max_over_mean``) and the share of computed tokens whose K/V travel between ranks
    (``ring_token_share``): ``whole_or_all`` (`parallel.cp_placement.place_sequences` with "auto": each
    sequence whole on one rank or split over all cp), ``split_all`` (every sequence over all cp) and
    ``hybrid`` (`place_hybrid`: whole, or split over an aligned sub-group of the degree it needs).
    ``known``: `cp_padding`'s figures already computed, by threshold (the plan's own), not computed again.
    Hybrid placement is pure Python, about 1-5 ms a micro-batch at cp = 8: past `HYBRID_MICRO_BATCHES` it
    places an evenly strided sample of them (``micro_batches`` of ``of_micro_batches``)."""
    real = int(lengths.sum(dtype=np.int64))
    out: dict[str, dict[str, Any]] = {}
    for name, threshold in (("whole_or_all", "auto"), ("split_all", 0)):
        figures = (known or {}).get(threshold) or cp_padding(
            lengths, batch_offsets, cp, tp, threshold, pair_cost
        )
        out[name] = {
            "efficiency": real / max(figures["computed"], 1),
            "max_over_mean": figures["max_over_mean"],
            "ring_token_share": figures["ring_tokens"] / max(figures["computed"], 1),
        }
    bounds = [(lo, hi) for lo, hi in zip(batch_offsets[:-1].tolist(), batch_offsets[1:].tolist()) if hi > lo]
    step = -(-len(bounds) // HYBRID_MICRO_BATCHES)  # a 10M-row epoch: every step-th micro-batch
    hybrid = {"computed": 0, "ring_tokens": 0, "worst": 0.0, "mean": 0.0}
    placed_real = 0
    for lo, hi in bounds[::step]:
        p = place_hybrid(lengths[lo:hi].tolist(), cp, tp=tp, pair_cost=pair_cost)
        _add_placement(hybrid, p.computed_tokens(), p.ring_tokens(), p.loads)
        placed_real += p.real_tokens()
    out["hybrid"] = {
        "efficiency": placed_real / max(hybrid["computed"], 1),
        "max_over_mean": hybrid["worst"] / hybrid["mean"] if hybrid["mean"] else 1.0,
        "ring_token_share": hybrid["ring_tokens"] / max(hybrid["computed"], 1),
        "micro_batches": len(bounds[::step]),
        "of_micro_batches": len(bounds),
    }
    return out


HYBRID_MICRO_BATCHES = 10_000  # `cp_layouts` places at most this many micro-batches with hybrid degrees


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
    padding = padding_figures(
        tokens, used, cp_size, tp_size, cp_split_threshold, pair_cost, inputs.text_chars is not None
    )
    layouts = padding.pop("cp_layouts")
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
        "padding": {**padding, "bshd_audio_efficiency": padded_audio_efficiency(used)},
        "cp_layouts": layouts,  # cp > 1: the three CP placements side by side (`cp_layouts`)
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
    """Real over computed tokens of padded BSHD and packed THD micro-batches, and the CP placement's; with
    ``cp_layouts`` (`summarize_plan` moves it to the top level of the summary)."""
    real = int(tokens.sum(dtype=np.int64))
    offsets = used.offsets
    longest = np.maximum.reduceat(tokens, offsets[:-1]) if len(tokens) else np.zeros(0, np.int64)
    bshd = int((used.lengths * longest.astype(np.int64)).sum())
    cp = cp_padding(tokens, offsets, cp_size, tp_size, cp_split_threshold, pair_cost)
    thd = cp["computed"]
    layouts = (
        cp_layouts(tokens, offsets, cp_size, tp_size, pair_cost, {cp_split_threshold: cp})
        if cp_size > 1
        else {}
    )
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
        "cp_layouts": layouts,
        "text_tokens_estimated": text_estimated,
        "chars_per_token": CHARS_PER_TOKEN,
    }
