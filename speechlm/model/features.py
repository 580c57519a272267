"""Log-mel front end in torch: waveform batch -> normalised log-mel frames, on any device.

Letters: B batch, N audio samples, T feature frames, F mel bins, K frequency bins (n_fft // 2 + 1).

Recipe (the defaults match the FastConformer/Parakeet front end):
1. optional pre-emphasis ``y[n] = x[n] - 0.97 x[n-1]`` inside each clip (samples past the clip's
   length are zeroed first, so a clip gives the same features alone or in a padded batch);
2. ``torch.stft``: Hann window of ``win_length`` (25 ms = 400 samples at 16 kHz) centred in an
   ``n_fft`` (512) frame, hop 10 ms (160), centred frames with zero padding at both ends;
3. power spectrum ``|X|^2`` -> mel filterbank (slaney or HTK scale, built here) -> ``[B, T, F]``;
4. log: ``ln(mel + 2**-24)``, then per-utterance, per-bin mean/variance normalisation over the
   clip's own frames (``(x - mean) / (std + 1e-5)``, unbiased std);
5. frame count per clip ``feat_len = audio_len // hop``; frames past it are set to 0.

Whisper (``log_style="whisper"``, `LogMelFeatures._forward_whisper`) computes what Whisper's own
extractor (transformers' ``WhisperFeatureExtractor``) computes on the clip padded with zeros to 30 s,
frame for frame: the STFT pads the start by reflecting the clip's first ``n_fft // 2`` samples (the
zero padding of 30 s makes the end's padding zeros), the power spectrum goes through the slaney mel
bank, then ``log10(max(mel, 1e-10))``, floored at the maximum minus 8 over the whole window, then
``(x + 4) / 4``. The tensor holds `whisper_tail_frames` frames past the longest clip's ``feat_len``:
the frames whose window still reads the end of a clip, then one that reads only zeros (the floor,
exactly). Frames past a clip's end keep these values (its tail, then its floor), as in Whisper's
window; the encoder fills the rest of the 30 s with the floor (`speechlm.model.encoders.whisper`).

Packed variant (`LogMelFeatures.packed`, ``"ln"`` style): instead of an STFT over the padded
batch, the clips are laid out in one stream, clip b starting ``n_fft // 2`` samples into a segment
that starts at a multiple of ``hop`` and is ``hop * ceil((len_b + n_fft // 2) / hop)`` samples long
(zeros around the clip). One uncentred STFT over the stream then computes, at stream frame
``start_b / hop + t``, exactly the centred frame t of clip b (the same window over the same samples,
zeros where the centred STFT pads). Only the clip's ``len_b // hop`` frames are kept (two or three
frames per clip are computed for the gaps); normalisation statistics are per-clip segment sums.
Output ``[sum T_b, F]``, equal per clip to the padded path.

Pad frames never influence real ones, which keeps the encoder's per-utterance outputs independent
of how clips were batched (needed for the CP layout-equivalence guarantee).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from parallel.frames import HOP_SAMPLES, SAMPLE_RATE
from speechlm.model.packed_encoder import segment_rows

LN_LOG_GUARD = 2.0**-24
NORM_EPS = 1e-5


@dataclass(frozen=True)
class FeatureSettings:
    """Everything that defines the front end; an encoder carries the settings it was trained with."""

    n_mels: int = 80
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = HOP_SAMPLES
    preemphasis: float = 0.97  # 0 disables it
    log_style: str = "ln"  # "ln" (Parakeet/NeMo, per-feature normalised) or "whisper"
    normalize: bool = True  # per-utterance, per-bin normalisation (ln style only)
    mel_scale: str = "slaney"  # "slaney" or "htk"
    mel_norm: str | None = "slaney"  # "slaney" (area normalisation) or None
    window_periodic: bool = False
    f_min: float = 0.0
    f_max: float | None = None  # default: sample_rate / 2


def hz_to_mel(freq_hz: Tensor, scale: str = "slaney") -> Tensor:
    """Convert Hz to mels: HTK ``2595 log10(1 + f/700)``, or slaney (linear below 1 kHz, log above)."""
    if scale == "htk":
        return 2595.0 * torch.log10(1.0 + freq_hz / 700.0)
    if scale != "slaney":
        raise ValueError(f"mel scale {scale!r} is not known; use 'slaney' or 'htk'")
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    log_step = math.log(6.4) / 27.0
    linear = freq_hz / f_sp
    logpart = min_log_mel + torch.log(torch.clamp(freq_hz, min=min_log_hz) / min_log_hz) / log_step
    return torch.where(freq_hz >= min_log_hz, logpart, linear)


def mel_to_hz(mels: Tensor, scale: str = "slaney") -> Tensor:
    """Inverse of `hz_to_mel`."""
    if scale == "htk":
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    if scale != "slaney":
        raise ValueError(f"mel scale {scale!r} is not known; use 'slaney' or 'htk'")
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    log_step = math.log(6.4) / 27.0
    linear = mels * f_sp
    logpart = min_log_hz * torch.exp(log_step * (mels - min_log_mel))
    return torch.where(mels >= min_log_mel, logpart, linear)


def build_mel_filterbank(
    n_mels: int,
    n_fft: int,
    sample_rate: int,
    *,
    f_min: float = 0.0,
    f_max: float | None = None,
    scale: str = "slaney",
    norm: str | None = "slaney",
) -> Tensor:
    """Return ``fb_KF``: triangular filters over the ``K = n_fft // 2 + 1`` STFT bins, in float64.

    Filter ``m`` rises linearly from mel point ``m`` to ``m + 1`` and falls to ``m + 2`` (the points
    are evenly spaced in mels between ``f_min`` and ``f_max``). Slaney norm scales each filter to
    unit area in Hz (``2 / (f_{m+2} - f_m)``).
    """
    f_max = sample_rate / 2.0 if f_max is None else f_max
    fft_hz_K = torch.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1, dtype=torch.float64)
    lo, hi = hz_to_mel(torch.tensor([f_min, f_max], dtype=torch.float64), scale)
    points_hz = mel_to_hz(torch.linspace(float(lo), float(hi), n_mels + 2, dtype=torch.float64), scale)
    left, centre, right = points_hz[:-2], points_hz[1:-1], points_hz[2:]
    rising = (fft_hz_K[:, None] - left[None, :]) / (centre - left)[None, :]
    falling = (right[None, :] - fft_hz_K[:, None]) / (right - centre)[None, :]
    fb_KF = torch.clamp(torch.minimum(rising, falling), min=0.0)
    if norm == "slaney":
        fb_KF = fb_KF * (2.0 / (right - left))[None, :]
    elif norm is not None:
        raise ValueError(f"mel norm {norm!r} is not known; use 'slaney' or None")
    return fb_KF


def whisper_tail_frames(settings: FeatureSettings) -> int:
    """Frames a whisper-style feature tensor holds past the longest clip's ``feat_len``: frame
    ``feat_len + j`` reads samples up to ``(feat_len + j) * hop + n_fft // 2``, so the last ones to read the
    clip's end are ``j <= (n_fft // 2) // hop + 1``; one more reads only zeros (the floor)."""
    return (settings.n_fft // 2) // settings.hop_length + 3


def compute_feature_lengths(audio_lens_B: Tensor, hop_length: int) -> Tensor:
    """Frames per clip: ``audio_len // hop`` (the centred STFT's extra last frame is dropped)."""
    return torch.div(audio_lens_B.to(torch.long), hop_length, rounding_mode="floor")


class LogMelFeatures(nn.Module):
    """``forward(audio_BN, audio_lens_B) -> (feats_BTF, feat_lens_B)``; see the module docstring."""

    def __init__(self, settings: FeatureSettings | None = None) -> None:
        super().__init__()
        s = settings or FeatureSettings()
        if s.log_style not in ("ln", "whisper"):
            raise ValueError(f"log_style {s.log_style!r} is not known; use 'ln' or 'whisper'")
        if s.log_style == "whisper" and s.preemphasis:
            raise ValueError(
                f"log_style='whisper' has no pre-emphasis (Whisper's front end), got preemphasis={s.preemphasis}; "
                "set preemphasis=0"
            )
        if s.win_length > s.n_fft:
            raise ValueError(f"win_length {s.win_length} is longer than n_fft {s.n_fft}")
        self.settings = s
        fb_KF = build_mel_filterbank(
            s.n_mels, s.n_fft, s.sample_rate, f_min=s.f_min, f_max=s.f_max, scale=s.mel_scale, norm=s.mel_norm
        )
        self.mel_fb_KF: Tensor
        self.window: Tensor
        self.register_buffer("mel_fb_KF", fb_KF.to(torch.float32), persistent=False)
        window = torch.hann_window(s.win_length, periodic=s.window_periodic, dtype=torch.float32)
        self.register_buffer("window", window, persistent=False)

    @property
    def n_mels(self) -> int:
        return self.settings.n_mels

    def forward(self, audio_BN: Tensor, audio_lens_B: Tensor) -> tuple[Tensor, Tensor]:
        s = self.settings
        if audio_BN.dim() != 2:
            raise ValueError(f"audio must be [B, N] (mono, padded), got shape {tuple(audio_BN.shape)}")
        device = audio_BN.device
        lens_B = audio_lens_B.to(device=device, dtype=torch.long)
        with torch.autocast(device_type=device.type, enabled=False):
            x_BN = audio_BN.float()
            valid_BN = torch.arange(x_BN.shape[1], device=device)[None, :] < lens_B[:, None]
            x_BN = x_BN.masked_fill(~valid_BN, 0.0)
            if s.log_style == "whisper":
                return self._forward_whisper(x_BN, lens_B)
            if s.preemphasis:
                x_BN = torch.cat([x_BN[:, :1], x_BN[:, 1:] - s.preemphasis * x_BN[:, :-1]], dim=1)
                x_BN = x_BN.masked_fill(~valid_BN, 0.0)
            spec_BKT = torch.stft(
                x_BN,
                n_fft=s.n_fft,
                hop_length=s.hop_length,
                win_length=s.win_length,
                window=self.window,
                center=True,
                pad_mode="constant",
                return_complex=True,
            )
            power_BTK = spec_BKT.abs().pow(2).transpose(1, 2)
            mel_BTF = power_BTK @ self.mel_fb_KF
            feat_lens_B = compute_feature_lengths(lens_B, s.hop_length)
            T = int(feat_lens_B.max()) if feat_lens_B.numel() else 0
            mel_BTF = mel_BTF[:, :T]
            valid_BT1 = (torch.arange(T, device=device)[None, :] < feat_lens_B[:, None]).unsqueeze(-1)
            feats_BTF = self._log_ln(mel_BTF, valid_BT1, feat_lens_B)
        return feats_BTF, feat_lens_B

    def _forward_whisper(self, x_BN: Tensor, lens_B: Tensor) -> tuple[Tensor, Tensor]:
        """Whisper's log-mel of each clip (zeros past its length), as in its zero-padded 30 s window: the
        start padded by reflection, ``feat_len + whisper_tail_frames`` frames (module docstring)."""
        s = self.settings
        half, hop = s.n_fft // 2, s.hop_length
        feat_lens_B = compute_feature_lengths(lens_B, hop)
        B = x_BN.shape[0]
        T = (int(feat_lens_B.max()) if B else 0) + whisper_tail_frames(s)
        # frame t reads padded samples [t hop, t hop + n_fft): half reflected samples, the clip, zeros
        width = (T - 1) * hop + s.n_fft
        x_BN = nn.functional.pad(x_BN, (0, max(half + 1 - x_BN.shape[1], 0)))
        stream_BN = torch.cat([x_BN[:, 1 : half + 1].flip(1), x_BN], dim=1)
        stream_BN = nn.functional.pad(stream_BN, (0, max(width - stream_BN.shape[1], 0)))[:, :width]
        spec_BKT = self._stft_uncentred(stream_BN)
        mel_BTF = spec_BKT.abs().pow(2).transpose(1, 2) @ self.mel_fb_KF
        log_BTF = torch.clamp(mel_BTF, min=1e-10).log10()
        peak_B11 = log_BTF.amax(dim=(1, 2), keepdim=True)
        log_BTF = torch.maximum(log_BTF, peak_B11 - 8.0)
        return (log_BTF + 4.0) / 4.0, feat_lens_B

    def packed(self, audio_BN: Tensor, audio_lens_B: Tensor) -> tuple[Tensor, Tensor]:
        """Packed features ``(feats_TF [sum T_b, F], feat_lens_B)`` from padded audio (module docstring)."""
        s = self.settings
        if s.log_style != "ln":
            raise ValueError(
                f"packed features support log_style='ln' only, got {s.log_style!r} (a Whisper front end); "
                "set model.encoder.packed=false"
            )
        if audio_BN.dim() != 2:
            raise ValueError(f"audio must be [B, N] (mono, padded), got shape {tuple(audio_BN.shape)}")
        device = audio_BN.device
        lens_B = audio_lens_B.to(device=device, dtype=torch.long)
        half, hop = s.n_fft // 2, s.hop_length
        with torch.autocast(device_type=device.type, enabled=False):
            seg_B = torch.div(lens_B + half + hop - 1, hop, rounding_mode="floor") * hop
            starts_B = torch.cumsum(seg_B, 0) - seg_B
            src = segment_rows(torch.arange(lens_B.numel(), device=device) * audio_BN.shape[1], lens_B)
            dest = segment_rows(starts_B + half, lens_B)
            stream = audio_BN.new_zeros(int(seg_B.sum()) + s.n_fft, dtype=torch.float32)
            stream = stream.index_copy(0, dest, audio_BN.float().reshape(-1).index_select(0, src))
            if s.preemphasis:
                keep = torch.zeros_like(stream, dtype=torch.bool).index_fill(0, dest, True)
                stream = torch.cat([stream[:1], stream[1:] - s.preemphasis * stream[:-1]])
                stream = stream.masked_fill(~keep, 0.0)
            spec_KS = self._stft_uncentred(stream)
            feat_lens_B = compute_feature_lengths(lens_B, hop)
            total = int(feat_lens_B.sum())
            clip_T = torch.repeat_interleave(
                torch.arange(lens_B.numel(), device=device), feat_lens_B, output_size=total
            )
            first_B = torch.cumsum(feat_lens_B, 0) - feat_lens_B
            frame_T = torch.div(starts_B, hop, rounding_mode="floor")[clip_T] + (
                torch.arange(total, device=device) - first_B[clip_T]
            )
            power_TK = spec_KS.index_select(1, frame_T).abs().pow(2).t()
            x_TF = torch.log(power_TK @ self.mel_fb_KF + LN_LOG_GUARD)
            if s.normalize:
                x_TF = self._normalize_segments(x_TF, clip_T, feat_lens_B)
        return x_TF, feat_lens_B

    def _stft_uncentred(self, stream: Tensor) -> Tensor:
        """``[K, frames]``: the complex STFT of a sample stream, frame j over samples ``[j hop, j hop + n_fft)``."""
        s = self.settings
        return torch.stft(
            stream,
            n_fft=s.n_fft,
            hop_length=s.hop_length,
            win_length=s.win_length,
            window=self.window,
            center=False,
            return_complex=True,
        )

    def frames_of_clip(
        self,
        audio_N: Tensor,
        n_samples: int,
        span: tuple[int, int],
        own: tuple[int, int],
        reduce_sum: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """Feature frames ``span = [a, b)`` ``[b - a, F]`` of ONE clip (``audio_N``, its first ``n_samples``
        real), computed from the samples those frames cover only, as `packed` computes them for the whole
        clip: a clip sharded over the CP group (`speechlm.model.sharded_encoder`) computes on each rank the
        frames its slice reads. The per-bin normalisation needs the whole clip's statistics: each rank sums
        its ``own`` frames (the ranks' ``own`` ranges partition the clip's frames), and ``reduce_sum`` adds
        the ranks' sums (an all-reduce over the CP group; no gradient flows through features)."""
        s = self.settings
        if s.log_style != "ln":
            raise ValueError(f"windowed features support log_style='ln' only, got {s.log_style!r}")
        a, b = span
        c, d = own
        hop, half = s.hop_length, s.n_fft // 2
        if not 0 <= a <= c <= d <= b <= n_samples // hop or a == b:
            raise ValueError(
                f"span={span} and own={own} must satisfy 0 <= a <= c <= d <= b <= {n_samples // hop} frames, a < b"
            )
        device = audio_N.device
        with torch.autocast(device_type=device.type, enabled=False):
            first = a * hop - half - 1  # the sample before the window: pre-emphasis reads it
            length = (b - a - 1) * hop + s.n_fft + 1
            src_lo, src_hi = max(first, 0), min(first + length, n_samples)
            seg = audio_N.new_zeros(length, dtype=torch.float32)
            seg[src_lo - first : src_hi - first] = audio_N[src_lo:src_hi].float()
            if s.preemphasis:
                real = torch.arange(first, first + length, device=device)
                keep = (real >= 0) & (real < n_samples)
                seg = torch.cat([seg[:1], seg[1:] - s.preemphasis * seg[:-1]]).masked_fill(~keep, 0.0)
            spec_KT = self._stft_uncentred(seg[1:])
            x_TF = torch.log(spec_KT.abs().pow(2).t() @ self.mel_fb_KF + LN_LOG_GUARD)
            if not s.normalize:
                return x_TF
            mine = x_TF[c - a : d - a].double()
            total = reduce_sum(torch.cat([mine.sum(0), mine.new_tensor([float(d - c)])]))
            n = float(total[-1])
            mean_F = total[:-1] / max(n, 1.0)
            var_F = reduce_sum(((mine - mean_F) ** 2).sum(0)) / max(n - 1.0, 1.0)
            return ((x_TF - mean_F.float()) / (var_F.sqrt().float() + NORM_EPS)).contiguous()

    @staticmethod
    def _normalize_segments(x_TF: Tensor, clip_T: Tensor, feat_lens_B: Tensor) -> Tensor:
        """Per-clip, per-bin ``(x - mean) / (std + eps)`` (unbiased std) with segment sums."""
        B = feat_lens_B.numel()
        n_B1 = feat_lens_B.clamp(min=1).to(x_TF.dtype)[:, None]
        mean_BF = x_TF.new_zeros(B, x_TF.shape[1]).index_add(0, clip_T, x_TF) / n_B1
        centred_TF = x_TF - mean_BF[clip_T]
        var_BF = x_TF.new_zeros(B, x_TF.shape[1]).index_add(0, clip_T, centred_TF**2)
        var_BF = var_BF / (n_B1 - 1).clamp(min=1)
        return centred_TF / (var_BF.sqrt() + NORM_EPS)[clip_T]

    def _log_ln(self, mel_BTF: Tensor, valid_BT1: Tensor, feat_lens_B: Tensor) -> Tensor:
        x_BTF = torch.log(mel_BTF + LN_LOG_GUARD)
        if self.settings.normalize:
            n_B11 = feat_lens_B.clamp(min=1).to(x_BTF.dtype)[:, None, None]
            masked = x_BTF.masked_fill(~valid_BT1, 0.0)
            mean_B1F = masked.sum(dim=1, keepdim=True) / n_B11
            var_B1F = ((masked - mean_B1F).masked_fill(~valid_BT1, 0.0) ** 2).sum(dim=1, keepdim=True)
            var_B1F = var_B1F / (n_B11 - 1).clamp(min=1)
            x_BTF = (x_BTF - mean_B1F) / (var_B1F.sqrt() + NORM_EPS)
        return x_BTF.masked_fill(~valid_BT1, 0.0)
