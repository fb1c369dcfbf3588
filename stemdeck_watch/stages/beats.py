"""The beat grid: tempo and beat times of a song, from its drums stem, with librosa.

librosa (and numba under it) takes seconds to import and to load its compiled beat tracker:
6–7 s for the first grid in a process on a 2-core AMD Zen 3. So it is imported here, inside
the step, never by the CLI; a service that will find beat grids has `warm` find one in a few
seconds of clicks as it starts, beside the model load, instead of on its first song.

Memory stays bounded for a song of any length: the stem is read block by block, mixed to
mono, resampled to 22.05 kHz by a streaming soxr resampler and turned into librosa's onset
strength envelope (one number per 23 ms) block by block; only that envelope — 0.6 MB for an
hour — reaches the beat tracker.

The tracker's tempo estimate is the mean of an autocorrelation tempogram over the whole song.
librosa builds that tempogram whole (8 s of lags for every frame, then its FFT): 0.6 GB for
15 minutes, several GB for an hour. Here the same mean is summed over blocks of frames
(`mean_tempogram`), so the estimate is librosa's and its memory does not grow with the song;
the tracker itself is then given that tempo and needs memory in proportion to the envelope.
The tempo written is the slope of the beat times the tracker found (least squares), which is
finer than the tempogram's own estimate (its lags are whole frames: at 120 BPM its neighbours
are 117.5 and 123 BPM).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from stemdeck_watch.stages.scratch import BLOCK_FRAMES

log = logging.getLogger(__name__)

RATE = 22050
HOP = 512
N_FFT = 2048
TOP_DB = 80.0
AC_SECONDS = 8.0  # librosa's tempo window (ac_size)
TEMPOGRAM_BLOCK = 2048  # envelope frames per block of the summed tempogram (~47 s of audio)
NO_DOWNBEATS = "librosa tracks beats, not bars: downbeats are not marked"
WARM_BPM = 120.0


class Frames(Protocol):
    """What the beat grid reads of a stem (an AudioReader, or audio in memory)."""

    @property
    def frames(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class _InMemory:
    def __init__(self, audio: np.ndarray):
        self.audio, self.frames = audio, int(audio.shape[1])

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.audio[:, start:stop]


def warm(samplerate: int = 44100) -> float:
    """Find the grid of a few seconds of clicks at WARM_BPM, loading what a beat grid uses;
    the tempo found."""
    from stemdeck_watch.stages.practice import Clicks

    beats = np.arange(int(6 * WARM_BPM / 60))
    onsets = np.round((0.25 + beats * 60 / WARM_BPM) * samplerate).astype(np.int64)
    audio = Clicks(onsets, beats % 4 == 0, samplerate).block(0, 6 * samplerate, 2)
    started = time.monotonic()
    tempo = beat_grid([_InMemory(audio)], samplerate, "clicks")["tempo"]
    log.info("beat grid ready: librosa loaded in %.1f s", time.monotonic() - started)
    return float(tempo or 0.0)


def beat_grid(
    readers: Sequence[Frames],
    samplerate: int,
    source: str,
    check: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """`beats.json`'s content for the sum of `readers` (the drums stem, or every stem = the
    mix): tempo in BPM, beat times in seconds, downbeats (none: see NO_DOWNBEATS) and a note
    when no beat was found. A song without a beat gives an empty grid, never an error."""
    import librosa

    envelope = onset_envelope(readers, samplerate, check=check)
    grid: dict[str, Any] = {
        "source": source,
        "tempo": None,
        "beats": [],
        "downbeats": [],
        "library": f"librosa {librosa.__version__}",
        "notes": [NO_DOWNBEATS],
    }
    if envelope.size < 2 or not envelope.any():
        grid["notes"].insert(0, "no beat found: the source is silent or has no onsets")
        return grid
    estimate = librosa.feature.tempo(
        tg=mean_tempogram(envelope, check), sr=RATE, hop_length=HOP, aggregate=None
    )
    tempo, frames = librosa.beat.beat_track(
        onset_envelope=envelope,
        sr=RATE,
        hop_length=HOP,
        bpm=float(np.atleast_1d(estimate).ravel()[0]),
    )
    times = librosa.frames_to_time(frames, sr=RATE, hop_length=HOP)
    if len(times) < 2:
        grid["notes"].insert(0, "no steady beat found")
        return grid
    grid["beats"] = [round(float(t), 4) for t in times]
    grid["tempo"] = round(_tempo(times, float(np.atleast_1d(tempo)[0])), 2)
    return grid


def mean_tempogram(
    envelope: np.ndarray, check: Callable[[], None] = lambda: None, block: int = TEMPOGRAM_BLOCK
) -> np.ndarray:
    """The time average of librosa's tempogram of `envelope` (shape: lags x 1), as
    `librosa.feature.tempo` takes it, summed block by block: each column needs only the
    envelope around its frame, so no more than `block` columns exist at once."""
    import librosa

    window = int(librosa.time_to_frames(AC_SECONDS, sr=RATE, hop_length=HOP))
    frames = envelope.shape[-1]
    # the centred tempogram's padding, as librosa.feature.tempogram pads
    padded = np.pad(envelope, window // 2, mode="linear_ramp", end_values=[0, 0])
    total = np.zeros(window, np.float64)
    for start in range(0, frames, block):
        check()
        stop = min(frames, start + block)
        part = librosa.feature.tempogram(
            onset_envelope=padded[start : stop + window - 1],
            sr=RATE,
            hop_length=HOP,
            win_length=window,
            center=False,
        )
        total += part.sum(axis=-1)
    return (total / max(frames, 1))[:, None]


def _tempo(times: np.ndarray, estimate: float) -> float:
    """BPM from the beat times (least-squares slope); the tracker's estimate if too few."""
    if len(times) < 4:
        return estimate
    slope = np.polyfit(np.arange(len(times)), times, 1)[0]
    return 60.0 / slope if slope > 0 else estimate


def onset_envelope(
    readers: Sequence[Frames],
    samplerate: int,
    block_frames: int = 4 * BLOCK_FRAMES,
    check: Callable[[], None] = lambda: None,
) -> np.ndarray:
    """librosa's onset strength envelope of the summed, mono, 22.05 kHz signal, computed
    block by block: log-mel frames (not centred) of each block, floored at TOP_DB below the
    loudest frame so far, differenced against the previous frame (carried across blocks),
    and aligned with what librosa computes from the whole signal at once."""
    import librosa
    import soxr

    frames = min(r.frames for r in readers)
    stream = soxr.ResampleStream(samplerate, RATE, 1, dtype="float32")
    pending = np.zeros(0, np.float32)
    previous: np.ndarray | None = None
    loudest = -np.inf
    # librosa's own envelope (centred frames, then shifted by n_fft/2 and the lag): ours
    # starts from frames that are not centred, hence twice the shift
    parts = [np.zeros(2 * (N_FFT // (2 * HOP)) + 1, np.float32)]
    for start in range(0, frames, block_frames):
        check()  # a cancel is honoured between blocks
        stop = min(frames, start + block_frames)
        mono = sum(r.read(start, stop) for r in readers).mean(axis=0)
        pending = np.concatenate([pending, stream.resample_chunk(mono, last=stop >= frames)])
        count = (len(pending) - N_FFT) // HOP + 1 if len(pending) >= N_FFT else 0
        if count <= 0:
            continue
        mel = librosa.feature.melspectrogram(
            y=pending[: (count - 1) * HOP + N_FFT],
            sr=RATE,
            n_fft=N_FFT,
            hop_length=HOP,
            center=False,
        )
        pending = pending[count * HOP :]
        db = librosa.power_to_db(mel, top_db=None)
        loudest = max(loudest, float(db.max()))
        db = np.maximum(db, loudest - TOP_DB)
        if previous is not None:
            db = np.concatenate([previous, db], axis=1)
        previous = db[:, -1:]
        if db.shape[1] > 1:
            strength = librosa.onset.onset_strength(S=db, sr=RATE, hop_length=HOP, center=False)
            parts.append(strength[1:].astype(np.float32))  # librosa pads one frame: the lag
    return np.concatenate(parts) if len(parts) > 1 else np.zeros(0, np.float32)
