"""What a playlist link holds, as yt-dlp listed it: each entry's own address and title.

Listing downloads nothing: each entry becomes a job of its own (engine/playlists.py), which
downloads it alone later, even if the playlist changes meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from stemdeck_watch.core.errors import DownloadError
from stemdeck_watch.links.linkfile import url_problem
from stemdeck_watch.stages.naming import sanitise, song_name

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One item of a playlist: its own address, its title and (where the page said) length."""

    url: str
    title: str
    duration: float | None


@dataclasses.dataclass(frozen=True)
class Playlist:
    """What a playlist link holds (`links.playlists = true`): nothing is downloaded yet; each
    entry becomes a job of its own."""

    url: str
    title: str
    extractor: str
    entries: tuple[Entry, ...]
    total: int  # entries the page listed; more than len(entries) when cut at max_entries
    skipped: int = 0  # entries without an http(s) address of their own


def playlist_of(info: dict[str, Any], url: str, max_entries: int, fallback: str) -> Playlist:
    """The entries of a playlist as yt-dlp listed them, in order, cut at `max_entries`.

    Each entry keeps an address of its own (its page, or the media itself for a page of
    plain <audio> tags or an XSPF list), so it is downloaded alone later, even if the
    playlist changes meanwhile. Only http(s) addresses are kept: a playlist is untrusted
    input like a link file."""
    title = sanitise(str(info.get("title") or "")) or sanitise(fallback) or "playlist"
    listed = [e for e in (info.get("entries") or []) if e]
    if not listed:
        raise DownloadError(f"the playlist {title} behind the link is empty")
    entries: list[Entry] = []
    skipped = 0
    for number, item in enumerate(listed, 1):
        address = _entry_url(item, url)
        if address is None:
            skipped += 1
            log.warning(
                "entry %d of the playlist %s has no http(s) address; left out", number, title
            )
            continue
        if len(entries) < max_entries:
            length = item.get("duration")
            entries.append(
                Entry(
                    address,
                    song_name(item, fallback=f"{title} {number}"),
                    float(length) if isinstance(length, (int, float)) else None,
                )
            )
    if not entries:
        raise DownloadError(
            f"no entry of the playlist {title} has an address that can be downloaded"
        )
    return Playlist(
        url=url,
        title=title,
        extractor=str(info.get("extractor_key") or info.get("extractor") or ""),
        entries=tuple(entries),
        total=len(listed) - skipped,
        skipped=skipped,
    )


def _entry_url(item: dict[str, Any], page: str) -> str | None:
    candidates = [item.get("url"), item.get("webpage_url"), item.get("original_url")]
    candidates += [f.get("url") for f in reversed(item.get("formats") or [])]
    for candidate in candidates:
        if (
            isinstance(candidate, str)
            and candidate != page
            and not re.search(r"\s", candidate)
            and url_problem(candidate) is None
        ):
            return candidate
    return None
