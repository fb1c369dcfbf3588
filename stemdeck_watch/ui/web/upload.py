"""Songs and links added from the page, written into the inbox as a file dropped there would be.

An upload is streamed to disk a piece at a time (never whole in memory: a song may be a
gigabyte of video) under a random hidden name the watcher ignores (`safefile.new_temp`:
O_EXCL, O_NOFOLLOW), flushed, and renamed to its name only when complete, never over a file
already there (`song (2).mp3` then) — so the watcher sees a whole file appear, as with a
copy finished elsewhere and moved in. The name comes from the browser, so from anyone who can
reach the API with the token: it is cut to one clean path component (no separators, no `..`,
no control characters, no leading dot) that keeps its audio extension. A link is written as a
Windows `.url` file, the kind the link intake reads. A preset's folder is in the shared inbox:
one that is a link or not a folder is refused (409), the temporary file is written at the top
of the inbox, and it is moved in without going through a link (`move_file(within=inbox)`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from pathlib import Path
from typing import IO, Any

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import Conflict, ControlError, FilesystemError
from stemdeck_watch.links.linkfile import LinkError, check_url
from stemdeck_watch.core.paths import link_below, move_file
from stemdeck_watch.intake.filters import is_pause_file
from stemdeck_watch.stages.naming import safe_name
from stemdeck_watch.util.safefile import new_temp

log = logging.getLogger(__name__)

PIECE = 1 << 20  # bytes read from the socket and written at a time
SPARE = 64 << 20  # room left on the inbox's disk after an upload
MAX_URL = 4096
MAX_NAME = 120  # characters of a name, before its extension


class Refused(ControlError):
    status = 400


class TooLarge(ControlError):
    status = 413


class NotAudio(ControlError):
    status = 415


class NoRoom(ControlError):
    status = 507


def limits(settings: Settings) -> dict[str, Any]:
    """What the page needs to know before it sends anything (`GET /api/intake`)."""
    return {
        "presets": sorted(settings.presets),
        "extensions": list(settings.watch.extensions),
        "max_upload_bytes": settings.api.max_upload_mb << 20,
        "links": settings.links.enabled,
    }


def clean_file_name(name: str, extensions: tuple[str, ...] | list[str]) -> str:
    """One safe file name from what a browser sent, keeping an allowed audio extension;
    NotAudio for any other extension. A song named like the pause switch (`Pause.mp3`) gets
    " (song)" added: at the top of the inbox that name would pause the queue."""
    flat = re.sub(r"[/\\]+", "-", name)  # a path's separators join its parts: one component
    stem, dot, suffix = flat.rpartition(".")
    suffix = suffix.lower() if dot else ""
    allowed = [e.lower() for e in extensions]
    if not suffix or suffix not in allowed:
        shown = safe_name(suffix, "")[:20] if suffix else "(no extension)"
        raise NotAudio(
            f"{safe_name(name, 'the file')[:80]!r} is not a song the inbox takes: "
            f"{shown} is not one of {', '.join(allowed)} (watch.extensions)"
        )
    stem = safe_name(stem, "upload")[:MAX_NAME].rstrip(". ") or "upload"
    if is_pause_file(f"{stem}.{suffix}"):  # a song, not the inbox's pause switch
        stem = f"{stem} (song)"
    return f"{stem}.{suffix}"


def folder_for(settings: Settings, preset: str | None) -> Path:
    """The folder an upload or link goes into: the inbox, or a preset's folder in it, made
    where missing. A preset folder that is a link (anyone who can write the inbox can plant
    one, `inbox/karaoke` → a folder of the user's) or a file is refused before a byte is
    written: nothing is ever written through it."""
    inbox = settings.paths.inbox
    if not preset:
        return inbox
    if preset not in settings.presets:
        names = ", ".join(sorted(settings.presets)) or "none are configured"
        raise Refused(f"there is no preset {preset[:80]!r} (presets: {names})")
    folder = inbox / preset
    link = link_below(inbox, folder)
    if link is None:
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        link = link_below(inbox, folder)
    if link is not None or not folder.is_dir():
        what = "a symbolic link" if link is not None else "not a folder"
        raise Conflict(
            f"the preset folder {preset!r} in the inbox is {what}, and nothing is written "
            f"through it (anyone who can write the inbox could have put it there); nothing "
            f"was added — remove {folder} or make it a plain folder"
        )
    return folder


def _beside(settings: Settings, target: Path) -> Path:
    """Where the temporary file for `target` is written: at the top of the inbox, never in a
    preset's folder, which someone could swap for a link while the bytes arrive."""
    return settings.paths.inbox / target.name


def _move_in(tmp: Path, target: Path, inbox: Path) -> Path:
    """The finished temporary file renamed to `target` (or `target (2)`…), never through a
    link planted at a level of the inbox meanwhile; the temporary file is removed if not."""
    try:
        return move_file(tmp, target, within=inbox)
    except FilesystemError as exc:
        raise Conflict(f"{exc}; nothing was added") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def receive(
    stream: IO[bytes], length: int, settings: Settings, name: str, preset: str | None
) -> Path:
    """Write `length` bytes from `stream` into the inbox as `name`; the path it got."""
    cap = settings.api.max_upload_mb << 20
    if length > cap:
        raise TooLarge(
            f"{safe_name(name, 'the file')[:80]} has {_mb(length)}; uploads are "
            f"limited to {settings.api.max_upload_mb} MB (api.max_upload_mb) — "
            f"copy it into the inbox folder instead"
        )
    clean = clean_file_name(name, settings.watch.extensions)
    folder = folder_for(settings, preset)
    free = shutil.disk_usage(folder).free
    if free < length + SPARE:
        raise NoRoom(f"not enough room for {clean} ({_mb(length)}): {_mb(free)} free in {folder}")
    target = folder / clean
    with new_temp(_beside(settings, target)) as (tmp, handle):
        left = length
        while left > 0:
            try:
                piece = stream.read(min(PIECE, left))
            except OSError:
                piece = b""
            if not piece:
                raise Refused(
                    f"the upload of {clean} ended after {_mb(length - left)} of "
                    f"{_mb(length)}; nothing was added"
                )
            handle.write(piece)
            left -= len(piece)
    final = _move_in(tmp, target, settings.paths.inbox)
    log.info("added %s from the page (%s)", final, _mb(length))
    return final


def write_link(settings: Settings, url: str, name: str | None, preset: str | None) -> Path:
    """A `.url` file for `url` in the inbox (or a preset's folder); the path it got."""
    if not settings.links.enabled:
        raise Conflict("links are turned off (links.enabled = false)")
    if not isinstance(url, str) or len(url) > MAX_URL or re.search(r"[\x00-\x20\x7f]", url):
        raise Refused(
            f"send one web address of at most {MAX_URL} characters, without spaces "
            f"or control characters"
        )
    try:
        url = check_url(url, "the request", "send one web address, such as https://…")
    except LinkError as exc:
        raise Refused(str(exc)) from None
    folder = folder_for(settings, preset)
    stem = safe_name(name or _name_of(url), "link")[:MAX_NAME].rstrip(". ") or "link"
    if is_pause_file(f"{stem}.url"):  # a link, not the inbox's pause switch
        stem = f"{stem} (link)"
    target = folder / f"{stem}.url"
    with new_temp(_beside(settings, target)) as (tmp, handle):
        handle.write(f"[InternetShortcut]\r\nURL={url}\r\n".encode())
    final = _move_in(tmp, target, settings.paths.inbox)
    log.info("added the link %s from the page as %s", url, final)
    return final


def _name_of(url: str) -> str:
    """A readable name from a URL: its host and last path part."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    last = unquote(parts.path.rstrip("/").rsplit("/", 1)[-1])
    return f"{parts.hostname or 'link'} {last}".strip()


def _mb(size: int) -> str:
    return f"{size / (1 << 20):.1f} MB"
