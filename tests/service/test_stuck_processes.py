"""A stuck process never holds the service (the real service, its worker and zygote, the tiny
model): a load that hangs, a worker stopped (SIGSTOP) with its zygote lost, a zygote stopped
while a song separates. The queue moves on within the stall limit, a cancel and the intake
answer at once, shutdown returns within its timeout, and no worker is left behind.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.synth import write_song
from stemdeck_watch.workers import zygote

from support.helpers import processes, wait_for
from support.processes import freeze, gone_or_zombie, kill

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="workers fork from a zygote on Linux"),
]

STALL = 4.0  # separation.stall_seconds here
SHUTDOWN_LIMIT = 20.0  # seconds a shutdown may take with everything stuck


@pytest.fixture
def zygote_afterwards() -> Iterator[None]:
    """A zygote the test stopped is ended after it (the next test gets a new one)."""
    zygote.ready()
    first = zygote.pid()
    yield
    if first is not None and processes().get(first, (0, ""))[1] == "T":
        kill(first)
        wait_for(lambda: zygote.pid() != first, 15, "the stopped zygote to be gone")


def drop(settings: Any, name: str, seconds: float = 1.0) -> Path:
    staged = write_song(settings.paths.inbox.parent / "staging" / name, seconds, seed=3)
    return staged.rename(settings.paths.inbox / name)


def state_of(jobs: Any, name: str) -> JobState | None:
    found = [job for job in jobs.jobs() if job.name == name]
    return found[-1].state if found else None


def shut_within(service: Any, seconds: float) -> None:
    stopping = threading.Thread(target=service.shutdown, name="test-shutdown", daemon=True)
    stopping.start()
    stopping.join(seconds)
    assert not stopping.is_alive(), f"shutdown did not return within {seconds:.0f} s"


def test_a_hung_load_and_a_stopped_worker_of_a_lost_zygote_never_wedge_the_queue(
    make_settings: Any, service_factory: Any, faults: Path, zygote_afterwards: None
) -> None:
    """The warm-up's load hangs: it is stopped after the stall limit and the song starts.
    Mid-song the worker is stopped (SIGSTOP) and its zygote killed: the song goes back for
    another attempt at once and is done; shutdown returns; no worker is left behind."""
    (faults / "1-stall-load").touch()
    (faults / "slow").write_text("30")  # the first attempt's segments take 30 s more
    settings = make_settings(separation={"stall_seconds": STALL})
    service, jobs = service_factory(settings)
    drop(settings, "song.wav")
    wait_for(lambda: state_of(jobs, "song") is JobState.SEPARATING, 60, "the song to separate")
    assert not (faults / "1-stall-load").exists(), "the warm-up's load did not hang"
    worker, lost = service.client.pid, zygote.pid()
    assert worker is not None and lost is not None
    (faults / "slow").unlink()
    freeze(worker)
    kill(lost)
    [job] = jobs.wait_final(1, 60)
    assert job.state is JobState.DONE, job.error
    assert [f.kind for f in job.faults] == ["died"], job.faults
    assert "zygote" in job.faults[0].reason
    pids = list(service.client.pids)
    assert len(pids) == 3  # the hung load's, the stopped one's, the one that did the song
    started = time.monotonic()
    shut_within(service, SHUTDOWN_LIMIT)
    assert time.monotonic() - started < SHUTDOWN_LIMIT
    wait_for(lambda: gone_or_zombie(pids), 10, f"the workers {pids} to be gone")


def test_with_the_zygote_stopped_a_deleted_song_is_cancelled_at_once_and_new_songs_queue(
    make_settings: Any, service_factory: Any, faults: Path, zygote_afterwards: None
) -> None:
    """The zygote is stopped while a song separates. Deleting that song cancels it within 2 s
    (the watcher's thread never waits on the worker), a song dropped meanwhile is queued, and
    shutdown returns although the next worker's start waits on the stopped zygote."""
    (faults / "slow").write_text("30")
    settings = make_settings(separation={"stall_seconds": 30.0})
    service, jobs = service_factory(settings)
    first = drop(settings, "first.wav")
    wait_for(lambda: state_of(jobs, "first") is JobState.SEPARATING, 60, "the song to separate")
    worker, stopped = service.client.pid, zygote.pid()
    assert worker is not None and stopped is not None
    freeze(stopped)
    first.unlink()
    wait_for(lambda: state_of(jobs, "first") is JobState.CANCELLED, 3, "the cancel")
    drop(settings, "second.wav")
    wait_for(lambda: state_of(jobs, "second") is not None, 10, "the second song to be queued")
    wait_for(lambda: gone_or_zombie([worker]), 5, "the cancelled song's worker to be ended")
    shut_within(service, SHUTDOWN_LIMIT)
