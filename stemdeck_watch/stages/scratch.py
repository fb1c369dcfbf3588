"""Scratch audio on disk: written block by block, read back in frame ranges, never whole.

A song of any length passes through the pipeline in bounded memory because every step talks
to these files in blocks: decode appends the decoded input, the worker reads it window by
window and appends each window of every stem, publish reads the stems block by block.

The files are ordinary `.npy` files holding float32 audio of shape (channels, frames), stored
frame-major (`fortran_order`), i.e. interleaved like a wav: a block of frames is one
contiguous run of bytes, so writing is a sequential append, reading a block is one read, and
`np.load(path)` still returns the familiar (channels, frames) array. Reads are plain reads into
fresh arrays, never a memory map: one held for the whole song would keep every page it touched
counted in the process's resident memory, and one per read costs more than the read.

`estimate_scratch_bytes` is what a job needs on the scratch disk (input + stems, float32); a
disk-space check before a job starts can use it.

No torch here: the service imports this module.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from types import TracebackType

import numpy as np

DTYPE = np.dtype("<f4")
HEADER_BYTES = 128  # numpy pads a v1.0 header to a multiple of 64; (C, frames) needs 128
BLOCK_FRAMES = 1 << 16  # ~1.5 s at 44.1 kHz: the unit decode and publish work in


def estimate_scratch_bytes(
    seconds: float, stems: int = 4, samplerate: int = 44100, channels: int = 2
) -> int:
    """Bytes of scratch disk one job needs at its peak: the decoded input plus every stem, as
    float32 at the model's rate (about 10x the song as 16-bit wav for four stems; 14x for six).
    `seconds` is the song's duration; the published files are extra and go to the outbox."""
    frames = math.ceil(max(0.0, seconds) * samplerate)
    return (1 + stems) * (HEADER_BYTES + frames * channels * DTYPE.itemsize)


def _header(channels: int, frames: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": DTYPE.str, "fortran_order": True, "shape": (channels, frames)}
    )
    header = buf.getvalue()
    if len(header) != HEADER_BYTES:  # pragma: no cover - only for absurd shapes
        raise ValueError(f"npy header for {(channels, frames)} is {len(header)} bytes")
    return header


class AudioWriter:
    """Append float32 blocks of shape (channels, n) to an `.npy` file; the header is completed
    at `close()`. `abort()` (or leaving a `with` block by an exception) removes the file."""

    def __init__(self, path: Path, channels: int, buffering: int = 1 << 20):
        self.path = Path(path)
        self.channels = channels
        self.frames = 0
        self._file = open(self.path, "wb", buffering=buffering)
        try:
            self._file.write(_header(channels, 0))
        except BaseException:
            self.abort()
            raise

    def write(self, block: np.ndarray) -> None:
        if block.ndim != 2 or block.shape[0] != self.channels:
            raise ValueError(f"expected a ({self.channels}, n) block, got {block.shape}")
        # (n, channels) in C order is the file's frame-major layout
        self._file.write(np.ascontiguousarray(block.T, dtype=DTYPE).data)
        self.frames += block.shape[1]

    def close(self) -> None:
        """Complete the header and close; the file is closed even if that fails."""
        if self._file.closed:
            return
        try:
            self._file.seek(0)
            self._file.write(_header(self.channels, self.frames))
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close and remove the file; never raises (the scratch folder goes with the job)."""
        try:
            if not self._file.closed:
                self._file.close()  # flushing may fail (disk full): it is closed anyway
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> AudioWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


class AudioReader:
    """Frame ranges of a (channels, frames) float `.npy` file, in either storage order."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(handle)
            self._offset = handle.tell()
        if len(shape) != 2 or dtype.kind != "f":
            raise ValueError(f"{self.path} is not (channels, frames) float audio: {shape} {dtype}")
        self.channels, self.frames = int(shape[0]), int(shape[1])
        self._dtype = dtype
        self._order = "F" if fortran else "C"

    @property
    def shape(self) -> tuple[int, int]:
        return self.channels, self.frames

    def read(self, start: int, stop: int, interleaved: bool = False) -> np.ndarray:
        """Frames [start, stop) as a float32 (channels, n) array (clipped to the file; an
        empty range gives shape (channels, 0)): C-contiguous, or with `interleaved` in the
        file's own frame-major order where it has it (a plain copy instead of a transposing
        one, and what a sound file's writer wants: `block.T` is contiguous)."""
        start, stop = max(0, start), min(self.frames, stop)
        if stop <= start or self.frames == 0:
            return np.zeros((self.channels, 0), np.float32)
        n = stop - start
        if self._order == "F":  # frame-major, as AudioWriter writes: one run of bytes
            stored = self._read_runs([(start * self.channels, n * self.channels)])
            block = stored.reshape(n, self.channels).T
        else:  # channel-major, as np.save writes: one run per channel
            stored = self._read_runs([(c * self.frames + start, n) for c in range(self.channels)])
            block = stored.reshape(self.channels, n)
        block = block.astype(np.float32, copy=False)
        return block if interleaved else np.ascontiguousarray(block)

    def _read_runs(self, runs: list[tuple[int, int]]) -> np.ndarray:
        """The stored items of each (first item, count) run, one after another in a fresh
        1-D array: plain reads are cheaper than mapping the file for one read (a map per read
        cost 0.5 ms in a busy service), and nothing stays mapped."""
        items = np.empty(sum(count for _first, count in runs), self._dtype)
        view, size, done = memoryview(items).cast("B"), self._dtype.itemsize, 0
        with open(self.path, "rb", buffering=0) as handle:
            for first, count in runs:
                handle.seek(self._offset + first * size)
                end = done + count * size
                while done < end:  # one read returns at most ~2 GiB
                    got = handle.readinto(view[done:end])
                    if not got:
                        raise ValueError(
                            f"{self.path} holds fewer frames than its header says ({self.frames})"
                        )
                    done += got
        return items

    def blocks(self, size: int = BLOCK_FRAMES, start: int = 0, stop: int | None = None):
        """Yield (offset, block) for consecutive blocks of `size` frames."""
        stop = self.frames if stop is None else min(stop, self.frames)
        for offset in range(start, stop, size):
            yield offset, self.read(offset, min(stop, offset + size))


class RunningStats:
    """Mean and (unbiased) standard deviation of a signal seen block by block: what demucs
    computes of the mono mix to normalise it (`ref = wav.mean(0); ref.mean(), ref.std()`).
    Blocks are merged exactly in float64 (Chan et al.), so the result does not depend on how
    the signal was cut into blocks beyond rounding."""

    def __init__(self) -> None:
        self.count = 0
        self._mean = 0.0
        self._m2 = 0.0

    def add_audio(self, block: np.ndarray) -> None:
        """Add a (channels, n) block: its mono mix (the mean over channels) counts."""
        if block.shape[-1]:
            self.add(block.mean(axis=0, dtype=np.float64))

    def add(self, values: np.ndarray) -> None:
        n = int(values.size)
        if not n:
            return
        values = values.astype(np.float64, copy=False)
        mean = float(values.mean())
        m2 = float(np.square(values - mean).sum())
        total = self.count + n
        delta = mean - self._mean
        self._mean += delta * n / total
        self._m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def mean(self) -> float:
        return self._mean if self.count else float("nan")

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / (self.count - 1)) if self.count > 1 else float("nan")


def stats_of(path: Path, size: int = BLOCK_FRAMES * 16) -> tuple[float, float]:
    """(mean, std) of the mono mix of a scratch file, read block by block."""
    stats = RunningStats()
    for _, block in AudioReader(path).blocks(size):
        stats.add_audio(block)
    return stats.mean, stats.std
