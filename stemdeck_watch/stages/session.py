"""A DAW project beside the stems: a `.dawproject` and a Reaper `.rpp` that open as a session.

What a musician does first with stems is import them into a DAW, line them up and set the
tempo. The song folder does that for them: one track per stem (named and coloured as in
`preview.png`), the whole mix on a muted track for reference, every clip at 0 s, the project
tempo and a marker at the first beat from the beat grid. Media paths are relative to the song
folder, where the project files lie, so the folder can move or sync to another computer.

- `.dawproject` is the open exchange format of Bitwig, Studio One, Cubase and others: a zip
  holding `project.xml` and `metadata.xml` (schemas Project.xsd and MetaData.xsd in the
  bitwig/dawproject repository). The arrangement is in seconds, so the clips do not depend on
  the tempo; stems are referenced with `external="true"` (relative to the project file).
- `.rpp` is REAPER's text project: nested `<TAG ...>` blocks of one-line fields.

Both are small text files written from the manifest's entries; no audio is read here.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import uuid
import zipfile
from pathlib import Path
from typing import Any, Mapping
from xml.etree import ElementTree as ET

from stemdeck_watch import __version__
from stemdeck_watch.core.errors import FilesystemError, PublishError
from stemdeck_watch.stages.naming import clean_text, song_file
from stemdeck_watch.stages.preview import COLOURS, FALLBACK
from stemdeck_watch.util.safefile import open_new
from stemdeck_watch.util.safetext import xml_text

KINDS = ("dawproject", "reaper")
EXTENSIONS = {"dawproject": "dawproject", "reaper": "rpp"}
MIX_COLOUR = (200, 200, 205)
REAPER_SOURCES = {"wav": "WAVE", "flac": "FLAC", "mp3": "MP3"}
FIRST_BEAT = "First beat"
DEFAULT_TEMPO = 120.0  # a DAW needs one; used when the beat grid found none


@dataclasses.dataclass(frozen=True)
class Track:
    """One file of the song folder as a track: a stem, or the mix (muted)."""

    name: str
    file: str  # relative to the song folder, POSIX separators
    colour: tuple[int, int, int]
    muted: bool
    samplerate: int
    channels: int
    seconds: float

    @property
    def hex_colour(self) -> str:
        return "#{:02x}{:02x}{:02x}".format(*self.colour)

    @property
    def format(self) -> str:
        return self.file.rsplit(".", 1)[-1].lower()


def tracks_of(entries: list[dict[str, Any]]) -> list[Track]:
    """Every stem as a track, then every mix (the whole song, extra mixes) muted."""
    stems = [e for e in entries if e["kind"] == "stem"]
    mixes = [e for e in entries if e["kind"] != "stem"]
    return [
        Track(
            e["name"],
            e["file"],
            MIX_COLOUR if e["kind"] != "stem" else COLOURS.get(e["name"], FALLBACK),
            e["kind"] != "stem",
            int(e["samplerate"]),
            int(e["channels"]),
            float(e["duration"]),
        )
        for e in stems + mixes
    ]


def tempo_of(grid: Mapping[str, Any] | None) -> tuple[float, float | None]:
    """The project tempo and the first beat (seconds) from the beat grid; 120 BPM and no
    first beat where it found none."""
    if not grid or not grid.get("tempo"):
        return DEFAULT_TEMPO, None
    beats = grid.get("beats") or []
    return float(grid["tempo"]), (float(beats[0]) if beats else None)


def write_sessions(
    staging: Path,
    kinds: tuple[str, ...],
    entries: list[dict[str, Any]],
    grid: Mapping[str, Any] | None,
    name: str,
    tags: Mapping[str, Any],
) -> dict[str, Any]:
    """Write the project files `kinds` into the song folder `staging`, named after the song;
    returns the manifest's "session": file per kind, tempo and first beat."""
    tracks = tracks_of(entries)
    tempo, first = tempo_of(grid)
    title = clean_text(tags.get("title") or name)
    written: dict[str, Any] = {}
    for kind in kinds:
        path = staging / project_file(name, kind)
        try:
            if kind == "dawproject":
                write_dawproject(path, tracks, tempo, first, title, tags)
            else:
                write_reaper(path, tracks, tempo, first)
        except OSError as exc:
            raise PublishError(str(FilesystemError("write", path, reason=exc))) from exc
        written[kind] = path.name
    return {
        "files": written,
        "tempo": round(tempo, 2),
        "first_beat": None if first is None else round(first, 4),
        "tracks": [t.name for t in tracks],
    }


def project_file(name: str, kind: str) -> str:
    """The name of the song's project file of `kind`: the song's name and the extension."""
    return song_file(name, f".{EXTENSIONS[kind]}")


# ------------------------------------------------------------------ .dawproject


def dawproject_xml(tracks: list[Track], tempo: float, first: float | None) -> bytes:
    """project.xml: a master track, one audio track per file routed to it, and the
    arrangement in seconds with one clip per track at 0 and the first beat as a marker."""
    ids = (f"id{n}" for n in range(1_000_000))
    project = ET.Element("Project", version="1.0")
    ET.SubElement(project, "Application", name="stemdeck-watch", version=__version__)
    transport = ET.SubElement(project, "Transport")
    ET.SubElement(
        transport,
        "Tempo",
        id=next(ids),
        name="Tempo",
        unit="bpm",
        value=_number(tempo),
        min="20",
        max="666",
    )
    ET.SubElement(transport, "TimeSignature", id=next(ids), numerator="4", denominator="4")
    structure = ET.SubElement(project, "Structure")
    master = ET.SubElement(structure, "Track", id=next(ids), name="Master", loaded="true")
    master_channel = ET.SubElement(
        master, "Channel", id=next(ids), role="master", audioChannels="2"
    )
    _mixer(master_channel, ids, muted=False)
    track_ids = []
    for track in tracks:
        element = ET.SubElement(
            structure,
            "Track",
            id=next(ids),
            name=track.name,
            color=track.hex_colour,
            contentType="audio",
            loaded="true",
        )
        channel = ET.SubElement(
            element,
            "Channel",
            id=next(ids),
            role="regular",
            audioChannels=str(track.channels),
            destination=master_channel.get("id", ""),
        )
        _mixer(channel, ids, muted=track.muted)
        track_ids.append(element.get("id", ""))
    arrangement = ET.SubElement(project, "Arrangement", id=next(ids))
    lanes = ET.SubElement(arrangement, "Lanes", id=next(ids), timeUnit="seconds")
    for track, track_id in zip(tracks, track_ids, strict=True):
        clips = ET.SubElement(lanes, "Clips", id=next(ids), track=track_id)
        clip = ET.SubElement(
            clips,
            "Clip",
            name=track.name,
            time="0.0",
            duration=_number(track.seconds),
            contentTimeUnit="seconds",
            playStart="0.0",
            playStop=_number(track.seconds),
        )
        audio = ET.SubElement(
            clip,
            "Audio",
            id=next(ids),
            channels=str(track.channels),
            sampleRate=str(track.samplerate),
            duration=_number(track.seconds),
        )
        ET.SubElement(audio, "File", path=track.file, external="true")
    if first is not None:
        markers = ET.SubElement(arrangement, "Markers", id=next(ids), timeUnit="seconds")
        ET.SubElement(markers, "Marker", time=_number(first), name=FIRST_BEAT)
    return _xml(project)


def _mixer(channel: ET.Element, ids: Any, muted: bool) -> None:
    ET.SubElement(channel, "Mute", id=next(ids), name="Mute", value=str(muted).lower())
    ET.SubElement(
        channel,
        "Pan",
        id=next(ids),
        name="Pan",
        unit="normalized",
        value="0.5",
        min="0.0",
        max="1.0",
    )
    ET.SubElement(
        channel,
        "Volume",
        id=next(ids),
        name="Volume",
        unit="linear",
        value="1.0",
        min="0.0",
        max="2.0",
    )


def metadata_xml(title: str, tags: Mapping[str, Any]) -> bytes:
    metadata = ET.Element("MetaData")
    ET.SubElement(metadata, "Title").text = title
    for field, element in (("artist", "Artist"), ("album", "Album")):
        if clean_text(tags.get(field) or ""):
            ET.SubElement(metadata, element).text = clean_text(tags[field])
    return _xml(metadata)


def write_dawproject(
    path: Path,
    tracks: list[Track],
    tempo: float,
    first: float | None,
    title: str,
    tags: Mapping[str, Any],
) -> None:
    """The zip container: metadata.xml and project.xml, as DAWproject's own writer orders
    them; compressed, stamped with the time of writing."""
    stamp = _dt.datetime.now().timetuple()[:6]
    with open_new(path) as handle:  # new in the staging folder: never through a link
        with zipfile.ZipFile(handle, "w", zipfile.ZIP_DEFLATED) as archive:
            for member, data in (
                ("metadata.xml", metadata_xml(title, tags)),
                ("project.xml", dawproject_xml(tracks, tempo, first)),
            ):
                info = zipfile.ZipInfo(member, date_time=stamp)
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, data)
        handle.flush()
        os.fsync(handle.fileno())


def _xml(root: ET.Element) -> bytes:
    """The document, every text and attribute first made what XML can hold (xml_text):
    ElementTree writes U+FFFF or a lone surrogate as it is, and a DAW then refuses the
    whole project."""
    for element in root.iter():
        element.text = None if element.text is None else xml_text(element.text)
        element.tail = None if element.tail is None else xml_text(element.tail)
        for attribute, value in list(element.attrib.items()):
            element.set(attribute, xml_text(value))
    ET.indent(root, "  ")
    return ET.tostring(root, encoding="UTF-8", xml_declaration=True) + b"\n"


def _number(value: float) -> str:
    return repr(round(float(value), 6))


# ------------------------------------------------------------------ .rpp


def reaper_text(tracks: list[Track], tempo: float, first: float | None) -> str:
    """A REAPER project: tempo 4/4, a marker at the first beat, one track per file with its
    item at 0 s (muted for the mix), colours as REAPER stores them (0x01BBGGRR)."""
    rate = tracks[0].samplerate if tracks else 44100
    lines = [
        f'<REAPER_PROJECT 0.1 "7.0/stemdeck-watch {__version__}" '
        f"{int(_dt.datetime.now().timestamp())}",
        f"  TEMPO {_number(tempo)} 4 4",
        f"  SAMPLERATE {rate} 0 0",
    ]
    if first is not None:
        lines.append(f"  MARKER 1 {_number(first)} {_quote(FIRST_BEAT)} 0")
    for track in tracks:
        red, green, blue = track.colour
        lines += [
            f"  <TRACK {{{str(uuid.uuid4()).upper()}}}",
            f"    NAME {_quote(track.name)}",
            f"    PEAKCOL {0x1000000 | blue << 16 | green << 8 | red}",
            f"    MUTESOLO {int(track.muted)} 0 0",
            f"    NCHAN {max(2, track.channels)}",
            "    <ITEM",
            "      POSITION 0",
            f"      LENGTH {_number(track.seconds)}",
            f"      NAME {_quote(track.name)}",
            "      SOFFS 0",
            f"      <SOURCE {REAPER_SOURCES.get(track.format, 'WAVE')}",
            f"        FILE {_quote_path(track.file)}",
            "      >",
            "    >",
            "  >",
        ]
    lines.append(">")
    return "\n".join(lines) + "\n"


def write_reaper(path: Path, tracks: list[Track], tempo: float, first: float | None) -> None:
    with open_new(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(reaper_text(tracks, tempo, first))
        handle.flush()
        os.fsync(handle.fileno())


def _quote(text: str) -> str:
    """A name (a track's, the marker's) as a REAPER string: one line, quoted as REAPER
    quotes (see _quoted); one holding all three quote characters loses its backquotes."""
    text = clean_text(text)
    return _quoted(text) or "`" + text.replace("`", "'") + "`"


def _quote_path(path: str) -> str:
    """A media file's path exactly as it is on disk (two spaces, decomposed accents and
    quotes kept), quoted as REAPER quotes: a path changed here names a file that is not
    there. REAPER has no escape, so a path holding all three quote characters cannot be
    written; the song fails, naming the layout that made it."""
    quoted = _quoted(path)
    if quoted is None:
        raise PublishError(
            f"could not write the REAPER project: the file name {path!r} holds all three "
            f"quote characters (\" ' `), which an .rpp cannot name; take the double quote "
            f"out of output.layout, or leave reaper out of output.session"
        )
    return quoted


def _quoted(text: str) -> str | None:
    """`text` between the first quote character it does not contain, REAPER's own rule
    (", then ', then `); None if it holds all three."""
    for mark in ('"', "'", "`"):
        if mark not in text:
            return f"{mark}{text}{mark}"
    return None
