"""Stems back at the input's sample rate, streamed block by block, to the exact frame count.

Demucs works at 44.1 kHz; a 48 kHz DAW session needs stems at 48 kHz that line up sample for
sample with the original. soxr (the SoX resampler, also what librosa uses) resamples a stream
with its delay compensated, so the stems start where the input starts; the last few samples
are padded or cut so that the length equals the input's frame count exactly (the decode and
this resample each round the length once).
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import numpy as np

from stemdeck_watch.util.validators import MP3_RATES


def target_rate(
    setting: str | int, model_rate: int, input_rate: int | None, fmt: str = "wav"
) -> int:
    """The rate the stems are written at for `output.samplerate`. mp3 holds only the MPEG
    rates: an input rate it cannot hold (96 kHz) becomes the next MPEG rate up, at most
    48 kHz (a fixed rate is checked at config load)."""
    if setting == "model":
        rate = model_rate
    elif setting == "input":
        rate = input_rate or model_rate
    else:
        rate = int(setting)
    if fmt == "mp3" and rate not in MP3_RATES:
        rate = min([r for r in MP3_RATES if r >= rate] or [MP3_RATES[-1]])
    return rate


def target_frames(
    setting: str | int,
    rate: int,
    model_rate: int,
    model_frames: int,
    input_rate: int | None,
    input_frames: int | None,
) -> int:
    """How many frames the stems have at `rate`: the input's own count for "input" (when
    known and kept), else the model's frames scaled to the rate."""
    if setting == "input" and input_frames and rate == input_rate:
        return input_frames
    return round(model_frames * rate / model_rate)


class Timed:
    """Seconds spent in a step that runs piecewise inside another (resampling inside the
    write loop), so the manifest can show what each optional step costs."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> Timed:
        self._started = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.seconds += time.perf_counter() - self._started


def resampled(
    blocks: Iterable[np.ndarray],
    in_rate: int,
    out_rate: int,
    channels: int,
    frames: int,
    timer: Timed | None = None,
) -> Iterator[np.ndarray]:
    """Resample (channels, n) float32 blocks from `in_rate` to `out_rate`; yields blocks
    whose lengths add up to exactly `frames`. Memory: one block plus soxr's filter state."""
    timer = timer or Timed()
    if in_rate == out_rate:
        yield from _exact(blocks, channels, frames)
        return
    import soxr

    stream = soxr.ResampleStream(in_rate, out_rate, channels, dtype="float32", quality="HQ")
    done = 0
    pending: np.ndarray | None = None
    for block in blocks:
        if pending is not None:
            with timer:
                out = stream.resample_chunk(np.ascontiguousarray(pending.T), last=False)
            done, chunk = _take(out.T, done, frames)
            if chunk.shape[1]:
                yield chunk
        pending = block
    with timer:
        last = (
            np.zeros((0, channels), np.float32)
            if pending is None
            else np.ascontiguousarray(pending.T)
        )
        out = stream.resample_chunk(last, last=True)
    done, chunk = _take(out.T, done, frames)
    if done < frames:  # soxr rounded the length down: pad the last few samples
        chunk = np.concatenate([chunk, np.zeros((channels, frames - done), np.float32)], axis=1)
    if chunk.shape[1]:
        yield chunk


def _take(out: np.ndarray, done: int, frames: int) -> tuple[int, np.ndarray]:
    # in the block's own memory order: the writer wants frame-major (`chunk.T` contiguous)
    chunk = out[:, : max(0, frames - done)].astype(np.float32, copy=False)
    return done + chunk.shape[1], chunk


def _exact(blocks: Iterable[np.ndarray], channels: int, frames: int) -> Iterator[np.ndarray]:
    """The blocks unchanged, cut or padded to `frames` (no resampling)."""
    done = 0
    for block in blocks:
        done, chunk = _take(block, done, frames)
        if chunk.shape[1]:
            yield chunk
    if done < frames:
        yield np.zeros((channels, frames - done), np.float32)
