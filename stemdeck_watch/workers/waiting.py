"""Waiting on a worker: the one loop every client waits in, whatever runs the worker.

The local client waits on its worker process's replies, the Ray client on its actor's
stream and calls; both must give way at once to a cancel, notice a worker that died, stop
one that went silent past the stall limit and one that did not start in time, and never
wait without a deadline on anything that can hang. That is written here once: each client
says how to look for its next message (`poll`, which waits at most the time it is given)
and what each of those events means for its kind of worker (the exceptions carry its words:
which process, which machine); the order of the checks and their rules are the same for
both.
"""

from __future__ import annotations

import time
from typing import Callable, NoReturn, TypeVar

from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers.pace import Watch

T = TypeVar("T")
POLL = 0.1  # seconds a look for the next message waits before the checks are made again


def next_message(
    poll: Callable[[float], T | None],
    control: JobControl | None = None,
    *,
    on_cancel: Callable[[], None] | None = None,
    alive: Callable[[], bool] | None = None,
    on_death: Callable[[], NoReturn] | None = None,
    watch: Watch | None = None,
    on_stall: Callable[[], NoReturn] | None = None,
    deadline: float | None = None,
    on_late: Callable[[], NoReturn] | None = None,
    interval: float = POLL,
) -> T:
    """The worker's next message, once `poll(interval)` returns one (not None).

    Before each look: a cancel of `control` goes to `on_cancel` (which ends the worker and
    raises Cancelled, or returns while the worker is given a grace to stop by itself; without
    it the cancel is raised at once). After a look that found nothing: a worker no longer
    `alive` goes to `on_death`, one `watch` says stalled (and not cancelled: a cancel's own
    rule wins) to `on_stall`, and past `deadline` (time.monotonic()) to `on_late`; each of
    those raises."""
    while True:
        if control is not None and control.cancelled:
            if on_cancel is None:
                control.check()
            else:
                on_cancel()
        found = poll(interval)
        if found is not None:
            return found
        if alive is not None and on_death is not None and not alive():
            on_death()
        cancelled = control is not None and control.cancelled
        if watch is not None and on_stall is not None and watch.stalled() and not cancelled:
            on_stall()
        if deadline is not None and on_late is not None and time.monotonic() > deadline:
            on_late()
