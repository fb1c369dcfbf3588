"""`output.samplerate`: stems at the model's rate, the input's (exact length, aligned) or N."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.config import OutputSettings, SeparationSettings, settings_from_dict
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.stages.decode import decode_to_file
from stemdeck_watch.stages.publish import SongInfo, write_song
from stemdeck_watch.stages.resample import resampled
from stemdeck_watch.stages.scratch import AudioReader, AudioWriter
from stemdeck_watch.util.synth import write_song as synth_song

MODEL_RATE = 44100
SOURCES = ("drums", "bass", "other", "vocals")


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), beat_grid=False, preview=False, **kw)


def fake_stems(decoded_path: Path, folder: Path) -> dict[str, Path]:
    """Stems as the worker leaves them: here the decoded input itself, split in four parts
    that add up to it (so `no_vocals` + `vocals` and every mix are checkable)."""
    reader = AudioReader(decoded_path)
    stems = {}
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(SOURCES):
        with AudioWriter(folder / f"{name}.npy", reader.channels) as writer:
            for _, block in reader.blocks(50_000):
                writer.write(block * (0.1 * (i + 1)))  # 0.1 + 0.2 + 0.3 + 0.4 = 1
        stems[name] = folder / f"{name}.npy"
    return stems


def band_limited(seconds: float, rate: int) -> np.ndarray:
    """Stereo tones below 10 kHz with a rhythm: what survives a trip through 44.1 kHz."""
    t = np.arange(int(seconds * rate)) / rate
    envelope = 0.5 + 0.5 * np.cos(2 * np.pi * 2 * t)
    left = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * envelope * np.sin(2 * np.pi * 3150 * t)
    right = 0.3 * np.sin(2 * np.pi * 330 * t) + 0.2 * envelope * np.sin(2 * np.pi * 9000 * t)
    return np.stack([left, right], axis=1).astype(np.float32)


@pytest.mark.parametrize("rate, fmt", [(48000, "wav"), (22050, "flac"), (96000, "wav")])
def test_input_rate_stems_have_exactly_the_inputs_frame_count(
    tmp_path: Path, rate: int, fmt: str
) -> None:
    source = tmp_path / "in.wav"
    soundfile.write(source, band_limited(3.37, rate), rate, subtype="FLOAT")
    original, _ = soundfile.read(source, dtype="float32")
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    assert decoded.source_frames == len(original)
    stems = fake_stems(decoded.path, tmp_path / "stems")
    info = SongInfo(
        "in", input_samplerate=decoded.source_samplerate, input_frames=decoded.source_frames
    )
    timings: dict[str, float] = {}
    entries = write_song(
        tmp_path / "s",
        stems,
        MODEL_RATE,
        "in",
        SeparationSettings(),
        out(samplerate="input", format=fmt, bit_depth=24, clip="clamp"),
        block_frames=20_000,
        info=info,
        timings=timings,
    )
    for entry in entries:
        data, got_rate = soundfile.read(tmp_path / "s" / entry["file"], dtype="float32")
        assert got_rate == rate and len(data) == len(original) == entry["frames"]
        assert entry["samplerate"] == rate
    assert timings["resample"] > 0
    # the stems line up sample for sample with the original: their sum is the input again
    total = sum(soundfile.read(tmp_path / "s" / e["file"], dtype="float32")[0] for e in entries)
    band = slice(rate // 10, -rate // 10)  # the edges hold the resampler's fade
    error = total[band] - original[band]
    snr = 10 * np.log10(np.mean(original[band] ** 2) / np.mean(error**2))
    assert snr > 40, snr


@pytest.mark.parametrize("frames_off", [-37, 0, 52])
def test_at_the_models_own_rate_the_file_holds_the_frames_the_manifest_says(
    tmp_path: Path, frames_off: int
) -> None:
    """`samplerate = "input"` where the input's rate is the model's: nothing is resampled,
    and the stems still have the input's own frame count, as their manifest entries say."""
    source = tmp_path / "in.wav"
    soundfile.write(source, band_limited(2.0, MODEL_RATE), MODEL_RATE, subtype="FLOAT")
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    stems = fake_stems(decoded.path, tmp_path / "stems")
    wanted = decoded.source_frames + frames_off  # as if decoding had counted it otherwise
    info = SongInfo("in", input_samplerate=MODEL_RATE, input_frames=wanted)
    timings: dict[str, float] = {}
    entries = write_song(
        tmp_path / "s",
        stems,
        MODEL_RATE,
        "in",
        SeparationSettings(),
        out(samplerate="input", format="wav", bit_depth=24, clip="clamp"),
        block_frames=20_000,
        info=info,
        timings=timings,
    )
    for entry in entries:
        data, got_rate = soundfile.read(tmp_path / "s" / entry["file"], dtype="float32")
        assert got_rate == MODEL_RATE and len(data) == entry["frames"] == wanted
    assert timings["resample"] == 0  # nothing was resampled


def test_a_fixed_rate_and_the_models_rate(tmp_path: Path) -> None:
    source = synth_song(tmp_path / "in.wav", 2.0, samplerate=22050)
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    stems = fake_stems(decoded.path, tmp_path / "stems")
    info = SongInfo("in", input_samplerate=22050, input_frames=decoded.source_frames)
    fixed = write_song(
        tmp_path / "a",
        stems,
        MODEL_RATE,
        "in",
        SeparationSettings(),
        out(samplerate=48000),
        info=info,
    )
    assert {e["samplerate"] for e in fixed} == {48000}
    assert soundfile.info(tmp_path / "a" / "vocals.wav").frames == round(
        decoded.frames * 48000 / MODEL_RATE
    )
    model = write_song(
        tmp_path / "b", stems, MODEL_RATE, "in", SeparationSettings(), out(), info=info
    )
    info_b = soundfile.info(tmp_path / "b" / "vocals.wav")
    assert info_b.samplerate == MODEL_RATE and info_b.frames == decoded.frames
    assert model[0]["frames"] == decoded.frames


def test_the_stream_resampler_gives_the_requested_length_for_any_block_size() -> None:
    rng = np.random.default_rng(0)
    audio = rng.standard_normal((2, 44_117)).astype(np.float32) * 0.1
    for size in (1, 999, 44_117, 100_000):
        blocks = (audio[:, i : i + size] for i in range(0, audio.shape[1], size))
        pieces = list(resampled(blocks, 44100, 48000, 2, 48_020))
        assert sum(p.shape[1] for p in pieces) == 48_020
        assert all(p.shape[0] == 2 and p.dtype == np.float32 for p in pieces)


@pytest.mark.parametrize("value", ["model", "input", 48000, 8000])
def test_samplerate_values_accepted(value) -> None:
    settings = settings_from_dict({"output": {"samplerate": value}})
    assert settings.output.samplerate == value


@pytest.mark.parametrize("value", ["48000", 7999, 500_000, True, 44100.0, "native"])
def test_bad_samplerate_values_are_refused_naming_what_is_allowed(value) -> None:
    with pytest.raises(ConfigError, match=r'output.samplerate = .* expected "model", "input"'):
        settings_from_dict({"output": {"samplerate": value}})


def test_mp3_stems_use_an_mpeg_rate_and_say_so_in_the_manifest(tmp_path: Path) -> None:
    source = tmp_path / "in.wav"
    soundfile.write(source, band_limited(1.5, 96000), 96000, subtype="FLOAT")
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    stems = fake_stems(decoded.path, tmp_path / "stems")
    info = SongInfo("in", input_samplerate=96000, input_frames=decoded.source_frames)
    entries = write_song(
        tmp_path / "s",
        stems,
        MODEL_RATE,
        "in",
        SeparationSettings(),
        out(samplerate="input", format="mp3"),
        info=info,
    )
    written = soundfile.info(tmp_path / "s" / "drums.mp3")
    assert entries[0]["samplerate"] == 48000 == written.samplerate
    assert entries[0]["frames"] == round(decoded.frames * 48000 / MODEL_RATE)
    with pytest.raises(
        ConfigError,
        match=r"output.samplerate = 96000 is not allowed with "
        r'format = "mp3": mp3 holds 8000, .* 48000 Hz',
    ):
        settings_from_dict({"output": {"samplerate": 96000, "format": "mp3"}})
