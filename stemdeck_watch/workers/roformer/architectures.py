"""BS-RoFormer and Mel-Band RoFormer, as the published checkpoints were trained.

Both take a batch of stereo (or mono) audio, go to a complex spectrogram, turn groups of
frequency bins ("bands") into feature vectors, run axial transformers over time and over
bands, and estimate one complex mask per stem that multiplies the mixture's spectrogram; the
inverse STFT gives each stem. They differ in the bands: BS-RoFormer's are contiguous and
listed in the configuration (`freqs_per_bands`); Mel-Band RoFormer's are `num_bands`
overlapping mel bands, and where bands overlap their masks are averaged.

The differences between the two training codes are kept because the checkpoints depend on
them: BS-RoFormer's transformers have no output norm and one `final_norm` follows them, its
mask MLPs have `mask_estimator_depth - 1` hidden layers; Mel-Band RoFormer's transformers
each end in a norm, there is no final norm, and its mask MLPs have `mask_estimator_depth`
hidden layers.

The spectral parts (STFT, masking, inverse STFT) run in float32 whatever autocast the caller
set, because complex tensors have no bfloat16 form; only the transformers and MLPs take the
reduced precision. `forward` always returns (batch, stems, channels, samples).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from einops import rearrange
from torch import nn

from stemdeck_watch.workers.roformer.layers import (
    BandSplit,
    MaskEstimator,
    RMSNorm,
    build_blocks,
    run_blocks,
)


class _Spectral(nn.Module):
    """What both architectures share: STFT settings, the transformer trunk, the masks."""

    def __init__(
        self,
        *,
        dim: int,
        depth: int,
        stereo: bool,
        num_stems: int,
        time_transformer_depth: int,
        freq_transformer_depth: int,
        linear_transformer_depth: int,
        dim_head: int,
        heads: int,
        stft_n_fft: int,
        stft_hop_length: int,
        stft_win_length: int,
        stft_normalized: bool,
        zero_dc: bool,
        skip_connection: bool,
        norm_output: bool,
    ):
        super().__init__()
        self.stereo = stereo
        self.audio_channels = 2 if stereo else 1
        self.num_stems = num_stems
        self.skip_connection = skip_connection
        self.zero_dc = zero_dc
        self.n_fft = stft_n_fft
        self.hop_length = stft_hop_length
        self.win_length = stft_win_length
        self.normalized = stft_normalized
        # the chunk separation runs it on, in samples, and their rate (the configuration's
        # audio section, set by whoever builds it from one): what a compiled model is built
        # and measured for (compiled/graph.py, compiled/model.py)
        self.chunk_size: int | None = None
        self.samplerate: int | None = None
        self.layers = build_blocks(
            dim=dim,
            depth=depth,
            heads=heads,
            dim_head=dim_head,
            time_depth=time_transformer_depth,
            freq_depth=freq_transformer_depth,
            linear_depth=linear_transformer_depth,
            norm_output=norm_output,
        )

    @property
    def freqs(self) -> int:
        return self.n_fft // 2 + 1

    def _stft(self, audio: torch.Tensor) -> torch.Tensor:
        """(b, s, t) → real view of the spectrogram, (b, f·s, frames, 2), bins of the two
        channels interleaved (bin 0 left, bin 0 right, bin 1 left, …) as in training."""
        if audio.ndim != 3 or audio.shape[1] != self.audio_channels:
            raise ValueError(
                f"the model takes (batch, {self.audio_channels}, samples) audio, "
                f"got {tuple(audio.shape)}"
            )
        batch, channels, _ = audio.shape
        window = torch.hann_window(self.win_length, device=audio.device)
        spec = torch.stft(
            audio.float().reshape(batch * channels, -1),
            n_fft=self.n_fft,
            hop_length=self.hop_length,
            win_length=self.win_length,
            normalized=self.normalized,
            window=window,
            return_complex=True,
        )
        spec = torch.view_as_real(spec).reshape(batch, channels, *spec.shape[-2:], 2)
        return rearrange(spec, "b s f t c -> b (f s) t c")

    def _istft(self, spec: torch.Tensor, length: int) -> torch.Tensor:
        """(b, n, f·s, frames) complex → (b, n, s, length) audio."""
        batch = spec.shape[0]
        flat = rearrange(spec, "b n (f s) t -> (b n s) f t", s=self.audio_channels)
        if self.zero_dc:
            flat = flat.index_fill(1, torch.tensor(0, device=flat.device), 0.0)
        window = torch.hann_window(self.win_length, device=flat.device)
        audio = torch.istft(
            flat,
            n_fft=self.n_fft,
            hop_length=self.hop_length,
            win_length=self.win_length,
            normalized=self.normalized,
            window=window,
            length=length,
        )
        return rearrange(audio, "(b n s) t -> b n s t", b=batch, s=self.audio_channels)

    def _trunk(self, features: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.layers, features, self.skip_connection)

    @staticmethod
    def _complex_masks(masks: torch.Tensor) -> torch.Tensor:
        """(b, n, t, f·2) real, any precision → (b, n, f, t) complex64."""
        masks = rearrange(masks.float(), "b n t (f c) -> b n f t c", c=2)
        return torch.view_as_complex(masks.contiguous())


class BSRoformer(_Spectral):
    """Band-split RoFormer: contiguous bands of `freqs_per_bands` bins each."""

    def __init__(
        self,
        *,
        freqs_per_bands: tuple[int, ...],
        mask_estimator_depth: int = 2,
        mlp_expansion_factor: int = 4,
        **common: Any,
    ):
        super().__init__(norm_output=False, **common)
        dim = common["dim"]
        if sum(freqs_per_bands) != self.freqs:
            raise ValueError(
                f"freqs_per_bands adds up to {sum(freqs_per_bands)} bins, but an STFT of "
                f"stft_n_fft={self.n_fft} has {self.freqs}"
            )
        dim_inputs = tuple(2 * bins * self.audio_channels for bins in freqs_per_bands)
        self.final_norm = RMSNorm(dim)
        self.band_split = BandSplit(dim, dim_inputs)
        self.mask_estimators = nn.ModuleList(
            MaskEstimator(dim, dim_inputs, mask_estimator_depth - 1, mlp_expansion_factor)
            for _ in range(self.num_stems)
        )

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        spec = self._stft(audio)
        x = self.band_split(rearrange(spec, "b f t c -> b t (f c)"))
        x = self.final_norm(self._trunk(x))
        masks = self._complex_masks(torch.stack([est(x) for est in self.mask_estimators], 1))
        mixture = torch.view_as_complex(spec.contiguous())[:, None]
        return self._istft(mixture * masks, audio.shape[-1])


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default): linear below 1 kHz, logarithmic above."""
    mel = hz / (200.0 / 3)
    log = hz >= 1000.0
    mel[log] = 15.0 + np.log(hz[log] / 1000.0) / (np.log(6.4) / 27.0)
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = mel * (200.0 / 3)
    log = mel >= 15.0
    hz[log] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel[log] - 15.0))
    return hz


def mel_bands(sample_rate: int, n_fft: int, num_bands: int) -> np.ndarray:
    """(bands, bins) bool: which STFT bins each mel band covers — where the Slaney mel filter
    bank (as `librosa.filters.mel(sr, n_fft, n_mels)` computes it, in the same float64
    steps, stored as float32) is positive, with the first bin forced into the first band and
    the last bin into the last (the bank leaves the first out, and the last is a rounding
    away from zero). Written out rather than imported: librosa's filters module pulls in
    scipy.signal, seconds of import for twenty lines of arithmetic."""
    bins = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    low, high = _hz_to_mel(np.array([0.0, sample_rate / 2.0]))
    mels = _mel_to_hz(np.linspace(low, high, num_bands + 2))
    widths = np.diff(mels)
    ramps = np.subtract.outer(mels, bins)
    bank = np.zeros((num_bands, len(bins)), dtype=np.float32)
    for band in range(num_bands):
        lower = -ramps[band] / widths[band]
        upper = ramps[band + 2] / widths[band + 1]
        bank[band] = np.maximum(0, np.minimum(lower, upper))
    bank *= (2.0 / (mels[2 : num_bands + 2] - mels[:num_bands]))[:, None]
    bank[0, 0] = 1.0
    bank[-1, -1] = 1.0
    covered = bank > 0
    if not covered.any(axis=0).all():
        raise ValueError(f"{num_bands} mel bands leave some of the {len(bins)} bins out")
    return covered


class MelBandRoformer(_Spectral):
    """Mel-band RoFormer: `num_bands` overlapping mel bands; overlapping masks are averaged."""

    freq_indices: torch.Tensor
    num_bands_per_freq: torch.Tensor

    def __init__(
        self,
        *,
        num_bands: int = 60,
        sample_rate: int = 44100,
        mask_estimator_depth: int = 1,
        mlp_expansion_factor: int = 4,
        **common: Any,
    ):
        super().__init__(norm_output=True, **common)
        dim = common["dim"]
        covered = mel_bands(sample_rate, self.n_fft, num_bands)
        channels = self.audio_channels
        bins = np.nonzero(covered)[1]  # band by band, each band's bins in order
        # index into the (bin, channel)-interleaved axis: bin b of channel s is b·channels + s
        indices = (bins[:, None] * channels + np.arange(channels)).reshape(-1)
        per_bin = covered.sum(0).repeat(channels)
        # built on the CPU even under a meta device: they are computed, never loaded
        self.register_buffer("freq_indices", torch.tensor(indices, device="cpu"), persistent=False)
        self.register_buffer(
            "num_bands_per_freq", torch.tensor(per_bin, device="cpu"), persistent=False
        )
        dim_inputs = tuple(2 * int(n) * channels for n in covered.sum(1))
        self.band_split = BandSplit(dim, dim_inputs)
        self.mask_estimators = nn.ModuleList(
            MaskEstimator(dim, dim_inputs, mask_estimator_depth, mlp_expansion_factor)
            for _ in range(self.num_stems)
        )

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        spec = self._stft(audio)
        # the band tables are built on the CPU (see __init__); a no-op once moved with .to()
        indices = self.freq_indices.to(spec.device)
        bands_per_bin = self.num_bands_per_freq.to(spec.device)
        x = self.band_split(rearrange(spec[:, indices], "b f t c -> b t (f c)"))
        x = self._trunk(x)
        masks = self._complex_masks(torch.stack([est(x) for est in self.mask_estimators], 1))
        mixture = torch.view_as_complex(spec.contiguous())[:, None]
        batch, stems, _, frames = masks.shape
        index = indices[None, None, :, None].expand(batch, stems, -1, frames)
        summed = torch.zeros(
            batch, stems, mixture.shape[2], frames, dtype=masks.dtype, device=masks.device
        ).scatter_add_(2, index, masks)
        averaged = summed / bands_per_bin[:, None].clamp(min=1)
        return self._istft(mixture * averaged, audio.shape[-1])


ARCHITECTURES: dict[str, type[_Spectral]] = {
    "bs_roformer": BSRoformer,
    "mel_band_roformer": MelBandRoformer,
}
