"""Song tags: read from the input with PyAV, written into flac/mp3 stems with mutagen.

A person finds a song on a phone by its title, and a DAW or music library shows a stem as
"Song (vocals)" by the artist: so the input's title, artist, album and track number travel
into the manifest and into every flac or mp3 stem. PyAV reads every input format's tags
(ID3, Vorbis comments, MP4 atoms, RIFF INFO) the same way, from the file the pipeline decodes
anyway; mutagen is the well-kept library for writing them (wav has no tag standard that
players agree on, so wav stems carry none).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping

from stemdeck_watch.core.errors import FilesystemError, PublishError
from stemdeck_watch.stages.naming import clean_text

log = logging.getLogger(__name__)

FIELDS = ("title", "artist", "album", "track")
_ALIASES = {"tracknumber": "track", "trck": "track", "album_artist": None}


def tags_of(container: Any) -> dict[str, Any]:
    """Title, artist, album (text) and track (a number) of an open PyAV input container (the
    decode step reads them as it opens the song); missing ones are left out, and tags that
    cannot be read are none (tags never fail a job)."""
    found: dict[str, Any] = {}
    audio = [s for s in container.streams if s.type == "audio"]
    # container tags first (mp3, flac, m4a); ogg/opus keep theirs on the stream
    try:
        for metadata in [container.metadata, *(s.metadata for s in audio[:1])]:
            for key, value in metadata.items():
                field = _ALIASES.get(key.lower(), key.lower())
                if field in FIELDS and field not in found:
                    found[field] = value
    except UnicodeError as exc:
        log.info(
            "could not read the tags of %s: %s; names fall back to the file name",
            container.name,
            exc,
        )
        return {}
    tags: dict[str, Any] = {}
    for field in ("title", "artist", "album"):
        text = clean_text(found.get(field, ""))
        if text:
            tags[field] = text
    track = _track_number(found.get("track"))
    if track is not None:
        tags["track"] = track
    return tags


def _track_number(value: object) -> int | None:
    """ "3", "03/12" → 3; anything else → None."""
    match = re.match(r"\s*(\d{1,4})", str(value or ""))
    return int(match.group(1)) if match else None


def stem_tags(tags: Mapping[str, Any], song: str, stem: str) -> dict[str, str]:
    """The tags one stem carries: title "Song (vocals)", artist, album, track number."""
    title = clean_text(tags.get("title") or "") or clean_text(song)
    result = {"title": f"{title} ({stem})"}
    for field in ("artist", "album"):
        if clean_text(tags.get(field) or ""):
            result[field] = clean_text(tags[field])
    if tags.get("track") is not None:
        result["tracknumber"] = str(tags["track"])
    return result


TAGGED_FORMATS = ("flac", "mp3")


def write_tags(path: Path, fmt: str, tags: Mapping[str, str]) -> None:
    """Write `tags` (title, artist, album, tracknumber) into a flac or mp3 file and flush it
    to disk (the one flush of a tagged stem: the writer leaves it to this); other formats
    are left untouched."""
    if fmt not in TAGGED_FORMATS:
        return
    from mutagen import MutagenError

    try:
        if fmt == "flac":
            from mutagen.flac import FLAC

            audio = FLAC(path)
        else:
            from mutagen.mp3 import EasyMP3

            audio = EasyMP3(path)
        if audio.tags is None:
            audio.add_tags()
        for field, value in tags.items():
            audio[field] = [value]
        audio.save()
        _fsync(path)
    except (MutagenError, OSError) as exc:
        raise PublishError(str(FilesystemError("tag", path, reason=exc))) from exc


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
