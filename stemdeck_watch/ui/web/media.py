"""A finished song's stems, picture and beat grid, served to the page's player.

Only from a published song folder, and only what its manifest lists: the folder a done job
recorded must lie inside the outbox (after resolving every link), be reached without a link,
and hold a complete `stemdeck.json` that names the job (or, for a duplicate, the same input
and settings). Each file is opened component by component with O_NOFOLLOW, so a link planted
anywhere in the folder — the outbox is shared, a sync peer may put one there — is refused
rather than followed, and checked to be a regular file on the open descriptor.

Files are sent in pieces (HTTP Range, one range per request), so the player starts a song of
any length after its first second has arrived and never holds more than it plays.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import IO, Any

from stemdeck_watch.core.errors import Conflict, ControlError
from stemdeck_watch.core.jobs import Job, JobState, settings_key_of
from stemdeck_watch.stages import preview as picture
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.stages.songfolder import BEATS, PREVIEW
from stemdeck_watch.util.folders import Folder

log = logging.getLogger(__name__)

AUDIO_TYPES = {".wav": "audio/wav", ".flac": "audio/flac", ".mp3": "audio/mpeg"}
FORMATS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3"}
PIECE = 64 * 1024  # bytes written to the socket at a time
MAX_BEATS = 8 << 20  # beats.json of a long song is well under a megabyte
RANGE = re.compile(r"bytes=([0-9]{0,18})-([0-9]{0,18})")
_OPEN_FILE = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class Refused(ControlError):
    """A file the player may not have: outside the outbox, through a link, not published."""

    status = 403


class NoSuchFile(ControlError):
    status = 404


class NotSatisfiable(ControlError):
    """A Range that starts beyond the file's end."""

    status = 416

    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.size = size


@dataclasses.dataclass(frozen=True)
class Song:
    """A published folder checked against its job: what the player may read."""

    job: Job
    root: Path  # the outbox, resolved
    folder: Path
    manifest: dict[str, Any]

    def stems(self) -> list[dict[str, Any]]:
        """The manifest's stems (not its mixes: those are sums of stems and would play twice)."""
        return [
            entry
            for entry in self.manifest.get("stems", [])
            if isinstance(entry, dict)
            and entry.get("kind", "stem") == "stem"
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("file"), str)
        ]

    def stem(self, name: str) -> dict[str, Any]:
        for entry in self.stems():
            if entry["name"] == name:
                return entry
        raise NoSuchFile(
            f"{self.job.name} has no stem {name[:100]!r}; it has "
            f"{', '.join(e['name'] for e in self.stems())}"
        )

    def listed(self, name: str) -> bool:
        """Whether the manifest lists `name` among the folder's files."""
        files = self.manifest.get("files", [])
        return isinstance(files, list) and any(
            isinstance(entry, dict) and entry.get("file") == name for entry in files
        )


def published_song(job: Job, outbox: Path) -> Song:
    """The job's song folder, if it may be played; a ControlError saying why not."""
    if job.state is not JobState.DONE or not job.output:
        raise Conflict(f"{job.name} has no stems to play: it is {job.state.value}")
    recorded = Path(job.output)
    root = outbox.resolve()
    try:
        real = recorded.resolve(strict=True)
    except (OSError, RuntimeError):
        raise Conflict(f"the stems of {job.name} are gone from {recorded}") from None
    if not recorded.is_absolute() or real != Path(os.path.normpath(recorded)):
        raise Refused(f"refused: the song folder of {job.name} is reached through a link")
    if real == root or not real.is_relative_to(root):
        raise Refused(f"refused: the song folder of {job.name} is outside the outbox {root}")
    manifest = read_manifest(real)
    if manifest is None:
        raise Conflict(
            f"{real} is not a complete published song folder (its stemdeck.json "
            f"is missing, damaged or lists files that are gone)"
        )
    if not _names(manifest, job):
        raise Refused(
            f"refused: {real} holds another song's stems (its stemdeck.json names "
            f"job {str(manifest.get('job_id'))[:40]!r}, not {job.id})"
        )
    return Song(job, root, real, manifest)


def _names(manifest: dict[str, Any], job: Job) -> bool:
    """The manifest is this job's: it names the job, or the job is a duplicate of the song
    it holds (the same input's sha256 separated with the same settings)."""
    if manifest.get("job_id") == job.id:
        return True
    source = manifest.get("input")
    return (
        job.sha256 is not None
        and isinstance(source, dict)
        and source.get("sha256") == job.sha256
        and settings_key_of(manifest.get("settings")) == job.settings_key
    )


def open_file(song: Song, name: str) -> tuple[IO[bytes], int]:
    """Open a file of the song folder by its name in the manifest (a relative path); the open
    file and its size. Every component below the outbox is opened without following a link,
    so a link swapped in after `published_song` looked is refused too."""
    rel = PurePosixPath(name)
    if (
        rel.is_absolute()
        or not rel.parts
        or any(p in ("", ".", "..") for p in rel.parts)
        or "\\" in name
        or "\0" in name
    ):
        raise Refused(f"refused: {name[:100]!r} is not a file inside the song folder")
    folder = Folder.root(song.root)
    try:
        for part in (*song.folder.relative_to(song.root).parts, *rel.parts[:-1]):
            try:
                inner = folder.open(part)
            except OSError as exc:
                raise _refusal(name, exc) from None
            folder.close()
            folder = inner
        try:
            file_fd = folder.open_file(rel.parts[-1], _OPEN_FILE)
        except OSError as exc:
            raise _refusal(name, exc) from None
    finally:
        folder.close()
    info = os.fstat(file_fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(file_fd)
        raise Refused(f"refused: {name[:100]!r} is not a regular file")
    if getattr(os, "O_NONBLOCK", 0):
        os.set_blocking(file_fd, True)
    return os.fdopen(file_fd, "rb", buffering=0), info.st_size


def _refusal(name: str, exc: OSError) -> ControlError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return Refused(f"refused: {name[:100]!r} is reached through a link")
    return NoSuchFile(f"{name[:100]!r} is missing from the song folder")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The (first, last) byte of a `Range: bytes=…` header, or None to send the whole file
    (no header, or one this server does not do: several ranges, another unit; a server
    may always answer those with the whole file). NotSatisfiable for a range past the end."""
    if not header:
        return None
    match = RANGE.fullmatch(header.strip())
    if match is None or (not match[1] and not match[2]):
        return None
    if not match[1]:  # bytes=-N: the last N bytes
        suffix = int(match[2])
        if suffix == 0:
            raise NotSatisfiable("an empty range was asked for", size)
        return max(0, size - suffix), size - 1
    first = int(match[1])
    last = int(match[2]) if match[2] else size - 1
    if match[2] and last < first:
        return None  # not a valid range: ignored, as RFC 9110 allows
    if first >= size:
        raise NotSatisfiable(f"the range starts at byte {first}, past the end ({size} bytes)", size)
    return first, min(last, size - 1)


def copy_range(handle: IO[bytes], first: int, length: int, write: Any) -> None:
    """Write `length` bytes of `handle` from `first`, a piece at a time."""
    handle.seek(first)
    left = length
    while left > 0:
        piece = handle.read(min(PIECE, left))
        if not piece:  # the file shrank: the client sees a short body and retries
            break
        write(piece)
        left -= len(piece)


def player(song: Song) -> dict[str, Any]:
    """What the page's player needs: each stem's address and shape, the picture's geometry
    (the waveforms start `left` pixels in, below `top`) and whether there is a beat grid."""
    base = f"/api/jobs/{song.job.id}"
    stems = []
    for entry in song.stems():
        suffix = PurePosixPath(entry["file"]).suffix.lower()
        stems.append(
            {
                "name": entry["name"],
                "url": f"{base}/stems/{entry['name']}",
                "format": FORMATS.get(suffix, suffix.lstrip(".")),
                "samplerate": _int(entry.get("samplerate")),
                "channels": _int(entry.get("channels")),
                "frames": _int(entry.get("frames")),
            }
        )
    rate = max((s["samplerate"] for s in stems), default=0)
    frames = min((s["frames"] for s in stems), default=0)
    reply: dict[str, Any] = {
        "job": song.job.id,
        "name": song.job.name,
        "samplerate": rate,
        "frames": frames,
        "duration": round(frames / rate, 6) if rate else 0,
        "stems": stems,
        "preview": None,
        "beats": None,
    }
    if song.manifest.get("preview") == PREVIEW and song.listed(PREVIEW):
        width, height = picture.size_for(len(stems))
        reply["preview"] = {
            "url": f"{base}/preview",
            "width": width,
            "height": height,
            "left": picture.LABEL,
            "top": picture.HEADER,
        }
    if isinstance(song.manifest.get("beat_grid"), dict) and song.listed(BEATS):
        reply["beats"] = f"{base}/beats"
    return reply


def beats(song: Song) -> dict[str, Any]:
    """beats.json's tempo and beat times (numbers only)."""
    if not song.listed(BEATS):
        raise NoSuchFile(f"{song.job.name} has no beat grid (output.beat_grid was off)")
    handle, size = open_file(song, BEATS)
    with handle:
        if size > MAX_BEATS:
            raise Conflict(f"{BEATS} of {song.job.name} is too large to be a beat grid")
        try:
            grid = json.loads(handle.read(MAX_BEATS + 1))
        except ValueError:
            raise Conflict(f"{BEATS} of {song.job.name} is not valid JSON") from None
    times = grid.get("beats") if isinstance(grid, dict) else None
    tempo = grid.get("tempo") if isinstance(grid, dict) else None
    return {
        "tempo": tempo if isinstance(tempo, (int, float)) else None,
        "beats": [float(t) for t in times if isinstance(t, (int, float))]
        if isinstance(times, list)
        else [],
    }


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0
