"""One-time codes that hand the API token to the queue page without a command line.

Opening the page means starting a browser with an address, and a process's arguments are
visible to every local user (`ps`). So the address carries a code, not the token: random,
valid for one exchange only (`POST /api/token`) and for a short time, useless after; the page
trades it for the token and keeps that in its tab. The CLI's `open` asks the running service
for a code (with the token it reads from the 0600 token file); the tray asks in-process.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Callable

CODE_TTL = 60.0  # seconds a code stays valid: long enough for a cold browser start
MAX_CODES = 16  # codes not used yet that are kept; a new one beyond this drops the oldest


class OneTimeCodes:
    """Codes issued and not redeemed yet, each with its expiry."""

    def __init__(self, ttl: float = CODE_TTL, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._codes: dict[str, float] = {}  # code -> when it expires, oldest first

    def issue(self) -> str:
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._forget_expired()
            while len(self._codes) >= MAX_CODES:
                del self._codes[next(iter(self._codes))]
            self._codes[code] = self._clock() + self.ttl
        return code

    def redeem(self, code: str) -> bool:
        """True the first time a valid code is presented, within its time; False ever after."""
        with self._lock:
            expires = self._codes.pop(code, None)
            return expires is not None and self._clock() < expires

    def _forget_expired(self) -> None:
        now = self._clock()
        for code in [c for c, expires in self._codes.items() if expires <= now]:
            del self._codes[code]
