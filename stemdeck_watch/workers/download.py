"""Downloading one model file: resumable, verified, and never left half-written as a model.

A model file is fetched into a hidden partial file beside its final name, under a random name
(`.NAME.<16 hex>.partial`, created with O_EXCL|O_NOFOLLOW). A download cut off (a dropped
connection, Ctrl-C, a killed worker) leaves that partial file, and the next attempt goes on
from where it stopped with an HTTP Range request. Only when every byte is there and the
file's sha256 starts with the checksum in its name is it renamed to its final name: a model
file in the cache is always a whole, verified one. A partial whose bytes do not add up is
deleted, and a resumed one is downloaded once more from the start.

A download has a size limit (the caller's: a model's catalogue size and a margin): a server
that sends more than that, whatever it said the size was, is cut off with TooLarge and the
partial file is deleted, so an endless stream cannot fill the disk.

One process downloads a file at a time: a lock file beside it (`.NAME.lock`) is held while
it downloads; another process (the CLI while the worker downloads, say) waits for it and
reports that download's progress, and gives up when that download stops growing for
STALLED_FACTOR × the timeout (a stopped or hung process holds the lock for nothing).

Only the standard library: the CLI imports this without torch.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from stemdeck_watch import __version__
from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.util.safefile import discard, is_temp_name, open_new, sha256_of, temp_name

log = logging.getLogger(__name__)

PARTIAL = ".partial"
CHUNK = 1 << 16
TIMEOUT = 30.0  # seconds without a byte before a download counts as cut off
SLOWEST = 1024  # bytes a second, over TIMEOUT: a transfer slower than that counts as cut off
ASK_TIMEOUT = (
    10.0  # seconds for a question to the hub (a size, a list): an unreachable hub fails fast
)
RESUMES = 3  # a download cut off is resumed at once this many times, while it gets further
WAIT_POLL = 0.25  # seconds between two looks at another process's download
STALLED_FACTOR = 3  # another process's download without a new byte for this × the timeout
USER_AGENT = f"stemdeck-watch/{__version__}"

Progress = Callable[[int], None]  # bytes of the file present so far


class DownloadError(Exception):
    """A file could not be downloaded; the message says why."""


class Interrupted(DownloadError):
    """The transfer stopped part way; what arrived is kept for the next attempt."""


class ChecksumMismatch(DownloadError):
    """Every byte arrived, but they are not the file the name promises; nothing is kept."""


class TooLarge(DownloadError):
    """The server sent (or announced) more than the download's limit; nothing is kept."""


def checksum_of(name: str) -> str:
    """The sha256 prefix a model file's name carries: `955717e8-8726e21a.th` → `8726e21a`
    (torch.hub's rule: what follows the first '-', up to the next '.')."""
    match = re.search(r"-([a-f0-9]+)\.", name)
    return match.group(1) if match else ""


def matches(path: Path, checksum: str) -> bool:
    """Whether the file's sha256 starts with `checksum` (an empty checksum: no check)."""
    return sha256_of(path).startswith(checksum)


def partials(dest: Path) -> list[Path]:
    """The partial downloads of `dest` in its folder, largest first."""
    try:
        entries = [p for p in dest.parent.iterdir() if is_temp_name(p.name, dest.name, PARTIAL)]
    except OSError:
        return []
    return sorted(entries, key=_size, reverse=True)


def partial_bytes(dest: Path) -> int:
    """Bytes of `dest` downloaded so far (its largest partial), 0 without one."""
    found = partials(dest)
    return _size(found[0]) if found else 0


def fetch(
    url: str,
    dest: Path,
    on_bytes: Progress | None = None,
    timeout: float = TIMEOUT,
    limit: int | None = None,
) -> Path:
    """Download `url` to `dest` (see the module docstring): resumed from a partial download,
    at most `limit` bytes, verified against the checksum in `dest`'s name, renamed into
    place. Raises Interrupted (what arrived is kept), ChecksumMismatch, TooLarge (nothing
    is kept) or DownloadError."""
    report = on_bytes or (lambda _n: None)
    checksum = checksum_of(dest.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest, report, timeout):
        if dest.is_file():  # another process finished it while we waited
            return dest
        for attempt in (1, 2):
            found = partials(dest)
            partial = found[0] if found else _new_partial(dest)
            for extra in found[1:]:  # older leftovers of a run that crashed: ours now
                discard(extra)
            resumed = _size(partial) > 0
            try:
                _transfer_resuming(url, partial, report, timeout, limit)
            except TooLarge:
                discard(partial)  # more than the file can be: nothing worth resuming
                raise
            if matches(partial, checksum):
                os.replace(partial, dest)
                return dest
            discard(partial)
            if not resumed or attempt == 2:
                break
            log.warning(
                "%s: the resumed download of %s did not verify; downloading it again "
                "from the start",
                dest.name,
                url,
            )
    raise ChecksumMismatch(
        f"{dest.name} from {_where(url)} is not the file its name promises "
        f"(its sha256 does not start with {checksum}); nothing was kept. "
        f"The mirror may serve a damaged copy"
    )


def _transfer_resuming(
    url: str, partial: Path, report: Progress, timeout: float, limit: int | None
) -> None:
    """`_transfer`, resumed at once when the connection drops, while each try gets further."""
    for attempt in range(RESUMES + 1):
        before = _size(partial)
        try:
            _transfer(url, partial, report, timeout, limit)
            return
        except Interrupted as exc:
            if attempt == RESUMES or _size(partial) <= before:
                raise
            log.warning("%s; resuming", exc)


def _transfer(url: str, partial: Path, report: Progress, timeout: float, limit: int | None) -> None:
    """Append the rest of `url` to `partial` (all of it if the server ignores the range),
    never more than `limit` bytes in all."""
    have = _size(partial)
    if limit is not None and have > limit:
        raise _too_large(url, limit)
    headers = {"User-Agent": USER_AGENT}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        response = urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        )
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and have:  # nothing after what we have: the checksum decides
            return
        raise DownloadError(
            f"{_where(url)} answered HTTP {exc.code} ({exc.reason}) for {redact_url(url)}"
        ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DownloadError(f"could not reach {_where(url)}: {reason}") from None
    with response:
        total = _total(response, have)
        if response.status != 206:  # a whole file: start again
            have = 0
        if limit is not None and total is not None and total > limit:
            raise TooLarge(
                f"{_where(url)} announced {total:,} bytes for {_file_of(url)}, more than "
                f"the {limit:,} it may have"
            )
        report(have)
        fd = os.open(
            partial,
            os.O_WRONLY
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_CLOEXEC", 0)
            | getattr(os, "O_BINARY", 0),
        )
        with open(fd, "wb", closefd=True) as out:
            out.seek(have)
            out.truncate()
            window, since = 0, time.monotonic()
            try:
                while True:
                    block = response.read1(CHUNK)
                    if not block:
                        break
                    if limit is not None and have + len(block) > limit:
                        raise _too_large(url, limit)
                    out.write(block)
                    out.flush()  # on disk as it arrives: a resume starts from all of it
                    have += len(block)
                    report(have)
                    # a byte now and then never trips the socket's timeout: the rate does
                    window, elapsed = window + len(block), time.monotonic() - since
                    if elapsed >= timeout:
                        if window < SLOWEST * elapsed:
                            raise Interrupted(
                                f"the download from {_where(url)} stopped after {have:,} "
                                f"bytes (under {SLOWEST:,} bytes a second for {elapsed:.0f} s)"
                            )
                        window, since = 0, time.monotonic()
            except (http.client.HTTPException, OSError) as exc:
                out.flush()
                raise Interrupted(
                    f"the download from {_where(url)} stopped after "
                    f"{have:,} bytes ({exc or type(exc).__name__})"
                ) from None
            finally:
                out.flush()
                os.fsync(out.fileno())
    if total is not None and have < total:
        raise Interrupted(
            f"the download from {_where(url)} stopped after {have:,} of {total:,} bytes"
        )


def _total(response: http.client.HTTPResponse, have: int) -> int | None:
    """The whole file's size, from Content-Range (a resumed download) or Content-Length."""
    if response.status == 206:
        match = re.fullmatch(r"bytes (\d+)-\d+/(\d+)", response.headers.get("Content-Range", ""))
        if match is None or int(match.group(1)) != have:
            raise DownloadError(
                f"{_where(response.geturl())} answered a resumed download with "
                f"the wrong range ({response.headers.get('Content-Range')!r})"
            )
        return int(match.group(2))
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def remote_size(url: str, timeout: float = ASK_TIMEOUT) -> int | None:
    """The file's size as the hub says it (a HEAD request); None if it does not say."""
    request = urllib.request.Request(url, method="HEAD", headers={"User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            raise DownloadError(
                f"{_where(url)} has no {url.rsplit('/', 1)[-1]} (HTTP 404): "
                f"is separation.model_hub a mirror of the model files?"
            ) from None
        return None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DownloadError(f"could not reach {_where(url)}: {reason}") from None
    return int(length) if length and length.isdigit() else None


def fetch_text(url: str, limit: int = 1 << 20, timeout: float = ASK_TIMEOUT) -> str | None:
    """A small text file from the hub, or None where it has none (HTTP 403 or 404)."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = response.read(limit + 1)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code in (403, 404):
            return None
        raise DownloadError(
            f"{_where(url)} answered HTTP {exc.code} ({exc.reason}) for {redact_url(url)}"
        ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DownloadError(f"could not reach {_where(url)}: {reason}") from None
    if len(data) > limit:
        raise DownloadError(f"{redact_url(url)} is larger than {limit:,} bytes: not an index file")
    return data.decode("utf-8", errors="replace")


def _where(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or url


def _file_of(url: str) -> str:
    return urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1] or redact_url(url)


def _too_large(url: str, limit: int) -> TooLarge:
    return TooLarge(f"{_where(url)} sent more than the {limit:,} bytes {_file_of(url)} may have")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _new_partial(dest: Path) -> Path:
    path = dest.with_name(temp_name(dest.name, PARTIAL))
    open_new(path).close()
    return path


@contextlib.contextmanager
def _locked(dest: Path, report: Progress, timeout: float) -> Iterator[None]:
    """Hold `dest`'s lock file; while another process holds it, report its progress, and
    give up when its download has not grown for STALLED_FACTOR × `timeout`."""
    lock = dest.with_name(f".{dest.name}.lock")
    fd = os.open(
        lock,
        os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
        0o644,
    )
    try:
        waited = False
        seen, since = -1, time.monotonic()
        while not _try_lock(fd):
            if not waited:
                log.info("another process is downloading %s; waiting for it", dest.name)
                waited = True
            present = partial_bytes(dest)
            if present != seen:
                seen, since = present, time.monotonic()
            elif time.monotonic() - since > STALLED_FACTOR * timeout:
                raise DownloadError(
                    f"another process has been downloading {dest.name} without a new byte "
                    f"for {STALLED_FACTOR * timeout:.0f} s (a stopped worker or command?); "
                    f"try again once it has ended"
                )
            report(present)
            time.sleep(WAIT_POLL)
        try:
            yield
        finally:
            _unlock(fd)
    finally:
        os.close(fd)


if sys.platform == "win32":
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
