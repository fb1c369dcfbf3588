"""A background thread that does one small thing every few seconds, for as long as it runs.

Each long-lived loop catches, logs with the traceback and goes on: one failed tick never
ends it. A supervisor that finds it dead (`alive`) starts it again.
"""

from __future__ import annotations

import abc
import logging
import threading

log = logging.getLogger(__name__)


class Ticker(abc.ABC):
    """Calls `tick` every `interval` seconds on a daemon thread named `name`, until `stop`."""

    name = "ticker"

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @abc.abstractmethod
    def tick(self) -> None:
        """One round of the work; an exception is logged and the next round runs."""

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:
                log.exception("%s: a tick failed; going on", self.name)
