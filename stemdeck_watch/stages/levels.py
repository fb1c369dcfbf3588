"""Levels of a song folder: the one gain that keeps every file from clipping, how far the
stems' sum is from the input (the residual), and each file's integrated loudness.

Stems are only useful in a session if they add back up to the song: a stem scaled down on
its own (to keep it from clipping) no longer sums to the mix. So clipping is avoided with one
gain for the whole song, the same for every stem and mix, and the manifest records it with
the residual — the input minus the sum of the stems, in dB relative to the input — so a
person can see how much of the song the model left out, and undo the gain exactly.

Loudness is ITU-R BS.1770-4 integrated loudness (LUFS), computed block by block: the
K-weighting filters are pyloudnorm's (its coefficients, run with carried filter state), and
only one mean square per 100 ms step is kept (36,000 numbers for an hour), from which the
400 ms gating blocks with 75 % overlap are formed at the end, as pyloudnorm does for a
whole signal at once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np

from stemdeck_watch.stages.scratch import AudioReader

GATE_ABSOLUTE = -70.0  # LUFS
GATE_RELATIVE = -10.0  # LU below the absolutely gated loudness
STEPS_PER_BLOCK = 4  # 400 ms blocks, 100 ms apart
CHANNEL_WEIGHTS = (1.0, 1.0, 1.0, 1.41, 1.41)  # L, R, C, Ls, Rs (BS.1770)


def to_db(ratio: float) -> float | None:
    """An energy ratio in dB (two decimals), or None where it has none (silence)."""
    if not ratio > 0 or not math.isfinite(ratio):
        return None
    return round(10.0 * math.log10(ratio), 2)


class LoudnessMeter:
    """Integrated loudness of a (channels, n) signal fed block by block, in LUFS."""

    def __init__(self, samplerate: int, channels: int):
        import pyloudnorm
        from scipy import signal

        self._sosfilt = signal.sosfilt
        meter = pyloudnorm.Meter(samplerate)  # K-weighting: high shelf, then high pass
        # both biquads as one cascade, every channel in one call (a quarter of the calls of
        # one filter per stage and channel, about half the CPU); their pass-band gains, applied
        # after each stage by pyloudnorm, are linear: applied once, squared, to the squares
        stages = list(meter._filters.values())
        self._sos = np.array([np.concatenate([f.b, f.a]) / f.a[0] for f in stages], np.float64)
        self._state = np.zeros((len(stages), channels, 2))
        gain = float(np.prod([f.passband_gain for f in stages]))
        self._weights = gain**2 * np.array(
            [CHANNEL_WEIGHTS[min(c, len(CHANNEL_WEIGHTS) - 1)] for c in range(channels)]
        )
        self.samplerate = samplerate
        self.step = round(samplerate * 0.1)
        self._pending = np.zeros(0)  # weighted squares of a step not yet complete
        self._steps: list[np.ndarray] = []  # weighted sum of squares per complete step

    def add(self, block: np.ndarray) -> None:
        if not block.shape[-1]:
            return
        filtered, self._state = self._sosfilt(
            self._sos, block.astype(np.float64), axis=-1, zi=self._state
        )
        np.square(filtered, out=filtered)
        squares = self._weights @ filtered
        pending = np.concatenate([self._pending, squares])
        whole = len(pending) // self.step * self.step
        if whole:
            self._steps.append(pending[:whole].reshape(-1, self.step).sum(axis=1))
        self._pending = pending[whole:]

    def integrated(self) -> float | None:
        """LUFS (two decimals), or None for a signal below the absolute gate (silence) or
        shorter than one 400 ms block."""
        steps = np.concatenate(self._steps) if self._steps else np.zeros(0)
        if len(steps) < STEPS_PER_BLOCK:
            return None
        sums = np.convolve(steps, np.ones(STEPS_PER_BLOCK), mode="valid")
        energy = sums / (STEPS_PER_BLOCK * self.step)
        with np.errstate(divide="ignore"):
            loudness = -0.691 + 10.0 * np.log10(energy)
        gated = energy[loudness >= GATE_ABSOLUTE]
        if not gated.size:
            return None
        relative = -0.691 + 10.0 * math.log10(float(gated.mean())) + GATE_RELATIVE
        kept = energy[(loudness > relative) & (loudness > GATE_ABSOLUTE)]
        if not kept.size:
            return None
        return round(-0.691 + 10.0 * math.log10(float(kept.mean())), 2)


class Residual:
    """The energy of the input and of the input minus the sum of the stems, block by block."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.error = 0.0

    def add(self, source: np.ndarray, total: np.ndarray) -> None:
        n = min(source.shape[-1], total.shape[-1])
        self.signal += _energy(source[..., :n])
        self.error += _energy(source[..., :n] - total[..., :n])

    @property
    def db(self) -> float | None:
        """The residual's energy relative to the input's, in dB (negative: below it); None
        for a silent input. An exact sum is reported as -200 dB, never -inf (JSON)."""
        if not self.signal > 0:
            return None
        db = to_db(self.error / self.signal)
        return -200.0 if db is None else max(-200.0, db)


def song_gain(
    outputs: list[list[str]],
    readers: dict[str, AudioReader],
    frames: int,
    block_frames: int,
    rescale: bool,
    source: Path | None,
    check: Callable[[], None] = lambda: None,
) -> tuple[float, Residual | None]:
    """The one factor every output is divided by — 1 unless `rescale` must bring the loudest
    output's peak (each output: the stems summed into it) below full scale — and the
    residual of the stems' sum against `source` (the decoded input), both from one pass that
    reads every stem once, block by block (`check`, which raises to cancel, before each)."""
    input_reader = AudioReader(source) if source is not None else None
    if input_reader is not None and input_reader.channels != next(iter(readers.values())).channels:
        input_reader = None  # not the input these stems were separated from
    if not rescale and input_reader is None:
        return 1.0, None
    residual = Residual() if input_reader is not None else None
    peak = 0.0
    for start in range(0, frames, block_frames):
        check()
        stop = min(frames, start + block_frames)
        blocks = {
            stem: reader.read(start, stop, interleaved=True) for stem, reader in readers.items()
        }
        if rescale:
            for members in outputs:
                audio = blocks[members[0]] if len(members) == 1 else _summed(blocks, members)
                if audio.size:
                    peak = max(peak, float(audio.max()), -float(audio.min()))
        if residual is not None and input_reader is not None:
            residual.add(input_reader.read(start, stop), _summed(blocks, list(blocks)))
    return max(1.01 * peak, 1.0), residual


def _energy(audio: np.ndarray) -> float:
    """The sum of squares of a float32 block, as a dot product (one pass, no float64 copy):
    off by about 1e-5 of itself (0.0001 dB), and zero only when every sample is."""
    flat = audio.reshape(-1)
    return float(np.dot(flat, flat))


def _summed(blocks: dict[str, np.ndarray], members: list[str]) -> np.ndarray:
    audio = blocks[members[0]].copy()
    for member in members[1:]:
        audio += blocks[member]
    return audio
