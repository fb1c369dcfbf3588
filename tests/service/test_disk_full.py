"""A full disk for real: the outbox on a small tmpfs (mounting needs root; elsewhere these
tests skip with the reason, never under CI=true)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from stemdeck_watch.core.events import DiskLow, JobChanged
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.synth import write_song

from support.helpers import outbox_entries, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def small_outbox(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "outbox"
    folder.mkdir()
    why = None
    if os.geteuid() != 0:
        why = "mounting a size-limited tmpfs needs root"
    else:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            why = f"could not mount a tmpfs: {done.stderr.strip()}"
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_the_queue_pauses_for_disk_before_a_song_that_would_not_fit(make_settings,
                                                                   service_factory,
                                                                   small_outbox: Path,
                                                                   monkeypatch):
    from stemdeck_watch.engine import diskguard

    monkeypatch.setattr(diskguard, "MARGIN", 0)  # a 3 MB disk has no room for the real one
    settings = make_settings()
    service, jobs = service_factory(settings)
    lows: list[DiskLow] = []
    service.bus.subscribe(DiskLow, lows.append)
    write_song(settings.paths.inbox / "big.wav", 20.0)  # ~14 MB of stems; 3 MB of room
    wait_for(lambda: service.queue.pause_reason == "disk", 30, "a pause for disk")
    wait_for(lambda: lows, 10, "disk_low (announced just after the pause)")
    assert lows[0].path == str(small_outbox)
    job = service.registry.get(service.queue.order()[0])
    assert job.state is JobState.QUEUED and job.name == "big"
    assert not jobs.final() and outbox_entries(small_outbox) == set()
    # room comes back (the song gets smaller): the queue starts by itself
    write_song(settings.paths.inbox / "big.wav", 1.2)
    done = wait_for(lambda: [j for j in jobs.final() if j.state is JobState.DONE], 60, "done")
    assert done and not service.queue.paused


def test_a_write_that_fails_mid_song_leaves_no_partial_folder(make_settings, service_factory,
                                                             small_outbox: Path, monkeypatch):
    from stemdeck_watch.engine import diskguard

    monkeypatch.setattr(diskguard, "MARGIN", 0)
    settings = make_settings()
    service, jobs = service_factory(settings)

    def fill_the_disk(event: JobChanged) -> None:  # after the check, before the write
        if event.job.state is JobState.SEPARATING:
            filler = small_outbox / "filler.bin"
            if not filler.exists():
                free = os.statvfs(small_outbox).f_bavail * os.statvfs(small_outbox).f_frsize
                filler.write_bytes(b"\0" * max(0, free - 64 * 1024))

    service.bus.subscribe(JobChanged, fill_the_disk)
    write_song(settings.paths.inbox / "song.wav", 2.0)
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.FAILED and "No space left" in job.error, job.error
    assert outbox_entries(small_outbox) - {"filler.bin"} == set()
    assert (settings.paths.failed / "song.wav").is_file()  # the input is safe
