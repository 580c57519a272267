"""CTC-compressed audio (``model.audio_compression: ctc``, aligned positions) under dynamic CP and dp, issue 38.

The LLM's audio rows per clip are known only after the encoder, so under CP every clip's compressed rows
are gathered to every rank and the sequences are placed again from the compressed lengths
(`SpeechLLM.forward`, docs/parallelism.md "CTC-compressed audio under CP"). The checks here: the real
training step (FSDP2) at cp 2 gives the losses and gradients of one process, THD, on the compressed lengths
at the CP boundaries (a clip of 0 rows, clips of one row, a sample whose audio rows are fewer than its
transcript's tokens) and with the oracle prefix (one step each in the default run; ``-m slow``: three
steps at dp 2, cp 2 with ring and all-gather attention, every sequence split, the padded encoder,
conversations, and dp 2 x cp 2); a clip sharded over the CP group compresses as one process compresses it
whole, and the logged real and computed tokens are the compressed ones; the validator's view.

The tiny model's CTC head is sharpened (`parallel_harness.hear_tokens_and_blanks`) so that compression
has something to do: runs of tokens, blanks, clips that hear nothing.
"""

from __future__ import annotations

import functools

import pytest
import torch
from parallel_harness import (
    COMPRESSED,
    Layout,
    build_model,
    global_steps,
    rank_layouts,
    reference_run,
    tiny_config,
)
from test_long_clip_training import WINDOW, _assert_steps_match, _forward_worker, _reference
from test_parallel_equivalence import assert_matches

from parallel.cp_layout import NullCPLayout, plan_for_clips
from parallel.cp_placement import place_sequences
from parallel.testing import run_distributed
from speechlm.config import ConfigError, load_config
from speechlm.model import cp_audio
from speechlm.model.conversation_inputs import (
    as_conversation,
    clips_per_sample,
    conversation_prompts,
    conversation_seq_lens,
)
from speechlm.preflight.rules import validate

N_STEPS = 3
MIXED = "ctc-mixed"
THRESHOLD = 8  # the compressed sequences are 4-11 tokens: whole and split ones in one micro-batch
ORACLE = ("model.audio_prefix=oracle",)
HEARD = (*COMPRESSED, "model.audio_token_embedding=true")  # each row also carries its heard token's embedding

# the default run, one step each: the edge batch at cp 2 (a clip of 0 rows, clips of one row, a sample with
# fewer audio rows than transcript tokens; whole and split sequences), a small edge batch whose 0-frame clip
# is all one CP rank encodes, and the oracle prefix at cp 2 (issue 38 wants it in the default suite)
QUICK = [
    Layout(
        "cp2-ring-edge", 1, 2, 1, split_threshold=THRESHOLD, overrides=COMPRESSED, batches="edge", tweak=MIXED
    ),
    Layout("cp2-empty-owner", 1, 2, 1, overrides=HEARD, batches="edge-small", tweak=MIXED),
    Layout("cp2-oracle-compressed", 1, 2, 1, split_threshold=THRESHOLD, overrides=COMPRESSED + ORACLE),
]
# three steps of every case (slow: ~80 s on 2 cores)
LAYOUTS = [
    Layout("dp2-compressed", 2, 1, 1, overrides=COMPRESSED, tweak=MIXED),
    Layout("cp2-ring-compressed", 1, 2, 1, split_threshold=THRESHOLD, overrides=COMPRESSED, tweak=MIXED),
    Layout("cp2-ring-heard", 1, 2, 1, split_threshold=THRESHOLD, overrides=HEARD, tweak=MIXED),
    Layout("cp2-split-all-compressed", 1, 2, 1, split_threshold=0, overrides=COMPRESSED, tweak=MIXED),
    Layout("cp2-allgather-compressed", 1, 2, 1, "allgather", THRESHOLD, overrides=COMPRESSED, tweak=MIXED),
    *QUICK,
    Layout("cp2-oracle", 1, 2, 1, split_threshold=THRESHOLD, overrides=ORACLE),
    # the padded encoder path (Whisper's and NeMo's) compresses the real frames of each clip
    Layout(
        "cp2-padded-encoder",
        1,
        2,
        1,
        split_threshold=THRESHOLD,
        overrides=COMPRESSED + ("model.encoder.packed=false",),
        tweak=MIXED,
    ),
    # several clips per sample (conversations), some without a transcript
    Layout("cp2-conv-compressed", 1, 2, 1, split_threshold=14, overrides=COMPRESSED, batches="conversations"),
]
LAYOUTS_4 = [
    Layout("dp2-cp2-compressed", 2, 2, 1, split_threshold=THRESHOLD, overrides=COMPRESSED, tweak=MIXED),
    Layout(
        "dp2-cp2-edge", 2, 2, 1, split_threshold=THRESHOLD, overrides=COMPRESSED, batches="edge", tweak=MIXED
    ),
    # hybrid CP degrees: placed again from the compressed lengths with place_hybrid (`parallel.hybrid_layout`)
    Layout(
        "cp4-hybrid-compressed", 1, 4, 1, overrides=(*COMPRESSED, "parallel.cp_degrees=hybrid"), tweak=MIXED
    ),
]


@functools.cache
def reference(dp: int, overrides: tuple[str, ...], batches: str, tweak: str, n_steps: int) -> dict:
    cfg = tiny_config(overrides=overrides)
    return reference_run(cfg, global_steps(n_steps, dp, batches=batches), tweak=tweak)


def _check(layouts: list[Layout], world: int, n_steps: int) -> None:
    got = run_distributed(rank_layouts, world, "gloo", layouts, n_steps, "gloo", timeout_s=850)
    failed = []
    for i, lay in enumerate(layouts):
        # the oracle's projector output joins the loss with weight 0, and beside the heard tokens the projector
        # starts behind a gate at 0 (`SpeechLLM.audio_gate`): a zero gradient either way
        trained: tuple[str, ...] = ("encoder.", "projector.")
        if ORACLE[0] in lay.overrides:
            trained = ("encoder.",)
        elif HEARD[-1] in lay.overrides:
            trained = ("encoder.", "audio_gate")
        try:
            ref = reference(lay.dp, lay.overrides, lay.batches, lay.tweak, n_steps)
            assert_matches(ref, [r[i] for r in got], trained)
        except AssertionError as e:
            failed.append(f"{lay.id}: {e}")
    assert not failed, "\n".join(failed)


@pytest.mark.multiproc
def test_cp2_with_compression_and_the_oracle_matches_one_process():
    _check(QUICK, 2, 1)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_layouts_match_single_process(world):
    _check(LAYOUTS if world == 2 else LAYOUTS_4, world, N_STEPS)


def _first_micro_batch(batches: str) -> tuple[list[int], list[int], list[int], list[int]]:
    """(compressed rows, encoder frames, transcript tokens) per clip and the compressed sequence lengths of
    the micro-batch the QUICK layouts run (the first step at dp 1), with the sharpened head."""
    model = build_model(tiny_config(overrides=COMPRESSED), tweak=MIXED)
    b = global_steps(1, 1, batches=batches)[0][0]
    with torch.no_grad():
        enc = model.encode_audio(b.audio, b.audio_lens)
    rows = [int(e.shape[0]) for e in enc.embeds]
    prompts, clip_sample = conversation_prompts(as_conversation(b, model.prompt), model.audio_id)
    seqs = conversation_seq_lens(prompts, clips_per_sample(clip_sample, len(prompts)), rows)
    return rows, enc.enc_lens_B.tolist(), (b.token_lens - 1).tolist(), seqs


def test_the_compressed_batches_cover_the_cp_boundary_cases():
    """What the QUICK layouts exercise: compression shortens, a clip keeps one row (it hears nothing), a
    clip of 0 frames keeps 0 rows, a sample's audio rows are fewer than its transcript's tokens, at cp 2
    with THRESHOLD a micro-batch holds whole and split sequences of the compressed lengths; and in the
    small edge batch one CP rank encodes only the clip of 0 frames (the clips are dealt by length)."""
    rows, frames, tokens, seqs = _first_micro_batch("edge")
    assert all(r <= f for r, f in zip(rows, frames)) and any(r < f for r, f in zip(rows, frames))
    assert any(r == 1 and f > 1 for r, f in zip(rows, frames))
    assert any(r == 0 and f == 0 for r, f in zip(rows, frames))
    assert any(0 < r < t for r, t in zip(rows, tokens))
    split = place_sequences(seqs, 2, threshold=THRESHOLD).split
    assert any(split) and not all(split)
    _, frames, _, seqs = _first_micro_batch("edge-small")
    plan = place_sequences(seqs, 2, threshold="auto").local(0)
    owners = plan_for_clips(plan, list(range(len(frames))), frames, 2, gather_all=True).clip_owners
    assert any([frames[c] for c, o in enumerate(owners) if o == r] == [0] for r in range(2)), (frames, owners)


def test_compressed_clips_are_all_gathered_and_dealt_by_length_alike_on_every_rank():
    """The encoding plan of compressed audio under CP (`plan_for_clips(..., gather_all=True)`): every clip
    gathered, whole sequences' too; dealt longest first to the least loaded encoder; the same on every rank.
    One CP rank gathers nothing."""
    placement = place_sequences([30, 6, 9, 12], 2, threshold=10)
    assert not all(placement.split)  # some sequences whole: their clips are gathered all the same
    clip_sample, frames = [0, 0, 1, 2, 3], [9, 7, 5, 0, 8]
    views = [plan_for_clips(placement.local(r), clip_sample, frames, 2, gather_all=True) for r in range(2)]
    assert all(v.gathered == [True] * 5 for v in views)
    assert views[0].clip_owners == views[1].clip_owners == [0, 1, 0, 0, 1]  # 9: 0, 8: 1, 7: 1, 5: 0, 0: 0
    one = place_sequences([30, 6], 1, threshold=10).local(0)
    assert (
        cp_audio.encoding_plan(NullCPLayout(), one, [0, 1], [4, 5], compressed=True).gathered == [False] * 2
    )


def test_ctc_of_clips_that_all_have_no_frames_is_zero_and_keeps_the_head_in_the_graph():
    """Under CP a rank may encode only a clip of 0 frames (the edge batches at cp 2: the longest clip goes
    to one rank, the empty one to the other); its CTC sum is 0, not an error of ctc_loss."""
    model = build_model(tiny_config(overrides=COMPRESSED))
    enc = model.encode_audio(torch.zeros(1, 0), torch.tensor([0]))
    assert enc.enc_lens_B.tolist() == [0] and [int(e.shape[0]) for e in enc.embeds] == [0]
    total, n = model.ctc_loss_sum(
        enc.enc_hidden, enc.enc_lens_B, torch.tensor([[5, 9, 10]]), torch.tensor([3])
    )
    assert n == 1 and float(total.detach()) == 0.0
    total.backward()
    assert model.ctc_head.weight.grad is not None


# ------------------------------------------------------------------------------------------------
# A clip sharded over the CP group, compressed
# ------------------------------------------------------------------------------------------------


def _sharded_reference(extra: tuple[str, ...]) -> dict:
    ref = _reference(extra, MIXED)
    model, batch = ref.pop("model"), ref.pop("batch")
    with torch.no_grad():
        enc = model.encode_audio(batch.audio, batch.audio_lens)
    frames, tokens = enc.enc_lens_B.tolist(), batch.token_lens.tolist()
    ref["rows"], ref["frames"] = int(enc.embeds[0].shape[0]), frames[0]
    ref["uncompressed"] = sum(2 + a + int(t) for a, t in zip(frames, tokens))  # bos, audio, tokens, eos
    return ref


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "world, threshold, extra",
    [
        (2, "auto", HEARD),  # the long sequence split over the group; the heard tokens' embeddings
        (3, 0, COMPRESSED),  # every sequence split, slices that do not divide the clip
        # a frozen encoder: the slices and their gathers run without autograd
        pytest.param(2, "auto", (*COMPRESSED, "model.encoder.train=frozen"), marks=pytest.mark.slow),
    ],
)
def test_a_sharded_clip_compresses_as_one_process_compresses_it_whole(world, threshold, extra):
    """The long clip is encoded in one slice per rank, then compressed whole on every rank: the same rows
    (a run across a cut is one row), losses and gradients as one process."""
    ref = _sharded_reference(extra)
    assert 1 < ref["rows"] < ref["frames"]
    got = run_distributed(_forward_worker, world, "gloo", threshold, extra, MIXED)
    slices = [res["calls"] for res in got]
    assert all(len(b) == 1 for b in slices), slices  # each rank encoded one slice of the long clip
    assert slices[0][0][0] == 0 and all(a[0][1] == b[0][0] for a, b in zip(slices, slices[1:])), slices
    # the logged real-token share counts what the LLM computed: the compressed sequences, as placed
    stream = place_sequences(ref["seq_lens"], world, threshold=threshold)
    for r, res in enumerate(got):
        assert res["seq_lens"] == ref["seq_lens"], f"rank {r}: the compressed lengths differ"
        local = stream.local(r)
        want = sum(n // world if k < local.n_split else n for k, n in enumerate(local.padded_lengths))
        assert res["computed"] == want, f"rank {r}"
        assert res["ce"] == pytest.approx(ref["ce"], rel=1e-5)
        assert res["ctc"] == pytest.approx(ref["ctc"], rel=1e-5)
    assert sum(res["real"] for res in got) == pytest.approx(sum(ref["seq_lens"]))
    assert sum(ref["seq_lens"]) < ref["uncompressed"]
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in ref["grads"].values()))
    for name, g in ref["grads"].items():
        err = (got[0]["grads"][name].double() - g.double()).norm()
        assert err <= 1e-5 * g.double().norm() + 1e-6 * total, (name, float(err), float(g.norm()))


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp2_cp2_with_a_compressed_long_clip_on_one_dp_rank_only_matches_one_process():
    """dp 2 x cp 2 (FSDP2 over all four ranks), one dp rank's micro-batches shard a long clip: the head, the
    encoder and the projector run once per micro-batch on every rank, sharded clip or not (the slices'
    labels join the whole clips' head call), so FSDP's collectives stay in step; 3 steps as one process."""
    extra = (*WINDOW, *COMPRESSED)
    lay = [
        Layout("dp2-cp2-long", 2, 2, 1, split_threshold="auto", overrides=extra, batches="long", tweak=MIXED)
    ]
    got = run_distributed(rank_layouts, 4, "gloo", lay, N_STEPS, "gloo", timeout_s=850)
    ref = reference_run(tiny_config(overrides=extra), global_steps(N_STEPS, 2, batches="long"), tweak=MIXED)
    _assert_steps_match(ref, [per_rank[0] for per_rank in got])


def test_the_validator_takes_compression_with_every_layout_it_runs_and_refuses_what_it_cannot():
    """Compression runs under CP (tested above), with a sharded clip (limited context) and with the padded
    encoder path: the validator's rule table finds no error there. What it cannot run is refused when the
    config loads, naming the key to set (`ModelConfig.problems`)."""
    cp2 = ("parallel.cp_size=2", *COMPRESSED)
    summary = {"max_duration": 3600.0, "max_encoder_frames": 45_000, "median_duration": 5.0}
    for extra in [(), ("model.encoder.att_context_size=[70,13]",), ("model.encoder.packed=false",)]:
        cfg = load_config(None, [*cp2, *extra])
        found = validate(cfg, 2, {}, None, {"torch": "2.13.0"}, manifest_summary=summary)
        assert [f.rule_id for f in found if f.level == "error"] == [], extra
    with pytest.raises(ConfigError, match="set model.projector_stack=1"):
        load_config(None, ["model.audio_compression=ctc"])
    with pytest.raises(ConfigError, match="set model.ctc_weight > 0"):
        load_config(None, ["model.audio_compression=ctc", "model.projector_stack=1", "model.ctc_weight=0"])
