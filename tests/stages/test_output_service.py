"""Musicians' output through the real service: the six-stem tiny model through two-stem,
mixes, layout and beat grid; awkward inputs each give correct stems."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.manifest import read_manifest, verify_folder
from stemdeck_watch.util.synth import song, write_song

from support.helpers import wait_for

SIX = ["drums", "bass", "other", "vocals", "guitar", "piano"]


def tag(path: Path, **tags: str) -> Path:
    from mutagen.flac import FLAC

    audio = FLAC(path)
    for key, value in tags.items():
        audio[key] = [value]
    audio.save()
    return path


def drop(inbox: Path, made: Path) -> None:
    """Move a finished file into the inbox in one step (as a sync client does)."""
    target = inbox / made.name
    target.parent.mkdir(parents=True, exist_ok=True)
    made.replace(target)


@pytest.mark.slow
def test_six_stems_flow_through_two_stem_mixes_layout_and_beat_grid(
    make_settings, service_factory, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="stemdeck_watch.stages.beats")
    settings = make_settings(
        separation={"model": "tiny6"},
        output={
            "layout": "{artist}/{title} - {stem}.{ext}",
            "format": "flac",
            "beat_grid": True,
            "mixes": {"band": ["guitar", "piano", "bass"]},
        },
        presets={"karaoke": {"two_stems": "guitar"}},
    )
    service, jobs = service_factory(settings)
    # the beat tracker is loaded as the service starts, before any song needs it
    wait_for(lambda: "beat grid ready" in caplog.text, 120, "the beat tracker loaded at start")
    made = tmp_path / "made"
    drop(
        settings.paths.inbox,
        tag(write_song(made / "six.flac", 3.0), title="Six Song", artist="The Band"),
    )
    drop(settings.paths.inbox / "karaoke", write_song(made / "two.wav", 2.0, seed=1))
    done = jobs.wait_final(2)
    assert [j.state for j in done] == [JobState.DONE, JobState.DONE], [j.error for j in done]
    six = settings.paths.outbox / "six"
    manifest = read_manifest(six)
    assert [e["name"] for e in manifest["stems"]] == SIX + ["band"]
    assert manifest["stems"][4]["file"] == "The Band/Six Song - guitar.flac"
    assert manifest["tags"] == {"title": "Six Song", "artist": "The Band"}
    assert manifest["beat_grid"]["source"] == "drums" and (six / "beats.json").is_file()
    for key in ("write", "beat_grid", "preview", "tags", "resample", "separate"):
        assert key in manifest["timings"], key
    band, _ = soundfile.read(six / "The Band/Six Song - band.flac")
    assert band.shape[1] == 2 and (six / "preview.png").is_file()
    assert verify_folder(six) == []
    two = read_manifest(settings.paths.outbox / "karaoke" / "two")
    assert [e["name"] for e in two["stems"]] == ["guitar", "no_guitar", "band"]
    assert two["stems"][1]["sources"] == ["drums", "bass", "other", "vocals", "piano"]
    assert two["stems"][0]["file"] == "two/two - guitar.flac"  # no tags: the file name


def bad_inputs(folder: Path) -> dict[str, tuple[int, int]]:
    """Awkward songs; name → (sample rate, frames) of each input."""
    folder.mkdir(parents=True, exist_ok=True)
    made = {}

    def write(name: str, audio: np.ndarray, rate: int) -> None:
        soundfile.write(folder / name, audio, rate, subtype="PCM_16")
        made[name] = (rate, len(audio))

    write("silence.wav", np.zeros((2 * 44100, 2), np.float32), 44100)
    write("short.wav", song(1.1, 44100, seed=2), 44100)
    write("untagged.wav", song(1.5, 44100, seed=3), 44100)
    six = song(1.5, 48000, seed=4)
    write("surround.wav", np.concatenate([six, six * 0.5, six[:, ::-1] * 0.3], axis=1), 48000)
    write("phone.wav", song(1.5, 8000, seed=5).mean(axis=1), 8000)
    write("studio.wav", song(1.5, 96000, seed=6), 96000)
    hostile = write_song(folder / "hostile.flac", 1.5, seed=7)
    tag(hostile, title="../../" + "x" * 400, artist="AC/DC\nlive", album="..")
    made["hostile.flac"] = (44100, soundfile.info(hostile).frames)
    return made


@pytest.mark.slow
def test_bad_inputs_each_give_correct_stems_at_the_inputs_rate(
    make_settings, service_factory, tmp_path
):
    settings = make_settings(
        output={
            "samplerate": "input",
            "beat_grid": True,
            "layout": "{artist} - {title}/{stem}.{ext}",
        }
    )
    made = bad_inputs(tmp_path / "made")
    service, jobs = service_factory(settings)
    for name in made:
        drop(settings.paths.inbox, tmp_path / "made" / name)
    done = jobs.wait_final(len(made), timeout=240)
    failed = {j.name: j.error for j in done if j.state is not JobState.DONE}
    assert failed == {}
    outbox = settings.paths.outbox
    for job in done:
        folder = Path(job.output)
        assert folder.parent == outbox
        manifest = read_manifest(folder)
        rate, frames = made[Path(job.source).name]
        for entry in manifest["stems"]:
            info = soundfile.info(folder / entry["file"])
            assert (info.samplerate, info.frames, info.channels) == (rate, frames, 2), entry
        grid = json.loads((folder / "beats.json").read_text())
        assert isinstance(grid["beats"], list) and grid["notes"]
        assert verify_folder(folder) == []
    silence = read_manifest(outbox / "silence")
    assert silence["beat_grid"]["tempo"] is None
    assert silence["beat_grid"]["notes"][0].startswith("no beat found")
    hostile = read_manifest(outbox / "hostile")
    stem = hostile["stems"][0]["file"]
    assert stem.startswith("AC-DC live - ") and stem.count("/") == 1 and ".." not in stem
    every = [p for p in outbox.rglob("*") if p.is_file()]
    assert all(outbox in p.parents for p in every)
    assert sorted(p.name for p in settings.paths.processed.iterdir()) == sorted(made)
