"""A full disk for real: the outbox on a small tmpfs (mounting needs root; elsewhere these
tests skip with the reason, never under CI=true). A cancel that meets the check is placed
through the check's own reading of the free space instead."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from stemdeck_watch.core.events import DiskLow, JobChanged
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.synth import write_song

from support.helpers import SeparationGate, outbox_entries, wait_for

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: "3m") on `folder`, unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    why = None
    if os.geteuid() != 0:
        why = "mounting a size-limited tmpfs needs root"
    else:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
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


@pytest.fixture
def small_outbox(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "outbox", "3m") as folder:
        yield folder


def test_the_queue_pauses_for_disk_before_a_song_that_would_not_fit(
    make_settings, service_factory, small_outbox: Path, monkeypatch
):
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


def test_a_write_that_fails_mid_song_leaves_no_partial_folder(
    make_settings, service_factory, small_outbox: Path, monkeypatch
):
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


def test_a_song_decoded_ahead_never_takes_the_room_the_separating_song_needs(
    make_settings, service_factory, tmp_path: Path, caplog, monkeypatch
) -> None:
    """Scratch and outbox on one 20 MiB disk: a 5 s song fits, a 45 s song does not. While
    the short one separates, the long one is not decoded ahead into the room the short one's
    stems need; the short one is published, and the queue then waits for disk at the long
    one."""
    from stemdeck_watch.engine import diskguard

    monkeypatch.setattr(diskguard, "MARGIN", 0)  # a small disk has no room for the real one
    caplog.set_level(logging.INFO, "stemdeck_watch.engine.diskguard")
    with small_disk(tmp_path / "disk", "20m") as disk:
        settings = make_settings(
            folders={"outbox": str(disk / "outbox"), "state": str(disk / "state")},
            queue={"work_beside": "on"},
        )
        service, jobs = service_factory(settings)
        lows: list[DiskLow] = []
        service.bus.subscribe(DiskLow, lows.append)
        service.scheduler.pause("user")
        write_song(settings.paths.inbox / "short.wav", 5.0)
        wait_for(lambda: len(service.queue.order()) == 1, 30, "the short song queued")
        write_song(settings.paths.inbox / "long.wav", 45.0, seed=1)
        wait_for(lambda: len(service.queue.order()) == 2, 30, "the long song queued")
        short, long = service.queue.order()
        gate = SeparationGate(service.client, short)  # it separates until the long one is seen
        service.scheduler.start()

        wait_for(
            lambda: jobs.latest.get(short) and jobs.latest[short].state is JobState.SEPARATING,
            60,
            "the short song separating",
        )
        decoded = settings.paths.scratch / long / "input.npy"
        whole = 128 + 45 * 44100 * 2 * 4  # the long song, decoded, as it would be ahead
        wait_for(
            lambda: (
                "not preparing long ahead" in caplog.text
                or (decoded.is_file() and decoded.stat().st_size >= whole)
            ),
            120,
            "the long song to be decoded ahead or left for later",
        )
        gate.open()

        done = wait_for(
            lambda: jobs.latest[short].state.is_final and jobs.latest[short],
            120,
            "the short song to end",
        )
        assert done.state is JobState.DONE, done.error
        assert outbox_entries(settings.paths.outbox) == {"short"}
        wait_for(lambda: service.queue.pause_reason == "disk", 30, "a pause for disk")
        assert service.queue.order() == [long] and jobs.latest[long].state is JobState.QUEUED
        assert wait_for(lambda: lows, 10, "disk_low")[0].path == str(settings.paths.outbox)
        assert not (settings.paths.scratch / long).exists()
        assert (settings.paths.inbox / "long.wav").is_file()


def test_a_link_is_sized_by_its_own_length_not_the_longest_a_link_may_be(
    make_settings, service_factory, tmp_path: Path, monkeypatch
) -> None:
    """On a 20 MiB disk (far less than a link of links.max_duration would need) a short link
    and the file behind it run. A link that turns out too long for the disk once it is
    downloaded waits at the head of the paused queue, downloaded once, and runs when there is
    room."""
    from stemdeck_watch.engine import diskguard
    from stemdeck_watch.engine.dispatcher import DISK_RECHECK_SECONDS

    from support.media import MediaServer, url_file

    monkeypatch.setattr(diskguard, "MARGIN", 0)  # a small disk has no room for the real one
    served = tmp_path / "served"
    write_song(served / "song.wav", 2.0)
    write_song(served / "long.wav", 8.0, seed=1)  # its scratch and stems: ~20 MB
    media = MediaServer(served)
    try:
        with small_disk(tmp_path / "disk", "20m") as disk:
            settings = make_settings(
                folders={"outbox": str(disk / "outbox"), "state": str(disk / "state")},
                links={"max_duration": 300},
            )  # 300 s would need 740 MB
            service, jobs = service_factory(settings)
            lows: list[DiskLow] = []
            service.bus.subscribe(DiskLow, lows.append)
            inbox = settings.paths.inbox
            service.scheduler.pause("user")
            url_file(inbox, "short.url", media.url("song.wav"))
            wait_for(lambda: len(service.queue.order()) == 1, 30, "the link queued")
            write_song(inbox / "behind.wav", 1.0)
            wait_for(lambda: len(service.queue.order()) == 2, 30, "the file queued")
            service.scheduler.start()
            done = jobs.wait_final(2)
            assert [j.state for j in done] == [JobState.DONE] * 2, [j.error for j in done]
            assert not lows and not service.queue.paused

            url_file(inbox, "long.url", media.url("long.wav"))
            # the queue pauses for disk, then the link goes back to its head
            link = wait_for(
                lambda: (
                    service.queue.pause_reason == "disk"
                    and (order := service.queue.order())
                    and jobs.latest[order[0]].state is JobState.QUEUED
                    and order
                ),
                60,
                "a pause for disk with the link back at the head of the queue",
            )
            assert len(link) == 1
            assert lows and lows[-1].path == str(settings.paths.outbox)
            wait_for(
                lambda: not (settings.paths.scratch / link[0]).exists(), 10, "its download removed"
            )
            time.sleep(2 * DISK_RECHECK_SECONDS)  # the queue looks for room meanwhile
            assert media.requests.count("/long.wav") == 2, media.requests  # probe + download
            assert service.queue.pause_reason == "disk"

            subprocess.run(["mount", "-o", "remount,size=100m", str(disk)], check=True)
            job = wait_for(
                lambda: jobs.latest[link[0]].state.is_final and jobs.latest[link[0]],
                120,
                "the long link to run once there is room",
            )
            assert job.state is JobState.DONE, job.error
            assert outbox_entries(settings.paths.outbox) == {"song", "behind", "long"}
    finally:
        media.close()


@pytest.mark.parametrize("where", ["before the song starts", "once its download is in"])
def test_a_song_cancelled_as_the_disk_check_puts_it_back_stays_cancelled(
    make_settings, service_factory, tmp_path: Path, monkeypatch, where: str
) -> None:
    """The user cancels a song just as the check finds no room for it (before it starts, or,
    for a link, once its download says how long it is): the cancel is answered as done, so
    the song must not go back to the queue and be separated once there is room. The check's
    own seam (the free space it reads) places the cancel in that moment; no tmpfs needed."""
    from stemdeck_watch.engine import diskguard
    from stemdeck_watch.engine.requests import CANCELLED_BY_USER

    from support.media import MediaServer, url_file

    write_song(tmp_path / "served" / "song.wav", 2.0)
    media = MediaServer(tmp_path / "served")
    try:
        settings = make_settings()
        service, jobs = service_factory(settings)
        service.scheduler.pause("user")
        if where == "before the song starts":
            write_song(settings.paths.inbox / "song.wav", 2.0)
        else:
            url_file(settings.paths.inbox, "song.url", media.url("song.wav"))
        (song,) = wait_for(lambda: service.queue.order(), 30, "the song queued")
        download = settings.paths.scratch / song / "download"
        answered: list[str] = []
        real = diskguard.shutil.disk_usage

        def usage(path: str) -> Any:
            found = real(path)
            moment = threading.current_thread().name == "dispatcher" and (
                where == "before the song starts" or download.is_dir()
            )
            if moment and not answered:  # the user's cancel lands as the check runs
                answered.append(service.scheduler.cancel_job(song).id)
                return found._replace(free=0)
            return found

        monkeypatch.setattr(diskguard.shutil, "disk_usage", usage)
        service.scheduler.start()
        job = wait_for(
            lambda: jobs.latest[song].state.is_final and jobs.latest[song],
            60,
            "the cancelled song to end",
        )
        assert answered == [song]
        assert job.state is JobState.CANCELLED and job.error == CANCELLED_BY_USER, job
        wait_for(lambda: not service.queue.paused, 30, "the queue to start again")
        assert service.queue.order() == [] and outbox_entries(settings.paths.outbox) == set()
        assert jobs.latest[song].state is JobState.CANCELLED
    finally:
        media.close()
