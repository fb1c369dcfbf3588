"""When the queue will be done: the estimate of a real service with the tiny model against when
its songs really finished, and the same estimate where people read it (`status`, `status
--json`, the tray's tooltip) and after a restart.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from stemdeck_watch.ui.desktop.tray import build_view
from stemdeck_watch.engine.eta import RATES_META, Estimator
from stemdeck_watch.core.events import EventBus
from stemdeck_watch.core.jobs import Job, JobKind, JobState
from stemdeck_watch.store.registry import Registry
from stemdeck_watch.cli.status import collect, render, to_json
from stemdeck_watch.util.synth import write_song

from support.helpers import SeparationGate, wait_for

import pytest

LENGTHS = [3.0, 8.0, 4.0, 11.0, 3.0, 9.0, 5.0, 12.0, 4.0, 7.0]  # seconds, in queue order


def queue_songs(service: Any, lengths: list[float]) -> list[str]:
    """Songs dropped while the queue is paused, queued in this order; their job ids."""
    inbox = service.settings.paths.inbox
    staging = inbox.parent / "staging"
    staging.mkdir(exist_ok=True)
    ids = []
    for i, seconds in enumerate(lengths):
        path = write_song(staging / f"song {i:02d}.wav", seconds, seed=i)
        os.replace(path, inbox / path.name)
        ids.append(
            wait_for(
                lambda: getattr(
                    service.registry.latest_for_source(str(inbox / path.name)), "id", None
                ),
                20,
                f"song {i} to be queued",
            )
        )
    return ids


def done_ids(service: Any) -> dict[str, float]:
    return {job.id: job.finished_at for job in service.registry.jobs([JobState.DONE])}


def manifest_of(job: Any) -> dict[str, Any]:
    return json.loads((Path(job.output) / "stemdeck.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_queue_is_done_when_the_estimate_said_within_a_quarter(
    make_settings: Any, service_factory: Any
) -> None:
    """Ten songs of different lengths; the estimate read after the first three finished.

    The machine's speed is not the estimate's to know, and on a shared machine it changes
    while the queue runs: so the estimate is checked against the service's own measurements
    (each song's separation seconds in its manifest), not against a guess of this machine's
    speed. It must reproduce what it measured on the songs it learnt from, give each queued
    song the time its length asks for, and — with the change in the machine's pace over the
    remaining songs taken out, as the service itself measured it — finish within a quarter of
    the time that was really left."""
    service, _ = service_factory(make_settings())
    service.scheduler.pause()
    ids = queue_songs(service, LENGTHS)
    eta = service.scheduler.snapshot()["eta"]
    assert eta["songs"] == 10 and eta["measured"] is False and eta["finish"] is None
    assert [round(eta["jobs"][i]["length"]) for i in ids] == [round(s) for s in LENGTHS]

    service.scheduler.start()

    def learnt_from_three() -> dict[str, Any] | None:
        # a song is done in the registry a moment before the estimator hears of it (the
        # event is delivered after the write): wait for what it has learnt, not for the rows
        snap: dict[str, Any] = service.scheduler.snapshot()
        return snap if ((snap["eta"] or {}).get("rate") or {}).get("songs", 0) >= 3 else None

    snap = wait_for(learnt_from_three, 300, "the first three songs to be learnt from", 0.2)
    asked_at, eta = time.time(), snap["eta"]
    left = [job["id"] for job in ([snap["running"]] if snap["running"] else []) + snap["queued"]]
    assert eta["measured"] and eta["finish"] > asked_at and eta["songs"] == len(left)
    rate = eta["rate"]
    assert rate["model"] == "tiny" and len(done_ids(service)) >= rate["songs"]
    expect = lambda length: rate["per_song"] + rate["seconds_per_second"] * length  # noqa: E731
    finishes = [eta["jobs"][i]["finish"] for i in left]
    assert finishes == sorted(finishes)  # one worker: one song after the other
    queued = [job["id"] for job in snap["queued"]]
    for before, after in zip(queued, queued[1:]):
        assert eta["jobs"][after]["start"] == eta["jobs"][before]["finish"]
    for job_id in queued:  # each song's time from its own length
        entry = eta["jobs"][job_id]
        assert (
            abs(entry["finish"] - entry["start"] - rate["overhead"] - expect(entry["length"])) < 0.2
        ), entry

    finished = wait_for(
        lambda: len(done_ids(service)) == 10 and done_ids(service), 500, "every song"
    )
    jobs = sorted(service.registry.jobs([JobState.DONE]), key=lambda job: job.finished_at)
    measured = [
        (manifest_of(job)["input"]["duration"], manifest_of(job)["timings"]["separate"])
        for job in jobs
    ]
    learnt, rest = measured[: rate["songs"]], measured[rate["songs"] :]
    # calibrated on what it measured: the fit gives back the separation seconds of the
    # songs it learnt from
    assert abs(
        sum(expect(length) for length, _ in learnt) - sum(s for _, s in learnt)
    ) < 0.05 + 1e-3 * sum(s for _, s in learnt), (rate, learnt)
    # the machine's change of pace over the songs left, as the service measured them
    pace = sum(s for _, s in rest) / sum(expect(length) for length, _ in rest)
    actual = max(finished.values()) - asked_at
    predicted = eta["finish"] - asked_at
    assert abs(predicted * pace - actual) <= 0.25 * actual, (
        f"estimated {predicted:.1f} s to go ({predicted * pace:.1f} s at the pace the songs "
        f"left were separated, {pace:.2f}× the pace measured), took {actual:.1f} s"
    )


def test_status_and_the_tray_say_when_the_queue_will_be_done_and_a_restart_remembers(
    make_settings: Any, service_factory: Any
) -> None:
    settings = make_settings()
    service, _ = service_factory(settings)
    queue_songs(service, [3.0])
    wait_for(lambda: len(done_ids(service)) == 1, 180, "the first song")
    done = next(iter(done_ids(service)))
    service.scheduler.pause()
    ids = queue_songs(service, [4.0, 6.0, 5.0])
    snap = service.scheduler.snapshot()
    eta = snap["eta"]  # paused: how long, not when
    assert eta["songs"] == 3 and eta["measured"] and eta["paused"] and eta["finish"] is None
    # the total and each song's figure are rounded to tenths on their own
    assert eta["seconds"] > 0
    assert abs(eta["seconds"] - sum(eta["jobs"][i]["seconds"] for i in ids)) <= 0.05 * len(ids)
    assert eta["took"][done] > 0  # how long the finished song took
    assert "3 songs, about" in build_view(snap, None).title

    gate = SeparationGate(service.client, ids[0])  # the first song holds: the rest wait
    service.scheduler.start()
    wait_for(
        lambda: service.registry.get(ids[0]).state is JobState.SEPARATING,
        60,
        "the first song to separate",
    )
    snap = service.scheduler.snapshot()
    eta = snap["eta"]
    assert eta["songs"] == 3 and eta["finish"] > time.time() and not eta["paused"]
    clock = time.strftime("%H:%M", time.localtime(eta["finish"]))
    assert f"3 songs, done around {clock}" in build_view(snap, None).title

    status = wait_for(
        lambda: (s := collect(settings))["eta"] and s["eta"]["finish"] and s,
        10,
        "status to read the estimate",
    )
    assert abs(status["eta"]["finish"] - eta["finish"]) < 5
    assert [i for i in ids if status["eta"]["jobs"][i]["finish"]] == ids
    clock = time.strftime("%H:%M", time.localtime(status["eta"]["finish"]))
    assert f"eta:     3 songs, done around {clock}" in render(status)
    assert json.loads(to_json(status))["eta"] == status["eta"]  # status --json

    service.shutdown()  # stopped: the work left is known, not when it will be done
    gate.open()
    status = collect(settings)
    assert status["eta"]["songs"] == 3 and status["eta"]["finish"] is None
    assert "eta:     3 songs, about" in render(status)

    again, _ = service_factory(settings)  # what was measured survived the restart
    assert json.loads(again.registry.get_meta(RATES_META))["rates"]
    eta = again.scheduler.snapshot()["eta"]  # restored paused, already measured
    assert eta["measured"] and eta["songs"] == 3 and eta["seconds"] > 0


def test_a_fifo_in_place_of_a_queued_song_never_holds_the_estimate(
    settings: Any, tmp_path: Path
) -> None:
    """The inbox is shared: a FIFO planted under a queued song's name must not stop the
    snapshot (the page, the tray, `GET /api/queue`) while it waits for a writer."""
    registry = Registry.open(tmp_path / "registry.sqlite3")
    estimator = Estimator(registry, settings, EventBus())
    fifo = settings.paths.inbox / "song.wav"
    os.mkfifo(fifo)
    job = Job(
        id="a" * 12,
        name="song",
        kind=JobKind.FILE,
        state=JobState.QUEUED,
        source=str(fifo),
        rel_path="song.wav",
    )
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(estimator.estimate([], [job], [], None)))
    thread.start()
    try:
        thread.join(10)
        assert not thread.is_alive(), "the estimate waited on the FIFO"
    finally:
        while thread.is_alive():  # let it go: a writer that opens and closes, each time
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader this instant
                pass
            thread.join(0.1)
        registry.close()
    assert result["jobs"][job.id]["length"] is None and result["songs"] == 1


def test_a_preset_with_its_own_precision_is_estimated_at_that_precision(
    tmp_path: Path, model_repo: Path
) -> None:
    """The worker chose bfloat16 for `auto`; a preset that asks for float32 runs in float32,
    so its song is estimated at float32's measured rate, not at the worker's choice."""
    from stemdeck_watch.core.config import settings_from_dict
    from stemdeck_watch.engine.eta import Rate

    from support.helpers import config_data

    data = config_data(tmp_path, model_repo, separation={"precision": "auto"})
    data["presets"] = {"exact": {"precision": "float32"}}
    settings = settings_from_dict(data)
    registry = Registry.open(tmp_path / "registry.sqlite3")
    try:
        estimator = Estimator(registry, settings, EventBus(), probe=lambda path: 10.0)
        estimator.rates = {
            "tiny/float32": Rate(1).add(10.0, 20.0, 0.0),  # 2 s per second of audio
            "tiny/bfloat16": Rate(1).add(10.0, 5.0, 0.0),  # 0.5 s per second
        }
        worker = {"model": "tiny", "precision": {"setting": "auto", "precision": "bfloat16"}}
        jobs = [
            Job(
                id=f"{i}" * 12,
                name=f"song {i}",
                kind=JobKind.FILE,
                state=JobState.QUEUED,
                source=str(settings.paths.inbox / f"song {i}.wav"),
                rel_path=f"song {i}.wav",
                preset=preset,
            )
            for i, preset in enumerate([None, "exact"])
        ]
        eta = estimator.estimate([], jobs, [], worker)
        took = [eta["jobs"][job.id]["finish"] - eta["jobs"][job.id]["start"] for job in jobs]
        assert took == pytest.approx([5.0, 20.0], abs=0.2), eta
        assert eta["rate"]["precision"] == "bfloat16", eta["rate"]  # the config's own: auto
    finally:
        registry.close()


class _Lane:
    """An Estimator fed as the service feeds it (job and queue events on its bus), on a clock
    the test moves: each song separates in `SEPARATE` s of its `LENGTH` s and takes `SIDE` s
    of other work."""

    LENGTH, SEPARATE, SIDE = 10.0, 8.0, 1.0

    def __init__(self, settings: Any, tmp_path: Path) -> None:
        from stemdeck_watch.core.events import QueueChanged

        self._queue_changed = QueueChanged
        self.now = 1000.0
        self.folder = tmp_path
        self.registry = Registry.open(tmp_path / "registry.sqlite3")
        self.bus = EventBus()
        self.estimator = Estimator(
            self.registry, settings, self.bus, clock=lambda: self.now, probe=lambda p: 10.0
        )
        self.count = 0
        self.model = settings.separation.model

    def job(self, state: JobState, **fields: Any) -> Job:
        return Job(
            id=f"{self.count:012d}",
            name=f"song {self.count}",
            kind=JobKind.FILE,
            state=state,
            source=str(self.folder / f"song {self.count}.wav"),
            rel_path=f"song {self.count}.wav",
            **fields,
        )

    def change(self, state: JobState, **fields: Any) -> None:
        from stemdeck_watch.core.events import JobChanged

        self.bus.publish(JobChanged(self.job(state, **fields)))

    def pause(self, paused: bool, reason: str | None = "user") -> None:
        self.bus.publish(self._queue_changed(paused, reason if paused else None, (), 0))

    def begin(self) -> None:
        self.count += 1
        self.change(JobState.QUEUED)
        self.change(JobState.DECODING)

    def finish(self) -> None:
        output = self.folder / f"out {self.count}"
        output.mkdir()
        (output / "vocals.wav").write_bytes(b"")
        manifest = {
            "job_id": f"{self.count:012d}",
            "stems": [{"file": "vocals.wav"}],
            "input": {"duration": self.LENGTH},
            "timings": {"separate": self.SEPARATE},
            "model": {"name": self.model},
            "precision": {"precision": "float32"},
        }
        (output / "stemdeck.json").write_text(json.dumps(manifest))
        self.change(JobState.DONE, output=str(output), finished_at=self.now)

    def song(self) -> None:
        """One song as measured without a wait: separation and the lane's own time."""
        self.begin()
        self.now += self.SEPARATE + self.SIDE
        self.finish()

    @property
    def overhead(self) -> float:
        return self.estimator.rates[f"{self.model}/float32"].overhead

    def close(self) -> None:
        self.registry.close()


@pytest.fixture
def lane(settings: Any, tmp_path: Path) -> Any:
    made = _Lane(settings, tmp_path)
    yield made
    made.close()


def test_an_outage_a_pause_or_a_stalled_attempt_never_raises_the_time_per_song(lane: Any) -> None:
    """What the lane learns is work: a publish that waited 40 s for the outbox's share (the
    queue paused "outbox" meanwhile), a link put back in the queue while the queue waited
    for disk space, and an attempt the machine cut off (the song back in the queue, then
    started again) each teach the time the song itself took, not the wait."""
    for _ in range(3):
        lane.song()
    assert lane.overhead == pytest.approx(lane.SIDE)

    lane.begin()  # its stems wait in scratch while the outbox's share is away
    lane.now += lane.SEPARATE
    lane.pause(True, "outbox")
    lane.now += 40.0
    lane.pause(False)
    lane.now += lane.SIDE
    lane.finish()
    assert lane.overhead == pytest.approx(lane.SIDE)

    lane.begin()  # downloaded, it does not fit: back to the queue, paused for disk
    lane.now += 5.0
    lane.change(JobState.QUEUED)
    lane.pause(True, "disk")
    lane.now += 600.0
    lane.pause(False)
    lane.change(JobState.DECODING)
    lane.now += lane.SEPARATE + lane.SIDE
    lane.finish()
    assert lane.overhead == pytest.approx(lane.SIDE)

    lane.begin()  # the worker stalls; after the stall limit the song goes back to the queue
    lane.now += 60.0
    lane.change(JobState.QUEUED, attempts=1)
    lane.change(JobState.DECODING, attempts=1)  # the next attempt, timed afresh
    lane.now += lane.SEPARATE + lane.SIDE
    lane.finish()
    assert lane.overhead == pytest.approx(lane.SIDE)
    assert lane.estimator.rates[f"{lane.model}/float32"].songs == 6

    lane.begin()  # a person's pause lets the running song finish: that is work
    lane.pause(True, "user")
    lane.now += lane.SEPARATE + lane.SIDE + 7.0
    lane.finish()
    lane.pause(False)
    assert lane.overhead > lane.SIDE


def test_an_idle_queue_is_never_said_to_take_longer_than_the_work_it_holds(lane: Any) -> None:
    """With nothing running, the queue is done when its songs are: also where the last song
    finished "later" than now (the clock was set back meanwhile)."""
    from stemdeck_watch.engine.eta import over_work, work_held

    lane.song()
    lane.now -= 120.0  # the clock set back after the song finished
    queued = [lane.job(JobState.QUEUED) for lane.count in range(10, 13)]
    eta = lane.estimator.estimate([], queued, [], None)
    assert work_held(eta) == pytest.approx(3 * (lane.SEPARATE + lane.SIDE), abs=0.2)
    assert over_work(eta) <= 0, eta
    paused = lane.estimator.estimate([], queued, [], None, paused=True)
    assert over_work(paused) <= 0 and paused["seconds"] == pytest.approx(work_held(paused))


def test_the_pauses_that_hold_a_running_song_are_the_services_own() -> None:
    from stemdeck_watch.engine.eta import HOLDING
    from stemdeck_watch.engine.scheduler import PAUSE_INBOX, PAUSE_OUTBOX
    from stemdeck_watch.workers.ray.cluster import PAUSE_CLUSTER

    assert HOLDING == {PAUSE_INBOX, PAUSE_OUTBOX, PAUSE_CLUSTER}
