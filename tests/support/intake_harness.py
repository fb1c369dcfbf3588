"""The intake on its own: a real watchdog observer on a real inbox, the real scheduler and
SQLite registry, no worker. What a writer test checks is what the user would see in
`status`: which songs became jobs, with which content, and what is still waiting to be seen.
"""

from __future__ import annotations

import os
from typing import Any

from stemdeck_watch.core.config import Settings
from stemdeck_watch.intake.watcher import InboxWatcher
from stemdeck_watch.core.jobs import FileSignature, Job
from stemdeck_watch.core.paths import MOUNT_TABLE

from support.helpers import open_scheduler, wait_for


class IntakeRig:
    def __init__(self, settings: Settings, mount_table: str | os.PathLike[str] = MOUNT_TABLE):
        for folder in ("inbox", "outbox", "processed", "failed", "state"):
            getattr(settings.paths, folder).mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.inbox = settings.paths.inbox
        self.scheduler = open_scheduler(settings)
        self.intake = InboxWatcher(
            settings.watch, self.inbox, self.scheduler, mount_table=mount_table
        )

    def __enter__(self) -> IntakeRig:
        self.intake.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.intake.stop()
        self.scheduler.registry.close()

    def jobs(self) -> list[Job]:
        return self.scheduler.registry.jobs()

    def jobs_by_path(self) -> dict[str, list[Job]]:
        found: dict[str, list[Job]] = {}
        for job in self.jobs():
            found.setdefault(job.rel_path, []).append(job)
        return found

    def wait_jobs(self, count: int, timeout: float = 30.0) -> list[Job]:
        return wait_for(
            lambda: len(self.jobs()) >= count and self.jobs(), timeout, f"{count} job(s) queued"
        )

    def quiet(self, timeout: float = 30.0) -> None:
        """Wait until the intake tracks nothing more: every file it saw was decided."""
        wait_for(lambda: not self.intake.tracker.pending(), timeout, "the intake to settle")

    def assert_songs(self, songs: dict[str, bytes]) -> None:
        """Exactly one job per song, each queued with the song's complete content (the
        signature of the finished file), and no job for anything else."""
        by_path = self.jobs_by_path()
        assert sorted(by_path) == sorted(songs), by_path
        for rel, content in songs.items():
            [job] = by_path[rel]
            path = self.inbox / rel
            assert path.read_bytes() == content
            assert job.signature == FileSignature.of(os.stat(path)), (rel, job.signature)
            assert job.signature.size == len(content)
