"""Tags read from the input (PyAV), names from tags (sanitised), tags written into stems."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.core.errors import DecodeError
from stemdeck_watch.stages.decode import decode_to_file
from stemdeck_watch.stages.naming import MAX_COMPONENT_BYTES, safe_name
from stemdeck_watch.stages.publish import SongInfo, write_song
from stemdeck_watch.stages.scratch import AudioWriter
from stemdeck_watch.util.synth import write_song as synth_song

SR = 44100
TAGS = {"title": "Blue in Green", "artist": "Miles Davis", "album": "Kind of Blue", "track": "3/5"}


def tag_input(path: Path, tags: dict[str, str]) -> Path:
    """Tag a synthesised input with mutagen, the way a music library would have."""
    suffix = path.suffix
    if suffix == ".flac":
        from mutagen.flac import FLAC

        audio = FLAC(path)
        names = {"title": "title", "artist": "artist", "album": "album", "track": "tracknumber"}
    elif suffix == ".mp3":
        from mutagen.mp3 import EasyMP3

        audio = EasyMP3(path)
        if audio.tags is None:
            audio.add_tags()
        names = {"title": "title", "artist": "artist", "album": "album", "track": "tracknumber"}
    else:
        from mutagen.mp4 import MP4

        audio = MP4(path)
        names = {"title": "\xa9nam", "artist": "\xa9ART", "album": "\xa9alb"}
        if "track" in tags:
            audio["trkn"] = [tuple(int(v) for v in tags["track"].split("/"))]
    for key, value in tags.items():
        if key in names:
            audio[names[key]] = [value]
    audio.save()
    return path


@pytest.mark.parametrize("ext", ["flac", "mp3", "m4a"])
def test_tags_are_read_from_flac_mp3_and_m4a_while_decoding(tmp_path: Path, ext: str) -> None:
    """Publishing takes them from the decode step: it never opens the input again."""
    source = tag_input(synth_song(tmp_path / f"song.{ext}", 1.0), TAGS)
    decoded = decode_to_file(source, tmp_path / "input.npy", SR, 2)
    assert decoded.tags == {
        "title": "Blue in Green",
        "artist": "Miles Davis",
        "album": "Kind of Blue",
        "track": 3,
    }


def test_tags_behind_a_cover_larger_than_the_quick_probe_are_read(tmp_path: Path) -> None:
    """An mp3 from a music library may carry a cover picture of hundreds of kilobytes before
    the audio: more than open_media's first look at a file."""
    from mutagen.id3 import APIC, ID3

    source = tag_input(synth_song(tmp_path / "song.mp3", 1.0), TAGS)
    tags = ID3(source)
    tags.add(
        APIC(
            encoding=3,
            mime="image/jpeg",
            type=3,
            desc="cover",
            data=b"\xff\xd8" + np.random.default_rng(0).bytes(600_000),
        )
    )
    tags.save(source)
    decoded = decode_to_file(source, tmp_path / "input.npy", SR, 2)
    assert decoded.tags == {
        "title": "Blue in Green",
        "artist": "Miles Davis",
        "album": "Kind of Blue",
        "track": 3,
    }
    assert decoded.source_codec.startswith("mp3") and decoded.source_samplerate == SR
    assert abs(decoded.frames - SR) <= 1152


def test_an_untagged_input_has_no_tags_and_an_unreadable_one_fails_its_decode(
    tmp_path: Path,
) -> None:
    plain = synth_song(tmp_path / "plain.wav", 1.0)
    assert decode_to_file(plain, tmp_path / "plain.npy", SR, 2).tags == {}
    junk = tmp_path / "junk.mp3"
    junk.write_bytes(b"not audio at all" * 10)
    with pytest.raises(DecodeError, match="could not decode .*junk.mp3"):
        decode_to_file(junk, tmp_path / "junk.npy", SR, 2)


@pytest.fixture
def stems(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(5)
    result = {}
    for name in ("drums", "bass", "other", "vocals"):
        path = tmp_path / "stems" / f"{name}.npy"
        path.parent.mkdir(exist_ok=True)
        with AudioWriter(path, 2) as writer:
            writer.write((0.1 * rng.standard_normal((2, SR))).astype(np.float32))
        result[name] = path
    return result


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), beat_grid=False, preview=False, **kw)


@pytest.mark.parametrize("fmt", ["flac", "mp3"])
def test_flac_and_mp3_stems_carry_the_songs_tags(tmp_path: Path, stems, fmt: str) -> None:
    import mutagen

    info = SongInfo(
        "blue",
        tags={
            "title": "Blue in Green",
            "artist": "Miles Davis",
            "album": "Kind of Blue",
            "track": 3,
        },
    )
    entries = write_song(
        tmp_path / "s",
        stems,
        SR,
        "blue",
        SeparationSettings(),
        out(format=fmt, bit_depth=16),
        info=info,
    )
    for entry in entries:
        tagged = mutagen.File(tmp_path / "s" / entry["file"], easy=True)
        assert tagged["title"] == [f"Blue in Green ({entry['name']})"]
        assert tagged["artist"] == ["Miles Davis"] and tagged["album"] == ["Kind of Blue"]
        assert tagged["tracknumber"] == ["3"]
    untagged = write_song(
        tmp_path / "u", stems, SR, "My Song", SeparationSettings(), out(format=fmt, bit_depth=16)
    )
    tagged = mutagen.File(tmp_path / "u" / untagged[0]["file"], easy=True)
    assert tagged["title"] == ["My Song (drums)"] and "artist" not in tagged


def test_names_come_from_tags_with_the_file_name_as_fallback(tmp_path: Path, stems) -> None:
    layout = "{artist}/{album}/{title} - {stem} [{preset}].{ext}"
    info = SongInfo(
        "file name", tags={"title": "Blue in Green", "artist": "Miles Davis"}, preset="karaoke"
    )
    entries = write_song(
        tmp_path / "s", stems, SR, "file name", SeparationSettings(), out(layout=layout), info=info
    )
    assert entries[0]["file"] == "Miles Davis/file name/Blue in Green - drums [karaoke].wav"
    bare = write_song(
        tmp_path / "b", stems, SR, "file name", SeparationSettings(), out(layout=layout)
    )
    assert bare[0]["file"] == "file name/file name/file name - drums [default].wav"
    assert (tmp_path / "b" / bare[0]["file"]).is_file()


HOSTILE = [
    {"title": "../../../etc/passwd", "artist": "..", "album": "/"},
    {"title": "line one\nline two\r\n\x00", "artist": "AC/DC", "album": "C:\\Windows\\x"},
    {"title": "x" * 400, "artist": "é" * 400, "album": ".hidden"},
    {"title": "CON", "artist": "  ", "album": 'a?b*c<d>e|f:"g"'},
]


@pytest.mark.parametrize("tags", HOSTILE, ids=["dots", "newlines", "long", "reserved"])
def test_hostile_tags_never_place_a_file_outside_the_song_folder(
    tmp_path: Path, stems, tags
) -> None:
    import mutagen

    layout = "{artist}/{album}/{title} - {stem}.{ext}"
    folder = tmp_path / "outbox" / "song"
    entries = write_song(
        folder,
        stems,
        SR,
        "song",
        SeparationSettings(),
        out(layout=layout, format="flac"),
        info=SongInfo("song", tags=tags),
    )
    written = sorted(p for p in (tmp_path / "outbox").rglob("*") if p.is_file())
    assert len(written) == 4 and all(folder in p.parents for p in written)
    for entry in entries:
        path = folder / entry["file"]
        parts = Path(entry["file"]).parts
        assert len(parts) == 3  # artist/album/file: no tag added or removed a level
        assert all(len(p.encode()) <= MAX_COMPONENT_BYTES and not p.startswith(".") for p in parts)
        assert not any(c in entry["file"] for c in '\\:*?"<>|\n\r\x00')
        assert path.suffix == ".flac"
        title = mutagen.File(path, easy=True)["title"][0]
        assert "\n" not in title and title.endswith(f"({entry['name']})")


def test_safe_name_keeps_ordinary_names_and_cleans_the_rest() -> None:
    assert safe_name("Blue in Green", "x") == "Blue in Green"
    assert safe_name("Beyoncé — Halo (Live)", "x") == "Beyoncé — Halo (Live)"
    assert safe_name("AC/DC", "x") == "AC-DC"
    assert safe_name("..", "fallback") == "fallback"
    assert safe_name("", "") == "" and safe_name("nul", "x") == "nul_"
    assert len(safe_name("y" * 400, "x")) == 80


@pytest.mark.parametrize(
    "fmt,tags", [("flac", True), ("mp3", True), ("wav", True), ("flac", False)]
)
def test_every_stem_reaches_the_disk_once_after_its_last_write(
    tmp_path: Path, stems, fmt: str, tags: bool, monkeypatch
) -> None:
    """A stem is flushed to disk after its tags, not also before them: on a slow disk or a
    NAS each flush is a wait, and the one before the tags protects nothing."""
    import os

    flushed: list[str] = []
    real_fsync = os.fsync

    def recorded_fsync(fd: int) -> None:
        flushed.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name the file behind a descriptor")
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    entries = write_song(
        tmp_path / "s",
        stems,
        SR,
        "blue",
        SeparationSettings(),
        out(format=fmt, bit_depth=16, tags=tags),
    )
    files = [e["file"] for e in entries]
    assert sorted(flushed) == sorted(files), flushed
