"""The files side of the seams test (tests/test_model_based.py): what a person does to the
inbox and the outbox, and what the test reads back from them.

The test's own hands never destroy bytes: a deleted input and a replaced one are kept (hard
linked or copied) in the test's trash/, so that "nothing is lost" stays a plain count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
from pathlib import Path
from typing import Any

import tomli_w

from stemdeck_watch.core.config import Folders, LinkSettings
from stemdeck_watch.stages.manifest import MANIFEST, read_manifest

from support.helpers import config_data, outbox_entries

PRESET = "duo"
UPLOAD_PRESET = "solo"  # songs come only through the API; a peer may plant a link there
# a song whose name tag chooses the recipe `best`: a tiny RoFormer with random weights saved
# as the published checkpoint makes its vocals, `htdemucs_ft` (a bag of the tiny model) the
# rest (the world's model folder holds both: recipe_repo in tests/conftest.py)
RECIPE_SLOT = "r [best].wav"
RECIPE_VOCALS = "bs_roformer_viperx_1297"
# where songs are dropped: a preset folder too, a song named like that folder (its stems
# folder and the preset's folder of songs meet in the outbox: one is never put in the
# other), and a song separated by recipe (two models, and the worker switching between them)
SLOTS = ("a.wav", "b.wav", f"{PRESET}/a.wav", f"{PRESET}.wav", RECIPE_SLOT)
LINK_SLOT = "l.url"
STAGING = Folders(*[Path("/")] * 5).staging.name
# where the test plants links in the outbox: folders the service makes, and the name a
# careless writer would give STATUS.txt's temporary copy (written through, or renamed into
# place as a link, it changes the file the link points at)
STATUS_TEMP = ".STATUS.txt.tmp"
PLANTED = (STAGING, PRESET, STATUS_TEMP)
VICTIM = b"a file of the user's, outside every folder the service may write\n"
_names = itertools.count()


def write_example_config(root: Path, outbox: Path, model_repo: Path) -> Path:
    """The config of one example: folders under `root` (the outbox given), the tiny model,
    compiled, work beside the worker on, a preset folder, restores not paused, no job failed
    for being cut off by the test's kills."""
    # the link server is on loopback; a link's length is unknown until it is downloaded, so
    # the disk check sizes its download at links.max_duration: at the default 30 minutes that
    # is 72 MB, which the rules' 96 MB disk (less the check's 64 MB margin) rightly has no
    # room for: the queue would wait for disk for good. Five minutes (12 MB) fits, as a user
    # with a small disk would set it.
    links: dict[str, Any] = {"max_duration": 300}
    if "allow_private" in {f.name for f in dataclasses.fields(LinkSettings)}:
        links["allow_private"] = True
    data = config_data(
        root,
        model_repo,
        links=links,
        folders={"outbox": str(outbox)},
        queue={
            "work_beside": "on",
            "start_paused_after_restore": False,
            "resume_attempts": 100,
            "on_duplicate": "skip",
        },
    )
    # the worker adopts the tiny model's compiled form ("on": "auto" skips a model that small)
    data["separation"]["compile"] = "on"
    data["presets"] = {PRESET: {"two_stems": "vocals"}, UPLOAD_PRESET: {"two_stems": "drums"}}
    config = root / "stemdeck.toml"
    config.write_text(tomli_w.dumps(data))
    return config


def sha_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def link_text(url: str) -> bytes:
    return f"[InternetShortcut]\r\nURL={url}\r\n".encode()


def url_in(path: Path) -> str | None:
    try:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("URL="):
                return line[4:].strip()
    except OSError:
        pass
    return None


class Hashes:
    """sha256 of files, remembered by (device, inode, size, mtime, ctime): a step hashes only
    what changed since the last one (`cp -p` onto a file keeps all but its ctime)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, int, int, int], str] = {}

    def of(self, path: Path) -> str | None:
        try:
            st = path.stat()
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if key not in self._known:
                self._known[key] = sha_of(path.read_bytes())
            return self._known[key]
        except OSError:
            return None  # moved by the service meanwhile


class Hands:
    """What a person (an editor, a sync client, a file manager) does to the inbox."""

    def __init__(self, inbox: Path, trash: Path, away: Path):
        self.inbox, self.trash, self.away = inbox, trash, away

    def _keep(self, path: Path, copy: bool) -> None:
        """Keep the bytes at `path` in trash/ before they are replaced or deleted."""
        keep = self.trash / f"{next(_names)}-{path.name}"
        try:
            if copy:
                keep.write_bytes(path.read_bytes())
            else:
                os.link(path, keep)
        except FileNotFoundError:
            pass  # the service moved it away first: it is in processed/ or failed/

    def place(self, rel: str, data: bytes, how: str) -> str:
        """Put `data` at inbox/`rel`: "atomic" (a hidden temp file renamed over it, as editors
        save), "inplace" (rewritten in the same file), "stamp" (a new file with the old size
        and mtime, as `cp -p` or `rsync -t` leave it) or "cp -p onto" (rewritten in the same
        file, its mtime set back: `cp -p` onto an existing file). Returns how it was done in
        the end."""
        path = self.inbox / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if how in ("inplace", "cp -p onto"):
            self._keep(path, copy=True)
            try:
                before = path.stat()
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            except FileNotFoundError:
                how = "atomic"
            else:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                if how == "cp -p onto":  # the same file, size and mtime: only ctime moved
                    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
                return how
        temp = path.with_name(f".{path.name}.{next(_names)}.tmp")
        temp.write_bytes(data)
        if how == "stamp":
            try:
                st = path.stat()
                os.utime(temp, ns=(st.st_atime_ns, st.st_mtime_ns))
            except FileNotFoundError:
                how = "atomic"
        self._keep(path, copy=False)
        os.replace(temp, path)
        return how

    def remove(self, rel: str, how: str) -> bool:
        """Delete ("unlink") or move out ("move") inbox/`rel`; False if nothing was there."""
        path = self.inbox / rel
        try:
            if how == "move":
                os.rename(path, self.away / f"{next(_names)}-{path.name}")
            else:
                self._keep(path, copy=False)
                path.unlink()
        except FileNotFoundError:
            return False
        return True


def listing(folder: Path) -> list[Path]:
    """What `folder` holds now, sorted; nothing where it is gone or no folder. The service
    makes and removes folders in the outbox (its staging folder, a song's, a preset's) while
    the test looks: a folder that went between the look at its parent and the look inside it
    is simply not there any more, never a failure of the test."""
    try:
        return sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def scan_outbox(outbox: Path) -> tuple[dict[str, dict[str, Any] | None], list[str], list[str]]:
    """(song folders -> complete manifest or None, stray entries, staging leftovers). A folder
    removed or renamed while it is looked at is left out (a half folder is one that stays)."""
    folders: dict[str, dict[str, Any] | None] = {}
    stray: list[str] = []
    staging: list[str] = []
    for entry in sorted(outbox / name for name in outbox_entries(outbox)):
        if entry.is_symlink() and entry.name in PLANTED:
            continue  # the test's own link, planted where the service makes a folder
        elif entry.name == STAGING:
            staging += [p.name for p in listing(entry)]
        elif not os.path.lexists(entry):
            continue  # gone since the listing
        elif entry.name.startswith(".") or not entry.is_dir():
            stray.append(entry.name)
        elif _preset_folder(entry):
            for inner in listing(entry):
                if inner.is_dir() and not inner.name.startswith("."):
                    _manifest_of(inner, f"{entry.name}/{inner.name}", folders)
                elif os.path.lexists(inner):
                    stray.append(f"{entry.name}/{inner.name}")
        else:
            _manifest_of(entry, entry.name, folders)
    return folders, stray, staging


def _manifest_of(folder: Path, rel: str, folders: dict[str, dict[str, Any] | None]) -> None:
    manifest = read_manifest(folder)
    if manifest is not None or folder.is_dir():  # None and gone: removed while read
        folders[rel] = manifest


def _preset_folder(entry: Path) -> bool:
    """A preset's folder of songs: `duo` (or `solo`, the uploads' preset), or `duo (2)` where
    the song `duo` or a planted link holds `duo`; it holds song folders only (a song's half
    folder holds files), or nothing (made for a song whose publish then failed)."""
    presets = "|".join(re.escape(name) for name in (PRESET, UPLOAD_PRESET))
    if not re.fullmatch(rf"(?:{presets})(?: \(\d+\))?", entry.name):
        return False
    return not (entry / MANIFEST).exists() and all(
        p.is_dir() or not os.path.lexists(p) for p in listing(entry)
    )
