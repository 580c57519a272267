"""One owner per audio fact (`parallel.frames`, issue 37): the hop, the sample rate, each encoder kind's
subsampling and padding-free path, the encoder-frame arithmetic and the dummy clip, pinned against the
model's own arithmetic."""

from __future__ import annotations

import numpy as np
import torch

from parallel import frames
from parallel.clip_placement import short_clip_frames, slice_halo
from speechlm.data.sampler.cost import TokenCostModel
from speechlm.model.encoders import NemoAudioEncoder, ParakeetAudioEncoder, WhisperAudioEncoder
from speechlm.model.encoders.base import stride2_conv_lengths
from speechlm.model.features import FeatureSettings, compute_feature_lengths
from speechlm.model.flops import EncoderDims
from speechlm.model.flops import encoder_frames as flops_encoder_frames


def test_the_hop_is_10_ms_at_16_khz():
    assert (frames.SAMPLE_RATE, frames.HOP_SAMPLES, frames.FEATURE_FRAMES_PER_SECOND) == (16000, 160, 100)
    settings = FeatureSettings()
    assert (settings.sample_rate, settings.hop_length) == (frames.SAMPLE_RATE, frames.HOP_SAMPLES)
    assert frames.DUMMY_CLIP_SAMPLES == 1600  # 0.1 s


def test_feature_frames_are_the_models():
    samples = torch.arange(0, 50_000, 7)
    want = compute_feature_lengths(samples, frames.HOP_SAMPLES).tolist()
    assert [frames.feature_frames(int(n)) for n in samples] == want
    assert frames.feature_frames_of_seconds(2.5) == 250


def test_encoder_frames_are_the_stride2_convolutions():
    feats = torch.arange(0, 3000)
    for n_convs in (1, 2, 3, 4):
        conv = stride2_conv_lengths(feats, n_convs).tolist()
        assert [frames.encoder_frames(int(t), 2**n_convs) for t in feats] == conv
    dims = EncoderDims(subsampling=8)
    assert [flops_encoder_frames(dims, int(t)) for t in feats] == stride2_conv_lengths(feats, 3).tolist()


def test_each_kind_has_one_subsampling_and_padding_free_flag():
    assert frames.ENCODER_SUBSAMPLING == {"whisper": 2, "parakeet": 8, "nemo": 8}
    assert frames.PADDING_FREE_KINDS == {"parakeet"}
    for cls in (ParakeetAudioEncoder, WhisperAudioEncoder, NemoAudioEncoder):
        assert cls.kind in frames.ENCODER_SUBSAMPLING
        assert cls.supports_packed == (cls.kind in frames.PADDING_FREE_KINDS)


def test_the_planner_counts_from_seconds_and_may_count_one_frame_more():
    assert frames.planned_encoder_frames(3600, 8) == 45_000
    assert short_clip_frames(8) == 375
    # 1.0001 s: the planner counts 101 feature frames, the model 100 (1600 samples // 160)
    assert frames.planned_encoder_frames(1.0001, 1) == 101
    assert frames.feature_frames_of_seconds(1.0001) == 100
    durations = np.array([0.0, 0.5, 1.0001, 3.3, 29.99, 600.0])
    vector = frames.planned_encoder_frames(durations, 8, ceil=np.ceil)
    assert vector.tolist() == [frames.planned_encoder_frames(float(d), 8) for d in durations]
    tokens = TokenCostModel(encoder_subsampling=8, projector_stack=2, prompt_tokens=0).count_tokens(durations)
    assert tokens.tolist() == [-(-int(u) // 2) for u in vector]


def test_the_slice_halo_is_the_window_or_half_the_kernel():
    assert slice_halo((4, 4), 9) == 4
    assert slice_halo((32, 16), 9) == 32
    assert slice_halo((1, 2), 31) == 15
