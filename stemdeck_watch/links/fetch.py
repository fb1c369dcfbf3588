"""Download the audio behind a link with yt-dlp, embedded: cancellable, bounded, audio only.

yt-dlp knows thousands of sites and plain file URLs alike. It runs in the service's process
(no subprocess: its progress hook is where a cancel, a size limit and the progress bar all
live), downloads the best audio format PyAV can decode without post-processing (so no ffmpeg
is needed), into the job's scratch folder. yt-dlp's own filters skip silently; here a limit
fails the job with a reason instead, before the download where the size or length is known
and during it where not. Every connection it makes goes through the link's guard
(links/netguard.py): public addresses only, pages and time bounded, stopped by a cancel in
whichever phase the fetch is.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
import shutil
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from stemdeck_watch.core.config import LinkSettings
from stemdeck_watch.core.errors import Cancelled, DownloadError
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.core.jobs import PlaylistRef
from stemdeck_watch.stages.decode import probe_duration
from stemdeck_watch.links.listing import Entry, Playlist, playlist_of
from stemdeck_watch.stages.naming import song_name

if TYPE_CHECKING:  # imported with yt-dlp, when a link is fetched
    import yt_dlp

    from stemdeck_watch.links.netguard import Guard, Resolver

log = logging.getLogger(__name__)
ytdlp_log = logging.getLogger("stemdeck_watch.ytdlp")

STALL_TIMEOUT = 30.0  # seconds without data before a download counts as stalled


@dataclasses.dataclass(frozen=True)
class Downloaded:
    path: Path
    url: str
    title: str
    extractor: str
    duration: float | None
    playlist: PlaylistRef | None = None  # the playlist this download is an entry of

    def manifest(self) -> dict[str, Any]:
        found = {
            "url": self.url,
            "extractor": self.extractor,
            "title": self.title,
            "duration": self.duration,
        }
        if self.playlist is not None:
            found["playlist"] = {
                "name": self.playlist.name,
                "entry": self.playlist.entry,
                "entries": self.playlist.entries,
            }
        return found


class _Log:
    """yt-dlp's logger interface, routed into our log (it never prints)."""

    def debug(self, msg: str) -> None:
        ytdlp_log.debug("%s", msg)

    def info(self, msg: str) -> None:
        ytdlp_log.debug("%s", msg)

    def warning(self, msg: str) -> None:
        ytdlp_log.info("%s", msg)

    def error(self, msg: str) -> None:
        ytdlp_log.info("%s", msg)


class _TooLarge(Exception):
    pass


def download(
    url: str,
    folder: Path,
    links: LinkSettings,
    *,
    control: JobControl,
    on_progress: Callable[[float], None],
    link_name: str,
    expand: bool = False,
    title: str | None = None,
    playlist: PlaylistRef | None = None,
    resolver: Resolver | None = None,
) -> Downloaded | Playlist:
    """Download `url` into `folder`; DownloadError with a reason a person understands,
    Cancelled when `control` is cancelled (in any phase: reading the page or downloading).

    With `expand` (a playlist link with `links.playlists = true`) a link to a playlist of two
    or more entries gives a Playlist and downloads nothing. `title` and `playlist` name an
    entry of a playlist: the playlist's title for it wins over a file name, and a length the
    playlist gave is checked before the download. `resolver` maps host names to addresses
    (the system's by default)."""
    from stemdeck_watch.links.netguard import Guard

    folder.mkdir(parents=True, exist_ok=True)
    limit = links.max_filesize or None
    if (
        playlist is not None
        and playlist.duration
        and links.max_duration
        and playlist.duration > links.max_duration
    ):
        raise DownloadError(
            _too_long(
                f"{link_name} (entry {playlist.entry} of {playlist.name})",
                playlist.duration,
                links.max_duration,
            )
        )

    def hook(status: dict[str, Any]) -> None:
        control.check()  # raising here stops yt-dlp at once (it propagates unwrapped)
        done = status.get("downloaded_bytes") or 0
        total = status.get("total_bytes") or status.get("total_bytes_estimate")
        if limit and (done > limit or (total and total > limit)):
            raise _TooLarge(total or done)
        if total:
            on_progress(min(1.0, done / total))

    options = {
        "format": "bestaudio/best",
        "outtmpl": {"default": str(folder / "media.%(ext)s")},
        "paths": {"home": str(folder), "temp": str(folder)},
        # one item per link unless it is expanded (links.playlists): then a playlist is only
        # listed, flat, and each entry is downloaded by a job of its own
        "noplaylist": not expand,
        **({"extract_flat": "in_playlist"} if expand else {"playlist_items": "1"}),
        "progress_hooks": [hook],
        "logger": _Log(),
        "quiet": True,
        "no_warnings": True,
        "noprogress": True,
        "socket_timeout": STALL_TIMEOUT,
        "retries": 1,
        "fragment_retries": 1,
        "extractor_retries": 0,
        "continuedl": False,
        "overwrites": True,
        "cachedir": False,
        "postprocessors": [],
        "enable_file_urls": False,
    }
    guard = Guard(
        allow_private=links.allow_private,
        page_bytes=links.max_page_bytes,
        file_bytes=limit,
        page_timeout=links.page_timeout,
        timeout=links.timeout or None,
        resolver=resolver,
    )
    only: Entry | None = None
    try:
        with control.registered(guard.cancel), guard, _youtube_dl(options, guard) as ydl:
            info = ydl.extract_info(url, download=False)
            control.check()
            if expand and info.get("_type") == "playlist":
                found = playlist_of(info, url, links.max_entries, Path(link_name).stem)
                if len(found.entries) != 1:
                    return found
                only = found.entries[0]  # a playlist of one: that one song, as a plain link
            else:
                entry = _single(info)
                _check_limits(entry, links, link_name)
                result = ydl.process_ie_result(info, download=True)
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)  # the .part and anything beside it
        failure = _failure(exc, guard, control, links, link_name)
        if failure is exc:
            raise
        raise failure from None
    if only is not None:
        return download(
            only.url,
            folder,
            links,
            control=control,
            on_progress=on_progress,
            link_name=link_name,
            title=only.title,
            resolver=resolver,
        )
    path = _downloaded_path(_single(result))
    if path is None or not path.is_file():
        raise DownloadError(
            f"{link_name}: yt-dlp finished without a file (the page may offer "
            f"no downloadable audio)"
        )
    duration = entry.get("duration") or probe_duration(path)
    if links.max_duration and duration and duration > links.max_duration:
        shutil.rmtree(folder, ignore_errors=True)
        raise DownloadError(_too_long(link_name, duration, links.max_duration))
    return Downloaded(
        path=path,
        url=url,
        title=title or song_name(entry, fallback=Path(link_name).stem),
        extractor=str(entry.get("extractor_key") or entry.get("extractor") or ""),
        duration=float(duration) if duration else None,
        playlist=playlist,
    )


def _youtube_dl(options: dict[str, Any], guard: Guard) -> yt_dlp.YoutubeDL:
    """A YoutubeDL whose only request handler is the guard's, and whose download phase the
    guard knows of (the page limits end there)."""
    import yt_dlp
    from yt_dlp.downloader import get_suitable_downloader
    from yt_dlp.downloader.external import ExternalFD

    from stemdeck_watch.links.netguard import Stop

    class Guarded(yt_dlp.YoutubeDL):
        def build_request_director(self, handlers: Any, preferences: Any = None) -> Any:
            return super().build_request_director([guard.handler])

        def dl(
            self, name: str, info: dict[str, Any], subtitle: bool = False, test: bool = False
        ) -> Any:
            if issubclass(get_suitable_downloader(info, self.params) or ExternalFD, ExternalFD):
                # a program of its own (ffmpeg) would connect past the guard
                raise guard.stop(Stop.EXTERNAL, str(info.get("protocol") or "?"))
            guard.downloading()
            return super().dl(name, info, subtitle, test)

    return Guarded(options)


def _failure(
    exc: BaseException, guard: Guard, control: JobControl, links: LinkSettings, link_name: str
) -> BaseException:
    """What a fetch that raised `exc` ended with, for the job: Cancelled, or a DownloadError
    with the reason (the guard's stop first: yt-dlp may have wrapped it)."""
    import yt_dlp

    from stemdeck_watch.links.netguard import Stop

    stopped = guard.stopped
    if isinstance(exc, (Cancelled, _TooLarge)) or stopped is not None:
        _release(exc)
    if control.cancelled or isinstance(exc, Cancelled):
        return Cancelled(control.reason or str(exc) or "cancelled")
    could_not = f"could not download {link_name}:"
    if stopped is not None:
        return DownloadError(
            {
                Stop.PAGE_TIMEOUT: f"{could_not} its page did not load within links.page_timeout "
                f"({_length(links.page_timeout)}); raise that limit to wait "
                f"longer",
                Stop.TIMEOUT: f"{could_not} it did not finish within links.timeout "
                f"({_length(links.timeout)}); raise that limit to wait longer",
                Stop.PAGE_SIZE: f"{could_not} its page is larger than links.max_page_bytes "
                f"({_mb(links.max_page_bytes)}); raise that limit to read it",
                Stop.FILE_SIZE: f"the download of {link_name} is larger than links.max_filesize "
                f"({_mb(links.max_filesize)}); raise that limit to accept it",
                Stop.REFUSED: f"{could_not} it leads to {stopped.detail}, and links to this "
                f"machine or the local network are refused; set links.allow_private "
                f"= true to allow them",
                Stop.EXTERNAL: f"{could_not} its audio is streamed ({stopped.detail}) in a way "
                f"only an external program downloads, which links never use",
                Stop.SCHEME: f"{could_not} "
                + (
                    "the link leads to a local file (file: URL), which is never fetched"
                    if stopped.detail == "file"
                    else f"it redirects to a {stopped.detail}: "
                    f"address, which is not a web address (only http and https are fetched)"
                ),
                Stop.CANCELLED: f"{could_not} cancelled",
            }[stopped.why]
        )
    if isinstance(exc, _TooLarge):
        return DownloadError(
            f"the download of {link_name} is larger than links.max_filesize "
            f"({_mb(links.max_filesize)}); raise that limit to accept it"
        )
    if isinstance(exc, yt_dlp.utils.YoutubeDLError):  # DownloadError, network errors raised bare
        return DownloadError(explain(str(exc), link_name), details=str(exc))
    return exc


def _release(exc: BaseException) -> None:
    """Close the connection of a download our progress hook stopped, now.

    yt-dlp does not close the HTTP response when a hook raises: the frames in the exception's
    traceback, and a reference cycle, hold it until a garbage collection some time later, on
    whichever thread. Clearing those frames and collecting closes it here (quietly: the
    socket's "unclosed" warning says nothing a cancel did not mean)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        traceback.clear_frames(exc.__traceback__)
        gc.collect()  # the response sits in a reference cycle: only a collection frees it


def _single(info: dict[str, Any]) -> dict[str, Any]:
    if info.get("_type") == "playlist":
        entries = [e for e in (info.get("entries") or []) if e]
        if not entries:
            raise DownloadError("the playlist behind the link is empty")
        return entries[0]
    return info


def _check_limits(entry: dict[str, Any], links: LinkSettings, link_name: str) -> None:
    duration = entry.get("duration")
    if links.max_duration and duration and duration > links.max_duration:
        raise DownloadError(_too_long(link_name, duration, links.max_duration))
    size = entry.get("filesize") or entry.get("filesize_approx")
    if links.max_filesize and size and size > links.max_filesize:
        raise _TooLarge(size)


def _downloaded_path(entry: dict[str, Any]) -> Path | None:
    for item in entry.get("requested_downloads") or []:
        if item.get("filepath"):
            return Path(item["filepath"])
    return None


def _too_long(link_name: str, duration: float, limit: int) -> str:
    return (
        f"{link_name} is {_length(duration)} long, longer than links.max_duration "
        f"({_length(limit)}); raise that limit to accept it"
    )


def _length(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _mb(size: int | None) -> str:
    return f"{(size or 0) / 1e6:,.0f} MB"


HTTP_REASONS = {
    404: "the page no longer exists (HTTP 404)",
    410: "the page no longer exists (HTTP 410)",
    401: "the site asks for a login (HTTP 401)",
    403: "the site refused the download (HTTP 403)",
    429: "the site refused: too many requests (HTTP 429); try again later",
}


def explain(message: str, link_name: str) -> str:
    """yt-dlp's error as a first sentence a person understands, naming the link file; a
    password or token in an address it quotes is hidden (the text reaches notifications)."""
    found = re.search(r"HTTP Error (\d{3})", message)
    if found:
        code = int(found.group(1))
        reason = HTTP_REASONS.get(code) or (
            f"the site had an error (HTTP {code}); try again later"
            if code >= 500
            else f"the site answered HTTP {code}"
        )
    elif (
        "Unsupported URL" in message
        or "no video formats" in message.lower()
        or "Requested format is not available" in message
    ):
        reason = "the page has no audio or video that can be downloaded"
    elif re.search(r"timed? ?out", message, re.I):
        reason = f"the download stalled (no data for {STALL_TIMEOUT:.0f} s)"
    elif "file:" in message or "file URLs are disabled" in message:
        reason = "the link leads to a local file (file: URL), which is never fetched"
    else:
        reason = redact_url(re.sub(r"^ERROR:\s*", "", message.splitlines()[0]))
    return f"could not download {link_name}: {reason}"
