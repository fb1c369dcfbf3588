"""Decode any input (audio or the audio track of a video) to float32 at the model's rate.

PyAV decodes every input format from its own wheels, without a system ffmpeg, and hands us
one frame at a time, so a cancel is honoured between frames. Files that decode "fine" but are
cut short (a wav or flac copied half-way) are caught by comparing what the header promises
with what came out: separating half a song and calling it done would lose the rest silently.

Decoding streams: resampled blocks are appended to the scratch file as they come (see
stages/scratch.py) and the normalisation statistics demucs needs are accumulated on the way,
so the service never holds the whole song, however long it is.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stemdeck_watch.core.errors import DecodeError
from stemdeck_watch.stages.scratch import BLOCK_FRAMES, AudioWriter, RunningStats
from stemdeck_watch.stages.tags import tags_of

log = logging.getLogger(__name__)

MIN_SECONDS = 1.0
COPY_AGAIN = "if it was cut off while copying or downloading, copy it into the inbox again"
# FFmpeg's stream probe reads up to 5 MB of a file and decodes what it read only to learn the
# stream's parameters: 22 ms of CPU for a 10 s wav, twice what decoding the song then costs.
# Almost every audio file states them in its first kilobytes, so open_media probes that much
# first.
QUICK_PROBE = {"probesize": str(64 * 1024)}


@dataclasses.dataclass(frozen=True)
class DecodedAudio:
    path: Path
    frames: int
    samplerate: int
    channels: int
    source_codec: str
    source_samplerate: int
    source_channels: int
    # demucs's normalisation statistics of the decoded audio: mean and (unbiased) standard
    # deviation of its mono mix, accumulated while decoding
    mean: float | None = None
    std: float | None = None
    # frames of the input at its own rate (what `output.samplerate = "input"` gives back)
    source_frames: int | None = None
    # the input's tags (stages/tags.py), read while decoding
    tags: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.frames / self.samplerate

    @property
    def stats(self) -> tuple[float, float] | None:
        """(mean, std) for the worker (`DemucsSettings.stats`), or None."""
        if self.mean is None or self.std is None:
            return None
        return self.mean, self.std


def open_media(path: Path) -> Any:
    """`path` as a PyAV input container, probed in its first 64 KiB when they describe its
    audio. A file they do not (no audio stream found, no rate or channel count yet, an error:
    say a video whose sound starts after a megabyte of picture) is opened again with FFmpeg's
    full probe, whose errors are the ones raised."""
    import av

    try:
        container = av.open(str(path), metadata_errors="ignore", container_options=QUICK_PROBE)
    except (av.error.FFmpegError, OSError):
        pass
    else:
        audio = next((s for s in container.streams if s.type == "audio"), None)
        context = audio.codec_context if audio is not None else None
        if context is not None and context.sample_rate and context.channels:
            return container
        container.close()
    return av.open(str(path), metadata_errors="ignore")


def probe_duration(path: Path) -> float | None:
    """A media file's length as its header or container declares it (open_media: under a
    millisecond for a song), None if it cannot say (not decodable: the decode step says
    why)."""
    try:
        with open_media(path) as container:
            if container.duration:
                return container.duration / 1_000_000
    except Exception:
        return None
    return None


def decode_to_file(
    source: Path,
    target: Path,
    samplerate: int,
    channels: int,
    check_cancel: Callable[[], None] = lambda: None,
    on_progress: Callable[[float], None] = lambda _: None,
) -> DecodedAudio:
    """Decode `source` into `target` (.npy, shape (channels, frames), float32), streaming:
    frames go to disk in blocks as they are decoded (see stages/scratch.py), so memory does
    not grow with the song. On any failure or cancel `target` is removed."""
    import av  # imported here: commands that never decode should not pay for it

    try:
        container = open_media(source)
    except av.error.InvalidDataError:
        raise DecodeError(
            f"could not decode {source}: it is not an audio or video file that "
            f"can be read (the data is not a known format); check that it plays "
            f"in a media player, or {COPY_AGAIN}"
        ) from None
    except (av.error.FFmpegError, OSError) as exc:
        raise DecodeError(f"could not open {source}: {exc}") from None
    with container:
        streams = [s for s in container.streams if s.type == "audio"]
        if not streams:
            kinds = ", ".join(sorted({s.type for s in container.streams})) or "nothing"
            raise DecodeError(
                f"could not decode {source}: it has no audio stream (it contains "
                f"{kinds}); drop a file with a sound track"
            )
        stream = streams[0]
        tags = tags_of(container)  # here, so that publishing need not open the file again
        stream.thread_type = "AUTO"
        codec = stream.codec_context.name
        src_rate = stream.codec_context.sample_rate or stream.rate
        src_channels = stream.codec_context.channels
        total_seconds = float(container.duration / 1_000_000) if container.duration else None
        layout = "stereo" if channels == 2 else "mono"
        out_channels = 2 if channels == 2 else 1
        resampler = av.AudioResampler(format="fltp", layout=layout, rate=samplerate)
        target.parent.mkdir(parents=True, exist_ok=True)
        with AudioWriter(target, out_channels) as writer:
            sink = _Sink(source, writer)
            source_frames = 0
            try:
                for frame in container.decode(stream):
                    check_cancel()
                    source_frames += frame.samples
                    for out in resampler.resample(frame):
                        sink.add(out.to_ndarray())
                    if total_seconds and frame.time is not None:
                        on_progress(min(1.0, float(frame.time) / total_seconds))
                for out in resampler.resample(None):
                    sink.add(out.to_ndarray())
                sink.flush()
            except av.error.FFmpegError as exc:
                done = source_frames / src_rate if src_rate else 0
                raise DecodeError(
                    f"could not decode {source}: the audio data is damaged after "
                    f"{done:.1f} s ({exc.strerror or exc}); {COPY_AGAIN}"
                ) from None
            _check_complete(source, source_frames, src_rate)
            if writer.frames < MIN_SECONDS * samplerate:
                raise DecodeError(
                    f"could not separate {source}: it holds only {writer.frames} "
                    f"samples ({writer.frames / samplerate:.2f} s) of audio; "
                    f"stemdeck-watch needs at least {MIN_SECONDS:g} s"
                )
        frames = writer.frames
    on_progress(1.0)
    return DecodedAudio(
        target,
        frames,
        samplerate,
        out_channels,
        codec,
        src_rate,
        src_channels,
        mean=sink.stats.mean,
        std=sink.stats.std,
        source_frames=source_frames,
        tags=tags,
    )


class _Sink:
    """Collects resampled frames into blocks of BLOCK_FRAMES, checks them, adds them to the
    statistics and appends them to the scratch file."""

    def __init__(self, source: Path, writer: AudioWriter):
        self.source = source
        self.writer = writer
        self.stats = RunningStats()
        self._pending: list[np.ndarray] = []
        self._pending_frames = 0

    def add(self, planar: np.ndarray) -> None:
        self._pending.append(planar[: self.writer.channels])
        self._pending_frames += planar.shape[1]
        if self._pending_frames >= BLOCK_FRAMES:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        block = (
            self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending, axis=1)
        )
        self._pending, self._pending_frames = [], 0
        block = np.asarray(block, dtype=np.float32)
        if not np.isfinite(block).all():
            raise DecodeError(
                f"could not decode {self.source}: the decoded audio contains "
                f"invalid (NaN or infinite) samples; {COPY_AGAIN}"
            )
        self.stats.add_audio(block)
        self.writer.write(block)


def _check_complete(source: Path, decoded: int, rate: int) -> None:
    expected = _declared_frames(source)
    if expected is None or rate <= 0:
        return
    # a few frames of slack: some encoders round the header up to a whole block
    if decoded + max(64, expected // 1000) < expected:
        raise DecodeError(
            f"could not decode {source}: the file is truncated — its header promises "
            f"{expected / rate:.2f} s of audio but only {decoded / rate:.2f} s is there; "
            f"{COPY_AGAIN}"
        )


def _declared_frames(source: Path) -> int | None:
    """How many frames the header of a wav, aiff or flac file promises; None if unknown."""
    try:
        with open(source, "rb") as f:
            head = f.read(12)
            if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
                return _riff_frames(f)
            if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
                return _aiff_frames(f)
            if head[:4] == b"fLaC":
                f.seek(4)
                block = f.read(4 + 34)
                if len(block) == 38 and block[0] & 0x7F == 0:  # STREAMINFO
                    info = block[4:]
                    total = ((info[13] & 0x0F) << 32) | struct.unpack(">I", info[14:18])[0]
                    return total or None
    except OSError:
        return None
    return None


def _chunks(f, endian: str):  # type: ignore[no-untyped-def]
    """Walk the chunks of a RIFF (little-endian) or IFF (big-endian) file: (id, size, read)."""
    while True:
        header = f.read(8)
        if len(header) < 8:
            return
        chunk_id, size = header[:4], struct.unpack(endian + "I", header[4:])[0]
        start = f.tell()
        yield chunk_id, size, lambda n=size: f.read(n + (n & 1))
        f.seek(start + size + (size & 1))


def _riff_frames(f) -> int | None:  # type: ignore[no-untyped-def]
    block_align = None
    for chunk_id, size, read in _chunks(f, "<"):
        if chunk_id == b"fmt ":
            fmt = read()
            if len(fmt) >= 14:
                block_align = struct.unpack("<H", fmt[12:14])[0]
        elif chunk_id == b"data":
            if not block_align or size in (0, 0xFFFFFFFF):  # streamed wav: size unknown
                return None
            return size // block_align
    return None


def _aiff_frames(f) -> int | None:  # type: ignore[no-untyped-def]
    for chunk_id, _size, read in _chunks(f, ">"):
        if chunk_id == b"COMM":
            comm = read()
            return struct.unpack(">I", comm[2:6])[0] if len(comm) >= 6 else None
    return None
