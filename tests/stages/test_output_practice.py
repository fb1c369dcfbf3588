"""Practice renders: click track with a count-in, "minus STEM" mixes, slowed versions; read
back with soundfile (libsndfile's mp3 decoder) and mutagen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.config import OutputSettings, SeparationSettings, settings_from_dict
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.stages import practice
from stemdeck_watch.stages.publish import SongInfo
from stemdeck_watch.stages.scratch import AudioWriter
from stemdeck_watch.stages.songfolder import make_song_folder

SR = 44100
FOUR = ("drums", "bass", "other", "vocals")
PITCH = {"drums": 220.0, "bass": 310.0, "other": 470.0, "vocals": 700.0}
GRID = {"source": "drums", "tempo": 120.0, "beats": [0.25 + 0.5 * i for i in range(8)], "notes": []}


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), beat_grid=False, preview=False, **kw)


def tone_stems(folder: Path, seconds: float) -> dict[str, Path]:
    t = np.arange(int(seconds * SR)) / SR
    folder.mkdir(parents=True, exist_ok=True)
    stems = {}
    for name in FOUR:
        tone = 0.2 * np.sin(2 * np.pi * PITCH[name] * t)
        with AudioWriter(folder / f"{name}.npy", 2) as writer:
            writer.write(np.stack([tone, tone]).astype(np.float32))
        stems[name] = folder / f"{name}.npy"
    return stems


def level_at(audio: np.ndarray, hz: float) -> float:
    """The amplitude of a sine at `hz` in mono `audio` (a windowed FFT's peak near it)."""
    window = np.hanning(len(audio))
    spectrum = np.abs(np.fft.rfft(audio * window)) * 2 / window.sum()
    freqs = np.fft.rfftfreq(len(audio), 1 / SR)
    near = (freqs > hz - 5) & (freqs < hz + 5)
    return float(spectrum[near].max())


def onsets(audio: np.ndarray) -> np.ndarray:
    """Seconds where a click starts: 5 ms frames rising past a threshold."""
    hop = SR // 200
    energy = np.array([np.abs(audio[i : i + hop]).max() for i in range(0, len(audio), hop)])
    loud = energy > 0.5 * energy.max()
    rising = np.flatnonzero(loud[1:] & ~loud[:-1]) + 1
    return rising * hop / SR


@pytest.fixture
def grid(monkeypatch):
    from stemdeck_watch.stages import songfolder

    monkeypatch.setattr(songfolder, "find_beat_grid", lambda *_a, **_k: GRID)
    return GRID


def test_practice_files_for_a_phone_click_minus_each_stem_and_slowed(tmp_path: Path, grid) -> None:
    from mutagen.mp3 import EasyMP3

    stems = tone_stems(tmp_path / "stems", 4.0)
    info = SongInfo("song", tags={"title": "Blue in Green", "artist": "Miles Davis"})
    folder = make_song_folder(
        tmp_path / "s",
        stems,
        SR,
        info,
        SeparationSettings(),
        out(practice=True, practice_speeds=(75,)),
    )
    summary = folder.manifest["practice"]
    names = [f["file"] for f in summary["files"]]
    assert names == [
        "practice/01 Blue in Green - click.mp3",
        *(f"practice/0{i} Blue in Green - minus {s}.mp3" for i, s in enumerate(FOUR, start=2)),
        "practice/06 Blue in Green - 75% speed.mp3",
    ]
    assert sorted(p.name for p in (tmp_path / "s" / "practice").iterdir()) == [
        Path(n).name for n in names
    ]  # the names sort in the files' order
    for number, name in enumerate(names, start=1):
        tags = EasyMP3(tmp_path / "s" / name)
        assert tags["album"] == ["Blue in Green (practice)"]
        assert tags["tracknumber"] == [f"{number}/6"] and tags["artist"] == ["Miles Davis"]
        # small: 128 kbit/s
        seconds = soundfile.info(tmp_path / "s" / name).duration
        assert (tmp_path / "s" / name).stat().st_size < 128_000 / 8 * seconds * 1.1

    # the click: a bar of count-in at the first beat's place, then every beat, one bar later
    click, rate = soundfile.read(tmp_path / "s" / names[0], dtype="float64")
    assert rate == SR
    found = onsets(click.mean(axis=1))
    count_in = 4 * 0.5
    want = [0.25 + 0.5 * k for k in range(4)] + [b + count_in for b in GRID["beats"]]
    delay = found[0] - want[0]  # the mp3 decoder's delay, the same for every click
    assert 0 <= delay < 0.06
    assert np.allclose(found - delay, want, atol=0.006), found
    assert summary["files"][0]["count_in"] == 2.0 and summary["files"][0]["tempo"] == 120.0

    # minus drums: the others' tones, not the drums' (after the count-in)
    minus, _ = soundfile.read(tmp_path / "s" / names[1], dtype="float64")
    song = minus[int(2.5 * SR) : int(5.5 * SR)].mean(axis=1)
    assert level_at(song, PITCH["drums"]) < 0.01
    for stem in ("bass", "other", "vocals"):
        assert level_at(song, PITCH[stem]) > 0.05, stem

    # 75 %: one bar of count-in at 90 BPM, the song a third longer, every pitch kept
    slow, _ = soundfile.read(tmp_path / "s" / names[5], dtype="float64")
    assert summary["files"][5]["tempo"] == 90.0
    expected = 4 * 60 / 90 + 4.0 / 0.75
    assert len(slow) / SR == pytest.approx(expected, abs=0.1)
    middle = slow[int(4 * SR) : int(7 * SR)].mean(axis=1)
    for stem in FOUR:
        assert level_at(middle, PITCH[stem]) > 0.05, stem
        assert level_at(middle, PITCH[stem] * 0.75) < 0.02, stem  # pitch kept, not lowered


def test_without_a_beat_there_is_no_click_and_no_count_in(tmp_path: Path, monkeypatch) -> None:
    from stemdeck_watch.stages import songfolder

    monkeypatch.setattr(
        songfolder,
        "find_beat_grid",
        lambda *_a, **_k: {
            "source": "drums",
            "tempo": None,
            "beats": [],
            "notes": ["no beat found"],
        },
    )
    stems = tone_stems(tmp_path / "stems", 2.0)
    folder = make_song_folder(
        tmp_path / "s",
        stems,
        SR,
        SongInfo("song"),
        SeparationSettings(),
        out(practice=True, practice_speeds=()),
    )
    summary = folder.manifest["practice"]
    assert [f["what"] for f in summary["files"]] == [f"minus {s}" for s in FOUR]
    assert summary["notes"] == ["no click or count-in: the beat grid found no beat"]
    minus, _ = soundfile.read(tmp_path / "s" / summary["files"][0]["file"])
    assert len(minus) / SR == pytest.approx(2.0, abs=0.08)  # no count-in


def test_slowing_down_in_chunks_keeps_length_pitch_and_level_across_the_seams(monkeypatch) -> None:
    monkeypatch.setattr(practice, "CHUNK_SECONDS", 1.0)  # a seam every second
    monkeypatch.setattr(practice, "CONTEXT_SECONDS", 0.5)
    frames = int(4.3 * SR)
    t = np.arange(frames) / SR
    audio = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 550 * t)])
    blocks = list(
        practice.stretched(lambda a, b: audio[:, a:b].astype(np.float32), frames, SR, 0.75)
    )
    slow = np.concatenate(blocks, axis=1)
    assert slow.shape == (2, round(frames / 0.75))
    assert level_at(slow[0, SR:-SR], 440) > 0.25 and level_at(slow[1, SR:-SR], 550) > 0.25
    # no dip or bump at the seams: the level over 10 ms windows stays near the tone's
    body = slow[0, SR // 2 : -SR // 2]
    windows = body[: len(body) // 441 * 441].reshape(-1, 441)
    rms = np.sqrt(np.mean(windows**2, axis=1))
    assert rms.min() > 0.8 * 0.3 / np.sqrt(2) and rms.max() < 1.2 * 0.3 / np.sqrt(2)


def test_practice_settings() -> None:
    settings = settings_from_dict({})
    assert settings.output.practice is False and settings.output.practice_speeds == (75.0,)
    assert settings_from_dict({"output": {"practice_speeds": [50, 80]}}).output.practice_speeds == (
        50.0,
        80.0,
    )
    with pytest.raises(
        ConfigError,
        match=r"output.practice_speeds = \[120\] is not allowed: "
        r"expected a list of numbers ≥ 25 and ≤ 99",
    ):
        settings_from_dict({"output": {"practice_speeds": [120]}})


@pytest.mark.slow
def test_a_dropped_song_gets_practice_tracks(
    make_settings, service_factory, tmp_path: Path
) -> None:
    from stemdeck_watch.core.jobs import JobState
    from stemdeck_watch.stages.manifest import read_manifest, verify_folder
    from stemdeck_watch.util.synth import write_song

    settings = make_settings(output={"practice": True, "preview": False})
    _service, jobs = service_factory(settings)
    made = write_song(tmp_path / "made" / "Tune.wav", 6.0)
    made.replace(settings.paths.inbox / "Tune.wav")
    (job,) = jobs.wait_final(1)
    assert job.state is JobState.DONE, job.error
    folder = Path(job.output)
    manifest = read_manifest(folder)
    files = [f["file"] for f in manifest["practice"]["files"]]
    assert files[-1] == "practice/06 Tune - 75% speed.mp3" and "practice" in manifest["timings"]
    assert verify_folder(folder) == []
    slow = soundfile.info(folder / files[-1])
    assert slow.duration > 6.0 / 0.75
