"""A share that comes and goes: a real sshfs mount over loopback (tests/support/sshfs_share.py)
that is unmounted, whose server dies, or whose link stalls, while songs are queued, separating and
being published. What the user must see: the queue pauses and goes on by itself, no job is
cancelled or failed by the outage, every song is published exactly once, every input ends in
processed/, and `status` (the API and the scheduler's snapshot) answers within a second all the
while.

Events are ordered with gates (the worker held before separating a song, the writer held
before publishing one); the outages themselves last a few seconds.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from stemdeck_watch.core.events import EventBus
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages import songfolder
from stemdeck_watch.stages.manifest import publisher_of
from stemdeck_watch.service import Service
from stemdeck_watch.util.synth import write_song

from support.helpers import JobLog, outbox_entries, wait_for
from support.sshfs_share import Share, require

pytestmark = pytest.mark.slow
SONG_SECONDS = 1.5
STATUS_LIMIT = 1.0  # seconds `status` may take, whatever the share does


class WorkerGate:
    """Holds the real worker back from separating each song until `release(job_id)` (or
    `open()` for all): the order of events decides, not this machine's speed."""

    def __init__(self, service: Service) -> None:
        self._open = threading.Event()
        self._released: set[str] = set()
        self.held: list[str] = []
        client = service.client
        real = client.separate

        def gated(job_id: str, *args: Any, **kwargs: Any) -> Any:
            self.held.append(job_id)
            while not (self._open.is_set() or job_id in self._released):
                kwargs["control"].wait(0.05)
            return real(job_id, *args, **kwargs)

        client.separate = gated  # type: ignore[method-assign]

    def release(self, job_id: str) -> None:
        self._released.add(job_id)

    def open(self) -> None:
        self._open.set()


class StatusClock:
    """Asks for the status every 0.1 s — the scheduler's snapshot, and GET /api/queue when
    the API runs — and keeps the slowest answer."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.slowest = 0.0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for ask in (
                self.service.scheduler.snapshot,
                lambda: api(self.service, "GET", "/api/queue"),
            ):
                started = time.monotonic()
                try:
                    ask()
                except Exception as exc:  # the test fails on it (and stops the clock)
                    self.errors.append(repr(exc))
                    return
                self.slowest = max(self.slowest, time.monotonic() - started)

    def stop(self) -> float:
        """The slowest answer so far; the clock stops."""
        self._stop.set()
        self._thread.join(40)
        assert not self.errors
        return self.slowest


@pytest.fixture
def status_clock() -> Iterator[Callable[[Service], StatusClock]]:
    """Start a StatusClock; every one is stopped before the services are (a failed test
    leaves none asking a service that is shutting down)."""
    clocks: list[StatusClock] = []

    def start(service: Service) -> StatusClock:
        clocks.append(StatusClock(service))
        return clocks[-1]

    yield start
    for clock in clocks:
        clock._stop.set()
        clock._thread.join(40)


def api(service: Service, method: str, path: str) -> dict[str, Any]:
    """One request to the service's API, as the CLI and the page make them."""
    assert service.api is not None
    conn = http.client.HTTPConnection("127.0.0.1", service.api.port, timeout=30)
    try:
        conn.request(
            method,
            path,
            body=b"" if method == "POST" else None,
            headers={
                "Host": f"127.0.0.1:{service.api.port}",
                "Authorization": f"Bearer {service.api.token}",
            },
        )
        response = conn.getresponse()
        reply = json.loads(response.read())
        assert response.status == 200, reply
        return reply
    finally:
        conn.close()


@pytest.fixture
def share(tmp_path: Path) -> Iterator[Share]:
    require()
    with Share(tmp_path / "share") as mounted:
        yield mounted


@pytest.fixture
def run_service(
    make_settings: Callable[..., Any],
) -> Iterator[Callable[..., tuple[Service, JobLog]]]:
    started: list[Service] = []

    def start(**folders: Path) -> tuple[Service, JobLog]:
        settings = make_settings(
            watch={"poll_interval": 0.2},
            api={"port": 0},
            folders={name: str(path) for name, path in folders.items()},
        )
        bus = EventBus()
        jobs = JobLog(bus)
        service = Service(settings, bus=bus)
        service.start()
        started.append(service)
        return service, jobs

    yield start
    for service in started:
        service.shutdown()


def drop_songs(service: Service, folder: Path, names: list[str]) -> None:
    """Songs written beside the inbox and renamed in, each once the one before is queued:
    their order is the queue's."""
    for seed, name in enumerate(names):
        staged = folder.parent / f".{name}.partial.wav"
        write_song(staged, SONG_SECONDS, seed=seed)
        staged.rename(folder / f"{name}.wav")
        wait_for(
            lambda: any(job.name == name for job in service.scheduler.registry.jobs()),
            60,
            f"{name} to be queued",
        )


def queued_names(service: Service) -> list[str]:
    return [job["name"] for job in service.scheduler.snapshot()["queued"]]


def wait_pause(service: Service, reason: str | None, timeout: float = 30.0) -> None:
    queue = service.scheduler.queue
    wait_for(
        lambda: (queue.pause_reason if queue.paused else None) == reason,
        timeout,
        f"the queue to be {'paused for ' + reason if reason else 'running'}",
    )


def assert_nothing_lost(
    service: Service, jobs: JobLog, names: list[str], inbox: Path, outbox: Path, processed: Path
) -> None:
    """Every song separated once and published once; every input in processed/; no job
    cancelled or failed; nothing left in the inbox or half-written in the outbox."""
    registry = service.scheduler.registry
    every = registry.jobs()
    assert sorted(job.name for job in every) == sorted(names), [
        (job.name, job.state.value, job.error) for job in every
    ]
    assert {job.state for job in every} == {JobState.DONE}, [
        (job.name, job.state.value, job.error) for job in every
    ]
    published = sorted(outbox_entries(outbox))
    assert published == sorted(names)
    owners = [publisher_of(outbox / name) for name in published]
    assert sorted(owners) == sorted(job.id for job in every)  # each folder its own job's
    assert sorted(p.name for p in processed.iterdir()) == sorted(f"{n}.wav" for n in names)
    assert not [p for p in inbox.iterdir() if p.suffix == ".wav"]
    assert registry.pending_moves() == []


def test_a_share_unmounted_with_songs_queued_and_one_running_pauses_and_loses_nothing(
    share: Share, run_service, status_clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stemdeck_watch")
    inbox = share.mount_point  # the mount point itself: unmounted, an empty local folder
    outbox, processed = tmp_path / "outbox", tmp_path / "processed"
    service, jobs = run_service(inbox=inbox, outbox=outbox, processed=processed)
    gate = WorkerGate(service)
    names = ["one", "two", "three", "four"]
    drop_songs(service, share.export, names)
    wait_for(
        lambda: gate.held and len(queued_names(service)) == 3,
        60,
        "one song separating and three queued",
    )
    running = service.scheduler.registry.get(gate.held[0]).name
    last = queued_names(service)[-1]
    service.scheduler.move(service.scheduler.find(last).id, first=True)  # the user's order
    order = queued_names(service)
    assert order[0] == last and sorted([running, *order]) == sorted(names)
    clock = status_clock(service)

    share.unmount()
    wait_pause(service, "inbox")
    time.sleep(1.0)  # the polling observer looks at the empty folder several times meanwhile
    assert queued_names(service) == order  # every job and its place kept
    assert all(not job.state.is_final for job in service.scheduler.registry.jobs())
    gate.open()  # the running song finishes while the share is away
    [first] = jobs.wait_final(1)
    assert first.name == running and first.state is JobState.DONE
    snapshot = service.scheduler.snapshot()
    assert [(m["job"], m["to"]) for m in snapshot["pending_moves"]] == [(first.id, "processed")]
    assert snapshot["paused"] and snapshot["pause_reason"] == "inbox"

    share.mount()
    final = jobs.wait_final(4)
    assert [job.name for job in sorted(final, key=lambda j: j.finished_at or 0)] == [
        running,
        *order,
    ]
    wait_for(lambda: not service.scheduler.registry.pending_moves(), 30, "the move kept")
    assert clock.stop() < STATUS_LIMIT
    wait_for(
        lambda: not [p for p in inbox.iterdir() if p.suffix == ".wav"], 30, "the inbox to be empty"
    )
    assert_nothing_lost(service, jobs, names, inbox, outbox, processed)
    assert service.scheduler.queue.paused is False
    assert "answers again after" in caplog.text
    assert "could not look for a PAUSE file" not in caplog.text


def test_a_server_that_dies_mid_separation_keeps_the_users_pause_and_loses_nothing(
    share: Share, run_service, status_clock, tmp_path: Path
) -> None:
    inbox = share.mount_point / "inbox"
    inbox.mkdir()
    outbox, processed = tmp_path / "outbox", tmp_path / "processed"
    service, jobs = run_service(inbox=inbox, outbox=outbox, processed=processed)
    gate = WorkerGate(service)
    names = ["alpha", "beta", "gamma"]
    drop_songs(service, inbox, names)
    wait_for(
        lambda: gate.held and len(queued_names(service)) == 2,
        60,
        "one song separating and two queued",
    )
    clock = status_clock(service)

    share.kill_server()  # every call on the mount answers EIO now
    wait_pause(service, "inbox")
    service.scheduler.pause()  # the user pauses while the share is away
    gate.open()
    [first] = jobs.wait_final(1)
    assert first.state is JobState.DONE and first.name == "alpha"
    assert [m.job_id for m in service.scheduler.registry.pending_moves()] == [first.id]

    share.start_server()
    wait_for(
        lambda: not service.scheduler.registry.pending_moves(),
        60,
        "the kept move to be done once the share answers",
    )
    assert (processed / "alpha.wav").exists()
    time.sleep(1.0)
    assert service.scheduler.queue.pause_reason == "user"  # the user's pause stays
    assert queued_names(service) == ["beta", "gamma"]
    service.scheduler.start()
    jobs.wait_final(3)
    assert clock.stop() < STATUS_LIMIT
    assert_nothing_lost(service, jobs, names, inbox, outbox, processed)


def test_an_outbox_share_that_dies_mid_publish_publishes_every_song_once(
    share: Share, run_service, status_clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inbox, processed = tmp_path / "inbox", tmp_path / "processed"
    outbox = share.mount_point / "outbox"
    writing, go = threading.Event(), threading.Event()
    real = songfolder.make_song_folder

    def held_first(*args: Any, **kwargs: Any) -> Any:
        if not writing.is_set():
            writing.set()
            assert go.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(songfolder, "make_song_folder", held_first)
    service, jobs = run_service(inbox=inbox, outbox=outbox, processed=processed)
    names = ["left", "right"]
    drop_songs(service, inbox, names)
    assert writing.wait(60)
    clock = status_clock(service)

    share.kill_server()
    go.set()  # the stems are written into a share that answers EIO
    wait_pause(service, "outbox")
    [left] = [job for job in service.scheduler.registry.jobs() if job.name == "left"]
    assert left.state is JobState.PUBLISHING  # waiting with its stems, not failed
    time.sleep(1.0)
    assert not jobs.final()

    share.start_server()
    jobs.wait_final(2)
    wait_pause(service, None)
    assert clock.stop() < STATUS_LIMIT
    assert_nothing_lost(service, jobs, names, inbox, outbox, processed)


def test_a_share_that_stalls_never_stalls_status_or_the_controls(
    share: Share, run_service, status_clock, tmp_path: Path
) -> None:
    inbox = share.mount_point / "inbox"
    inbox.mkdir()
    outbox, processed = tmp_path / "outbox", tmp_path / "processed"
    service, jobs = run_service(inbox=inbox, outbox=outbox, processed=processed)
    gate = WorkerGate(service)
    names = ["first", "second", "third"]
    drop_songs(service, inbox, names)
    wait_for(
        lambda: gate.held and len(queued_names(service)) == 2,
        60,
        "one song separating and two queued",
    )

    share.freeze()  # every call on the share blocks from now on
    try:
        started = time.monotonic()
        api(service, "GET", "/api/queue")
        third = service.scheduler.find("third").id
        reply = api(service, "POST", f"/api/jobs/{third}/cancel")
        assert reply["job"]["state"] == "cancelled"
        api(service, "POST", "/api/queue/pause")
        api(service, "POST", "/api/queue/start")
        assert time.monotonic() - started < 4 * STATUS_LIMIT  # four requests
        clock = status_clock(service)
        time.sleep(2.0)
    finally:
        share.thaw()
    gate.open()
    wait_for(lambda: len(jobs.final()) == 3, 120, "every job to end")
    assert clock.stop() < STATUS_LIMIT
    states = {job.name: job.state for job in service.scheduler.registry.jobs()}
    assert states == {"first": JobState.DONE, "second": JobState.DONE, "third": JobState.CANCELLED}
    wait_for(lambda: not service.scheduler.registry.pending_moves(), 30, "kept moves")
    assert sorted(p.name for p in processed.iterdir()) == ["first.wav", "second.wav"]


def test_a_service_started_before_its_share_is_mounted_waits_for_it(
    share: Share, run_service, tmp_path: Path
) -> None:
    inbox = share.mount_point / "inbox"
    inbox.mkdir()
    outbox, processed = tmp_path / "outbox", tmp_path / "processed"
    first, _jobs = run_service(inbox=inbox, outbox=outbox, processed=processed)
    gate = WorkerGate(first)
    names = ["early", "late"]
    drop_songs(first, inbox, names)
    wait_for(
        lambda: gate.held and len(queued_names(first)) == 1,
        60,
        "one song separating and one queued",
    )
    first.shutdown()  # the computer is switched off; it comes back before the NAS does
    share.unmount()

    service, jobs = run_service(inbox=inbox, outbox=outbox, processed=processed)
    wait_pause(service, "inbox")
    assert not inbox.exists()  # not made on the local disk under the mount point
    assert {job.name: job.state for job in service.scheduler.registry.jobs()} == {
        "early": JobState.QUEUED,
        "late": JobState.QUEUED,
    }
    assert queued_names(service) == names

    share.mount()
    wait_pause(service, "restore")  # what paused it before the share stays
    service.scheduler.start()
    jobs.wait_final(2)
    assert_nothing_lost(service, jobs, names, inbox, outbox, processed)


def test_a_song_deleted_while_the_inbox_was_away_ends_its_job_once_the_share_answers(
    make_settings: Any, service_factory: Any
) -> None:
    """What the observer reports while the inbox is away is not believed, so a song
    deleted then (a peer cleaned up on the NAS meanwhile) goes unheard; once the share
    answers, the rescan finds its input gone and ends its job as a deletion seen, and the
    queue does not wait on it (for disk, or for good)."""
    settings = make_settings()
    service, _jobs = service_factory(settings)
    service.scheduler.pause("user")
    inbox = settings.paths.inbox
    for name in ("gone.wav", "kept.wav"):
        write_song(inbox.parent / name, 1.0).rename(inbox / name)
    wait_for(lambda: sorted(queued_names(service)) == ["gone", "kept"], 30, "both queued")
    aside = inbox.with_name("inbox-away")
    inbox.rename(aside)  # the mount below the inbox dropped
    wait_for(lambda: service.shares.away("inbox"), 30, "the inbox seen away")
    (aside / "gone.wav").unlink()
    aside.rename(inbox)
    wait_for(lambda: not service.shares.away("inbox"), 30, "the inbox seen back")
    registry = service.scheduler.registry
    wait_for(lambda: queued_names(service) == ["kept"], 30, "the deleted song's job to end")
    [ended] = [j for j in registry.jobs() if j.name == "gone"]
    assert ended.state is JobState.CANCELLED and "removed from the inbox" in (ended.error or "")


def test_a_song_cancelled_while_its_outbox_is_away_leaves_no_staging_behind_once_it_answers(
    make_settings: Any, service_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A song whose stems were half out when the outbox went away, then cancelled while it
    waited for it: its staging folder could not be removed then, and the share brings it
    back; it is removed once the outbox answers, not left in the outbox for good."""
    settings = make_settings()
    outbox, inbox = settings.paths.outbox, settings.paths.inbox
    aside = outbox.with_name("outbox-away")
    staging = settings.paths.staging.name
    real = songfolder.make_song_folder

    def written_then_away(*args: Any, **kwargs: Any) -> Any:
        made = real(*args, **kwargs)  # the song folder is in staging, not yet published
        if not aside.exists():
            outbox.rename(aside)  # the mount below the outbox dropped
        return made

    monkeypatch.setattr(songfolder, "make_song_folder", written_then_away)
    service, jobs = service_factory(settings)
    write_song(inbox.parent / "song.wav", 1.0).rename(inbox / "song.wav")
    wait_pause(service, "outbox")
    [job] = service.scheduler.registry.jobs()
    assert (aside / staging / job.id).is_dir()  # half out, where the share took it
    (inbox / "song.wav").unlink()  # cancelled while it waits for the outbox
    wait_for(lambda: jobs.final(), 30, "the song's job to end")
    aside.rename(outbox)
    wait_for(lambda: not service.shares.away("outbox"), 30, "the outbox seen back")
    wait_for(lambda: not (outbox / staging / job.id).exists(), 10, "its staging removed")
    assert not list((outbox / staging).glob("*")) and outbox_entries(outbox) <= {staging}
