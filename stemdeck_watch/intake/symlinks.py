"""Symbolic links in the inbox are never followed out of it.

The service moves every input it separates (to processed/ or failed/). Following a link
would separate — and then move — a file the user never put into the inbox, or separate a song
in the inbox twice. So a link to a file is refused the way bad input is: it goes to failed/
(the link itself, never what it points to) with `<name>.error.txt` saying why, and shows up
as a failed job. A file reached through a linked folder is left alone and logged: it is the
user's own file elsewhere, and moving it would take it from where it lives.
"""

from __future__ import annotations

import datetime as _dt
import errno
import logging
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Callable

from stemdeck_watch.core.paths import report_path, unique_path
from stemdeck_watch.util.safefile import write_replacing
from stemdeck_watch.util.safetext import strip_controls

log = logging.getLogger(__name__)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def link_refusal(path: Path, real_inbox: str) -> str | None:
    """Why the link `path` is not separated, or None if `path` is not a link. `real_inbox`
    is the inbox with its own links resolved (os.path.realpath)."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    if _within(target, real_inbox):
        return (
            f"{path.name} is a symbolic link to {target}, which is in the inbox and is "
            f"separated itself; links are not followed"
        )
    return (
        f"{path.name} is a symbolic link to {target}, outside the inbox; links are not "
        f"followed out of the inbox — copy or move the file itself into the inbox"
    )


def outside_inbox(
    path: Path, real_inbox: str, resolve: Callable[[Path], str] = os.path.realpath
) -> bool:
    """True for a file the inbox reaches only through a linked folder. `resolve` resolves a
    folder's links (the intake's remembers each folder for one tick: a library dropped at
    once lies in a handful of folders)."""
    return not _within(resolve(path.parent), real_inbox)


def _plain_folders(root: Path, folder: Path) -> bool:
    """Whether every level of `folder` below `root` is a folder or not there yet: a link or
    a file put at one (failed/ may be shared) sends the link to the top of failed/."""
    level = root
    for part in folder.relative_to(root).parts:
        level = level / part
        try:
            if not stat.S_ISDIR(os.lstat(level).st_mode):
                return False
        except FileNotFoundError:
            return True
    return True


def set_aside(link: Path, rel: PurePosixPath, failed: Path, reason: str) -> Path:
    """Move the link itself (not what it points to) to failed/ beside a report; returns
    where it went. Raises OSError if it could not be moved."""
    target = unique_path(failed / rel)
    if not _plain_folders(failed, target.parent):  # never through a link planted there
        target = unique_path(failed / rel.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(link, target)  # rename never follows a link
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        os.symlink(os.readlink(link), target)  # another filesystem: recreate the link
        os.unlink(link)
    shown = strip_controls  # names from someone else: no line of their own, no escapes
    write_replacing(
        report_path(target),
        f"stemdeck-watch did not separate {shown(rel.name)}\n\n"
        f"Why: {shown(reason)}.\n\nLink:    {shown(link)}\nNow at:  {shown(target)}\n"
        f"Time:    {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}\n",
    )
    return target
