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
    assert queue.set_running(control) is False        # the consumer must close it out
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
