"""Shared pieces of the layout-equivalence tests: a tiny model config, deterministic batches, one rank's run.

The single-process reference and every (dp, cp, tp) layout run the same `run_optimizer_step` that the
Lightning module uses; a layout's data-parallel rank d receives micro-batch d of each global step, the
reference receives all of them in one step (the objective is normalised by global counts, so the two
are the same optimisation problem).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from speechlm.config import ExperimentConfig, load_config
from speechlm.data.dataset import Batch
from speechlm.data.run_inputs import TokenizerInfo
from speechlm.train.schedule import build_optimizer
from speechlm.train.step import StepContext, run_optimizer_step

VOCAB = 64
TOK = TokenizerInfo(vocab_size=VOCAB, pad_id=0, bos_id=2, eos_id=3, audio_id=4)
ADDED_IDS = (4, 5, 6, 7)  # "added" to a frozen/LoRA LLM: the placeholder and three ids the batches use


def tiny_config(
    cp: int = 1,
    tp: int = 1,
    cp_attention: str = "ring",
    ctc_weight: float = 0.3,
    split_threshold: int | str = 9,
    overrides: tuple[str, ...] = (),
) -> ExperimentConfig:
    """`overrides`: more dotted overrides (e.g. model.llm.train=lora), applied last."""
    return load_config(
        None,
        [
            "model.encoder.hidden_size=32",
            "model.encoder.num_layers=1",
            "model.encoder.num_heads=2",
            "model.encoder.intermediate_size=64",
            "model.encoder.subsampling_conv_channels=8",
            "model.encoder.num_mel_bins=16",
            "model.llm.hidden_size=32",
            "model.llm.num_layers=2",
            "model.llm.num_heads=4",
            "model.llm.num_kv_heads=2",
            "model.llm.intermediate_size=64",
            "model.projector_hidden=32",
            "model.projector_stack=2",
            f"model.ctc_weight={ctc_weight}",
            "model.dropout=0",
            "trainer.precision=32",
            f"parallel.cp_size={cp}",
            f"parallel.tp_size={tp}",
            f"parallel.cp_attention={cp_attention}",
            f"parallel.cp_split_threshold={split_threshold}",
            "optim.lr=0.003",
            "optim.warmup_steps=0",
            "optim.grad_clip=0",
            "trainer.max_steps=10",
            *overrides,
        ],
    )


def make_batch(seed: int, n_clips: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2400, 8000, (n_clips,), generator=g)
    audio = torch.zeros(n_clips, int(lens.max()))
    for i, n in enumerate(lens.tolist()):
        audio[i, :n] = 0.3 * torch.randn(n, generator=g)
    tlens = torch.randint(2, 7, (n_clips,), generator=g)
    tokens = torch.zeros(n_clips, int(tlens.max()), dtype=torch.long)
    for i, n in enumerate(tlens.tolist()):
        tokens[i, :n] = torch.randint(5, VOCAB, (n,), generator=g)
        tokens[i, 0] = 5 + (seed + i) % 3  # a "language tag" first, as a transcript has (ids 5-7)
    return Batch(
        audio=audio,
        audio_lens=lens,
        tokens=tokens,
        token_lens=tlens,
        langs=["xx"] * n_clips,
        indices=list(range(n_clips)),
        durations=lens.float() / 16000,
        dropped={},
    )


def make_conversation_batch(seed: int, n_rows: int) -> Batch:
    """A conversation batch (`multiclip_helpers.make_conv_batch`): rows of 1-3 clips and one or two
    answers, CTC transcripts on some clips only."""
    from multiclip_helpers import make_conv_batch

    return make_conv_batch(seed, n_rows, VOCAB)


def make_untranscribed_batch(seed: int, n_rows: int) -> Batch:
    """`make_conversation_batch` whose clips have no transcript: no CTC target in the whole batch (issue 35)."""
    from multiclip_helpers import make_conv_batch

    return make_conv_batch(seed, n_rows, VOCAB, transcripts=False)


def make_text_and_audio_batch(seed: int, n_rows: int) -> Batch:
    """`make_conversation_batch` whose first row holds no audio (under CP a rank may own no clip)."""
    from multiclip_helpers import make_conv_batch

    return make_conv_batch(seed, n_rows, VOCAB, text_rows=1)


def make_long_clip_batch(seed: int, n_rows: int) -> Batch:
    """`make_batch` whose first clip lasts 33-37 s (for even seeds: odd ones are plain `make_batch`, so that
    under dp x cp one dp rank's micro-batch shards a clip while the other's does not): longer than the 30 s below which a clip is never
    sharded, so under CP (with limited-context attention) the encoder shards it over the group
    (`parallel.clip_placement`), beside n_rows - 1 short clips encoded whole; its transcript is long."""
    g = torch.Generator().manual_seed(seed + 7)
    batch = make_batch(seed, n_rows)
    if seed % 2:  # odd seeds (the second dp rank's micro-batches in `global_steps`) stay short
        return batch
    n_long = int(torch.randint(33 * 16000, 37 * 16000, (1,), generator=g))
    audio = torch.zeros(n_rows, max(n_long, batch.audio.shape[1]))
    audio[:, : batch.audio.shape[1]] = batch.audio
    audio[0, :n_long] = 0.3 * torch.randn(n_long, generator=g)
    lens = batch.audio_lens.clone()
    lens[0] = n_long
    tlens = batch.token_lens.clone()
    tlens[0] = 40
    tokens = torch.zeros(n_rows, 40, dtype=torch.long)
    tokens[:, : batch.tokens.shape[1]] = batch.tokens
    tokens[0, 1:40] = torch.randint(5, VOCAB, (39,), generator=g)
    return dataclasses.replace(
        batch, audio=audio, audio_lens=lens, tokens=tokens, token_lens=tlens, durations=lens.float() / 16000
    )


def make_long_clips_batch(seed: int, n_rows: int, seconds: tuple[float, ...]) -> Batch:
    """`make_batch` of ``n_rows`` short clips after ``len(seconds)`` long ones of those durations, each with a
    40-token transcript: under hybrid CP degrees at cp 4, (34, 34) places the two long sequences over the
    two pairs of ranks (degrees 2, 2) and (32, 31, 31) the first over all four and the others over the two
    pairs (degrees 4, 2, 2: ranks hold slices of clips sharded over different, nested groups)."""
    g = torch.Generator().manual_seed(seed + 13)
    k = len(seconds)
    batch = make_batch(seed, n_rows + k)
    longs = [int(sec * 16000) for sec in seconds]
    audio = torch.zeros(n_rows + k, max(*longs, batch.audio.shape[1]))
    audio[:, : batch.audio.shape[1]] = batch.audio
    lens, tlens = batch.audio_lens.clone(), batch.token_lens.clone()
    tokens = torch.zeros(n_rows + k, 40, dtype=torch.long)
    tokens[:, : batch.tokens.shape[1]] = batch.tokens
    for i, n in enumerate(longs):
        audio[i] = 0.0
        audio[i, :n] = 0.3 * torch.randn(n, generator=g)
        lens[i], tlens[i] = n, 40
        tokens[i, 1:40] = torch.randint(5, VOCAB, (39,), generator=g)
    return dataclasses.replace(
        batch, audio=audio, audio_lens=lens, tokens=tokens, token_lens=tlens, durations=lens.float() / 16000
    )


def make_edge_batch(seed: int, n_rows: int, more: int = 2) -> Batch:
    """`make_batch` whose last clip holds no audio: a clip of 0 frames, which CTC compression keeps as 0
    rows (issue 38), beside clips that compress to one row or to fewer rows than their transcripts (with
    the `hear_tokens_and_blanks` model). ``more`` rows than asked: one micro-batch holds every case."""
    batch = make_batch(seed, n_rows + more)
    lens = batch.audio_lens.clone()
    lens[-1] = 0
    audio = batch.audio.clone()
    audio[-1] = 0.0
    return dataclasses.replace(batch, audio=audio, audio_lens=lens, durations=lens.float() / 16000)


def global_steps(n_steps: int, dp: int, seed: int = 0, batches: str = "clips") -> list[list[Batch]]:
    """Micro-batch d of step s goes to data-parallel rank d; sizes differ so ranks hold unequal work.
    ``batches``: "clips" (one clip per row, `make_batch`), "conversations" (`make_conversation_batch`),
    "untranscribed" (`make_untranscribed_batch`), "text+audio" (`make_text_and_audio_batch`), "long"
    (`make_long_clip_batch`), "two-long" or "three-long" (`make_long_clips_batch`), "edge" or "edge-small"
    (`make_edge_batch`)."""
    make = {
        "clips": make_batch,
        "conversations": make_conversation_batch,
        "untranscribed": make_untranscribed_batch,
        "text+audio": make_text_and_audio_batch,
        "long": make_long_clip_batch,
        "two-long": functools.partial(make_long_clips_batch, seconds=(34.0, 34.0)),
        "three-long": functools.partial(make_long_clips_batch, seconds=(32.0, 31.0, 31.0)),
        "edge": make_edge_batch,
        "edge-small": functools.partial(make_edge_batch, more=0),
    }[batches]
    return [[make(seed + 100 * s + d, 2 + (s + d) % 3) for d in range(dp)] for s in range(n_steps)]


COMPRESSED = ("model.projector_stack=1", "model.audio_compression=ctc", "model.audio_positions=aligned")


def hear_tokens_and_blanks(model: Any) -> None:
    """Let the tiny model's CTC head hear a mix of tokens and blanks (issue 38's compression tests): the
    untrained encoder's frames differ by ~1e-3, so the random head's bias decides its argmax, one token for
    every frame (each clip compresses to one row); without that bias, its weights tell the frames apart,
    and a blank's bias of 0.002 makes about a third of them blank, some clips all blank (one row)."""
    with torch.no_grad():
        model.ctc_head.bias.zero_()
        model.ctc_head.bias[model.ctc_blank_id] = 0.002


TWEAKS = {"": lambda model: None, "ctc-mixed": hear_tokens_and_blanks}


def build_model(cfg: ExperimentConfig, added_token_ids: Any = None, tweak: str = "") -> Any:
    """The SpeechLLM with its train modes applied (model.llm.train, model.encoder.train), as the
    Lightning module builds it; ``added_token_ids`` default: ADDED_IDS for a frozen or LoRA LLM;
    ``tweak``: a name in `TWEAKS`, applied to the built model."""
    from speechlm.model.speech_llm import SpeechLLM
    from speechlm.model.trainable import apply_train_modes

    torch.manual_seed(1234)
    # a frozen or LoRA LLM gets ADDED_IDS as tokens added to a pretrained vocabulary (rows at the mean,
    # trained as `AddedTokenRows`), as a run on a pretrained LLM's own tokenizer adds its language tags
    adapted = cfg.model.llm.train in ("frozen", "lora")
    model = SpeechLLM(
        cfg.model,
        vocab_size=TOK.vocab_size,
        pad_id=TOK.pad_id,
        bos_id=TOK.bos_id,
        eos_id=TOK.eos_id,
        audio_id=TOK.audio_id,
        added_token_ids=(ADDED_IDS if adapted else ()) if added_token_ids is None else added_token_ids,
    )
    apply_train_modes(model, cfg.model)
    TWEAKS[tweak](model)
    return model


def full_grads(model: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return out


def run_steps(
    model: Any, ctx: StepContext, cfg: ExperimentConfig, per_step: list[list[Batch]]
) -> dict[str, Any]:
    opt, sched = build_optimizer(model, cfg)
    losses: list[float] = []
    captured: dict[str, torch.Tensor] = {}
    for step, micro in enumerate(per_step):

        def capture(step: int = step) -> float:
            if step == 0:
                captured.update(full_grads(model))
            return 0.0

        res = run_optimizer_step(model, micro, ctx, opt, sched, cfg, step=step, clip=capture)
        losses.append(res["loss"])
    return {"losses": losses, "grads": captured}


def reference_run(cfg: ExperimentConfig, steps: list[list[Batch]], tweak: str = "") -> dict[str, Any]:
    model = build_model(cfg, tweak=tweak)
    ctx = StepContext()
    return run_steps(model, ctx, cfg, steps)


def batch_to(batch: Batch, device: torch.device) -> Batch:
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def rank_run(
    rank: int,
    world: int,
    cp: int,
    tp: int,
    cp_attention: str,
    n_steps: int,
    ctc_weight: float = 0.3,
    split_threshold: int | str = 9,
    backend: str = "gloo",
    overrides: tuple[str, ...] = (),
    batches: str = "clips",
    tweak: str = "",
) -> dict[str, Any] | None:
    """Body of one rank: build the mesh, parallelize, run the same steps on this rank's share (on cuda:rank
    under NCCL; the results come back on the CPU)."""
    from helpers import device_for, to_cpu

    from parallel.mesh import ParallelDims
    from speechlm.train.distributed import build_distributed_context

    torch.set_num_threads(1)
    device = device_for(backend, rank)
    dims = ParallelDims(world, 1, -1, cp, tp)
    dims.build_mesh(device.type)
    cfg = tiny_config(cp, tp, cp_attention, ctc_weight, split_threshold, overrides)
    model = build_model(cfg, tweak=tweak).to(device)
    ctx = build_distributed_context(model, dims, cfg, device)
    steps = global_steps(n_steps, dims.dp, batches=batches)
    d = dims.dp_rank(rank)
    out = to_cpu(run_steps(model, ctx, cfg, [[batch_to(s[d], device)] for s in steps]))
    return out if rank == 0 else {"losses": out["losses"]}


class Layout(NamedTuple):
    """One (dp, cp, tp) layout of the equivalence tests, with its CP attention and placement threshold."""

    id: str
    dp: int
    cp: int
    tp: int
    cp_attention: str = "ring"
    split_threshold: int | str = 9
    overrides: tuple[str, ...] = ()  # config overrides of the model (e.g. model.llm.train=lora)
    batches: str = "clips"  # or "conversations" (several clips per row: `global_steps`)
    tweak: str = ""  # a change to the built model (`TWEAKS`)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp


def rank_layouts(
    rank: int, world: int, layouts: list[Layout], n_steps: int, backend: str = "gloo"
) -> list[dict[str, Any] | None]:
    """Every layout of one world size, one after the other, in one process group (one start and one
    rendezvous for all of them); result i is `rank_run`'s for layouts[i]."""
    out = []
    for lay in layouts:
        assert lay.world == world, f"{lay.id} needs {lay.world} ranks, the group has {world}"
        out.append(
            rank_run(
                rank,
                world,
                lay.cp,
                lay.tp,
                lay.cp_attention,
                n_steps,
                0.3,
                lay.split_threshold,
                backend,
                lay.overrides,
                lay.batches,
                lay.tweak,
            )
        )
    return out


def dp_only_step(rank: int, world: int) -> tuple[Any, Any, Any, Any, list[Batch], ExperimentConfig]:
    """(model, step context, optimizer, scheduler, this rank's micro-batches, config) of one optimizer
    step of the tiny model under pure data parallelism over `world` gloo ranks (process group set up)."""
    from parallel.mesh import ParallelDims
    from speechlm.train.distributed import build_distributed_context

    torch.set_num_threads(1)
    dims = ParallelDims(world, 1, -1, 1, 1)
    dims.build_mesh("cpu")
    cfg = tiny_config()
    model = build_model(cfg)
    ctx = build_distributed_context(model, dims, cfg, torch.device("cpu"))
    opt, sched = build_optimizer(model, cfg)
    return model, ctx, opt, sched, [global_steps(1, dims.dp)[0][dims.dp_rank(rank)]], cfg
