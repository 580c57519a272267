"""The report of `speechlm plan` (`speechlm.data.plan`): the summary `figures` computed, as the text
it prints, and the warning it (and training) prints when the lockstep trims drop much of an epoch.
"""

from __future__ import annotations

from typing import Any

from speechlm.data.sampler import EpochPlan


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
    if s.get("cp_layouts"):
        lines += [
            f"  CP placements side by side (cp {p['cp_size']}, tp {p['tp_size']}):",
            f"    {'placement':<34}{'real/computed':>14}{'max/mean':>10}{'K/V travels':>13}",
        ]
        names = {
            "whole_or_all": "whole, or split over all cp ranks",
            "split_all": "every utterance over all cp ranks",
            "hybrid": "hybrid degrees (2, 4, ..., cp)",
        }
        for key, name in names.items():
            f = s["cp_layouts"][key]
            sample = (
                f"  ({f['micro_batches']:,} of {f['of_micro_batches']:,} micro-batches)"
                if f.get("micro_batches", 0) < f.get("of_micro_batches", 0)
                else ""
            )
            lines.append(
                f"    {name:<34}{100 * f['efficiency']:>13.1f}%{f['max_over_mean']:>10.3f}"
                f"{100 * f['ring_token_share']:>12.1f}%{sample}"
            )
    return "\n".join(lines)


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
