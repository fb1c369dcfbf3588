"""Which paths in the inbox may become jobs.

Sync clients, NAS boxes, browsers and office suites leave temporary files, lock files and
metadata folders beside real files; none of them is ever a song. The built-in rules below are
always on; the user's `watch.ignore` patterns are added to them, never replace them.
"""

from __future__ import annotations

import fnmatch
import os
import unicodedata
from pathlib import PurePosixPath
from typing import Iterable

from stemdeck_watch.util.safetext import NAME_BYTES, fit_bytes

IGNORED_NAMES = (
    ".*",  # AppleDouble ._x, Syncthing/Nextcloud temps, .DS_Store, hidden files
    "~$*",
    ".~lock.*",  # Office / LibreOffice locks
    "*.part",
    "*.crdownload",
    "*.download",
    "*.tmp",
    "*.!sync",
    "*.partial",
    "*.icloud",
    "*.rsls",
    "thumbs.db",
    "desktop.ini",
    "*.sync-conflict-*",
)
IGNORED_FOLDERS = frozenset(
    name.lower()
    for name in (
        ".stfolder",
        ".stversions",
        ".dropbox.cache",
        ".tmp.drivedownload",
        ".tmp.driveupload",
        "@eaDir",
        "#recycle",
        "#snapshot",
        "$RECYCLE.BIN",
        ".Trashes",
        "__MACOSX",
    )
)
# Safari downloads into a `NAME.download/` bundle holding the unfinished file under its final
# name, and moves it out when done: nothing inside such a folder is ever complete
IGNORED_FOLDER_PATTERNS = ("*.download",)


def is_pause_file(name: str) -> bool:
    """`PAUSE`, `pause.txt`, `Pause.mp3`…: any case, any extension, at the top of the inbox."""
    return PurePosixPath(name).stem.lower() == "pause" or name.lower() == "pause"


def readable_name(name: str, spare: int = 0) -> str | None:
    """A name for a file whose name is not UTF-8 (`Caf\xe9.wav` from an old zip, an SMB share
    or a Windows tool: Python holds its bytes as surrogates, which no database, JSON or page
    can carry), read as Windows-1252 as such tools wrote it; None for a UTF-8 name. A byte
    that is nothing in Windows-1252, or a control character, becomes "_"; a name grown past
    one file name's bytes (each such byte becomes two or three) is cut in the middle, with
    `spare` bytes left for a companion's suffix (the sidecar's, which follows the song)."""
    try:
        name.encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    text = os.fsencode(name).decode("cp1252", errors="replace")
    text = "".join("_" if c == "\ufffd" or unicodedata.category(c) == "Cc" else c for c in text)
    suffix = PurePosixPath(text).suffix
    return (
        fit_bytes(text[: len(text) - len(suffix)], NAME_BYTES - spare - len(suffix.encode()))
        + suffix
    )


class InboxFilter:
    def __init__(
        self, extensions: Iterable[str], extra_patterns: Iterable[str] = (), recursive: bool = True
    ):
        self.extensions = frozenset(e.lower() for e in extensions)
        self.extra = tuple(p.lower() for p in extra_patterns)
        self.recursive = recursive

    def folder_ignored(self, name: str) -> bool:
        lowered = name.lower()
        return (
            lowered in IGNORED_FOLDERS
            or lowered.startswith(".")
            or any(fnmatch.fnmatchcase(lowered, p) for p in IGNORED_FOLDER_PATTERNS)
            or self._matches_extra(lowered)
        )

    def name_ignored(self, name: str) -> bool:
        lowered = name.lower()
        return any(fnmatch.fnmatchcase(lowered, p) for p in IGNORED_NAMES) or self._matches_extra(
            lowered
        )

    def eligible(self, rel_path: PurePosixPath) -> bool:
        """True for an audio file the service should turn into a job."""
        parts = rel_path.parts
        if not parts or (len(parts) > 1 and not self.recursive):
            return False
        if len(parts) == 1 and is_pause_file(parts[0]):
            return False  # the PAUSE switch (control from the synced folder), never a song
        if any(self.folder_ignored(p) for p in parts[:-1]):
            return False
        if self._matches_extra(rel_path.as_posix().lower()):
            return False
        name = parts[-1]
        if self.name_ignored(name):
            return False
        suffix = PurePosixPath(name).suffix.lower().lstrip(".")
        return suffix in self.extensions

    def _matches_extra(self, text: str) -> bool:
        return any(fnmatch.fnmatchcase(text, p) for p in self.extra)
