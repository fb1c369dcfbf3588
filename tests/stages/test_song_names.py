"""The names a song folder writes, from names and tags anyone can choose: XML a DAW opens
whatever the title holds, REAPER paths that name the files on disk, every name within a
filesystem's 255 bytes, and no two files one name."""

from __future__ import annotations

import dataclasses
import json
import unicodedata
import zipfile
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pytest

from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.core.errors import PublishError
from stemdeck_watch.stages.manifest import MANIFEST, write_manifest
from stemdeck_watch.stages.publish import SongInfo, publish_folder
from stemdeck_watch.stages.scratch import AudioWriter
from stemdeck_watch.stages.songfolder import make_song_folder

from test_output_session import validate

SR = 44100
SOURCES = ("drums", "bass", "other", "vocals")
GRID = {"source": "drums", "tempo": 120.0, "beats": [0.25 + 0.5 * i for i in range(4)], "notes": []}
SESSION = ("dawproject", "reaper")


def out(**kw) -> OutputSettings:
    return dataclasses.replace(
        OutputSettings(), **{"beat_grid": False, "preview": False, "session": SESSION, **kw}
    )


@pytest.fixture
def stems(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(7)
    result = {}
    for i, name in enumerate(SOURCES):
        path = tmp_path / "stems" / f"{name}.npy"
        path.parent.mkdir(exist_ok=True)
        with AudioWriter(path, 2) as writer:
            writer.write((0.1 * (i + 1) * rng.standard_normal((2, SR))).astype(np.float32))
        result[name] = path
    return result


@pytest.fixture
def grid(monkeypatch: pytest.MonkeyPatch) -> dict:
    from stemdeck_watch.stages import songfolder

    monkeypatch.setattr(songfolder, "find_beat_grid", lambda *_a, **_k: GRID)
    return GRID


def rpp_files(path: Path) -> list[str]:
    """Every FILE path of a REAPER project, read as REAPER reads a string: from its opening
    quote character to the next one of the same kind."""
    import rpp

    files: list[str] = []

    def walk(element) -> None:
        for child in element.children:
            if isinstance(child, rpp.Element):
                walk(child)
            elif isinstance(child, list) and child[0] == "FILE":
                files.append(child[1])

    walk(rpp.loads(path.read_text(encoding="utf-8")))
    return files


def dawproject_files(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        project = archive.read("project.xml")
    return [f.get("path") for f in ET.fromstring(project).iter("File")]


@pytest.mark.parametrize(
    "forbidden",
    ["\uffff", "\ufffe", "\ud800", "\udfff", "\x01\x0b\x1f", "\udce9"],
    ids=["U+FFFF", "U+FFFE", "high surrogate", "low surrogate", "controls", "undecodable byte"],
)
def test_a_title_with_what_xml_forbids_gives_a_well_formed_valid_dawproject(
    tmp_path: Path, stems, grid, forbidden: str
) -> None:
    """A title, artist or file name holding a character XML 1.0 forbids (even as `&#xFFFF;`)
    or a lone surrogate (Python's stand-in for a file name's undecodable byte): both XML
    documents parse and validate, and the .rpp is UTF-8 naming files that exist."""
    staging = tmp_path / "outbox" / "song"
    info = SongInfo(
        f"Song {forbidden} name",
        tags={"title": f"Title {forbidden} end", "artist": f"A{forbidden}", "album": forbidden},
    )
    folder = make_song_folder(
        staging, stems, SR, info, SeparationSettings(), out(layout="{title} - {stem}.{ext}")
    )
    files = folder.manifest["session"]["files"]
    with zipfile.ZipFile(staging / files["dawproject"]) as archive:
        project, metadata = archive.read("project.xml"), archive.read("metadata.xml")
    validate(project, "Project.xsd")
    validate(metadata, "MetaData.xsd")
    title = ET.fromstring(metadata).findtext("Title")
    assert title.startswith("Title ") and title.endswith(" end")
    for path in dawproject_files(staging / files["dawproject"]):
        assert (staging / path).is_file(), path
    for path in rpp_files(staging / files["reaper"]):
        assert (staging / path).is_file(), path
    # every name written is UTF-8, and the manifest listing them can be written (its tags
    # come from decoding, which cleans them as the projects' are)
    for written in staging.rglob("*"):
        written.name.encode("utf-8")
    session = folder.manifest["session"]
    write_manifest(staging, {"stems": folder.entries, "session": session})
    json.loads((staging / MANIFEST).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "layout",
    [
        "{stem}  two  spaces.{ext}",
        unicodedata.normalize("NFD", "Café/{stem} à la carte.{ext}"),
        '{stem} "live".{ext}',
        '{stem} "live" at Ronnie\'s.{ext}',
        "{title} - {stem} `take`.{ext}",
    ],
    ids=["two spaces", "NFD", "double quote", "double and single quote", "backquote"],
)
def test_every_file_a_reaper_project_names_is_on_disk(
    tmp_path: Path, stems, grid, layout: str
) -> None:
    """The .rpp writes each path exactly as the file is called, quoted as REAPER quotes a
    string (with ", or ' where it holds ", or ` where it holds both)."""
    staging = tmp_path / "outbox" / "song"
    info = SongInfo("song", tags={"title": "Don't  stop `me`"})
    folder = make_song_folder(staging, stems, SR, info, SeparationSettings(), out(layout=layout))
    files = folder.manifest["session"]["files"]
    named = rpp_files(staging / files["reaper"])
    assert named == [entry["file"] for entry in folder.entries]
    for path in named:
        assert (staging / path).is_file(), f"{path!r} is not on disk: {sorted(staging.rglob('*'))}"
    for path in dawproject_files(staging / files["dawproject"]):
        assert (staging / path).is_file(), path


def test_a_path_reaper_cannot_quote_fails_the_song_naming_the_layout(
    tmp_path: Path, stems, grid
) -> None:
    """REAPER has no escape: a name holding ", ' and ` cannot be written into an .rpp."""
    layout = "{stem} \"a\" 'b' `c`.{ext}"
    with pytest.raises(PublishError, match=r"all three quote characters.*output\.layout"):
        make_song_folder(
            tmp_path / "song", stems, SR, SongInfo("song"), SeparationSettings(), out(layout=layout)
        )


JAPANESE = "日本語の歌の名前" * 10  # 80 characters, 240 bytes
EMOJI = "🎸" * 63  # 252 bytes: a legal file name


@pytest.mark.parametrize("name", [JAPANESE, EMOJI], ids=["80 Japanese characters", "252 bytes"])
def test_a_long_name_gives_every_output_a_name_within_255_bytes(
    tmp_path: Path, stems, grid, name: str
) -> None:
    """Every file a song writes is named after the song within one name's 255 bytes: cut
    in the middle, keeping what tells the files apart; the song publishes."""
    pytest.importorskip("pedalboard", reason="the practice files' time stretch")
    staging = tmp_path / "outbox" / ".stemdeck-staging" / "job"
    info = SongInfo(name, tags={"title": name, "artist": name})
    settings = out(
        layout="{artist}/{title} - {stem}.{ext}",
        stem_file=True,
        practice=True,
        practice_speeds=(75.0,),
        beat_grid=True,
        mixes={"instrumental": ("drums", "bass", "other")},
    )
    folder = make_song_folder(staging, stems, SR, info, SeparationSettings(), settings)
    write_manifest(staging, {"stems": folder.entries, **folder.manifest})
    published = publish_folder(staging, tmp_path / "outbox", [], name)
    written = [p.relative_to(published) for p in published.rglob("*")]
    too_long = [p for p in written if any(len(part.encode()) > 255 for part in p.parts)]
    assert not too_long, too_long
    files = {p.as_posix() for p in written}
    assert folder.manifest["stem_file"]["file"] in files
    assert all(f in files for f in folder.manifest["session"]["files"].values())
    practice = [entry["file"] for entry in folder.manifest["practice"]["files"]]
    assert len(practice) == 6 and all(f in files for f in practice)  # click, minus 4, 75 %
    stem_files = [entry["file"] for entry in folder.entries]
    assert len(set(stem_files)) == len(stem_files) == 6 and all(f in files for f in stem_files)
    # what tells them apart is kept: the stem's name, the practice file's number and kind
    assert all(f.endswith(f" - {e['name']}.wav") for f, e in zip(stem_files, folder.entries))
    assert practice[1].endswith(" - minus drums.mp3") and "/02 " in practice[1]


@pytest.mark.parametrize(
    "layout,mix,settings,clash",
    [
        ("{stem}.json", "stemdeck", {}, "manifest"),
        ("{stem}.png", "preview", {"preview": True}, "preview picture"),
        ("{stem}.json", "beats", {"beat_grid": True}, "beat grid"),
        ("{name}.{stem}", "rpp", {}, "reaper project"),
        ("{stem}/{name}.{ext}", "practice", {"practice": True}, None),
        ("{stem}", "practice", {"practice": True}, "practice folder"),
        ("stemdeck.json/{stem}.{ext}", "full", {}, "manifest"),
    ],
)
def test_a_layout_and_mix_named_like_a_file_of_the_song_fail_it_with_the_settings_named(
    tmp_path: Path, stems, grid, layout: str, mix: str, settings: dict, clash: str | None
) -> None:
    """A stem or mix the layout names like the manifest, the picture, the beat grid, a
    project or the practice folder: the song fails before anything is written, naming
    output.layout and the mix, never "unexpected error: FileExistsError" at its end."""
    staging = tmp_path / "song"
    chosen = out(layout=layout, mixes={mix: ("drums", "bass")}, **settings)
    if clash is None:  # a folder of the layout's inside the practice folder: no clash
        make_song_folder(staging, stems, SR, SongInfo("song"), SeparationSettings(), chosen)
        return
    with pytest.raises(PublishError) as failed:
        make_song_folder(staging, stems, SR, SongInfo("song"), SeparationSettings(), chosen)
    message = str(failed.value)
    assert "output.layout" in message and clash in message, message
    if "{stem}" in layout.split("/")[0]:  # the mix is what clashes, not every stem
        assert repr(mix) in message and "output.mixes" in message, message
    assert not any(p.is_file() for p in staging.rglob("*")), "nothing is written"
