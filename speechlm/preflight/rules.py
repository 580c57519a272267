"""The validator's training rules and the full rule table that `speechlm validate` and fit start run.

`parallel.validator` owns the parallelism rules (`PARALLEL_RULES`) and knows nothing of speechlm; the
rules here check the rest of a run that can be judged before launch: the sampler's micro-batch budget
(against the CP/TP rounding and the manifest's longest utterance), the encoder's padding-free path, and
gradient accumulation against the utterances per data-parallel rank, and what trains (LoRA with TP,
a frozen encoder with an unfreeze step). `RULES` is the parallel table followed by these rows, in that
order (findings and docs/validator.md list the rules in table order).
No torch import.
"""

from __future__ import annotations

import functools
import math

from parallel.clip_placement import SHORT_CLIP_SECONDS
from parallel.frames import PADDING_FREE_KINDS
from parallel.validator import ERROR, PARALLEL_RULES, WARNING, Rule, ValidationContext
from parallel.validator import validate as _validate_with_rules

# encoder kinds with a padding-free (packed) path; the others compute their padding frames
PACKED_ENCODER_KINDS: frozenset[str] = PADDING_FREE_KINDS


def _budget_problems(ctx: ValidationContext) -> list[str]:
    tokens, seconds = ctx.max_batch_tokens, ctx.max_batch_duration
    if tokens is not None:
        if tokens < ctx.rounding_unit:
            return [
                f"sampler.max_batch_tokens={tokens} is below one rounded sequence "
                f"({ctx.rounding_unit} tokens for cp={ctx.cp}, tp={ctx.tp}), so no utterance fits"
            ]
        return []
    if seconds is None:
        return ["neither sampler.max_batch_duration nor sampler.max_batch_tokens is set"]
    return []


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _longest_over_budget(ctx: ValidationContext) -> list[str]:
    man = ctx.manifest or {}
    out = []
    if ctx.max_batch_tokens is not None and ctx.max_batch_tokens > 0 and man.get("max_tokens") is not None:
        unit = math.lcm(ctx.rounding_unit, ctx.pad_to_multiple or 1)
        longest = _round_up(int(man["max_tokens"]), unit)
        if longest > ctx.max_batch_tokens:
            out.append(
                f"the longest utterance has {int(man['max_tokens'])} tokens, {longest} after rounding to a "
                f"multiple of {unit}, above sampler.max_batch_tokens={ctx.max_batch_tokens}"
            )
    elif ctx.max_batch_tokens is None and ctx.max_batch_duration and man.get("max_duration") is not None:
        if float(man["max_duration"]) > ctx.max_batch_duration:
            out.append(
                f"the longest utterance lasts {float(man['max_duration']):g} s, above "
                f"sampler.max_batch_duration={ctx.max_batch_duration:g} s"
            )
    return out


FULL_CONTEXT_WARN_SECONDS = 300.0  # full self-attention over a clip longer than this draws a memory warning


def _whisper_over_window(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    if ctx.encoder_kind != "whisper" or man.get("max_duration") is None:
        return ""
    longest = float(man["max_duration"])
    return f"the longest training clip lasts {longest:g} s" if longest > SHORT_CLIP_SECONDS else ""


def _full_context_long_clip(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    frames, longest = man.get("max_encoder_frames"), man.get("max_duration")
    if ctx.encoder_kind != "parakeet" or ctx.encoder_att_context is not None or frames is None:
        return ""
    if longest is None or float(longest) <= FULL_CONTEXT_WARN_SECONDS:
        return ""
    per_layer = int(frames) ** 2 * ctx.encoder_heads * 4 * 2  # fp32 scores and probabilities
    return (
        f"the longest clip lasts {float(longest):g} s ({int(frames):,} encoder frames): full self-attention "
        f"over it holds about {per_layer / 2**30:.1f} GiB per encoder layer, "
        f"{per_layer * ctx.encoder_layers / 2**30:.1f} GiB over {ctx.encoder_layers} layers (frames^2 x "
        f"{ctx.encoder_heads} heads x 4 bytes x 2, scores and probabilities kept for backward)"
    )


CTC_CLIP_RATIO_WARN = 20.0  # the longest clip's CTC weighs this many times the median clip's, or more


def _ctc_per_clip_long_form(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    longest, median = man.get("max_duration"), man.get("median_duration")
    if ctx.ctc_weight <= 0 or ctx.ctc_reduction != "clip" or not longest or not median:
        return ""
    ratio = float(longest) / float(median)
    if ratio < CTC_CLIP_RATIO_WARN:
        return ""
    return (
        f"the longest clip lasts {float(longest):g} s, {ratio:.0f} times the median clip ({float(median):g} s): "
        f"with model.ctc_reduction=clip each clip's CTC sum is divided by the step's clip count, so that clip's "
        f"CTC (and its gradient) weighs about {ratio:.0f} times a median clip's"
    )


def _grad_accum_problem(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    if man.get("n_rows") is None or ctx.dp is None:
        return ""
    per_epoch = int(man["n_rows"])
    if ctx.sampler_mode == "temperature" and ctx.epoch_size:
        per_epoch = int(ctx.epoch_size)
    most = per_epoch // ctx.dp
    if most >= ctx.grad_accum:
        return ""
    return (
        f"{per_epoch} utterances per epoch over dp={ctx.dp} ranks give at most {most} micro-batches per rank "
        f"(one utterance each), fewer than trainer.grad_accum={ctx.grad_accum}"
    )


def _plan_problem(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    per_rank = man.get("plan_batches_per_rank")
    if per_rank is None or per_rank >= ctx.grad_accum or _grad_accum_problem(ctx):
        return ""
    return (
        f"epoch 0 packs {man.get('plan_micro_batches')} micro-batches, fewer than dp={ctx.dp} ranks x "
        f"trainer.grad_accum={ctx.grad_accum}"
    )


def _sentencepiece_with_pretrained(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    if not man.get("llm_pretrained") or man.get("tokenizer_kind") != "sentencepiece":
        return ""
    if man.get("allow_sentencepiece_with_pretrained"):
        return ""
    return f"model.llm.pretrained={man['llm_pretrained']} with data.tokenizer={man.get('tokenizer_path')}"


def _no_chat_template(ctx: ValidationContext) -> str:
    man = ctx.manifest or {}
    if man.get("tokenizer_kind") != "hf" or man.get("chat_template") is not False:
        return ""
    if man.get("chat_template_setting", "auto") != "auto":
        return ""
    return f"tokenizer {man.get('tokenizer_path')}"


# what trains (model.llm.train, model.encoder.train: speechlm/model/trainable.py)
TRAIN_MODE_RULES: tuple[Rule, ...] = (
    Rule(
        id="lora-with-tp",
        level=ERROR,
        when="model.llm.train=lora with parallel.tp_size > 1",
        applies=lambda c: c.llm_train == "lora" and c.tp > 1,
        reason="model.llm.train=lora with tp={tp}: the TP plan shards the LLM's nn.Linear projections, and "
        "LoRA replaces each adapted one by a peft layer the plan does not shard (its adapters would "
        "be replicated, not split with the base weight)",
        fix="train LoRA with parallel.tp_size=1 and scale with FSDP (parallel.dp_shard) and CP "
        "(parallel.cp_size), which LoRA supports; or use model.llm.train=full or frozen with TP",
        doc="LoRA adapters are injected with peft into the LLM's linear layers (docs/training-modes.md). "
        "Under TP each adapted projection would need its A/B matrices sharded to match the base weight "
        "(column-parallel: B split by rows; row-parallel: A split by columns); that plan does not exist, "
        "so the combination is refused. LoRA works with dp, FSDP2 and CP, where layout equivalence is "
        "tested.",
    ),
    Rule(
        id="frozen-encoder-with-unfreeze-step",
        level=ERROR,
        when="model.encoder.train=frozen with optim.unfreeze_step > 0",
        applies=lambda c: c.encoder_train == "frozen" and c.unfreeze_step > 0,
        reason=lambda c, d: (
            f"model.encoder.train=frozen never trains the encoder, but optim.unfreeze_step={c.unfreeze_step} "
            "asks to unfreeze it at that step"
        ),
        fix="for an encoder that starts frozen and then trains, use model.encoder.train=full with "
        "optim.unfreeze_step; for one that never trains, set optim.unfreeze_step=0",
        doc="`optim.unfreeze_step` is the two-phase schedule of a trained encoder (frozen, then trained "
        "with its own warmup); `model.encoder.train=frozen` keeps it frozen for the whole run, so the two "
        "contradict each other.",
    ),
    Rule(
        id="frozen-llm-added-lang-tags",
        level=WARNING,
        when="model.llm.train=frozen or lora on a pretrained LLM with data.lang_tags=special and "
        "model.llm.train_added_rows=false",
        applies=lambda c: (
            c.llm_train in ("frozen", "lora")
            and c.llm_pretrained
            and c.lang_tags == "special"
            and not c.llm_train_added_rows
        ),
        reason=lambda c, d: (
            f"model.llm.train={c.llm_train} freezes the embedding and the LM head, and "
            "model.llm.train_added_rows=false keeps the rows of the language tags added as tokens "
            "(data.lang_tags=special) at their initial values, all equal: the model cannot learn to tell the "
            "languages apart, and every predicted tag is the same"
        ),
        fix="leave model.llm.train_added_rows=true (the default: those rows train), set data.lang_tags=none "
        "(no tag in the target), or model.llm.train=full",
        doc="Tokens the tokenizer adds to a pretrained LLM get embedding and LM-head rows initialised at the "
        "mean of the existing ones (docs/pretrained-tokenizer.md); with a frozen or LoRA LLM those rows "
        "train only through model.llm.train_added_rows (docs/training-modes.md). Harmless for the audio "
        "placeholder, which is never read or predicted; a language tag is predicted, so its row must train.",
    ),
    Rule(
        id="adapting-a-random-llm",
        level=WARNING,
        when="model.llm.train=frozen or lora without model.llm.pretrained",
        applies=lambda c: c.llm_train in ("frozen", "lora") and not c.llm_pretrained,
        reason=lambda c, d: (
            f"model.llm.train={c.llm_train} keeps the LLM's randomly initialised weights (model.llm.pretrained "
            "is not set): only the projector, the encoder and any adapters learn"
        ),
        fix="set model.llm.pretrained=DIR (a save_pretrained directory of a causal LM), or "
        "model.llm.train=full to train an LLM from scratch",
        doc="Freezing an LLM, or training adapters on it, only makes sense for a pretrained one; a "
        "warning, since tests and benchmarks do it on purpose.",
    ),
    Rule(
        id="freezing-a-random-encoder",
        level=WARNING,
        when="model.encoder.train=frozen without model.encoder.pretrained",
        applies=lambda c: c.encoder_train == "frozen" and not c.encoder_pretrained,
        reason=lambda c, d: (
            "model.encoder.train=frozen keeps the encoder's randomly initialised weights (model.encoder.pretrained "
            "is not set): the projector and the LLM learn from features of an encoder that never learns"
        ),
        fix="set model.encoder.pretrained=PATH (a save_pretrained directory or a .nemo file), or "
        "model.encoder.train=full to train the encoder from scratch",
        doc="The encoder counterpart of adapting-a-random-llm: a frozen encoder only makes sense for a "
        "pretrained one. A warning, since tests and benchmarks do it on purpose.",
    ),
)

TRAINING_RULES: tuple[Rule, ...] = (
    Rule(
        id="sampler-budget-invalid",
        level=ERROR,
        when="no micro-batch budget, or a token budget below one rounded sequence",
        applies=_budget_problems,
        reason="the micro-batch budget cannot hold any sequence: {details}",
        fix="set sampler.max_batch_duration (seconds) or sampler.max_batch_tokens to a positive budget "
        "of at least one rounded sequence ({rounding_unit} tokens)",
        doc="The sampler packs utterances up to a budget of seconds or tokens (max_batch_tokens wins when "
        "set) and refuses a missing one (a non-positive one is refused with the config). A token budget below one rounded sequence "
        "(lcm(2*cp, cp*tp) tokens) cannot hold even the shortest utterance after CP/TP rounding.",
    ),
    Rule(
        id="budget-below-longest-utterance",
        level=WARNING,
        when="the longest utterance (after rounding) exceeds the micro-batch budget; needs manifest_summary",
        applies=_longest_over_budget,
        reason="the micro-batch budget is smaller than the longest utterance: {details}; the sampler packs "
        "such an utterance alone into an over-budget micro-batch",
        fix="raise the budget above the longest utterance (after rounding), or filter long utterances "
        "out of the manifest",
        doc="Checked only when the caller passes manifest_summary: max_tokens is the longest sequence in "
        "the units the token budget counts (audio + text + prompt tokens), max_duration the longest clip "
        "in seconds. A warning: training goes on, but memory sized for the budget may not hold that "
        "micro-batch.",
    ),
    Rule(
        id="encoder-packed-unsupported",
        level=ERROR,
        when="model.encoder.packed=true with an encoder kind that has no padding-free path",
        applies=lambda c: c.encoder_packed is True and c.encoder_kind not in PACKED_ENCODER_KINDS,
        reason=lambda c, d: (
            f"model.encoder.packed=true but encoder.kind={c.encoder_kind!r} has no "
            f"padding-free path (only {', '.join(sorted(PACKED_ENCODER_KINDS))})"
        ),
        fix="set model.encoder.packed=false, or leave it unset (padded for this encoder)",
        doc="The packed encoder path (features, subsampling, conformer layers on real frames only) exists "
        "for FastConformer/Parakeet. Whisper's encoder takes a fixed 30 s window by design and a NeMo "
        "module is run as loaded; both compute their padding frames.",
    ),
    Rule(
        id="encoder-runs-padded",
        level=WARNING,
        when="model.encoder.packed is unset and the encoder kind has no padding-free path",
        applies=lambda c: c.encoder_packed is None and c.encoder_kind not in PACKED_ENCODER_KINDS,
        reason=lambda c, d: (
            "encoder.kind='whisper' runs every clip in Whisper's 30 s window (model.encoder.whisper_window="
            "full): a 2 s clip costs the encoder what a 30 s one does"
            if c.encoder_kind == "whisper"
            else f"encoder.kind={c.encoder_kind!r} runs on padded clips: its cost grows with "
            "the longest clip of each micro-batch, not with the audio"
        ),
        fix="nothing to change for correctness; set model.encoder.packed=false to silence this, or use "
        "encoder.kind=parakeet for a padding-free encoder (whisper: model.encoder.whisper_window=clip is "
        "cheaper but not the representation Whisper was trained with, docs/pretrained.md)",
        doc="A reminder that the padding-free encoder is Parakeet-only: with Whisper or NeMo encoders the "
        "encoder, projector input and CTC head compute padding frames, so a wide duration mix wastes "
        "encoder FLOPs (see docs/benchmarks.md).",
    ),
    Rule(
        id="whisper-clip-over-window",
        level=ERROR,
        when="model.encoder.kind=whisper and a training clip longer than 30 s; needs manifest_summary",
        applies=_whisper_over_window,
        reason="{details}, but a Whisper encoder takes one fixed 30 s window: it can neither encode a longer "
        "clip whole nor shard it over the CP group (its positions end with the window)",
        fix="use model.encoder.kind=parakeet (clips of any length; limited context with "
        "model.encoder.att_context_size), or leave the longer clips out with data.max_duration=30",
        doc="Whisper's encoder has 1500 learned positions (30 s) and is always fed exactly that window; "
        "the encoder raises on a longer clip after the model has loaded. Long-form audio (issue 25) is "
        "encoded by the FastConformer, whose relative positions have no end, and only its clips are ever "
        "sharded over the CP group (`parallel.clip_placement`). max_duration is the longest row the plan "
        "keeps (data.max_duration applied).",
    ),
    Rule(
        id="encoder-full-context-long-clip",
        level=WARNING,
        when="a Parakeet encoder with full context (model.encoder.att_context_size unset) and a training clip "
        "longer than 5 minutes; needs manifest_summary",
        applies=_full_context_long_clip,
        reason="{details}",
        fix="set model.encoder.att_context_size=[128,128] (limited context: memory grows with frames x "
        "window, not frames^2), or leave the longest clips out with data.max_duration",
        doc="Full self-attention scores grow with the square of a clip's frames: a 60-minute clip is about "
        "45,000 FastConformer frames, 2 billion scores per head and layer. The estimate uses "
        "model.encoder.num_heads and num_layers (a pretrained encoder's own may differ) and fp32. A "
        "warning: a large GPU may hold it, and limited context changes what the encoder sees.",
    ),
    Rule(
        id="ctc-per-clip-long-form",
        level=WARNING,
        when="model.ctc_weight > 0 with model.ctc_reduction=clip and a training clip at least 20 times the "
        "median clip's duration; needs manifest_summary",
        applies=_ctc_per_clip_long_form,
        reason="{details}",
        fix="set model.ctc_reduction=token (the CTC sum divided by the step's CTC target tokens: each clip "
        "weighs by its transcript), or leave the longest clips out with data.max_duration",
        doc="The auxiliary CTC loss is a sum over a clip's frames, so it grows with the clip's length. Per clip "
        "(the default, NeMo's mean over the batch) suits clips of seconds; with long-form audio beside them, "
        "a 10-minute clip's CTC is about 100 times a 5 s clip's and its gradient dominates the step. Per "
        "target token normalises like the LLM's cross-entropy does. A warning: the weighting is a choice.",
    ),
    Rule(
        id="grad-accum-exceeds-batches",
        level=ERROR,
        when="fewer possible micro-batches per data-parallel rank than trainer.grad_accum; needs "
        "manifest_summary",
        applies=_grad_accum_problem,
        reason="the epoch has no complete optimizer step: {details}",
        fix="lower trainer.grad_accum, use fewer data-parallel ranks, or train on more utterances",
        doc="Every data-parallel rank gets the same number of micro-batches, trimmed to a multiple of "
        "grad_accum. A micro-batch holds at least one utterance, so there are at most n_rows // dp per "
        "rank (sampler.epoch_size replaces n_rows in temperature mode); below grad_accum the trim "
        "leaves nothing and the sampler raises after the model has loaded. Needs manifest_summary.",
    ),
    Rule(
        id="epoch-plan-too-short",
        level=ERROR,
        when="the epoch plan packs fewer micro-batches than dp * trainer.grad_accum; needs manifest_summary "
        "with the plan",
        applies=_plan_problem,
        reason="the epoch has no complete optimizer step: {details}, so every rank would get none",
        fix="lower trainer.grad_accum or the data-parallel size, lower the micro-batch budget "
        "(more, smaller micro-batches), or train on more utterances (sampler.epoch_size in temperature mode)",
        doc="The exact form of grad-accum-exceeds-batches: the sampler packs several utterances into one "
        "micro-batch, so an epoch can hold enough utterances and still too few micro-batches. `speechlm "
        "train` and `speechlm validate` (with the config's manifests or --manifest) build epoch 0's plan "
        "as training does and count its micro-batches per data-parallel rank.",
    ),
    Rule(
        id="pretrained-llm-sentencepiece-tokenizer",
        level=ERROR,
        when="model.llm.pretrained with a SentencePiece data.tokenizer (and not "
        "data.allow_sentencepiece_with_pretrained); needs the tokenizer facts of manifest_summary",
        applies=_sentencepiece_with_pretrained,
        reason="{details}: the LLM's embeddings are indexed by its own tokenizer's ids, which mean other "
        "tokens in the SentencePiece model, so the pretrained weights would be wasted",
        fix="unset data.tokenizer (the LLM's own tokenizer is then used) or point it at the LLM's tokenizer "
        "directory; set data.allow_sentencepiece_with_pretrained=true to train on these ids anyway",
        doc="A pretrained LLM reads the ids of its own tokenizer: with `model.llm.pretrained` set and "
        "`data.tokenizer` unset the run uses that tokenizer (docs/pretrained-tokenizer.md). A SentencePiece "
        "model trained on the corpus gives ids that index unrelated embedding rows; before issue 22 this "
        "trained silently. `speechlm train` refuses it with the same message.",
    ),
    Rule(
        id="chat-template-missing",
        level=WARNING,
        when="the LLM's tokenizer has no chat template and data.chat_template is auto; needs the tokenizer "
        "facts of manifest_summary",
        applies=_no_chat_template,
        reason="{details} has no chat template: the prompt falls back to the plain form "
        "[bos, audio, instruction, transcript, eos], which an instruction-tuned LLM has not seen",
        fix="nothing to change for a base LLM; for a chat LLM give its template with "
        "data.chat_template=FILE.jinja, or set data.chat_template=none to silence this",
        doc="With a template the prompt is the LLM's chat format (system turn, user turn with the audio "
        "placeholder and the instruction, assistant turn with the transcript and the end-of-turn token). "
        "A base model's tokenizer often has none; the plain form is then used, as for a model trained "
        "from scratch.",
    ),
    *TRAIN_MODE_RULES,
)


RULES: tuple[Rule, ...] = (*PARALLEL_RULES, *TRAINING_RULES)
# the rule that needs the epoch plan, which is built only once the others pass (speechlm.preflight.checks)
EPOCH_PLAN_RULE: Rule = next(r for r in TRAINING_RULES if r.id == "epoch-plan-too-short")

# `parallel.validator.validate` over the full table: validate(config, world_size, env, device_capability,
# installed, *, manifest_summary=None) -> findings
validate = functools.partial(_validate_with_rules, rules=RULES)
