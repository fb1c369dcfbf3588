"""The RoFormer checkpoints on disk: where each is looked for, pull, verify, import.

A catalogued checkpoint is two files under their published names: the state dict
(`.ckpt`) and its YAML configuration. The service looks for them in
`separation.model_repo` when the owner set one (fully offline), else in the model cache's
`roformer/` folder, beside demucs's files. `models pull NAME` downloads them there: from the
addresses the catalogue gives, or, where the owner set `separation.model_hub` to a mirror,
from `<hub>roformer/<file name>`; resumed where a download stopped, never more than the
catalogue's size and a margin (workers/download.py).

Checksums come from the catalogue only, never from the hub or an imported folder. Every
byte of a file the catalogue pins (`Checkpoint.checkpoint_sha256`, `config_sha256`) is
checked against its pin: that finds damage, and a file other than the one pinned, which is
refused. A checkpoint the catalogue knows the size of is never downloaded past it. Where an
entry holds no pin (one added before anybody recorded a sum), nothing is checked: `pull`,
`verify` and `import` say so, with the sha256 of what is there, to compare with a copy one
trusts. Loading is safe either way (weights only, workers/roformer/checkpoint.py); an
unpinned file may still be a different model.

No torch here: `stemdeck-watch models` answers at once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from pathlib import Path
from typing import Callable

from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.util.safefile import discard, open_new, sha256_of, temp_name
from stemdeck_watch.workers import download
from stemdeck_watch.workers.roformer.catalogue import KNOWN, Checkpoint

FOLDER = "roformer"  # in the model cache
CONFIG_LIMIT = 1 << 20  # bytes: a configuration is a few kilobytes
MARGIN = 0.5  # an unpinned checkpoint may exceed its estimated size by this much of it
DEFAULT_HUB = "https://dl.fbaipublicfiles.com/demucs/"  # models.DEFAULT_HUB (no torch there)
UNPINNED = (
    "no sha256 is pinned for it, so it was not checked against one: its sha256 is {sha}; "
    "compare it with a copy you trust"
)

OnProgress = Callable[[int, "int | None"], None]


class RoformerStoreError(Exception):
    """A checkpoint cannot be had as asked; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class File:
    name: str  # as published
    url: str
    sha256: str | None  # the catalogue's pin; None: none published
    limit: int  # the most bytes a download may take


def files_of(entry: Checkpoint, hub: str | None = None) -> tuple[File, File]:
    """The configuration and the checkpoint of `entry`, from `hub` where it is a mirror."""
    mirror = hub if hub and hub.rstrip("/") + "/" != DEFAULT_HUB else None

    def url(name: str, published: str) -> str:
        return f"{mirror.rstrip('/')}/{FOLDER}/{name}" if mirror else published

    return (
        File(
            entry.config_file,
            url(entry.config_file, entry.config_url),
            entry.config_sha256,
            CONFIG_LIMIT,
        ),
        File(
            entry.checkpoint_file,
            url(entry.checkpoint_file, entry.checkpoint_url),
            entry.checkpoint_sha256,
            entry.checkpoint_bytes or int(entry.megabytes * (1 + MARGIN) * 1_000_000),
        ),
    )


def entry_of(name: str) -> Checkpoint:
    entry = KNOWN.get(name)
    if entry is None:
        raise RoformerStoreError(
            f"no RoFormer checkpoint {name!r} is known: the known ones are "
            f"{', '.join(KNOWN)} (`stemdeck-watch models list`)"
        )
    return entry


def where(name: str, cache: Path, repo: str | Path | None) -> tuple[Path, Path]:
    """(configuration, checkpoint) of `name` where the service loads them: the owner's
    model_repo folder, else the cache."""
    entry = entry_of(name)
    folder = Path(repo) if repo else cache / FOLDER
    return folder / entry.config_file, folder / entry.checkpoint_file


def problem(path: Path, pinned: str | None) -> str | None:
    """What is wrong with a present file against its pin (None: whole, or nothing pinned)."""
    if pinned is None:
        return None
    actual = sha256_of(path)
    return None if actual == pinned else f"damaged: its sha256 is {actual}, not {pinned}"


@dataclasses.dataclass(frozen=True)
class State:
    name: str
    present: int  # of its 2 files
    partial_bytes: int
    pinned: bool  # the catalogue holds both files' sha256

    @property
    def cached(self) -> bool:
        return self.present == 2


class RoformerStore:
    """The RoFormer checkpoints of the model cache (`cache/roformer/`)."""

    def __init__(self, cache: Path, hub: str | None = None, timeout: float = download.TIMEOUT):
        self.cache, self.hub, self.timeout = cache, hub, timeout

    @property
    def folder(self) -> Path:
        return self.cache / FOLDER

    def state(self, name: str) -> State:
        entry = entry_of(name)
        files = files_of(entry, self.hub)
        present = [f for f in files if (self.folder / f.name).is_file()]
        partial = sum(
            download.partial_bytes(self.folder / f.name) for f in files if f not in present
        )
        return State(name, len(present), partial, all(f.sha256 for f in files))

    def pull(
        self, name: str, on_progress: OnProgress | None = None
    ) -> tuple[list[Path], list[str]]:
        """Make both files of `name` present: downloaded (resumed) if missing, checked
        against the catalogue's sha256 where it holds one (a damaged file is downloaded
        again). Returns the files and, for each file no sha256 is pinned for, what
        `UNPINNED` says."""
        entry = entry_of(name)
        report = on_progress or (lambda _d, _t: None)
        paths, notes = [], []
        done = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        for file in files_of(entry, self.hub):
            path = self.folder / file.name
            if path.is_file() and problem(path, file.sha256):
                discard(path)  # a cache: the source has it
            if not path.is_file():
                download.fetch(
                    file.url,
                    path,
                    functools.partial(_offset, report, done),
                    self.timeout,
                    limit=file.limit,
                )
                wrong = problem(path, file.sha256)
                if wrong:
                    discard(path)
                    raise download.ChecksumMismatch(
                        f"{file.name} from {redact_url(file.url)} is {wrong}; nothing was kept"
                    )
            done += path.stat().st_size
            report(done, None)
            paths.append(path)
            if file.sha256 is None:
                notes.append(f"{file.name}: " + UNPINNED.format(sha=sha256_of(path)))
        return paths, notes

    def verify(self) -> list[tuple[Path, str | None, bool]]:
        """Every catalogued file in the cache: (file, what is wrong or None, pinned)."""
        out = []
        for entry in KNOWN.values():
            for file in files_of(entry, self.hub):
                path = self.folder / file.name
                if path.is_file():
                    out.append((path, problem(path, file.sha256), file.sha256 is not None))
        return out

    def import_folder(self, folder: Path) -> tuple[list[str], list[tuple[Path, str]], list[str]]:
        """Copy the catalogued files found in `folder` (by their published names, in its
        folders or not) into the cache, each checked against the catalogue's sha256 where it
        holds one; whatever lists or checksums the folder carries are not read. Returns
        (files imported, (file, why) refused, notes on unpinned files)."""
        wanted = {file.name: file for entry in KNOWN.values() for file in files_of(entry, self.hub)}
        imported: list[str] = []
        refused: list[tuple[Path, str]] = []
        notes: list[str] = []
        for path in _found(folder, set(wanted)):
            file = wanted[path.name]
            wrong = problem(path, file.sha256)
            if wrong:
                refused.append((path, wrong))
                continue
            self.folder.mkdir(parents=True, exist_ok=True)
            _copy_in(path, self.folder / file.name)
            imported.append(file.name)
            if file.sha256 is None:
                notes.append(f"{file.name}: " + UNPINNED.format(sha=sha256_of(path)))
        return imported, refused, notes


def _offset(report: OnProgress, before: int, present: int) -> None:
    """A file's progress as the checkpoint's: the bytes of the file before it added."""
    report(before + present, None)


def _copy_in(source: Path, dest: Path) -> None:
    tmp = dest.with_name(temp_name(dest.name, download.PARTIAL))
    try:
        with open(source, "rb") as src, open_new(tmp) as out:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        discard(tmp)
        raise


def _found(folder: Path, names: set[str], depth: int = 3) -> list[Path]:
    """The files named `names` in `folder` and its folders; links are not followed."""
    found: list[Path] = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and depth > 1:
            found += _found(Path(entry.path), names, depth - 1)
        elif entry.is_file(follow_symlinks=False) and entry.name in names:
            found.append(Path(entry.path))
    return found
