"""The beat grid: librosa's beat tracker on a block-wise envelope, tempo within 1 BPM."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from stemdeck_watch.stages import songfolder
from stemdeck_watch.stages.beats import (
    HOP,
    NO_DOWNBEATS,
    RATE,
    WARM_BPM,
    beat_grid,
    mean_tempogram,
    onset_envelope,
    warm,
)
from stemdeck_watch.stages.scratch import AudioReader, AudioWriter
from stemdeck_watch.stages.songfolder import write_beat_grid

SR = 44100


def click_track(bpm: float, seconds: float = 20.0, first: float = 0.25, sr: int = SR) -> np.ndarray:
    """Stereo clicks (a 1 kHz burst of 30 ms) every beat, starting at `first` seconds."""
    n = int(seconds * sr)
    audio = np.zeros((2, n), np.float32)
    k = np.arange(int(0.03 * sr))
    burst = (np.sin(2 * np.pi * 1000 * k / sr) * np.exp(-k / (0.005 * sr))).astype(np.float32)
    t = first
    while t < seconds - 0.05:
        i = int(round(t * sr))
        audio[:, i : i + burst.size] += burst[: n - i]
        t += 60.0 / bpm
    return audio


def scratch(path: Path, audio: np.ndarray, piece: int = 30_000) -> Path:
    """Written the way the worker writes stems: appended piece by piece."""
    with AudioWriter(path, audio.shape[0]) as writer:
        for start in range(0, audio.shape[1], piece):
            writer.write(audio[:, start : start + piece])
    return path


@pytest.mark.parametrize("bpm", [80.0, 97.0, 120.0, 140.0, 174.0])
def test_the_tempo_of_a_click_track_is_found_within_one_bpm(tmp_path: Path, bpm: float) -> None:
    reader = AudioReader(scratch(tmp_path / "drums.npy", click_track(bpm)))
    grid = beat_grid([reader], SR, "drums")
    assert abs(grid["tempo"] - bpm) < 1.0, grid["tempo"]
    beats = np.array(grid["beats"])
    period = 60.0 / bpm
    assert len(beats) >= 0.8 * 20 / period  # nearly every beat, not a half-time grid
    # every beat sits on a click (within one 23 ms envelope frame)
    offsets = (beats - 0.25) / period
    assert np.abs(offsets - np.round(offsets)).max() * period < 0.035
    assert grid["downbeats"] == [] and NO_DOWNBEATS in grid["notes"]


def test_the_warm_up_finds_the_tempo_of_its_clicks() -> None:
    assert abs(warm() - WARM_BPM) < 1.0


@pytest.mark.parametrize(
    "output, presets, loads",
    [
        ({"beat_grid": True}, {}, True),
        ({}, {}, False),  # beat grid, practice and DAW projects all off
        ({}, {"practice": {"practice": True}}, True),  # a preset's click needs the grid
        ({}, {"daw": {"session": ["reaper"]}}, True),  # so does a project's tempo
    ],
)
def test_the_service_loads_the_beat_tracker_ahead_only_if_a_song_may_need_it(
    make_settings, caplog, output, presets, loads
) -> None:
    caplog.set_level(logging.INFO, logger="stemdeck_watch.stages.beats")
    songfolder.warm(make_settings(output=output, presets=presets))
    assert ("beat grid ready" in caplog.text) is loads, caplog.text


def test_silence_gives_an_empty_grid_and_a_note(tmp_path: Path) -> None:
    reader = AudioReader(scratch(tmp_path / "drums.npy", np.zeros((2, 3 * SR), np.float32)))
    grid = beat_grid([reader], SR, "drums")
    assert grid["tempo"] is None and grid["beats"] == [] and grid["downbeats"] == []
    assert grid["notes"][0].startswith("no beat found")


def test_the_block_wise_envelope_is_librosas_envelope_of_the_whole_signal(tmp_path: Path) -> None:
    import librosa
    import soxr

    rng = np.random.default_rng(3)
    audio = click_track(133.0, 12.0)
    audio += 0.01 * rng.standard_normal(audio.shape).astype(np.float32)
    reader = AudioReader(scratch(tmp_path / "drums.npy", audio))
    blockwise = onset_envelope([reader], SR, block_frames=40_000)  # many block edges
    mono = soxr.resample(audio.mean(axis=0), SR, 22050)
    whole = librosa.onset.onset_strength(y=mono, sr=22050)
    n = min(len(blockwise), len(whole))
    assert abs(len(blockwise) - len(whole)) <= 1
    assert np.corrcoef(blockwise[:n], whole[:n])[0, 1] > 0.995  # floor: loudest so far


def test_beats_json_comes_from_the_drums_stem_else_from_the_mix(tmp_path: Path) -> None:
    silent = np.zeros((2, 10 * SR), np.float32)
    stems = {
        "drums": scratch(tmp_path / "drums.npy", click_track(120.0, 10.0)),
        "vocals": scratch(tmp_path / "vocals.npy", silent),
    }
    summary = write_beat_grid(tmp_path / "beats.json", stems, SR)
    written = json.loads((tmp_path / "beats.json").read_text())
    assert summary["source"] == written["source"] == "drums"
    assert abs(written["tempo"] - 120.0) < 1.0 and summary["beats"] == len(written["beats"])
    no_drums = {"guitar": stems["drums"], "vocals": stems["vocals"]}  # clicks in the mix
    summary = write_beat_grid(tmp_path / "mix.json", no_drums, SR)
    assert summary["source"] == "mix" and abs(summary["tempo"] - 120.0) < 1.0


def test_a_cancel_stops_the_beat_grid_between_blocks(tmp_path: Path) -> None:
    from stemdeck_watch.core.errors import Cancelled

    stems = {"drums": scratch(tmp_path / "drums.npy", click_track(120.0, 30.0))}
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) > 2:
            raise Cancelled("the input was removed")

    with pytest.raises(Cancelled):
        write_beat_grid(tmp_path / "beats.json", stems, SR, check)
    assert len(calls) == 3 and not (tmp_path / "beats.json").exists()


def test_the_beat_grid_of_a_long_song_needs_no_more_memory_than_a_short_one(tmp_path: Path) -> None:
    """Twenty minutes of a steady kick: the tempo estimate is librosa's, summed in blocks, so
    the peak stays far below the +300 MB an hour may cost (librosa's whole-song tempogram
    took 926 MB for this song, and grows with its length)."""
    import tracemalloc

    sr, bpm, minutes = 11025, 120.0, 20
    bar = click_track(bpm, seconds=60.0, first=0.25, sr=sr)[:1]  # one minute, mono
    path = tmp_path / "drums.npy"
    with AudioWriter(path, 1) as writer:
        for _ in range(minutes):
            writer.write(bar)
    reader = AudioReader(path)
    tracemalloc.start()
    try:
        grid = beat_grid([reader], sr, "drums")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert abs(grid["tempo"] - bpm) < 1.0, grid["tempo"]
    assert len(grid["beats"]) > 0.9 * minutes * bpm
    assert peak < 150 * 2**20, f"the beat grid peaked at {peak / 2**20:.0f} MB"


def test_the_tempogram_summed_in_blocks_is_librosas_whole_song_mean() -> None:
    """The block-wise sum gives the tempo estimate librosa gives from the whole tempogram."""
    import librosa

    rng = np.random.default_rng(3)
    envelope = (0.1 * rng.random(9000)).astype(np.float32)
    envelope[::23] += 1.0
    envelope[7::31] += 0.5
    whole = librosa.feature.tempogram(
        onset_envelope=envelope,
        sr=RATE,
        hop_length=HOP,
        win_length=mean_tempogram(envelope).shape[0],
    )
    blocks = mean_tempogram(envelope, block=1000)
    assert np.allclose(blocks[:, 0], whole.mean(axis=-1), rtol=0, atol=1e-12)
    assert librosa.feature.tempo(
        tg=blocks, sr=RATE, hop_length=HOP, aggregate=None
    ) == librosa.feature.tempo(onset_envelope=envelope, sr=RATE, hop_length=HOP)
