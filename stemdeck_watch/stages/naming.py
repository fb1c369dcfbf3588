"""File names from tags: every value sanitised, every name kept inside the song folder.

Tags come from whoever made the file, or from a web page title for links: they may hold
`/`, `..`, newlines, characters Windows refuses, or 400 characters. The layout template itself
is checked at config load (validators.layout_template); the values put into it are cleaned
here, so that no tag can add a folder level, climb out of the song folder, hide a file (a
leading dot) or exceed what a filesystem or a sync client accepts in one name.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from stemdeck_watch.core.errors import PublishError
from stemdeck_watch.util.safetext import cut_to_bytes, fit_bytes, with_suffix_bytes, xml_text

MAX_VALUE_CHARS = 80  # one field of a name
MAX_COMPONENT_BYTES = 240  # one file or folder name (ext4, APFS, NTFS allow 255)
# a title as a folder name, in UTF-8 bytes: 255 is the limit of one name on ext4, APFS and
# most others; the rest leaves room for " (12)", a playlist entry's "001 - " and ".url",
# and a failed input's ".error.txt"
MAX_NAME_BYTES = 200
_UNSAFE = re.compile(r'[\x00-\x1f\x7f<>:"|?*]')
_SEPARATORS = re.compile(r"[/\\]+")
_RESERVED = {
    "con",
    "prn",
    "aux",
    "nul",
    *(f"com{i}" for i in range(1, 10)),
    *(f"lpt{i}" for i in range(1, 10)),
}  # Windows device names


def clean_text(value: object, limit: int = 1000) -> str:
    """A tag as readable one-line text (for the manifest, tags, the picture, the DAW
    projects, file names): control characters become spaces, runs of spaces collapse, what
    UTF-8 or XML cannot hold (a lone surrogate, U+FFFF) becomes U+FFFD, at most `limit`
    characters."""
    text = unicodedata.normalize("NFC", str(value))
    text = xml_text(re.sub(r"[\x00-\x1f\x7f]+", " ", text))
    return " ".join(text.split())[:limit].strip()


def safe_name(value: object, fallback: str) -> str:
    """One path component from a tag: no separators, no control or reserved characters, no
    leading dots (no `..`, no hidden files), no trailing dots or spaces (Windows drops them),
    not a Windows device name, at most MAX_VALUE_CHARS characters; `fallback` if nothing
    is left."""
    text = _SEPARATORS.sub("-", clean_text(value))
    text = _UNSAFE.sub("_", text)
    text = re.sub(r"\.{2,}", ".", text)  # no "..", even inside a name
    text = text.lstrip(". -")[:MAX_VALUE_CHARS].rstrip(". ")
    if text.split(".")[0].lower() in _RESERVED:
        text = f"{text}_"
    if not text:
        return fallback if fallback == "" else safe_name(fallback, "song")
    return text


def song_name(info: dict[str, Any], fallback: str) -> str:
    """ "Artist - Title" (or the title), safe as one folder name on every platform: no path
    separators, no leading dot (hidden), no reserved characters, bounded length."""
    title = str(info.get("track") or info.get("title") or "").strip()
    artist = str(info.get("artist") or info.get("creator") or "").strip()
    name = f"{artist} - {title}" if artist and title and artist not in title else title
    return sanitise(name) or sanitise(fallback) or "download"


def sanitise(name: str) -> str:
    """A page's title as one whole folder name (a link's song folder, a playlist's entry): no
    separators, control or reserved characters, no leading dot, not a device name, at most
    MAX_NAME_BYTES."""
    name = unicodedata.normalize("NFC", name)
    name = "".join(" " if unicodedata.category(c).startswith("C") else c for c in name)
    name = re.sub(r'[<>:"/\\|?*]', "_", name)
    name = re.sub(r"\s+", " ", name).strip()
    name = name.lstrip(".").rstrip(". ")
    if name.lower().split(".")[0] in _RESERVED:
        name = f"_{name}"
    return cut_to_bytes(name, MAX_NAME_BYTES).rstrip(". ")


def layout_values(
    name: str, tags: Mapping[str, object], preset: str | None, model: str, ext: str
) -> dict[str, str]:
    """The values of the layout fields except {stem}: a missing tag falls back to the file
    name (`name`), a missing preset to "default"."""
    song = safe_name(name, "song")
    return {
        "name": song,
        "ext": ext,
        "model": safe_name(model, "model"),
        "title": safe_name(tags.get("title") or "", song),
        "artist": safe_name(tags.get("artist") or "", song),
        "album": safe_name(tags.get("album") or "", song),
        "preset": safe_name(preset or "", "default"),
    }


def stem_file(layout: str, stem: str, values: Mapping[str, str], folder: Path) -> str:
    """The relative file name of one output, checked to stay inside `folder`. Over-long
    names are shortened, keeping the extension."""
    rel = PurePosixPath(layout.format(stem=safe_name(stem, "stem"), **values))
    parts = [_shorten(part) for part in rel.parts]
    rel = PurePosixPath(*parts)
    target = (folder / rel).resolve()
    if rel.is_absolute() or ".." in parts or folder.resolve() not in target.parents:
        raise PublishError(
            f"could not name a stem: output.layout = {layout!r} gives {rel}, "
            f"which is outside the song folder {folder}; fix output.layout"
        )
    return rel.as_posix()


def song_file(value: object, suffix: str, prefix: str = "", fallback: str = "song") -> str:
    """The name of a file a song writes after its name or title (`value`, made safe as
    safe_name makes it): `prefix` + that + `suffix` (".stem.mp4", ".rpp", a practice
    file's " - minus vocals.mp3"), in at most MAX_COMPONENT_BYTES. A filesystem counts a
    name's bytes, not its characters (80 Japanese characters are 240 bytes), so a longer
    name is cut in the middle ("…"), keeping its end and the suffix that tell files apart."""
    room = MAX_COMPONENT_BYTES - len(prefix.encode())
    return prefix + with_suffix_bytes(safe_name(value, fallback), suffix, room)


def check_distinct(
    outputs: Mapping[str, tuple[str, str]],
    own: Mapping[str, str],
    own_folders: Mapping[str, str],
    layout: str,
) -> None:
    """Every stem and mix gets a file of its own, checked before anything is written: no
    two of them one name, and none the name of a file or folder the song folder holds
    besides (`own`, `own_folders`: name → what it is, e.g. "stemdeck.json" → "the song's
    manifest"); one would be written over the other. Names are compared as macOS and
    Windows compare them (case and the encoding of accents aside). `outputs`: output →
    (kind, file name). PublishError naming the setting to change."""
    files = {_same(name): what for name, what in own.items()}
    folders = {_same(name): what for name, what in own_folders.items()}
    clash: tuple[str, str, str] | None = None
    for output, (kind, filename) in outputs.items():
        what = f"the {kind} {output!r} ({filename})"
        parts = PurePosixPath(filename).parts
        for depth in range(1, len(parts)):
            level = _same("/".join(parts[:depth]))
            if level in files:
                clash = clash or (what, files[level], kind)
            folders.setdefault(level, what)
        key = _same(filename)
        other = files.get(key) or folders.get(key)
        if other is not None:
            clash = clash or (what, other, kind)
        files.setdefault(key, what)
    if clash is not None:
        what, other, kind = clash
        change = "give the mix another name in output.mixes" if kind == "mix" else ""
        raise PublishError(
            f"could not name the song's files: with output.layout = {layout!r}, {what} and "
            f"{other} would have the same name; change output.layout"
            + (f" or {change}" if change else "")
        )


def _same(name: str) -> str:
    """A name as a case-insensitive filesystem tells names apart."""
    return unicodedata.normalize("NFC", name).casefold()


def _shorten(part: str) -> str:
    """One level of a layout's path in at most MAX_COMPONENT_BYTES, cut in the middle: its
    end holds what tells a song's files apart (the stem's name, the extension)."""
    return fit_bytes(part, MAX_COMPONENT_BYTES)
