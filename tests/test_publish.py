"""Stems, mixes and the manifest are written into staging and published in one rename."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.config import OutputSettings, SeparationSettings
from stemdeck_watch.errors import PublishError
from stemdeck_watch.pipeline.publish import (publish_folder, read_manifest, write_manifest,
                                             write_song)

SR = 44100
SOURCES = ("drums", "bass", "other", "vocals")


@pytest.fixture
def stems(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(1)
    result = {}
    for i, name in enumerate(SOURCES):
        path = tmp_path / "stems" / f"{name}.npy"
        path.parent.mkdir(exist_ok=True)
        np.save(path, (0.2 * (i + 1) * rng.standard_normal((2, SR))).astype(np.float32))
        result[name] = path
    return result


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), **kw)


def sep(**kw) -> SeparationSettings:
    return dataclasses.replace(SeparationSettings(), **kw)


@pytest.mark.parametrize("fmt, depth, subtype", [
    ("wav", 16, "PCM_16"), ("wav", 24, "PCM_24"), ("wav", 32, "FLOAT"), ("flac", 24, "PCM_24"),
])
def test_stems_are_written_in_the_configured_format(tmp_path: Path, stems, fmt, depth, subtype):
    entries = write_song(tmp_path / "stage", stems, SR, "song", sep(), out(format=fmt, bit_depth=depth))
    assert [e["name"] for e in entries] == list(SOURCES)
    for entry in entries:
        info = soundfile.info(tmp_path / "stage" / entry["file"])
        assert info.subtype == subtype and info.frames == SR and info.channels == 2
        assert entry["file"] == f"{entry['name']}.{fmt}"


def test_mp3_output_has_the_requested_bitrate(tmp_path: Path, stems) -> None:
    write_song(tmp_path / "stage", stems, SR, "song", sep(), out(format="mp3", mp3_bitrate=128))
    path = tmp_path / "stage" / "vocals.mp3"
    audio, rate = soundfile.read(path)
    assert rate == SR and abs(len(audio) - SR) < 2000
    assert abs(path.stat().st_size - 128_000 / 8) < 3000  # one second at 128 kbit/s


def test_rescale_keeps_peaks_below_full_scale_and_clamp_clips(tmp_path: Path, stems) -> None:
    write_song(tmp_path / "r", stems, SR, "song", sep(), out(clip="rescale", bit_depth=24))
    loud, _ = soundfile.read(tmp_path / "r" / "vocals.wav")
    assert 0.9 < np.abs(loud).max() < 1.0
    write_song(tmp_path / "c", stems, SR, "song", sep(), out(clip="clamp", bit_depth=24))
    clamped, _ = soundfile.read(tmp_path / "c" / "vocals.wav")
    assert np.abs(clamped).max() == pytest.approx(1.0, abs=1e-4)
    write_song(tmp_path / "f", stems, SR, "song", sep(), out(bit_depth=32))
    floats, _ = soundfile.read(tmp_path / "f" / "vocals.wav")
    assert np.abs(floats).max() > 1.0  # float keeps what it was given


def test_two_stems_and_mixes(tmp_path: Path, stems) -> None:
    entries = write_song(tmp_path / "s", stems, SR, "song", sep(two_stems="vocals"),
                         out(bit_depth=32, mixes={"instrumental": ("drums", "bass", "other")}))
    assert [e["name"] for e in entries] == ["vocals", "no_vocals", "instrumental"]
    no_vocals, _ = soundfile.read(tmp_path / "s" / "no_vocals.wav", dtype="float32")
    expected = sum(np.load(stems[s]) for s in ("drums", "bass", "other")).T
    assert np.allclose(no_vocals, expected, atol=1e-5)


def test_a_two_stem_name_the_model_lacks_is_a_clear_error(tmp_path: Path, stems) -> None:
    with pytest.raises(PublishError, match="separation.two_stems = 'guitar'.*drums, bass"):
        write_song(tmp_path / "s", stems, SR, "song", sep(two_stems="guitar"), out())
    with pytest.raises(PublishError, match="output.mixes.band names piano"):
        write_song(tmp_path / "s", stems, SR, "song", sep(), out(mixes={"band": ("piano",)}))


def test_layout_template_names_the_files(tmp_path: Path, stems) -> None:
    entries = write_song(tmp_path / "s", stems, SR, "My Song", sep(model="tiny"),
                         out(layout="{name} - {stem} ({model}).{ext}"))
    assert entries[0]["file"] == "My Song - drums (tiny).wav"
    assert (tmp_path / "s" / "My Song - drums (tiny).wav").is_file()


def test_publish_never_overwrites_and_the_manifest_marks_completion(tmp_path: Path, stems) -> None:
    outbox = tmp_path / "outbox"
    (outbox / "song").mkdir(parents=True)
    (outbox / "song" / "keep.txt").write_text("mine")
    stage = outbox / ".stemdeck-staging" / "job1"
    entries = write_song(stage, stems, SR, "song", sep(), out())
    assert read_manifest(stage) is None  # no manifest yet: not a finished song
    write_manifest(stage, {"job_id": "job1", "stems": entries})
    final = publish_folder(stage, outbox / "song")
    assert final == outbox / "song (2)"
    assert (outbox / "song" / "keep.txt").read_text() == "mine"
    manifest = read_manifest(final)
    assert manifest["job_id"] == "job1" and not stage.exists()
    (final / "bass.wav").unlink()
    assert read_manifest(final) is None  # a listed stem is missing: incomplete
    assert json.loads((final / "stemdeck.json").read_text())["stemdeck_watch"]
