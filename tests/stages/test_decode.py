"""PyAV decoding of real files the tests synthesise, and clear errors for bad ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.errors import Cancelled, DecodeError
from stemdeck_watch.stages.decode import decode_to_file
from stemdeck_watch.util.synth import write_song

SR = 44100


@pytest.mark.parametrize(
    "ext, slack",
    [
        ("wav", 0),
        ("flac", 0),
        ("mp3", 0),
        ("ogg", 0),
        ("aiff", 0),
        ("m4a", 1024),  # AAC pads its last packet; the decoder returns up to one packet more
    ],
)
def test_every_format_decodes_to_float32_stereo_at_the_model_rate(
    tmp_path: Path, ext: str, slack: int
) -> None:
    source = write_song(tmp_path / f"song.{ext}", 3.0)
    decoded = decode_to_file(source, tmp_path / "out.npy", SR, 2)
    audio = np.load(decoded.path)
    assert audio.dtype == np.float32 and audio.shape[0] == 2
    assert 3 * SR <= audio.shape[1] <= 3 * SR + slack
    assert decoded.frames == audio.shape[1]
    assert 0.05 < np.abs(audio).max() <= 1.0


def test_a_stream_whose_sound_starts_late_is_described_by_the_full_probe(tmp_path: Path) -> None:
    """A video (here an MPEG transport stream) whose first sound comes after more than a
    megabyte of picture: the quick probe of the first 64 KiB finds the audio stream but not
    its rate and channels, so the file is probed again in full and described right."""
    import fractions

    import av

    from stemdeck_watch.util.synth import song

    path = tmp_path / "late.ts"
    audio = (song(2.0, SR, 1).T * 32767).astype(np.int16)  # (channels, frames)
    noise = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg2video", rate=25)
        video.width, video.height, video.pix_fmt = 320, 240, "yuv420p"
        video.bit_rate = 20_000_000
        sound = container.add_stream("mp2", rate=SR, layout="stereo")
        for _ in range(15):  # over a megabyte of noisy picture first
            picture = noise.integers(0, 255, (240, 320, 3), dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24").reformat(format="yuv420p")
            for packet in video.encode(frame):
                container.mux(packet)
        for start in range(0, audio.shape[1], 1152):
            block = np.ascontiguousarray(audio[:, start : start + 1152].T).reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(block, format="s16", layout="stereo")
            frame.sample_rate, frame.time_base = SR, fractions.Fraction(1, SR)
            frame.pts = int(0.8 * SR) + start  # the sound starts after the pictures
            for packet in sound.encode(frame):
                container.mux(packet)
        for stream in (sound, video):
            for packet in stream.encode(None):
                container.mux(packet)
    decoded = decode_to_file(path, tmp_path / "out.npy", SR, 2)
    assert (decoded.source_codec, decoded.source_samplerate, decoded.source_channels) == (
        "mp2",
        SR,
        2,
    )
    assert abs(decoded.source_frames - 2 * SR) <= 2 * 1152


def test_other_rates_and_mono_are_converted(tmp_path: Path) -> None:
    source = write_song(tmp_path / "mono48k.wav", 2.0, samplerate=48000, channels=1)
    decoded = decode_to_file(source, tmp_path / "out.npy", SR, 2)
    audio = np.load(decoded.path)
    assert audio.shape[0] == 2 and abs(audio.shape[1] - 2 * SR) <= 1
    assert np.allclose(audio[0], audio[1])
    assert decoded.source_samplerate == 48000 and decoded.source_channels == 1


def test_opus_at_48k_decodes(tmp_path: Path) -> None:
    source = write_song(tmp_path / "song.opus", 2.0)
    decoded = decode_to_file(source, tmp_path / "out.npy", SR, 2)
    assert abs(decoded.frames - 2 * SR) < 0.05 * SR


def _truncate(path: Path, keep: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


@pytest.mark.parametrize(
    "make, words",
    [
        # seeded: about 1 in 100 random buffers probes as a subtitle or video container
        (
            lambda d: _write(d / "random.mp3", np.random.default_rng(0).bytes(40_000)),
            ["random.mp3", "not an audio"],
        ),
        (
            lambda d: _write(d / "text.wav", b"just some notes\n" * 200),
            ["text.wav", "not an audio"],
        ),
        (lambda d: _truncate(write_song(d / "cut.wav", 4.0), 0.5), ["cut.wav", "truncated"]),
        (lambda d: _truncate(write_song(d / "cut.flac", 4.0), 0.5), ["cut.flac", "copy it"]),
        (lambda d: _one_sample(d / "one.wav"), ["one.wav", "1 samples", "at least"]),
        (lambda d: _video_only(d / "silent.mp4"), ["silent.mp4", "no audio stream", "video"]),
    ],
)
def test_bad_input_gets_a_clear_error_naming_the_file(tmp_path: Path, make, words) -> None:
    source = make(tmp_path)
    with pytest.raises(DecodeError) as info:
        decode_to_file(source, tmp_path / "out.npy", SR, 2)
    for word in words:
        assert word in str(info.value)
    assert not (tmp_path / "out.npy").exists()


def test_a_cancel_stops_decoding_between_frames(tmp_path: Path) -> None:
    source = write_song(tmp_path / "long.flac", 20.0)
    frames_seen = []

    def check() -> None:
        frames_seen.append(1)
        if len(frames_seen) == 3:
            raise Cancelled("removed")

    with pytest.raises(Cancelled):
        decode_to_file(source, tmp_path / "out.npy", SR, 2, check)
    assert len(frames_seen) == 3


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _one_sample(path: Path) -> Path:
    soundfile.write(path, np.zeros((1, 2), np.float32), SR)
    return path


def _video_only(path: Path) -> Path:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(10):
            frame = av.VideoFrame.from_ndarray(
                np.full((48, 64, 3), i * 20, np.uint8), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


def test_decoding_streams_to_disk_and_accumulates_the_normalisation_statistics(
    tmp_path: Path,
) -> None:
    source = write_song(tmp_path / "song.flac", 7.3)
    decoded = decode_to_file(source, tmp_path / "out.npy", SR, 2)
    audio = np.load(decoded.path)
    # frame-major on disk (each block one append), still (channels, frames) when loaded
    assert audio.shape == (2, decoded.frames) and audio.flags.f_contiguous
    mono = audio.astype(np.float64).mean(axis=0)
    assert decoded.mean == pytest.approx(mono.mean(), rel=1e-9, abs=1e-12)
    assert decoded.std == pytest.approx(mono.std(ddof=1), rel=1e-9)
    assert decoded.stats == (decoded.mean, decoded.std)


def test_a_cancel_removes_the_partly_written_file(tmp_path: Path) -> None:
    source = write_song(tmp_path / "long.wav", 20.0)
    target = tmp_path / "out.npy"
    calls = []

    def check() -> None:
        calls.append(1)
        if target.exists() and target.stat().st_size > 1 << 20:  # well into the song
            raise Cancelled("removed")

    with pytest.raises(Cancelled):
        decode_to_file(source, target, SR, 2, check)
    assert len(calls) > 3 and not target.exists()
