"""A song held publishing behind the worker while the next one separates (queue.work_beside):
the moment where two songs are in flight at once, for the tests of cancels and of what every
surface shows then."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages import songfolder
from stemdeck_watch.util.synth import write_song

from support.helpers import SeparationGate, wait_for

HOLD = 60.0  # seconds a gate holds at most: a test that never opens it fails, not hangs


class StepGate:
    """Holds one job's call of a pipeline function (found by the staging folder it works in,
    named by the job id) until `open()`. With `cancellable`, the job's cancel check runs while
    it waits, as the real step's would: a cancel ends the wait with Cancelled."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        module: Any,
        name: str,
        job_id: str,
        cancellable: bool,
    ) -> None:
        self.reached = threading.Event()
        self._opened = threading.Event()
        real = getattr(module, name)

        def gated(staging: Path, *args: Any, **kwargs: Any) -> Any:
            if Path(staging).name == job_id:
                self.reached.set()
                check: Callable[[], None] = kwargs.get("check") or (lambda: None)
                for _ in range(int(HOLD / 0.05)):
                    if self._opened.wait(0.05):
                        break
                    if cancellable:
                        check()
            return real(staging, *args, **kwargs)

        monkeypatch.setattr(module, name, gated)

    def open(self) -> None:
        self._opened.set()


def queued_while_paused(service: Any, inbox: Path, names: list[str]) -> list[str]:
    """Drop 2-second songs while the queue is paused; their job ids in queue order."""
    service.scheduler.pause("user")
    for count, name in enumerate(names, start=1):
        write_song(inbox / name, 2.0, seed=count)
        wait_for(lambda n=count: len(service.queue.order()) == n, 30, f"{name} queued")
    return service.queue.order()


def publishing_behind(
    request: Any,
    make_settings: Any,
    service_factory: Any,
    monkeypatch: Any,
    cancellable: bool = True,
    step: tuple[Any, str] = (songfolder, "make_song_folder"),
) -> tuple[Any, Any, str, str, StepGate, SeparationGate]:
    """A service where song a is held in its publish step, behind the worker, while song b
    is held separating (so b holds the worker's slot). Both gates open before the service
    stops, also when the test failed first."""
    settings = make_settings(queue={"work_beside": "on"})
    service, jobs = service_factory(settings)
    a, b = queued_while_paused(service, settings.paths.inbox, ["a.wav", "b.wav"])
    held = StepGate(monkeypatch, *step, a, cancellable)
    separating = SeparationGate(service.client, b)
    request.addfinalizer(held.open)
    request.addfinalizer(separating.open)
    service.scheduler.start()
    assert held.reached.wait(HOLD), "a never reached its publish step"
    wait_for(lambda: jobs.latest[b].state is JobState.SEPARATING, HOLD, "b separating")
    assert jobs.latest[a].state is JobState.PUBLISHING
    return service, jobs, a, b, held, separating
