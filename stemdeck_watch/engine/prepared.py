"""What a job's first stage made before the worker, possibly ahead of time.

The Prefetcher prepares the head of the queue while another job separates (a link's
download; the hash and decode of a file, once the worker holds the job's model); the job's
own run prepares what was not. Made-ahead work is used only while it is still the input's:
decoded audio only if it was decoded from the same file (size, mtime, inode and change time
unchanged: `cp -p` onto the file keeps the first three) for the same model rate and channels,
a download only if the link file still holds the URL it was made from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stemdeck_watch.core.jobs import FileSignature
from stemdeck_watch.links.fetch import Downloaded
from stemdeck_watch.links.listing import Playlist
from stemdeck_watch.links.linkfile import LinkError, read_link
from stemdeck_watch.stages.decode import DecodedAudio

Version = tuple[FileSignature, int]  # a file's signature and its change time (st_ctime_ns)


@dataclasses.dataclass
class Prepared:
    """What `prepare` made ahead of the worker for one job (in its scratch folder)."""

    download: Downloaded | None = None
    playlist: Playlist | None = None  # a playlist link's entries, listed (links.playlists)
    # a link job: the link file's signature and its URL when it was read; the download (or
    # listing) is the job's only while the link file is still exactly that
    link: FileSignature | None = None
    url: str | None = None
    decoded: DecodedAudio | None = None
    sha256: str | None = None
    # the input's version when it was hashed and decoded, and the model rate and channels
    # it was decoded for: the decode is used only if all still hold
    version: Version | None = None
    format: tuple[int, int] | None = None

    def made_from(self, link: Path) -> bool:
        """Whether the download or listing was made from `link` as it is now."""
        if self.link is None or signature_of(link) != self.link:
            return False
        try:
            return read_link(link) == self.url
        except LinkError:
            return False

    def decoded_for(self, source: Path, samplerate: int, channels: int) -> DecodedAudio | None:
        """The decoded audio if it is still the input's, at this rate and channel count."""
        if self.decoded is None or self.format != (samplerate, channels):
            return None
        if version_of(source) != self.version or not self.decoded.path.exists():
            return None
        return self.decoded

    def sha256_for(self, source: Path) -> str | None:
        return self.sha256 if self.sha256 and version_of(source) == self.version else None


def signature_of(path: Path) -> FileSignature | None:
    """The file's signature now; None if it is gone."""
    try:
        return FileSignature.of(path.stat())
    except OSError:
        return None


def version_of(path: Path) -> Version | None:
    """The file's signature and change time: a write into the same file that sets the old
    size and modification time back (`cp -p` onto it) still moves the change time."""
    try:
        st = path.stat()
    except OSError:
        return None
    return FileSignature.of(st), st.st_ctime_ns
