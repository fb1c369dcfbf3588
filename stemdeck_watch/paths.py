"""Where things live, and moving files without ever overwriting or losing one.

Everything that differs per platform about the filesystem sits here behind small functions:
the state and config dirs, the filesystem type of a folder, and a move that works across
filesystems (inbox on a NAS, processed/ on the local disk).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from pathlib import Path

import platformdirs

from stemdeck_watch.errors import FilesystemError

log = logging.getLogger(__name__)

APP_NAME = "stemdeck-watch"

# Filesystems on which inotify/FSEvents/ReadDirectoryChangesW miss changes made by other
# machines; the watcher polls there.
NETWORK_FILESYSTEMS = frozenset({
    "cifs", "smb", "smb2", "smb3", "smbfs", "nfs", "nfs4", "fuse.sshfs", "sshfs", "9p",
    "drvfs", "fuse.rclone", "fuse.gvfsd-fuse", "afpfs", "webdav", "davfs", "fuse.davfs2",
})


def default_state_dir() -> Path:
    return Path(platformdirs.user_state_dir(APP_NAME))


def default_config_file() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "stemdeck.toml"


def numbered(path: Path, n: int, keep_suffix: bool = True) -> Path:
    """`song.mp3` → `song (2).mp3`; a folder `My.Song` (keep_suffix=False) → `My.Song (2)`."""
    if n < 2:
        return path
    if path.suffix and keep_suffix:
        return path.with_name(f"{path.stem} ({n}){path.suffix}")
    return path.with_name(f"{path.name} ({n})")


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
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                                 errno.EMLINK, errno.ENOSYS):
                raise
        else:
            os.unlink(src)
            return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    os.rename(src, dst)  # on Windows, rename itself refuses to replace


def move_file(src: Path, dst: Path) -> Path:
    """Move `src` to `dst`, or `dst (2)`… if taken; returns where it went.

    Across filesystems the file is copied to a hidden temporary name beside the target,
    flushed, renamed into place, and only then is the source removed: a failure at any point
    leaves the source where it was.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        while True:
            target = unique_path(dst)
            try:
                _rename_no_replace(src, target)
                return target
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                break
        return _copy_then_remove(src, dst)
    except FilesystemError:
        raise
    except OSError as exc:
        raise FilesystemError("move", src, dst, reason=exc) from exc


def _copy_then_remove(src: Path, dst: Path) -> Path:
    tmp = dst.with_name(f".{dst.name}.stemdeck-tmp")
    try:
        with open(src, "rb") as reader, open(tmp, "wb") as writer:
            shutil.copyfileobj(reader, writer, 1 << 20)
            writer.flush()
            os.fsync(writer.fileno())
        shutil.copystat(src, tmp)
        while True:
            target = unique_path(dst)
            try:
                _rename_no_replace(tmp, target)
                break
            except FileExistsError:
                continue
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FilesystemError("copy", src, dst, reason=exc) from exc
    try:
        os.unlink(src)
    except OSError as exc:
        log.warning("copied %s to %s but could not remove the original: %s", src, target, exc)
    return target


def filesystem_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path` (Linux); None where unknown."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
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


def is_network_filesystem(path: Path) -> bool:
    fs = filesystem_type(path)
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
