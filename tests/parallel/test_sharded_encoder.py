"""One clip's FastConformer sharded over the CP group (issue 25 item 3, `speechlm.model.sharded_encoder` with
`parallel.halo.HaloExchange`): each rank's slice of the output, and the sum over ranks of every parameter
gradient, equal the unsharded padding-free encoder's (fp32, 1e-5), at cp 2, 3 and 4 for lengths that do not
divide evenly; the subsampling's recomputed window is exact on its own; BatchNorm on batch statistics
and full context are refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel.clip_placement import shard_bounds
from parallel.halo import HaloExchange
from parallel.testing import run_distributed
from speechlm.config import EncoderConfig
from speechlm.model.encoders import build_encoder
from speechlm.model.features import LogMelFeatures
from speechlm.model.packed_encoder import _subsample
from speechlm.model.sharded_encoder import forward_sharded_parakeet, subsample_window


def make_encoder(window, factor=8, conv_norm="layer_norm", **kw):
    torch.manual_seed(0)
    cfg = EncoderConfig(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, subsampling_conv_channels=8,
        num_mel_bins=80, subsampling_factor=factor, conv_norm=conv_norm,
        att_context_size=None if window is None else list(window),
    )  # fmt: skip
    return build_encoder(cfg, dropout=0.0, **kw).train()


def clip_features(n_samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    audio = torch.randn(1, n_samples, generator=torch.Generator().manual_seed(seed)) * 0.1
    return LogMelFeatures().packed(audio, torch.tensor([n_samples]))


def _compare_sharded(rank: int, world: int, cases: list[tuple]) -> list[tuple[float, float]]:
    out = []
    for n_samples, window, factor, conv_norm in cases:
        enc = make_encoder(window, factor, conv_norm)
        feats, feat_lens = clip_features(n_samples)
        ref, lens = enc(feats, feat_lens, packed=True)
        L = int(lens[0])
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
        params = list(enc.parameters())
        g_ref = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
        lo, hi = shard_bounds(L, world)[rank]
        got = forward_sharded_parakeet(
            enc.model, feats, (lo, hi), enc.n_convs, enc.att_context, HaloExchange(None)
        )
        g_got = torch.autograd.grad((got * w[lo:hi]).sum(), params, allow_unused=True)
        out_err = float((got - ref[lo:hi]).abs().max()) / max(1.0, float(ref.abs().max()))
        grad_err = 0.0
        for a, b in zip(g_got, g_ref, strict=True):
            a = torch.zeros_like(b) if a is None else a.clone()
            dist.all_reduce(a)  # the sum over ranks, as FSDP's reduction gives it
            b = torch.zeros_like(a) if b is None else b
            grad_err = max(grad_err, float((a - b).abs().max()) / max(1.0, float(b.abs().max())))
        out.append((out_err, grad_err))
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "world, cases",
    [
        (
            2,
            [
                (48_123, (3, 2), 8, "layer_norm"),
                (30_011, (5, 1), 4, "layer_norm"),
                (41_000, (4, 4), 8, "batch_norm"),
            ],
        ),
        (3, [(52_345, (2, 3), 8, "layer_norm")]),
        (4, [(61_234, (3, 3), 8, "layer_norm")]),
    ],
)
def test_sharded_encoder_equals_the_unsharded_one_in_outputs_and_gradients(world, cases):
    for rank_results in run_distributed(_compare_sharded, world, "gloo", cases):
        for case, (out_err, grad_err) in zip(cases, rank_results, strict=True):
            assert out_err < 1e-5 and grad_err < 1e-5, (case, out_err, grad_err)


@pytest.mark.parametrize("factor", [4, 8])
def test_the_subsampling_window_is_exact_for_every_slice(factor):
    enc = make_encoder((2, 2), factor)
    feats, feat_lens = clip_features(23_457)
    full, lens = _subsample(enc.model.subsampling, feats, feat_lens, enc.n_convs)
    L = int(lens[0])
    for lo, hi in [(0, 1), (0, L), (L - 1, L), (3, 9), (L // 2, L - 2), (1, 2)]:
        got = subsample_window(enc.model.subsampling, feats, lo, hi, enc.n_convs)
        torch.testing.assert_close(got, full[lo:hi], rtol=1e-5, atol=1e-6)


def test_batch_statistics_and_full_context_are_refused_with_the_reason():
    feats, _ = clip_features(8000)
    enc = make_encoder((2, 2), conv_norm="batch_norm", freeze_batchnorm=False)
    with pytest.raises(ValueError, match="BatchNorm on batch statistics .* over a sharded clip"):
        forward_sharded_parakeet(enc.model, feats, (0, 5), enc.n_convs, enc.att_context, HaloExchange(None))
    enc = make_encoder(None)
    with pytest.raises(ValueError, match="limited-context attention only"):
        forward_sharded_parakeet(enc.model, feats, (0, 5), enc.n_convs, None, HaloExchange(None))


def test_without_the_halo_the_slice_differs_at_its_edge():
    """The exchange is what makes a slice exact: with none (each rank alone, its slice edges treated as the
    clip's ends) the frames near the cut differ, the ones far from it do not (the check has teeth)."""
    enc = make_encoder((3, 2))
    feats, feat_lens = clip_features(48_123)
    ref, lens = enc(feats, feat_lens, packed=True)
    lo, hi = shard_bounds(int(lens[0]), 2)[0]
    alone = forward_sharded_parakeet(
        enc.model, feats, (lo, hi), enc.n_convs, enc.att_context, lambda x, left, right: (x, 0, 0)
    )
    assert float((alone[-1] - ref[hi - 1]).detach().abs().max()) > 1e-3
    torch.testing.assert_close(alone[:2], ref[lo : lo + 2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, cp, stack", [(45_003, 2, 2), (101, 3, 2), (97, 4, 3)])
def test_the_projector_on_stack_aligned_slices_equals_the_whole_clip(length, cp, stack):
    """With the cuts on multiples of the projector's stack (`shard_bounds(..., align=stack)`), each rank's
    projector stacks whole groups of its own frames: its rows are exactly the whole clip's rows
    ``[lo / stack, ceil(hi / stack))``, and the slices' rows tile the clip's."""
    from speechlm.model.projector import FrameStackProjector

    torch.manual_seed(0)
    proj = FrameStackProjector(8, 6, stack, 16)
    x = torch.randn(length, 8)
    whole, _ = proj(x, torch.tensor([length]))
    rows = []
    for lo, hi in shard_bounds(length, cp, align=stack):
        assert lo % stack == 0
        part, _ = proj(x[lo:hi], torch.tensor([hi - lo]))
        torch.testing.assert_close(part, whole[lo // stack : -(-hi // stack)])
        rows.append(part)
    torch.testing.assert_close(torch.cat(rows), whole)


def _window_features(rank: int, world: int, n_samples: int, window: tuple[int, int]) -> tuple[float, float]:
    """Each rank computes the feature frames its slice reads (`frames_of_clip`, the statistics all-reduced
    over the group) and encodes from them alone: equal to the whole clip's features and encoder rows."""
    from parallel.sharded_clip import reduce_sum
    from speechlm.model.sharded_encoder import feature_span

    enc = make_encoder(window)
    audio = torch.randn(1, n_samples + 321, generator=torch.Generator().manual_seed(1)) * 0.1
    feats, feat_lens = LogMelFeatures().packed(audio, torch.tensor([n_samples]))
    ref, lens = enc(feats, feat_lens, packed=True)
    T, f = int(feat_lens[0]), 2**enc.n_convs
    lo, hi = shard_bounds(int(lens[0]), world)[rank]
    span = feature_span(lo, hi, enc.n_convs, T)
    own = (min(f * lo, T), min(f * hi, T))
    got = LogMelFeatures().frames_of_clip(audio[0], n_samples, span, own, lambda x: reduce_sum(x, None))
    feat_err = float((got - feats[span[0] : span[1]]).abs().max())
    out = enc.forward_slice(got, (lo, hi), HaloExchange(None), feat_offset=span[0], feat_total=T)
    return feat_err, float((out - ref[lo:hi]).abs().max()) / max(1.0, float(ref.abs().max()))


@pytest.mark.multiproc
@pytest.mark.parametrize("world, n_samples", [(2, 48_123), (3, 52_345)])
def test_each_rank_computes_only_the_features_its_slice_reads(world, n_samples):
    for feat_err, out_err in run_distributed(_window_features, world, "gloo", n_samples, (3, 2)):
        assert feat_err < 1e-4 and out_err < 1e-5, (feat_err, out_err)


def test_windowed_features_refuse_a_span_that_does_not_hold_its_own_frames():
    audio = torch.randn(16_000)
    with pytest.raises(ValueError, match="must satisfy"):
        LogMelFeatures().frames_of_clip(audio, 16_000, (10, 20), (5, 20), lambda x: x)
    whole, _ = LogMelFeatures().packed(audio[None], torch.tensor([16_000]))
    one = LogMelFeatures().frames_of_clip(audio, 16_000, (0, 100), (0, 100), lambda x: x)
    torch.testing.assert_close(one, whole, rtol=1e-5, atol=2e-5)
