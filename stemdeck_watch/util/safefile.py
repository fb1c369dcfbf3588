"""Files in folders that someone else can write: the inbox, outbox, processed/ and failed/.

A Syncthing peer or another user of a network share may put anything into those folders,
at any time: a symbolic link named like the temporary file the service is about to write
(the service would write through it into a file of the user's, a `.bashrc`), or a FIFO named
like a file the service reads (the read would wait for a writer for ever, and no signal
ends it). So, everywhere the service touches such a folder:

- a file is written under a fresh random name, created with O_CREAT|O_EXCL|O_NOFOLLOW (it can
  only be the file just made, never something already there), flushed to disk, and renamed
  over its final name; a rename replaces a link at the final name instead of following it;
- a file is read only if it is a regular file reached without a link at its last component,
  opened without blocking, and no longer than the caller expects.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import threading
from pathlib import Path
from typing import IO, Any, Iterator

from stemdeck_watch.util.safetext import NAME_BYTES, fit_bytes

TEMP_SUFFIX = ".tmp"
# a fresh file, never a link or anything that was there before; not inherited by the worker
_CREATE = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
_READ = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)

_in_flight: set[str] = set()  # temporary files this process is writing now
_tidied: set[tuple[str, str, str]] = set()  # (folder, name, suffix) cleared of leftovers
_lock = threading.Lock()


def temp_name(name: str, suffix: str = TEMP_SUFFIX) -> str:
    """A hidden name beside `name` that nobody can guess: `.NAME.<16 hex>SUFFIX` (NAME cut
    where the whole would not fit in one name)."""
    return f".{_temp_stem(name, suffix)}.{secrets.token_hex(8)}{suffix}"


def is_temp_name(candidate: str, name: str, suffix: str = TEMP_SUFFIX) -> bool:
    """Whether `candidate` is a temporary name that `temp_name(name, suffix)` gives."""
    stem = re.escape(_temp_stem(name, suffix))
    return re.fullmatch(rf"\.{stem}\.[0-9a-f]{{16}}{re.escape(suffix)}", candidate) is not None


def _temp_stem(name: str, suffix: str) -> str:
    return fit_bytes(name, NAME_BYTES - len(f"..{'0' * 16}{suffix}".encode()))


def _create(path: str, flags: int) -> int:
    access = os.O_RDWR if flags & os.O_RDWR else os.O_WRONLY  # "w+b": read back too
    return os.open(path, (_CREATE & ~os.O_WRONLY) | access, 0o666)


def open_new(
    path: Path,
    mode: str = "wb",
    *,
    encoding: str | None = None,
    newline: str | None = None,
    buffering: int = -1,
) -> IO[Any]:
    """Open `path` for writing as a new file: FileExistsError if anything — a file, a link,
    a FIFO — has that name already. For files in a folder the service made itself (a song's
    staging folder) and for temporary names from `temp_name`. "w+b" also reads it back (a
    container whose boxes are patched after writing)."""
    if mode not in ("w", "wb", "w+b"):
        raise ValueError(f"open_new writes new files only, not mode {mode!r}")
    return open(path, mode, buffering=buffering, encoding=encoding, newline=newline, opener=_create)


def discard(path: Path) -> None:
    """Remove a temporary file of ours; never raises (the error being handled matters more)."""
    try:
        os.unlink(path)
    except OSError:
        pass


@contextlib.contextmanager
def new_temp(
    path: Path,
    mode: str = "wb",
    *,
    suffix: str = TEMP_SUFFIX,
    encoding: str | None = None,
    newline: str | None = None,
) -> Iterator[tuple[Path, IO[Any]]]:
    """A new file under a random hidden name beside `path`, open for writing; yields its path
    and the handle. Leaving normally flushes it to disk and closes it; an error removes it.
    The caller renames it into place. Leftovers of an earlier run that was killed while
    writing beside `path` are removed the first time."""
    tidy(path.parent, path.name, suffix)
    tmp = path.with_name(temp_name(path.name, suffix))
    handle = open_new(tmp, mode, encoding=encoding, newline=newline)
    with _lock:
        _in_flight.add(str(tmp))
    try:
        with handle:
            yield tmp, handle
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        discard(tmp)
        raise
    finally:
        with _lock:
            _in_flight.discard(str(tmp))


@contextlib.contextmanager
def replacing(
    path: Path,
    mode: str = "wb",
    *,
    encoding: str | None = None,
    newline: str | None = None,
    suffix: str = TEMP_SUFFIX,
) -> Iterator[IO[Any]]:
    """Write `path` whole or not at all: what is written to the yielded handle goes to a new
    temporary file (see `new_temp`) that replaces `path` when the block ends without error.
    A sync client sees the old file or the new one, never half; a link planted at `path`
    is replaced, never written through."""
    with new_temp(path, mode, suffix=suffix, encoding=encoding, newline=newline) as (tmp, handle):
        yield handle
    try:
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def write_replacing(path: Path, data: str | bytes, *, suffix: str = TEMP_SUFFIX) -> None:
    """`replacing` for data at hand: text is written as UTF-8 with "\\n" line ends."""
    if isinstance(data, str):
        with replacing(path, "w", encoding="utf-8", newline="\n", suffix=suffix) as handle:
            handle.write(data)
    else:
        with replacing(path, "wb", suffix=suffix) as handle:
            handle.write(data)


def tidy(folder: Path, name: str, suffix: str = TEMP_SUFFIX) -> None:
    """Remove temporary files beside `name` that no write of this process holds: what a
    killed run left. Done once per folder and name in a process (a folder of 10,000 songs
    is not listed at every write). Unlinking never follows a link."""
    key = (str(folder), name, suffix)
    with _lock:
        if key in _tidied:
            return
        _tidied.add(key)
    try:
        with os.scandir(folder) as entries:
            stale = [entry.path for entry in entries if is_temp_name(entry.name, name, suffix)]
    except OSError:
        return
    for path in stale:
        with _lock:
            if path in _in_flight:
                continue
        discard(Path(path))


class NotRegularFile(OSError):
    """A link, FIFO, device, socket or folder where a plain file was expected."""


class FileTooLarge(OSError):
    """A file longer than the caller reads."""


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes.

    Opened with O_NOFOLLOW (a link at the last component fails with ELOOP) and O_NONBLOCK (a
    FIFO opens at once instead of waiting for a writer), then checked with fstat on the open
    file, so nothing swapped in between is read; NotRegularFile or FileTooLarge (both
    OSError) otherwise. Reads at most `limit` + 1 bytes whatever the file claims."""
    fd = os.open(path, _READ)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > limit:
            raise FileTooLarge(errno.EFBIG, f"larger than {limit:,} bytes", str(path))
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # it grew after fstat
            raise FileTooLarge(errno.EFBIG, f"larger than {limit:,} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_regular_text(path: Path, limit: int) -> str:
    """`read_regular` decoded as UTF-8 (ValueError if it is not)."""
    return read_regular(path, limit).decode("utf-8")


def read_json(path: Path, limit: int) -> Any:
    """The JSON value in `path`, read as `read_regular` reads it. ValueError if it is not
    JSON, and also if it is nested deeper than the parser follows: a few KB of `[[[[` make
    it raise RecursionError, which nobody reading a shared folder's file expects."""
    try:
        return json.loads(read_regular(path, limit))
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to read") from None


def sha256_of(path: Path) -> str:
    """A file's sha256, read a megabyte at a time (songs and model files alike)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
