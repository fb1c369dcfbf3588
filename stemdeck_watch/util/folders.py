"""Folders walked level by level in a tree someone else can write (the outbox), never
through a link planted at one of the levels.

Where the OS names files relative to an open folder (Linux, macOS, the BSDs: `dir_fd`), each
level is opened from the one above it without following a link, so a link swapped in after a
level was looked at is never gone through either. Elsewhere (Windows, where a folder cannot be
opened and `dir_fd` is not there) each level is looked at by path and refused if it is a
link, a junction or any other reparse point, or not a folder; one swapped in between the
look and the use is gone through there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Callable, Sequence

from stemdeck_watch.util.safetext import numbered_name

DIR_FD = {os.open, os.mkdir, os.stat, os.rename} <= os.supports_dir_fd
# a folder, or a file to read, reached without going through a link at its last level
_FOLDER = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FOLDER |= getattr(os, "O_CLOEXEC", 0)
_NOT_THIS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)  # a link, or not a folder
_REPARSE_POINT = 0x400  # FILE_ATTRIBUTE_REPARSE_POINT: a Windows link, junction or mount


def _a_link(info: os.stat_result) -> bool:
    """A symbolic link, or on Windows a junction (which lstat reports as a folder and any
    user can make) or another reparse point."""
    return (
        stat.S_ISLNK(info.st_mode)
        or bool(getattr(info, "st_reparse_tag", 0))
        or bool(getattr(info, "st_file_attributes", 0) & _REPARSE_POINT)
    )


class Folder:
    """An open folder that names are looked up, made and moved into. Close it (or use it as
    a context manager)."""

    def __init__(self, path: Path, fd: int | None = None):
        self.path = path
        self._fd = fd

    @classmethod
    def root(cls, path: Path) -> Folder:
        """The top of the tree: the user's own folder, which may be a link."""
        if not DIR_FD:
            return cls(path)
        return cls(path, os.open(path, _FOLDER & ~getattr(os, "O_NOFOLLOW", 0)))

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _lstat(self, name: str) -> os.stat_result:
        if self._fd is not None:
            return os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        return os.lstat(self.path / name)

    def exists(self, name: str) -> bool:
        """Whether anything (a link too) is at `name`."""
        try:
            self._lstat(name)
            return True
        except FileNotFoundError:
            return False

    def make(self, name: str) -> None:
        """A folder `name`, where nothing is yet."""
        with contextlib.suppress(FileExistsError):
            if self._fd is not None:
                os.mkdir(name, dir_fd=self._fd)
            else:
                os.mkdir(self.path / name)

    def open(self, name: str) -> Folder:
        """The folder `name` in this one; OSError (ELOOP, ENOTDIR) if it is a link or not a
        folder."""
        if self._fd is not None:
            return Folder(self.path / name, os.open(name, _FOLDER, dir_fd=self._fd))
        info = self._lstat(name)
        if _a_link(info) or not stat.S_ISDIR(info.st_mode):
            code = errno.ELOOP if _a_link(info) else errno.ENOTDIR
            raise OSError(code, os.strerror(code), str(self.path / name))
        return Folder(self.path / name)

    def open_file(self, name: str, flags: int) -> int:
        """A descriptor of the file `name`, opened with `flags` without following a link."""
        flags |= getattr(os, "O_NOFOLLOW", 0)
        if self._fd is not None:
            return os.open(name, flags, dir_fd=self._fd)
        if _a_link(self._lstat(name)):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(self.path / name))
        return os.open(self.path / name, flags)

    def move_in(self, src: Path, name: str) -> None:
        """Rename `src` to `name` in this folder."""
        if self._fd is not None:
            os.rename(src, name, dst_dir_fd=self._fd)
        else:
            os.rename(src, self.path / name)

    def sync(self) -> None:
        """Flush the folder's entries to disk, where a folder can be."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)


def open_folders(
    root: Path, parts: Sequence[str], taken: Callable[[Folder], bool] = lambda folder: False
) -> Folder:
    """The folder `root`/`parts`…, each level made where missing. A level that is a link
    (planted where the service makes a folder: going through it would write anywhere the
    link names), not a folder, or `taken` is passed by for the first free `part (2)`,
    `part (3)`…. The caller closes it."""
    folder = Folder.root(root)
    try:
        for part in parts:
            number = 1
            while True:
                name = numbered_name(part, number, keep_suffix=False)
                number += 1
                folder.make(name)
                try:
                    level = folder.open(name)
                except OSError as exc:
                    if exc.errno in _NOT_THIS:
                        continue
                    raise
                try:
                    free = not taken(level)
                except BaseException:
                    level.close()
                    raise
                if free:
                    break
                level.close()
            folder.close()
            folder = level
        return folder
    except BaseException:
        folder.close()
        raise
