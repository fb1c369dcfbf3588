"""Two computers, one synced inbox: which service owns it.

A Dropbox or Syncthing folder can be watched by a service on every machine that syncs it;
each would separate every song. So each service keeps a small heartbeat file with its host
and id in a hidden folder of the inbox (`.stemdeck/`, ignored by intake, carried to the other
machines by the sync client). A service that finds another live owner's heartbeat refuses to
start and says who owns the inbox — or, with `watch.standby = true`, waits and takes over
once that heartbeat goes stale (the owner stopped, crashed or lost its connection).

What this does not protect: the sync delay. A heartbeat reaches the other machine only as
fast as the sync client carries it, so two services started within that delay of each other
(or while one machine is offline) both see no owner. Clocks are compared across machines, so
they must roughly agree (NTP); `STALE_AFTER` leaves minutes of slack for both.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stemdeck_watch.core.errors import StemdeckError
from stemdeck_watch.core.lock import _alive as _pid_alive
from stemdeck_watch.util.safefile import read_json, write_replacing
from stemdeck_watch.util.ticker import Ticker

log = logging.getLogger(__name__)

FOLDER = ".stemdeck"  # hidden: intake never treats it as songs; synced like the rest
PREFIX = "owner-"
BEAT_EVERY = 30.0  # seconds between heartbeats of the owner
STALE_AFTER = 180.0  # a heartbeat older than this is an owner that is gone
STANDBY_CHECK_EVERY = 1.0  # how often a standby service looks at the owner's heartbeat
MAX_HEARTBEAT = 64 * 1024  # a heartbeat is ~150 bytes; a bigger file is not one


class InboxOwned(StemdeckError):
    """Another live service owns the inbox."""


@dataclass(frozen=True)
class Heartbeat:
    host: str
    service_id: str
    pid: int
    started: float
    updated: float
    path: Path

    def describe(self, now: float) -> str:
        return (
            f"stemdeck-watch on host {self.host!r} (service {self.service_id}, pid "
            f"{self.pid}, last heartbeat {max(0.0, now - self.updated):.0f} s ago)"
        )


def read_heartbeats(folder: Path) -> list[Heartbeat]:
    """Every readable heartbeat in `folder`; a half-synced or foreign file is skipped, and so
    is anything but a plain file (a link to a FIFO would block the start for ever)."""
    beats = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if not (entry.name.startswith(PREFIX) and entry.name.endswith(".json")):
            continue
        try:
            data = read_json(Path(entry.path), MAX_HEARTBEAT)
            beats.append(
                Heartbeat(
                    str(data["host"]),
                    str(data["service_id"]),
                    int(data["pid"]),
                    float(data["started"]),
                    float(data["updated"]),
                    Path(entry.path),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            log.debug("skipping unreadable heartbeat %s", entry.path)
    return beats


class InboxOwnership(Ticker):
    """Claims the inbox for this service and keeps the claim alive with a heartbeat."""

    name = "ownership"

    def __init__(
        self,
        inbox: Path,
        *,
        standby: bool = False,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        service_id: str | None = None,
        beat_every: float = BEAT_EVERY,
        stale_after: float = STALE_AFTER,
    ):
        self.folder = inbox / FOLDER
        self.standby = standby
        self.host = host or socket.gethostname()
        self.service_id = service_id or uuid.uuid4().hex[:12]
        self.path = self.folder / f"{PREFIX}{self.service_id}.json"
        super().__init__(beat_every)
        self.stale_after = stale_after
        self._clock = clock
        self._started = clock()
        self._warned: set[str] = set()
        # set by the service: while the inbox's share is away no heartbeat is written (into
        # the empty local folder a mount point leaves, it would fake the share's return)
        self.away: Callable[[], bool] = lambda: False

    # ------------------------------------------------------------ who owns it

    def live_owners(self) -> list[Heartbeat]:
        """Other services whose heartbeat is fresh (oldest claim first)."""
        now = self._clock()
        owners = [
            beat
            for beat in read_heartbeats(self.folder)
            if beat.service_id != self.service_id and self._alive(beat, now)
        ]
        return sorted(owners, key=lambda b: (b.started, b.service_id))

    def _alive(self, beat: Heartbeat, now: float) -> bool:
        if now - beat.updated > self.stale_after:
            return False
        if beat.host == self.host and not _pid_alive(beat.pid):
            return False  # a crashed service on this machine: its heartbeat means nothing
        return True

    def claim(self, stop: threading.Event | None = None) -> bool:
        """Become the owner: at once if nobody else is, else refuse (InboxOwned) or, in
        standby, wait until the owner's heartbeat goes stale. Returns False only when `stop`
        was set while waiting."""
        stop = stop or threading.Event()
        waited = False
        while True:
            owners = self.live_owners()
            if not owners:
                break
            owner = owners[0].describe(self._clock())
            if not self.standby:
                raise InboxOwned(
                    f"could not start: the inbox {self.folder.parent} is owned by {owner}; "
                    f"stop that service first, or set watch.standby = true to take over "
                    f"when it stops (its heartbeat is {owners[0].path})"
                )
            if not waited:
                log.info(
                    "standby: the inbox %s is owned by %s; taking over when its heartbeat "
                    "is older than %.0f s",
                    self.folder.parent,
                    owner,
                    self.stale_after,
                )
                waited = True
            if stop.wait(STANDBY_CHECK_EVERY):
                return False
        if waited:
            log.warning(
                "the owner's heartbeat went stale: taking over the inbox %s", self.folder.parent
            )
        self._remove_crashed()
        if not self.away():
            self.beat()
        return True

    def _remove_crashed(self) -> None:
        """Heartbeats that crashed services on this computer left behind: nobody else
        removes them (other computers' old ones are theirs to clean up)."""
        for beat in read_heartbeats(self.folder):
            if (
                beat.host == self.host
                and beat.service_id != self.service_id
                and not _pid_alive(beat.pid)
            ):
                try:
                    beat.path.unlink()
                except OSError:
                    pass

    # ------------------------------------------------------------ the heartbeat

    def beat(self) -> None:
        """Write this service's heartbeat atomically (a sync client never carries half)."""
        data = {
            "host": self.host,
            "service_id": self.service_id,
            "pid": os.getpid(),
            "started": self._started,
            "updated": self._clock(),
        }
        try:
            self.folder.mkdir(exist_ok=True)  # never the inbox itself: it may be a share away
            write_replacing(self.path, json.dumps(data))
        except OSError as exc:
            log.warning(
                "could not write the heartbeat %s: %s; check that the inbox is writable",
                self.path,
                exc.strerror or exc,
            )

    def tick(self) -> None:
        if self.away():
            return
        self.beat()
        self._warn_about_others()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating and remove the heartbeat: a standby service takes over at once."""
        super().stop(timeout)
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove the heartbeat %s: %s", self.path, exc)

    def _warn_about_others(self) -> None:
        """Two services started within the sync delay both own the inbox: say so, once."""
        for owner in self.live_owners():
            if owner.service_id not in self._warned:
                self._warned.add(owner.service_id)
                log.error(
                    "another service watches this inbox too: %s; both may separate the "
                    "same songs — stop one of them",
                    owner.describe(self._clock()),
                )
