"""The queue: order, pause, one consumer, and cancels wherever the job is."""

from __future__ import annotations

import threading

import pytest

from stemdeck_watch.core.errors import Cancelled
from stemdeck_watch.store.jobqueue import JobControl, JobQueue


def test_jobs_come_out_in_arrival_order_and_front_goes_first() -> None:
    queue = JobQueue()
    for job_id in ("a", "b", "c"):
        queue.put(job_id)
    queue.put("a")  # already queued: no duplicate
    queue.put("z", front=True)
    taken = []
    for _ in range(4):
        control = queue.take(timeout=0)
        assert control is not None and queue.set_running(control)
        taken.append(control.job_id)
        queue.finish(control)
    assert taken == ["z", "a", "b", "c"]
    assert queue.take(timeout=0) is None


def test_pause_stops_new_jobs_and_start_releases_them() -> None:
    queue = JobQueue()
    queue.put("a")
    queue.pause("user")
    assert queue.take(timeout=0.05) is None
    assert queue.paused and queue.pause_reason == "user"
    got: list[str] = []
    consumer = threading.Thread(target=lambda: got.append(queue.take(timeout=5).job_id))
    consumer.start()
    queue.start()
    consumer.join(5)
    assert got == ["a"]


def test_close_wakes_the_consumer() -> None:
    queue = JobQueue()
    result: list[object] = []
    consumer = threading.Thread(target=lambda: result.append(queue.take()))
    consumer.start()
    queue.close()
    consumer.join(5)
    assert result == [None]


def test_cancel_of_a_queued_job_removes_it() -> None:
    queue = JobQueue()
    queue.put("a")
    queue.put("b")
    assert queue.cancel("a", "removed") == "queued"
    assert queue.order() == ["b"]
    assert queue.cancel("nope", "removed") is None


def test_cancel_in_the_gap_is_finalised_by_the_consumer() -> None:
    queue = JobQueue()
    queue.put("a")
    control = queue.take(timeout=0)
    assert control is not None
    assert queue.cancel("a", "removed") == "claimed"  # neither queued nor running
    assert queue.set_running(control) is False  # the consumer must close it out
    assert control.reason == "removed"


def test_cancel_of_the_running_job_stops_its_step_at_once() -> None:
    queue = JobQueue()
    queue.put("a")
    control = queue.take(timeout=0)
    assert control is not None and queue.set_running(control)
    stopped = threading.Event()
    with control.registered(stopped.set):
        assert queue.cancel("a", "removed") == "running"
        assert stopped.is_set()
    with pytest.raises(Cancelled, match="removed"):
        control.check()


def test_a_committed_job_ignores_cancels() -> None:
    control = JobControl("a")
    assert control.commit()
    assert control.cancel("late") is False
    control.check()
    late = JobControl("b")
    late.cancel("first")
    assert late.commit() is False


def test_registering_after_a_cancel_stops_the_step_immediately() -> None:
    control = JobControl("a")
    control.cancel("shutdown")
    stopped = []
    with control.registered(lambda: stopped.append(True)):
        pass
    assert stopped == [True]


def test_the_job_that_was_cancelled_cannot_hand_on_a_worker_that_is_still_being_stopped() -> None:
    control = JobControl("a")
    killing, release, order = threading.Event(), threading.Event(), []

    def slow_kill() -> None:  # stopping a worker takes a moment
        killing.set()
        release.wait(10)
        order.append("worker stopped")

    def pipeline_step() -> None:
        with control.registered(slow_kill):
            killing.wait(10)
        order.append("step left")  # from here the dispatcher would take the next job

    step = threading.Thread(target=pipeline_step)
    step.start()
    canceller = threading.Thread(target=control.cancel, args=("removed",))
    canceller.start()
    step.join(0.5)  # without the fix the step leaves at once, before the worker is stopped
    release.set()
    step.join(10)
    canceller.join(10)
    assert order == ["worker stopped", "step left"]


def test_a_job_a_worker_failed_goes_to_another_worker_waiting_for_one() -> None:
    """After a machine fault on slot 0 the job is back at the head: slot 1, waiting for a
    job, takes it; slot 0 takes it only while no other slot waits."""
    queue = JobQueue()
    queue.put("a")
    failed = queue.take(timeout=0, slot=0)
    assert failed is not None and failed.job_id == "a" and queue.set_running(failed, 0)
    got: list[str] = []
    other = threading.Thread(target=lambda: got.append(queue.take(timeout=5, slot=1).job_id))
    other.start()
    while 1 not in queue._idle:  # slot 1 waits for a job
        threading.Event().wait(0.01)
    queue.put_back("a", avoid=0)
    assert queue.take(timeout=0.2, slot=0) is None  # left to slot 1
    queue.finish(failed)
    other.join(5)
    assert got == ["a"]
    queue.put("b")
    taken = queue.take(timeout=0, slot=1)
    assert taken is not None and queue.set_running(taken, 1)
    queue.put_back("b", avoid=1)  # it failed on slot 1 too, and no other slot waits
    again = queue.take(timeout=0, slot=1)
    assert again is not None and again.job_id == "b"
