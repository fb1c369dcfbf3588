"""Where things live, and moving files without ever overwriting or losing one.

Everything that differs per platform about the filesystem sits here behind small functions:
the state and config dirs, the filesystem type of a folder, and a move that works across
filesystems (inbox on a NAS, processed/ on the local disk).
"""

from __future__ import annotations

import errno
import filecmp
import logging
import os
import re
import shutil
import stat
import sys
import unicodedata
from pathlib import Path
from typing import Callable

import platformdirs

from stemdeck_watch.core.errors import FilesystemError
from stemdeck_watch.util.safefile import discard, new_temp
from stemdeck_watch.util.safetext import numbered_name, with_suffix_bytes

log = logging.getLogger(__name__)

APP_NAME = "stemdeck-watch"

COPY_SUFFIX = ".stemdeck-tmp"  # a copy across filesystems, before it is renamed into place

# Filesystems on which inotify/FSEvents/ReadDirectoryChangesW miss changes made by other
# machines; the watcher polls there.
NETWORK_FILESYSTEMS = frozenset(
    {
        "cifs",
        "smb",
        "smb2",
        "smb3",
        "smbfs",
        "nfs",
        "nfs4",
        "fuse.sshfs",
        "sshfs",
        "9p",
        "drvfs",
        "fuse.rclone",
        "fuse.gvfsd-fuse",
        "afpfs",
        "webdav",
        "davfs",
        "fuse.davfs2",
    }
)


def default_state_dir() -> Path:
    return Path(platformdirs.user_state_dir(APP_NAME))


def default_config_file() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "stemdeck.toml"


def private_dir(path: Path) -> Path:
    """Make the folder `path` (with missing parents) for the user only (0700), whatever the
    umask: the state folder holds the job history, whose sources and link URLs (which may
    carry share tokens) are nobody else's business. One of ours that others can read (made
    by an older version) is tightened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    tighten(path)
    return path


def private_file(path: Path) -> Path:
    """Make sure the file `path` exists and is for the user only (0600): created so, or
    tightened if it is ours and others could read it (a file from an older version)."""
    try:
        os.close(
            os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600
            )
        )
        return path
    except FileExistsError:
        pass
    tighten(path)
    return path


def tighten(path: Path) -> None:
    """Take the group's and others' access away from a file or folder of ours, if it is
    there (never through a symbolic link)."""
    if sys.platform == "win32":
        return  # ACLs, not mode bits; the profile folder is private already
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (
        st.st_uid == os.geteuid()
        and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))
        and st.st_mode & 0o077
    ):
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)


def numbered(path: Path, n: int, keep_suffix: bool = True) -> Path:
    """`song.mp3` → `song (2).mp3`; a folder `My.Song` (keep_suffix=False) → `My.Song (2)`
    (cut to fit one name: see numbered_name)."""
    return path.with_name(numbered_name(path.name, n, keep_suffix))


def unique_path(path: Path, keep_suffix: bool = True) -> Path:
    """The first of `path`, `path (2)`, `path (3)`… that does not exist yet."""
    n = 1
    while True:
        candidate = numbered(path, n, keep_suffix)
        if not os.path.lexists(candidate):
            return candidate
        n += 1


def _rename_no_replace(src: Path, dst: Path) -> None:
    """Rename that fails instead of replacing an existing `dst`.

    A hard link is the portable atomic "create only if absent" on POSIX; filesystems without
    hard links (FAT, some SMB shares) fall back to check-then-rename.
    """
    if sys.platform != "win32":
        try:
            os.link(src, dst)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in (
                errno.EPERM,
                errno.ENOTSUP,
                errno.EOPNOTSUPP,
                errno.EXDEV,
                errno.EMLINK,
                errno.ENOSYS,
            ):
                raise
        else:
            try:
                os.unlink(src)
            except OSError:  # the move did not happen: never leave the file in two places
                try:
                    os.unlink(dst)
                except OSError:
                    pass
                raise
            return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    os.rename(src, dst)  # on Windows, rename itself refuses to replace


GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})
# what a share that does not answer says (a full disk or a refused permission is no outage)
UNREACHABLE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "ENOTCONN",
        "ESTALE",
        "EHOSTDOWN",
        "EHOSTUNREACH",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "ETIMEDOUT",
        "ECONNABORTED",
        "ECONNRESET",
        "ECONNREFUSED",
        "EREMOTEIO",
    )
    if hasattr(errno, name)
)


def exists_or_unreachable(path: Path | str) -> os.stat_result | None:
    """The file's stat if it is there, None if it is not there (ENOENT, ENOTDIR); any other
    error (EIO, ENOTCONN, ESTALE, EHOSTDOWN, EACCES, a timeout) is raised: the file may well
    be there, on a share that does not answer, and taking that for "deleted" would cancel
    its job or forget its move."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            return None
        raise


def is_unreachable(exc: BaseException | None) -> bool:
    """Whether a failed operation says "the share does not answer" (EIO, ENOTCONN, ESTALE,
    EHOSTDOWN, a timeout…): the first OSError in it (itself, a FilesystemError's reason, or
    the error it was raised from) has one of UNREACHABLE_ERRNOS."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno in UNREACHABLE_ERRNOS
        reason = getattr(exc, "reason", None)
        exc = reason if isinstance(reason, BaseException) else exc.__cause__
        seen += 1
    return False


def report_path(path: Path) -> Path:
    """Where a failed input's diagnosis lives: `song.mp3` → `song.mp3.error.txt` (a name
    near the limit of one name cut before the suffix)."""
    return path.with_name(with_suffix_bytes(path.name, ".error.txt"))


# the files that go beside a moved file, named after where it goes (see move_file)
Companion = Callable[[Path], "Path | tuple[Path, ...]"]


def move_file(
    src: Path,
    dst: Path,
    companion: Companion | None = None,
    *,
    within: Path | None = None,
) -> Path:
    """Move `src` to `dst`, or `dst (2)`… if taken; returns where it went.

    `companion` names the files that will sit beside the target (a failed input's report, a
    song's sidecar): a number is only taken when their names are free too, so they share it,
    a stale report never describes a new failure and a sidecar never needs a number of its
    own.

    A move cut off by a crash (the target already is the source, hard-linked or fully
    copied) is finished instead of making a second copy under a new number. Across
    filesystems the file is copied to a new hidden file with a random name beside the target
    (see safefile.new_temp: nothing planted there is written through), flushed, renamed into
    place, and only then is the source removed: a failure at any point leaves the source
    where it was.

    `within`: the folder `dst` goes into (processed/, failed/, the inbox), which may be
    shared: a symbolic link planted at one of its subfolders is never gone through (the file
    would go wherever it points); the move fails instead, saying which, and the file stays.
    """
    if within is not None:
        _no_link_below(within, dst.parent, src, dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        finished = _finish_interrupted(src, dst)
        if finished is not None:
            return finished
        while True:
            target = _free_target(dst, companion)
            try:
                _rename_no_replace(src, target)
                return target
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                break
        return _copy_then_remove(src, dst, companion)
    except FilesystemError:
        raise
    except OSError as exc:
        raise FilesystemError("move", src, dst, reason=exc) from exc


def link_below(root: Path, folder: Path) -> Path | None:
    """The first level of `folder` below `root` that is a symbolic link, if any."""
    level = root
    for part in folder.relative_to(root).parts:
        level = level / part
        if os.path.islink(level):
            return level
    return None


def _no_link_below(root: Path, folder: Path, src: Path, dst: Path) -> None:
    link = link_below(root, folder)
    if link is not None:
        raise FilesystemError(
            "move",
            src,
            dst,
            reason=f"{link} is a symbolic link, and links there are never gone through "
            f"(anyone who can write that folder could have put it there); remove it",
        )


def _free_target(dst: Path, companion: Companion | None) -> Path:
    n = 1
    while True:
        candidate = numbered(dst, n)
        beside = companion(candidate) if companion is not None else ()
        if not os.path.lexists(candidate) and not any(
            os.path.lexists(path) for path in ((beside,) if isinstance(beside, Path) else beside)
        ):
            return candidate
        n += 1


def _finish_interrupted(src: Path, dst: Path) -> Path | None:
    """If `dst` (or a numbered sibling) already is `src`, drop the source and return it."""
    for candidate in numbered_siblings(dst):
        if os.path.abspath(candidate) == os.path.abspath(src):
            return candidate  # it is there already
        if _same_file(src, candidate):
            os.unlink(src)
            log.info("finished an interrupted move of %s to %s", src, candidate)
            return candidate
    return None


def numbered_siblings(path: Path, keep_suffix: bool = True) -> list[Path]:
    """Every existing `path`, `path (2)`, `path (N)`… — all of them, not just the run up to
    the first gap (an earlier number may have been moved away since); each as `numbered`
    names it, so a name cut to fit one file name is found too. Names are compared without
    case or Unicode normalisation: on a folder that ignores them (macOS, Windows, most
    shares) `Song` was made as `song` when `song` was there; callers check what they find."""
    suffix = path.suffix if keep_suffix and path.suffix else ""
    pattern = re.compile(r".* \((\d+)\)" + re.escape(suffix))
    found: list[tuple[int, bool, str]] = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    for name in names:
        match = pattern.fullmatch(name)
        number = int(match.group(1)) if match and _folded(name) != _folded(path.name) else 1
        made = numbered_name(path.name, number, keep_suffix)
        if _folded(made) == _folded(name):
            found.append((number, made != name, name))  # the exact name first
    return [path.parent / name for *_, name in sorted(found)]


def _folded(name: str) -> str:
    return unicodedata.normalize("NFC", name).casefold()


def find_moved(target: Path, size: int, mtime_ns: int) -> Path | None:
    """Where a file moved to `target` (or a numbered sibling) went, told by its size and
    modification time (a move keeps both, also across filesystems): how a restart finds an
    input whose move finished just before the crash, before the registry heard of it."""
    for candidate in numbered_siblings(target):
        try:
            info = os.lstat(candidate)  # a link planted there is not the file
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and (info.st_size, info.st_mtime_ns) == (size, mtime_ns):
            return candidate
    return None


def _same_file(a: Path, b: Path) -> bool:
    """The same inode, or a complete copy of it (same size, mtime and bytes): a copy made by
    `_copy_then_remove` keeps the mtime, which a different file of the same size hardly has.
    Both must be plain files: a link planted at `b` that points at `a` is not a copy of it."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    if not (stat.S_ISREG(sa.st_mode) and stat.S_ISREG(sb.st_mode)):
        return False
    if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
        return True
    if sa.st_size != sb.st_size or sa.st_mtime_ns != sb.st_mtime_ns:
        return False
    return filecmp.cmp(a, b, shallow=False)


def _copy_then_remove(src: Path, dst: Path, companion: Companion | None) -> Path:
    tmp: Path | None = None
    try:
        with open(src, "rb") as reader, new_temp(dst, suffix=COPY_SUFFIX) as (tmp, writer):
            shutil.copyfileobj(reader, writer, 1 << 20)
            writer.flush()
            if os.utime in os.supports_fd:
                _copy_mode_and_times(reader.fileno(), writer.fileno())
        if os.utime not in os.supports_fd:  # Windows
            shutil.copystat(src, tmp)
        while True:
            target = _free_target(dst, companion)
            try:
                _rename_no_replace(tmp, target)
                break
            except FileExistsError:
                continue
    except OSError as exc:
        if tmp is not None:
            discard(tmp)
        raise FilesystemError("copy", src, dst, reason=exc) from exc
    fsync_dir(target.parent)
    try:
        os.unlink(src)
    except OSError as exc:
        log.warning("copied %s to %s but could not remove the original: %s", src, target, exc)
    return target


def _copy_mode_and_times(src: int, dst: int) -> None:
    """The source's permissions and times onto the copy, through the open files: a link put
    in place of the copy by name meanwhile is never touched (nor the file it points to)."""
    info = os.fstat(src)
    os.chmod(dst, stat.S_IMODE(info.st_mode))
    os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))


MOUNT_TABLE = "/proc/self/mounts"


def filesystem_type(path: Path, table: str | os.PathLike[str] = MOUNT_TABLE) -> str | None:
    """The filesystem type of the mount holding `path` (Linux); None where unknown. `table`
    is a mount table in /proc/self/mounts format (tests feed their own)."""
    try:
        with open(table, encoding="utf-8", errors="replace") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:
        return None
    path = Path(path).resolve()
    best: tuple[int, str] | None = None
    for entry in entries:
        if len(entry) < 3:
            continue
        mount_point = entry[1].replace("\\040", " ")
        mp = Path(mount_point)
        if path == mp or mp in path.parents:
            depth = len(mp.parts)
            if best is None or depth > best[0]:
                best = (depth, entry[2])
    return best[1] if best else None


def is_network_filesystem(path: Path, table: str | os.PathLike[str] = MOUNT_TABLE) -> bool:
    fs = filesystem_type(path, table)
    return fs is not None and (fs in NETWORK_FILESYSTEMS or fs.startswith("fuse.sshfs"))


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX); a no-op where directories can't be opened."""
    if sys.platform == "win32":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
