"""Decode ahead, publish behind: the worker is kept busy, one job at a time, in order.

Real service, real worker with the tiny model. Slowness is injected by wrapping the real
decode and the real stem writer (they still do their work), so that "the worker did not wait"
shows up in the order of events, never in a timing assertion.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from stemdeck_watch.engine import diskguard
from stemdeck_watch.core.errors import PublishError
from stemdeck_watch.core.events import JobChanged
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages import publish
from stemdeck_watch.engine import pipeline as runner
from stemdeck_watch.util.synth import write_song

from support.helpers import SeparationGate, on_worker_side, outbox_entries, wait_for

pytestmark = pytest.mark.slow
SLOW = 1.5  # seconds each injected slow step takes on top of its real work


class Timeline:
    """Every job change in the order the service announced it."""

    def __init__(self, bus) -> None:  # type: ignore[no-untyped-def]
        self._lock = threading.Lock()
        self.events: list[tuple[str, JobState]] = []
        bus.subscribe(JobChanged, self._on)

    def _on(self, event: JobChanged) -> None:
        with self._lock:
            if not self.events or self.events[-1] != (event.job.id, event.job.state):
                self.events.append((event.job.id, event.job.state))

    def index(self, job_id: str, state: JobState) -> int:
        with self._lock:
            return self.events.index((job_id, state))

    def finished(self) -> list[str]:
        with self._lock:
            return [j for j, s in self.events if s.is_final]

    def crowded(self) -> list[list[str]]:
        """Moments when more than one job was announced on the worker side (taken, not yet
        publishing): what status and the page showed as two songs separating at once."""
        states: dict[str, JobState] = {}
        crowds = []
        with self._lock:
            for job_id, state in self.events:
                states[job_id] = state
                side = on_worker_side(states)
                if len(side) > 1:
                    crowds.append(side)
        return crowds


def thread_priority() -> tuple[int, int]:
    """The calling thread's scheduling policy and nice value (Linux: per thread)."""
    if sys.platform != "linux":
        return (0, 0)
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def queue_paused(service, inbox: Path, songs: dict[str, float]) -> list[str]:  # type: ignore[no-untyped-def]
    """Drop `songs` (name → seconds) while the queue is paused; returns their job ids in order."""
    service.scheduler.pause("user")
    for i, (name, seconds) in enumerate(songs.items()):
        write_song(inbox / name, seconds, seed=i)
        wait_for(lambda: len(service.queue.order()) == i + 1, 30, f"{name} queued")
    return service.queue.order()


def test_next_file_is_decoded_ahead_and_the_last_published_behind(
    make_settings, service_factory, monkeypatch
):
    decoded_on: dict[str, list[str]] = {}
    real_decode, real_write = runner.decode_to_file, publish.write_song

    priorities: set[tuple[int, int]] = set()

    def slow_decode(source, target, *args, **kwargs):  # type: ignore[no-untyped-def]
        decoded_on.setdefault(Path(target).parent.name, []).append(threading.current_thread().name)
        priorities.add(thread_priority())
        time.sleep(SLOW)
        return real_decode(source, target, *args, **kwargs)

    def slow_write(staging, stems, samplerate, name, *args, **kwargs):  # type: ignore[no-untyped-def]
        priorities.add(thread_priority())
        time.sleep(SLOW)
        if name == "b":  # the middle song's disk fails after the worker moved on
            raise PublishError(f"could not write the stems of {name} to {staging}: injected")
        return real_write(staging, stems, samplerate, name, *args, **kwargs)

    probed_on: dict[str, list[str]] = {}
    real_probe = diskguard.probe_duration

    def recorded_probe(source: Path) -> float | None:  # the disk check's duration probe
        probed_on.setdefault(Path(source).name, []).append(threading.current_thread().name)
        return real_probe(source)

    monkeypatch.setattr(runner, "decode_to_file", slow_decode)
    monkeypatch.setattr(publish, "write_song", slow_write)
    monkeypatch.setattr(diskguard, "probe_duration", recorded_probe)
    settings = make_settings(separation={"shifts": 2}, queue={"work_beside": "on"})
    service, jobs = service_factory(settings)
    timeline = Timeline(service.bus)
    a, b, c = queue_paused(
        service, settings.paths.inbox, {"a.wav": 6.0, "b.wav": 6.0, "c.wav": 6.0}
    )
    service.scheduler.start()
    finished = {j.id: j for j in jobs.wait_final(3, timeout=300)}

    # b and c were decoded once each, ahead, by the prefetcher while the job before separated
    assert decoded_on[b] == [f"prefetch-{b}"] and decoded_on[c] == [f"prefetch-{c}"], decoded_on
    # ahead and behind, at the service's own priority: a lowered thread holding the GIL
    # would stall every other thread of the service while the worker fills the cores
    assert priorities == {thread_priority()}, priorities
    # ...and so was the disk check's duration probe (by the prefetcher, asking whether the
    # next song fits beside the ones in flight): between two jobs the worker waits for
    # neither (only the first job, with nothing separating before it, was probed on the spot)
    assert probed_on == {"a.wav": ["dispatcher"], "b.wav": ["prefetch"], "c.wav": ["prefetch"]}, (
        probed_on
    )
    # the worker took the next job while the previous one was still being written
    assert timeline.index(b, JobState.SEPARATING) < timeline.index(a, JobState.DONE)
    assert timeline.index(c, JobState.SEPARATING) < timeline.index(b, JobState.FAILED)
    # ...and still one job at a time on it, finishing in queue order; a song is marked
    # publishing before the next one is taken, so no moment shows two songs separating
    assert timeline.finished() == [a, b, c]
    assert timeline.index(a, JobState.PUBLISHING) < timeline.index(b, JobState.DECODING)
    assert timeline.crowded() == []
    spans = sorted(service.client.busy)
    assert len(spans) == 3 and all(s[1] <= t[0] for s, t in zip(spans, spans[1:]))

    # the publish that failed after the worker moved on failed its job as it always did
    assert finished[a].state is JobState.DONE and finished[c].state is JobState.DONE
    assert finished[b].state is JobState.FAILED and "injected" in (finished[b].error or "")
    assert (settings.paths.failed / "b.wav").is_file()
    assert (settings.paths.failed / "b.wav.error.txt").is_file()
    assert outbox_entries(settings.paths.outbox) == {"a", "c"}
    wait_for(lambda: not any(settings.paths.scratch.rglob("*")), 10, "scratch to be empty")


def test_a_decoded_ahead_job_cancelled_or_paused_is_as_if_never_decoded(
    make_settings, service_factory
):
    settings = make_settings(separation={"shifts": 2}, queue={"work_beside": "on"})
    service, jobs = service_factory(settings)
    inbox, scratch = settings.paths.inbox, settings.paths.scratch
    a, b, c = queue_paused(service, inbox, {"a.wav": 6.0, "b.wav": 3.0, "c.wav": 3.0})
    gate = SeparationGate(service.client, a)  # a separates until the checks below are done
    service.scheduler.start()

    # b is decoded ahead while a separates; deleting b cancels it and removes its scratch
    wait_for(lambda: (scratch / b / "input.npy").is_file(), 60, "b decoded ahead")
    assert jobs.latest[a].state is JobState.SEPARATING
    (inbox / "b.wav").unlink()
    wait_for(lambda: jobs.latest[b].state is JobState.CANCELLED, 30, "b cancelled")
    wait_for(lambda: not (scratch / b).exists(), 10, "b's scratch removed")

    # c is the head now and is decoded ahead; a pause drops that work too
    wait_for(lambda: (scratch / c / "input.npy").is_file(), 60, "c decoded ahead")
    assert jobs.latest[a].state is JobState.SEPARATING
    service.scheduler.pause("user")
    wait_for(lambda: not (scratch / c).exists(), 10, "c's scratch removed on pause")
    assert jobs.latest[a].state is JobState.SEPARATING
    gate.open()
    wait_for(lambda: jobs.latest[a].state.is_final, 300, "a to end")
    assert jobs.latest[a].state is JobState.DONE, jobs.latest[a]
    assert jobs.latest[c].state is JobState.QUEUED and not (scratch / c).exists()

    service.scheduler.start()  # c runs as if it had never been decoded ahead
    wait_for(lambda: jobs.latest[c].state is JobState.DONE, 300, "c done")
    assert outbox_entries(settings.paths.outbox) == {"a", "c"}
    wait_for(lambda: not any(scratch.rglob("*")), 10, "scratch to be empty")


def test_work_beside_the_worker_where_it_pays(make_settings) -> None:
    """`queue.work_beside = "auto"`: publish behind and decode ahead where the worker leaves
    a core free or runs on a GPU, and on a CPU it fills unless the song gets a beat grid —
    there the beat tracker beside the worker slows separation as much as it saves. "on" and
    "off" decide alone."""
    from stemdeck_watch.core.events import EventBus
    from stemdeck_watch.core.jobs import Job, JobKind
    from stemdeck_watch.workers.demucs.precision import physical_cores
    from stemdeck_watch.engine.pipeline import Pipeline
    from stemdeck_watch.workers.local import WorkerClient

    cores = physical_cores()
    song = Job(
        id="j",
        name="song",
        kind=JobKind.FILE,
        state=JobState.QUEUED,
        source="/song.wav",
        rel_path="song.wav",
    )
    cases = [
        ("cpu", cores, "auto", True, False),
        ("cpu", cores, "auto", False, True),
        ("cpu", max(1, cores - 1), "auto", True, cores > 1),
        ("cuda", cores, "auto", True, True),
        ("cpu", cores, "on", True, True),
        ("cuda", 1, "off", False, False),
    ]
    for device, threads, mode, beat_grid, expected in cases:
        settings = make_settings(queue={"work_beside": mode}, output={"beat_grid": beat_grid})
        client = WorkerClient(device=device, threads=threads)
        pipeline = Pipeline(settings, client, EventBus(), lambda job_id, **fields: None)
        assert pipeline.works_beside(song) is expected, (device, threads, mode, beat_grid)


def test_work_ahead_survives_the_gap_between_taking_its_job_and_running_it(tmp_path) -> None:
    """The dispatcher takes the prepared job while the previous one still publishes behind
    (and so still holds the worker's running place): in that gap the job is neither the head
    of the queue nor the running one, and its work must be kept for the claim, not dropped
    and done a second time."""
    import dataclasses
    import types

    from stemdeck_watch.core.events import EventBus
    from stemdeck_watch.store.jobqueue import JobQueue
    from stemdeck_watch.core.jobs import Job, JobKind
    from stemdeck_watch.engine.prepared import Prepared
    from stemdeck_watch.engine.prefetch import Prefetcher

    jobs = {
        i: Job(
            id=i,
            name=i,
            kind=JobKind.FILE,
            state=JobState.QUEUED,
            source=f"/{i}.wav",
            rel_path=f"{i}.wav",
        )
        for i in ("a", "b", "c")
    }
    release, started, made = threading.Event(), threading.Event(), Prepared(sha256="b's")

    def prepare(job, control, on_progress):  # type: ignore[no-untyped-def]
        started.set()
        release.wait(10)
        control.check()  # as the real steps do between them: dropped work stops here
        return made

    queue = JobQueue()
    scheduler = types.SimpleNamespace(
        queue=queue, registry=types.SimpleNamespace(get=jobs.get), bus=EventBus()
    )
    pipeline = types.SimpleNamespace(
        can_prepare=lambda job: True,
        prepare=prepare,
        settings=types.SimpleNamespace(paths=types.SimpleNamespace(scratch=tmp_path)),
    )
    prefetcher = Prefetcher(scheduler, pipeline)  # type: ignore[arg-type]
    for job_id in ("a", "b", "c"):
        queue.put(job_id)
    taken_a = queue.take()
    assert taken_a is not None and queue.set_running(taken_a)
    jobs["a"] = dataclasses.replace(jobs["a"], state=JobState.SEPARATING)

    prefetcher._consider()  # a separates: b, the head, is prepared ahead
    assert started.wait(10)
    taken_b = queue.take()  # a is publishing behind; the dispatcher has taken b
    assert taken_b is not None and taken_b.job_id == "b" and queue.order() == ["c"]
    prefetcher._consider()
    release.set()
    assert prefetcher.claim(jobs["b"], taken_b, lambda value: None) is made
