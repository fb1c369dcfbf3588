"""Short synthetic songs for the demo, `doctor`, the tests and the benchmarks.

A bass line, a chord pad, a vibrato "voice" and noise-burst drums: enough texture that every
stem of a model has something to do, made from numpy alone, written in any input format.
"""

from __future__ import annotations

import fractions
from pathlib import Path

import numpy as np

SAMPLERATE = 44100


def song(seconds: float, samplerate: int = SAMPLERATE, seed: int = 0) -> np.ndarray:
    """Stereo float32 audio, shape (frames, 2), peak below 1."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * samplerate))
    t = np.arange(n) / samplerate
    root = 55.0 * 2 ** (rng.integers(0, 12) / 12)
    beat = 0.5
    bar = (t // (4 * beat)).astype(int) % 4
    progression = np.array([0, 5, 7, 3])[bar]
    bass = 0.25 * np.sin(2 * np.pi * root * 2 ** (progression / 12) * t)
    pad = sum(
        0.08 * np.sin(2 * np.pi * root * 4 * 2 ** ((progression + i) / 12) * t) for i in (0, 4, 7)
    )
    voice = (
        0.15
        * np.sin(2 * np.pi * (root * 8 + 6 * np.sin(2 * np.pi * 5 * t)) * t)
        * (0.5 + 0.5 * np.sin(2 * np.pi * 0.25 * t))
    )
    phase = (t % beat) / beat
    drums = 0.3 * rng.standard_normal(n) * np.exp(-phase * 30)
    left = bass + pad + voice * 0.8 + drums
    right = bass + pad * 0.9 + voice + drums * 0.8
    audio = np.stack([left, right], axis=1)
    return (0.8 * audio / max(1e-9, np.abs(audio).max())).astype(np.float32)


def write_song(
    path: Path, seconds: float, samplerate: int = SAMPLERATE, seed: int = 0, channels: int = 2
) -> Path:
    """Write a synthetic song; the format follows the extension (wav, flac, ogg, mp3, m4a)."""
    audio = song(seconds, samplerate, seed)
    if channels == 1:
        audio = audio.mean(axis=1, keepdims=True)
    suffix = path.suffix.lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in (".m4a", ".mp4", ".aac", ".opus", ".webm", ".mkv"):
        _write_with_av(path, audio, samplerate)
        return path
    import soundfile

    formats = {
        ".wav": ("WAV", "PCM_16"),
        ".flac": ("FLAC", "PCM_16"),
        ".ogg": ("OGG", "VORBIS"),
        ".mp3": ("MP3", "MPEG_LAYER_III"),
        ".aiff": ("AIFF", "PCM_16"),
    }
    fmt, subtype = formats[suffix]
    soundfile.write(path, audio, samplerate, format=fmt, subtype=subtype)
    return path


def _write_with_av(path: Path, audio: np.ndarray, samplerate: int) -> None:
    import av

    codec = {".opus": "libopus", ".webm": "libopus"}.get(path.suffix.lower(), "aac")
    rate = 48000 if codec == "libopus" else samplerate
    if rate != samplerate:  # opus only takes 48 kHz: resample by linear interpolation
        n = int(len(audio) * rate / samplerate)
        x = np.linspace(0, len(audio) - 1, n)
        audio = np.stack(
            [np.interp(x, np.arange(len(audio)), audio[:, c]) for c in range(audio.shape[1])],
            axis=1,
        ).astype(np.float32)
    layout = "stereo" if audio.shape[1] == 2 else "mono"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        planar = np.ascontiguousarray(audio.T)
        size = 1024
        for start in range(0, planar.shape[1], size):
            frame = av.AudioFrame.from_ndarray(
                planar[:, start : start + size], format="fltp", layout=layout
            )
            frame.sample_rate = rate
            frame.pts = start  # timestamps let the muxer write the encoder delay (edit list)
            frame.time_base = fractions.Fraction(1, rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
