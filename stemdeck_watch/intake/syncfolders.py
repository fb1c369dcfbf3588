"""Which sync client, if any, carries a folder — told by the marks each client leaves.

Used by `doctor`: an inbox inside a synced folder works best when outbox/ and processed/ sit
in the same synced folder, so a phone sees its song move from inbox to processed and its
stems appear. Detection is by the marks each client leaves at the top of the folder it syncs
(or the well-known places it syncs to); a client that leaves none is simply not recognised.
"""

from __future__ import annotations

import configparser
import dataclasses
import fnmatch
import os
from pathlib import Path
from typing import Iterable

# marks found in the top folder a client syncs: (client, glob of an entry name)
ROOT_MARKS = (
    ("Dropbox", ".dropbox.cache"),  # not `.dropbox`: the home folder has one of those too
    ("Syncthing", ".stfolder"),
    ("Resilio Sync", ".sync"),
    ("Nextcloud", ".sync_*.db"),
    ("Nextcloud", "._sync_*.db"),
    ("Nextcloud", ".owncloudsync.log"),
)
# folder names (or name prefixes) that are a client's sync root wherever they are
ROOT_NAMES = (
    ("iCloud Drive", "Mobile Documents"),
    ("iCloud Drive", "iCloudDrive"),
    ("iCloud Drive", "iCloud Drive"),
    ("OneDrive", "OneDrive"),
    ("OneDrive", "OneDrive - *"),
    ("OneDrive", "OneDrive-*"),
    ("Google Drive", "GoogleDrive-*"),
    ("Google Drive", "Google Drive"),
    ("Google Drive", "My Drive"),
)


@dataclasses.dataclass(frozen=True)
class SyncFolder:
    client: str
    root: Path

    def holds(self, path: Path) -> bool:
        path = _absolute(path)
        return path == self.root or self.root in path.parents


def nextcloud_roots(config_dirs: Iterable[Path] | None = None) -> list[Path]:
    """Local folders the Nextcloud desktop client syncs, from its own config file."""
    if config_dirs is None:
        home = Path.home()
        config_dirs = [
            home / ".config" / "Nextcloud",
            home / "Library" / "Preferences" / "Nextcloud",
            Path(os.environ.get("APPDATA", home / "AppData" / "Roaming")) / "Nextcloud",
        ]
    roots = []
    for folder in config_dirs:
        config = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            config.read(folder / "nextcloud.cfg", encoding="utf-8")
        except (OSError, configparser.Error):
            continue
        for section in config.sections():
            for key, value in config.items(section):
                if key.endswith("localpath") and value.strip():
                    roots.append(_absolute(Path(value.strip())))
    return roots


def find_sync_folder(path: Path, extra_roots: Iterable[tuple[str, Path]] = ()) -> SyncFolder | None:
    """The innermost synced folder holding `path`, or None if no client's marks are found."""
    path = _absolute(path)
    known = [(client, _absolute(root)) for client, root in extra_roots]
    for folder in (path, *path.parents):
        for client, root in known:
            if folder == root:
                return SyncFolder(client, folder)
        for client, pattern in ROOT_NAMES:
            if fnmatch.fnmatch(folder.name, pattern):
                return SyncFolder(client, folder)
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for client, pattern in ROOT_MARKS:
            if any(fnmatch.fnmatch(name, pattern) for name in names):
                return SyncFolder(client, folder)
    return None


def _absolute(path: Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(path)))
