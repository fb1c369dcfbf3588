"""Cancels and stops reach a song that publishes behind the next one's separation.

The queue on its own first; then the real service, real worker with the tiny model,
`queue.work_beside = "on"`. The moments that matter ("a publishes while b separates", "a is cut off before b") are made by gates on the
real steps, never by sleeps: a gate holds a real step until the test opens it, or until the
job's own cancel check fires, exactly as the step itself would stop.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import threading
from typing import Any

import pytest

from stemdeck_watch.store.jobqueue import JobQueue
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages import publish, songfolder
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.util.synth import write_song

from support.behind import HOLD, StepGate, publishing_behind, queued_while_paused
from support.helpers import outbox_entries, run_restore, wait_for


class CancelsAnswered:
    """The queue's answers to cancels, recorded after the real call returns: the test knows
    that a delete or a replacement was acted on before it lets the song go on."""

    def __init__(self, queue: Any) -> None:
        self.answers: list[tuple[str, str | None]] = []
        real = queue.cancel

        def recorded(job_id: str, reason: str) -> str | None:
            where = real(job_id, reason)
            self.answers.append((job_id, where))
            return where

        queue.cancel = recorded

    def asked(self, job_id: str) -> bool:
        return any(j == job_id for j, _ in self.answers)


def api_cancel(service: Any, job_id: str) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", service.api.port, timeout=10)
    try:
        conn.request(
            "POST",
            f"/api/jobs/{job_id}/cancel",
            headers={
                "Host": f"127.0.0.1:{service.api.port}",
                "Authorization": f"Bearer {service.api.token}",
            },
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_the_queue_routes_a_cancel_to_the_song_publishing_behind_until_it_commits() -> None:
    queue = JobQueue()
    for job_id in ("a", "b", "c"):
        queue.put(job_id)
    a = queue.take(timeout=0)
    assert a is not None and queue.set_running(a)
    queue.publish_behind(a)  # a's worker part is over; the slot takes b
    b = queue.take(timeout=0)
    assert b is not None and queue.set_running(b)
    assert queue.running() is b and [c.job_id for c in queue.in_flight()] == ["a", "b"]
    assert queue.cancel("a", "you") == "publishing" and a.cancelled and not b.cancelled
    assert b.commit()  # b's stems are going out: nothing is cancelled, and it says so
    assert queue.cancel("b", "you") is None and not b.cancelled
    queue.finish(a)
    assert queue.cancel("a", "again") is None and queue.in_flight() == [b]


@pytest.mark.parametrize("first", ["a", "b"])
def test_songs_cut_off_together_go_back_in_their_queue_order(first: str) -> None:
    queue = JobQueue()
    for job_id in ("a", "b", "c"):
        queue.put(job_id)
    a, b = queue.take(timeout=0), queue.take(timeout=0, slot=1)
    assert a is not None and b is not None
    for job_id in (first, "b" if first == "a" else "a"):
        queue.put_back(job_id)
    assert queue.order() == ["a", "b", "c"]
    queue.finish(a)
    queue.finish(b)
    taken = queue.take(timeout=0)
    assert taken is not None and taken.job_id == "a"
    queue.put_back("a")  # one taken again and put back goes first once more
    assert queue.order() == ["a", "b", "c"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["api", "delete", "replace"])
def test_a_song_publishing_behind_the_next_one_is_cancelled_when_the_user_asks(
    request, make_settings, service_factory, monkeypatch, tmp_path, how
) -> None:
    """Cancelling through the API, deleting the input or replacing it while the song is
    written out behind the next one's separation stops it: nothing of it is published and
    its input is not moved to processed/ (a replacement is separated once, as `a`)."""
    service, jobs, a, _b, held, separating = publishing_behind(
        request, make_settings, service_factory, monkeypatch
    )
    settings = service.settings
    song = settings.paths.inbox / "a.wav"
    answered = CancelsAnswered(service.queue)
    new_sha = ""
    if how == "api":
        status, reply = api_cancel(service, a)
        assert status == 200, reply
    elif how == "delete":
        song.unlink()
    else:  # an editor's atomic save: new bytes under the same name
        fresh = write_song(tmp_path / "elsewhere" / "a.wav", 3.0, seed=7)
        new_sha = hashlib.sha256(fresh.read_bytes()).hexdigest()
        os.replace(fresh, song)
    wait_for(lambda: answered.asked(a), 30, "the cancel to reach the queue")
    held.open()
    wait_for(lambda: jobs.latest[a].state.is_final, HOLD, "a to end")
    assert jobs.latest[a].state is JobState.CANCELLED, jobs.latest[a]
    assert not (settings.paths.outbox / "a").exists()
    assert not (settings.paths.processed / "a.wav").exists()
    assert song.is_file() is (how != "delete")

    separating.open()
    ends = 3 if how == "replace" else 2  # a replacement is queued again once a has ended
    done = jobs.wait_final(ends, timeout=HOLD)
    assert sorted(j.state.value for j in done if j.id != a) == ["done"] * (ends - 1), done
    expected = {"a", "b"} if how == "replace" else {"b"}
    assert outbox_entries(settings.paths.outbox) == expected
    if how == "replace":
        manifest = read_manifest(settings.paths.outbox / "a")
        assert manifest is not None and manifest["input"]["sha256"] == new_sha


@pytest.mark.slow
def test_a_cancel_after_the_song_is_committed_is_refused_not_reported_done(
    request, make_settings, service_factory, monkeypatch
) -> None:
    """Once a song publishing behind is past its last cancel check (its folder is going out),
    the API answers 409 and says why, instead of "cancelled" for a song that is published."""
    service, jobs, a, _b, held, separating = publishing_behind(
        request,
        make_settings,
        service_factory,
        monkeypatch,
        cancellable=False,
        step=(publish, "publish_folder"),
    )
    status, reply = api_cancel(service, a)
    assert status == 409 and "can no longer be cancelled" in reply["error"], (status, reply)
    held.open()
    separating.open()
    done = jobs.wait_final(2, timeout=HOLD)
    assert [j.state for j in done] == [JobState.DONE, JobState.DONE], done
    assert outbox_entries(service.settings.paths.outbox) == {"a", "b"}


@pytest.mark.slow
def test_a_clean_stop_puts_the_songs_it_cut_off_back_in_their_queue_order(
    request, make_settings, service_factory, monkeypatch
) -> None:
    """Stopping while a publishes behind and b has just been taken sends both back to the
    head of the queue; after the restart the queue is a, b, c as it was, whichever of the two
    threads gets there first (here a does: the order that used to come back as b, a, c)."""
    settings = make_settings(queue={"work_beside": "on"})
    service, _jobs = service_factory(settings)
    a, b, c = queued_while_paused(service, settings.paths.inbox, ["a.wav", "b.wav", "c.wav"])
    held = StepGate(monkeypatch, songfolder, "make_song_folder", a, cancellable=True)
    request.addfinalizer(held.open)
    guard = service.dispatcher.guard
    real_hold, taken = guard.hold, threading.Event()

    def b_goes_back_after_a(job: Any) -> bool:
        """b's disk check, between its take and its start: it lets b go on only once the
        stop has put a back in the queue."""
        if job.id == b:
            taken.set()
            wait_for(lambda: a in service.queue.order(), HOLD, "a back in the queue")
        return real_hold(job)

    monkeypatch.setattr(guard, "hold", b_goes_back_after_a)
    service.scheduler.start()
    assert held.reached.wait(HOLD), "a never reached its publish step"
    assert taken.wait(HOLD), "b was never taken"
    service.shutdown()
    assert outbox_entries(settings.paths.outbox) == set()

    restored, count = run_restore(settings)
    try:
        names = {a: "a", b: "b", c: "c"}
        assert count == 3 and [names[j] for j in restored.queue.order()] == ["a", "b", "c"]
    finally:
        restored.registry.close()


@pytest.mark.slow
def test_a_song_publishing_behind_is_shown_beside_the_one_separating(
    request, make_settings, service_factory, monkeypatch
) -> None:
    """Two songs are in flight: every surface shows both, and the one publishing can be
    cancelled from where it is shown (the page's Cancel sends its id)."""
    from stemdeck_watch.cli.status import render
    from stemdeck_watch.ui.folder import render_status_text
    from stemdeck_watch.ui.desktop.tray import build_view

    service, jobs, a, b, held, separating = publishing_behind(
        request, make_settings, service_factory, monkeypatch
    )
    snap = service.scheduler.snapshot()
    assert snap["running"]["id"] == b
    assert [(j["id"], j["state"]) for j in snap["active"]] == [(a, "publishing"), (b, "separating")]
    text = render_status_text(snap)
    assert "Now: b — separating" in text and "     a — publishing" in text, text
    status = render(snap)
    assert "now:     b — separating" in status and "         a — publishing" in status, status
    assert "(+ a publishing)" in build_view(snap, None).title
    status_code, reply = api_cancel(service, a)
    assert status_code == 200, reply
    held.open()
    wait_for(lambda: jobs.latest[a].state is JobState.CANCELLED, HOLD, "a cancelled")
    separating.open()
    jobs.wait_final(2, timeout=HOLD)
    assert [j["id"] for j in service.scheduler.snapshot()["active"]] == []


@pytest.mark.slow
def test_a_cancel_while_the_song_folder_is_written_is_answered_within_2_s(
    make_settings, service_factory, monkeypatch, tmp_path
) -> None:
    """A song long enough that its stem file and practice tracks (Rubber Band stretching it
    to half speed) take seconds to write, cancelled once its slowed track is being written:
    every writer checks for the cancel within a block, so the API answers within 2 s with
    the song ended cancelled, nothing published and nothing left in staging.

    The tiny model's low sample rate makes Rubber Band quick here; it is made as slow as
    it is at 44.1 kHz on a busy machine (0.1 s per second of audio, one call that cannot
    be interrupted), the real stretch still done."""
    import time

    import pedalboard

    real_stretch = pedalboard.time_stretch
    stretching = threading.Event()

    def busy_stretch(audio: Any, samplerate: float, **kwargs: Any) -> Any:
        stretching.set()
        out = real_stretch(audio, samplerate, **kwargs)
        time.sleep(0.1 * audio.shape[-1] / samplerate)
        return out

    monkeypatch.setattr(pedalboard, "time_stretch", busy_stretch)

    settings = make_settings(
        output={
            "stem_file": True,
            "practice": True,
            "practice_speeds": [50],
            "preview": False,
        }
    )
    service, jobs = service_factory(settings)
    made = write_song(tmp_path / "made" / "long.wav", 30.0)
    made.replace(settings.paths.inbox / "long.wav")
    staging = settings.paths.staging
    wait_for(stretching.is_set, 60, "the slowed practice track to be written")
    (job,) = [j for j in jobs.latest.values() if not j.state.is_final]
    started = time.monotonic()
    status, reply = api_cancel(service, job.id)
    answered = time.monotonic() - started
    assert status == 200, reply
    assert answered < 2.0, f"the cancel took {answered:.1f} s to answer"
    # ended on record by then, or once the stretch under way returns (one chunk: about 1.4 s
    # of Rubber Band here, several times that on a machine as busy as a test run's)
    wait_for(lambda: jobs.latest[job.id].state.is_final, 10, "the cancelled song to end")
    assert jobs.latest[job.id].state is JobState.CANCELLED, jobs.latest[job.id]
    assert outbox_entries(settings.paths.outbox) == set()
    assert not (settings.paths.processed / "long.wav").exists()
    wait_for(
        lambda: not staging.is_dir() or not any(staging.iterdir()),
        10,
        "the staging folder to be cleared",
    )
