"""DAW projects beside the stems: a `.dawproject` checked against the format's published
schema and a REAPER `.rpp` parsed back with the `rpp` package.

The schemas (Project.xsd, MetaData.xsd from the bitwig/dawproject repository) are not part of
this repository: they are read from `$STEMDECK_DAWPROJECT_SCHEMAS` or from the shared folder
beside the checkout (`../shared/dawproject/`). Without them the projects are still parsed and
every structural assertion below still runs; only the schema validation is left out."""

from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.config import OutputSettings, SeparationSettings, settings_from_dict
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.stages.preview import COLOURS
from stemdeck_watch.stages.publish import SongInfo
from stemdeck_watch.stages.scratch import AudioWriter
from stemdeck_watch.stages.songfolder import make_song_folder

SR = 44100
SOURCES = ("drums", "bass", "other", "vocals")


def _schemas() -> Path | None:
    places = [
        os.environ.get("STEMDECK_DAWPROJECT_SCHEMAS", ""),
        str(Path(__file__).resolve().parents[3] / "shared" / "dawproject"),
    ]
    return next((Path(p) for p in places if p and (Path(p) / "Project.xsd").is_file()), None)


SCHEMAS = _schemas()


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), beat_grid=False, preview=False, **kw)


@pytest.fixture
def stems(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(4)
    result = {}
    for i, name in enumerate(SOURCES):
        path = tmp_path / "stems" / f"{name}.npy"
        path.parent.mkdir(exist_ok=True)
        with AudioWriter(path, 2) as writer:
            writer.write((0.1 * (i + 1) * rng.standard_normal((2, 2 * SR + 11))).astype(np.float32))
        result[name] = path
    return result


def validate(xml: bytes, schema: str) -> None:
    """Well-formed XML, and valid against the published XSD where the schemas are at hand
    (lxml, from the `test` extra)."""
    ET.fromstring(xml)
    if SCHEMAS is None:
        return
    etree = pytest.importorskip("lxml.etree", reason="the `test` extra's lxml validates XSD")
    xsd = etree.XMLSchema(etree.parse(str(SCHEMAS / schema)))
    document = etree.fromstring(xml)
    assert xsd.validate(document), xsd.error_log


def rpp_children(element, tag: str) -> list:
    import rpp

    return [c for c in element.children if isinstance(c, rpp.Element) and c.tag == tag]


def rpp_field(element, name: str) -> list[str]:
    found = [c for c in element.children if isinstance(c, list) and c[0] == name]
    assert found, f"{element.tag} has no {name}"
    return found[0]


GRID = {"source": "drums", "tempo": 123.45, "beats": [0.512, 0.998, 1.484], "notes": []}


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_a_song_folder_opens_as_a_session_in_reaper_and_dawproject_daws(
    tmp_path: Path, stems, fmt: str, monkeypatch
) -> None:
    import rpp

    from stemdeck_watch.stages import songfolder

    monkeypatch.setattr(songfolder, "find_beat_grid", lambda *_a, **_k: GRID)
    staging = tmp_path / "outbox" / "song"
    info = SongInfo('Song "1"', tags={"title": "Blue in Green", "artist": "Miles Davis"})
    folder = make_song_folder(
        staging,
        stems,
        SR,
        info,
        SeparationSettings(),
        out(format=fmt, session=("dawproject", "reaper"), layout="{title}/{stem}.{ext}"),
    )
    session = folder.manifest["session"]
    assert session["files"] == {"dawproject": "Song _1_.dawproject", "reaper": "Song _1_.rpp"}
    assert session["tempo"] == 123.45 and session["first_beat"] == 0.512
    # the whole song is written as a mix for the reference track
    mix = folder.entries[-1]
    assert (mix["name"], mix["kind"], mix["sources"]) == ("mix", "mix", list(SOURCES))
    assert session["tracks"] == [*SOURCES, "mix"]
    # the folder moves as a whole: every path is relative to it
    moved = tmp_path / "elsewhere" / "song"
    staging.rename(moved.parent.mkdir(parents=True) or moved)

    project = rpp.loads((moved / session["files"]["reaper"]).read_text(encoding="utf-8"))
    assert project.tag == "REAPER_PROJECT"
    assert rpp_field(project, "TEMPO")[1:4] == ["123.45", "4", "4"]
    marker = rpp_field(project, "MARKER")
    assert float(marker[2]) == 0.512 and marker[3] == "First beat"
    tracks = rpp_children(project, "TRACK")
    assert [rpp_field(t, "NAME")[1] for t in tracks] == [*SOURCES, "mix"]
    for track, entry in zip(tracks, folder.entries, strict=True):
        muted = rpp_field(track, "MUTESOLO")[1] == "1"
        assert muted == (entry["name"] == "mix")
        colour = int(rpp_field(track, "PEAKCOL")[1])
        red, green, blue = colour & 0xFF, colour >> 8 & 0xFF, colour >> 16 & 0xFF
        assert colour & 0x1000000 and (red, green, blue) == COLOURS.get(
            entry["name"], (200, 200, 205)
        )
        (item,) = rpp_children(track, "ITEM")
        assert float(rpp_field(item, "POSITION")[1]) == 0.0
        (source,) = rpp_children(item, "SOURCE")
        assert source.attrib[0] == {"wav": "WAVE", "mp3": "MP3"}[fmt]
        path = rpp_field(source, "FILE")[1]
        assert path == entry["file"] and not Path(path).is_absolute()
        length = float(rpp_field(item, "LENGTH")[1])
        assert length == pytest.approx(entry["duration"], abs=1e-6)
        # the file holds that much audio (an mp3 adds its encoder's padding at the end)
        assert 0 <= soundfile.info(moved / path).duration - length < 0.1

    with zipfile.ZipFile(moved / session["files"]["dawproject"]) as archive:
        assert sorted(archive.namelist()) == ["metadata.xml", "project.xml"]
        project_xml, metadata_xml = archive.read("project.xml"), archive.read("metadata.xml")
    validate(project_xml, "Project.xsd")
    validate(metadata_xml, "MetaData.xsd")
    metadata = ET.fromstring(metadata_xml)
    assert (metadata.findtext("Title"), metadata.findtext("Artist")) == (
        "Blue in Green",
        "Miles Davis",
    )
    root = ET.fromstring(project_xml)
    assert root.find("Transport/Tempo").get("value") == "123.45"
    marker = root.find("Arrangement/Markers/Marker")
    assert float(marker.get("time")) == 0.512
    assert root.find("Arrangement/Lanes").get("timeUnit") == "seconds"
    master = root.find("Structure/Track/Channel[@role='master']")
    tracks = root.findall("Structure/Track")[1:]
    assert [t.get("name") for t in tracks] == [*SOURCES, "mix"]
    clips = {c.get("track"): c for c in root.findall("Arrangement/Lanes/Clips")}
    for track, entry in zip(tracks, folder.entries, strict=True):
        channel = track.find("Channel")
        assert channel.get("destination") == master.get("id")
        assert channel.find("Mute").get("value") == str(entry["name"] == "mix").lower()
        assert track.get("color") == "#{:02x}{:02x}{:02x}".format(
            *COLOURS.get(entry["name"], (200, 200, 205))
        )
        clip = clips[track.get("id")].find("Clip")
        assert float(clip.get("time")) == 0.0
        file = clip.find("Audio/File")
        assert file.get("external") == "true" and file.get("path") == entry["file"]
        assert (moved / file.get("path")).is_file()
        assert int(clip.find("Audio").get("sampleRate")) == entry["samplerate"]


def test_a_mix_of_every_stem_is_the_sessions_reference_and_no_other_is_written(
    tmp_path: Path, stems
) -> None:
    folder = make_song_folder(
        tmp_path / "s",
        stems,
        SR,
        SongInfo("song"),
        SeparationSettings(two_stems="vocals"),
        out(session=("reaper",), mixes={"all": list(SOURCES)}),
    )
    assert [e["name"] for e in folder.entries] == ["vocals", "no_vocals", "all"]
    assert folder.manifest["session"]["files"] == {"reaper": "song.rpp"}
    assert not (tmp_path / "s" / "song.dawproject").exists()


def test_without_a_beat_the_session_has_a_default_tempo_and_no_marker(
    tmp_path: Path, stems, monkeypatch
) -> None:
    import rpp

    from stemdeck_watch.stages import songfolder

    silent = {"source": "drums", "tempo": None, "beats": [], "notes": ["no beat found"]}
    monkeypatch.setattr(songfolder, "find_beat_grid", lambda *_a, **_k: silent)
    folder = make_song_folder(
        tmp_path / "s",
        stems,
        SR,
        SongInfo("song"),
        SeparationSettings(),
        out(session=("reaper", "dawproject")),
    )
    assert folder.manifest["session"]["first_beat"] is None
    assert "beat_grid" not in folder.manifest  # found for the project, beats.json is off
    project = rpp.loads((tmp_path / "s" / "song.rpp").read_text())
    assert rpp_field(project, "TEMPO")[1] == "120.0"
    assert not [c for c in project.children if isinstance(c, list) and c[0] == "MARKER"]
    with zipfile.ZipFile(tmp_path / "s" / "song.dawproject") as archive:
        project_xml = archive.read("project.xml")
    validate(project_xml, "Project.xsd")
    assert ET.fromstring(project_xml).find("Arrangement/Markers") is None


def test_session_names_the_projects_it_knows() -> None:
    assert settings_from_dict({"output": {"session": ["reaper"]}}).output.session == ("reaper",)
    assert settings_from_dict({}).output.session == ()
    with pytest.raises(
        ConfigError,
        match=r"output.session = .* expected a list of projects "
        r'from "dawproject", "reaper" \(unknown: "ableton"\)',
    ):
        settings_from_dict({"output": {"session": ["ableton"]}})


@pytest.mark.slow
def test_a_dropped_song_is_published_with_its_daw_projects(
    make_settings, service_factory, tmp_path: Path
) -> None:
    """Through the real service and worker, the beat grid found for the projects only."""
    import rpp

    from stemdeck_watch.core.jobs import JobState
    from stemdeck_watch.stages.manifest import read_manifest, verify_folder
    from stemdeck_watch.util.synth import write_song

    settings = make_settings(output={"session": ["dawproject", "reaper"], "format": "flac"})
    _service, jobs = service_factory(settings)
    made = write_song(tmp_path / "made" / "Groove.flac", 6.0)
    made.replace(settings.paths.inbox / "Groove.flac")
    (job,) = jobs.wait_final(1)
    assert job.state is JobState.DONE, job.error
    folder = Path(job.output)
    manifest = read_manifest(folder)
    session = manifest["session"]
    assert session["files"] == {"dawproject": "Groove.dawproject", "reaper": "Groove.rpp"}
    assert session["tempo"] > 0 and "session" in manifest["timings"]
    assert not (folder / "beats.json").exists()
    assert verify_folder(folder) == []  # the projects are listed with their sha256
    project = rpp.loads((folder / "Groove.rpp").read_text(encoding="utf-8"))
    assert float(rpp_field(project, "TEMPO")[1]) == session["tempo"]
    files = [
        rpp_field(rpp_children(rpp_children(t, "ITEM")[0], "SOURCE")[0], "FILE")[1]
        for t in rpp_children(project, "TRACK")
    ]
    assert files == [e["file"] for e in manifest["stems"]] and files[-1] == "mix.flac"
    assert all((folder / f).is_file() for f in files)
    with zipfile.ZipFile(folder / "Groove.dawproject") as archive:
        validate(archive.read("project.xml"), "Project.xsd")
