"""Signing in from another device: sessions, the limit on wrong passwords, the sign-in page and
its routes.

A device that signs in gets a session: a random 256-bit token in a cookie the page's code
cannot read (HttpOnly), that the browser sends only with requests from the page itself
(SameSite=Strict) and, under HTTPS, only over HTTPS (Secure, and the `__Host-` name that keeps
it to this exact origin). The service keeps the sessions in memory, each until it expires; a
restart signs every device out. Wrong passwords are counted per address: after
`MAX_FAILURES` within `FAILURE_WINDOW` that address is answered 429 until the oldest of them
is older than the window, whatever it sends.
"""

from __future__ import annotations

import collections
import html
import logging
import secrets
import threading
import time
from typing import Any, Callable
from urllib.parse import parse_qsl

from stemdeck_watch.ui.web.httpbase import HttpError, JsonHandler

log = logging.getLogger(__name__)

SESSION_TTL = 7 * 24 * 3600.0  # a phone on the couch signs in once a week
MAX_SESSIONS = 256  # sessions kept; a new one beyond this ends the oldest
MAX_FAILURES, FAILURE_WINDOW = 5, 15 * 60.0  # wrong passwords per address, per window
MAX_ADDRESSES = 4096  # addresses whose failures are remembered; the oldest are forgotten
MAX_FORM = 4096  # bytes of the sign-in form
COOKIE = "stemdeck-session"
SECURE_COOKIE = "__Host-stemdeck-session"  # browsers keep it to HTTPS and this exact origin


class Sessions:
    """Signed-in devices: token → when the session ends."""

    def __init__(self, ttl: float = SESSION_TTL, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._ends: dict[str, float] = {}  # oldest first

    def begin(self) -> str:
        token = secrets.token_urlsafe(32)  # 256 bits
        with self._lock:
            self._forget_expired()
            while len(self._ends) >= MAX_SESSIONS:
                del self._ends[next(iter(self._ends))]
            self._ends[token] = self._clock() + self.ttl
        return token

    def valid(self, token: str) -> bool:
        with self._lock:
            ends = self._ends.get(token)
            if ends is not None and self._clock() >= ends:
                del self._ends[token]
                return False
            return ends is not None

    def end(self, token: str) -> None:
        with self._lock:
            self._ends.pop(token, None)

    def _forget_expired(self) -> None:
        now = self._clock()
        for token in [t for t, ends in self._ends.items() if ends <= now]:
            del self._ends[token]


class FailureLimit:
    """Wrong passwords per address within a sliding window."""

    def __init__(
        self,
        limit: int = MAX_FAILURES,
        window: float = FAILURE_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit, self.window = limit, window
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def retry_after(self, address: str) -> int:
        """Seconds until `address` may try again; 0 if it may now."""
        with self._lock:
            times = self._recent(address)
            if len(times) < self.limit:
                return 0
            return max(1, int(times[-self.limit] + self.window - self._clock() + 0.999))

    def failed(self, address: str) -> None:
        with self._lock:
            times = self._recent(address)
            times.append(self._clock())
            self._failures[address] = times
            self._failures.move_to_end(address)
            while len(self._failures) > MAX_ADDRESSES:
                self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)

    def _recent(self, address: str) -> list[float]:
        since = self._clock() - self.window
        return [t for t in self._failures.get(address, []) if t > since][-self.limit :]


def cookie_name(secure: bool) -> str:
    return SECURE_COOKIE if secure else COOKIE


def session_cookie(token: str, secure: bool, max_age: float = SESSION_TTL) -> str:
    """The Set-Cookie value of a new session (an empty token and age 0 end it)."""
    flags = "; Secure" if secure else ""
    return (
        f"{cookie_name(secure)}={token}; Path=/; Max-Age={int(max_age)}; HttpOnly; "
        f"SameSite=Strict{flags}"
    )


def session_of(cookie_header: str | None, secure: bool) -> str | None:
    """The session token the request's Cookie header carries, if any."""
    wanted = cookie_name(secure)
    for part in (cookie_header or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == wanted and value:
            return value
    return None


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>Sign in · stemdeck-watch</title>
<link rel="stylesheet" href="/style.css">
</head>
<body class="signin">
<main>
<h1>stemdeck-watch</h1>
<form method="post" action="/signin">
<label for="password">Password</label>
<input id="password" name="password" type="password" autocomplete="current-password"
 required autofocus>
<button type="submit">Sign in</button>
</form>
<p id="signin-message" class="signin-message" role="alert">{message}</p>
<p class="signin-note">The password is the one set with <code>stemdeck-watch password</code>
on the computer that runs the service. A device stays signed in for a week, or until the
service restarts.</p>
</main>
</body>
</html>
"""


def page(message: str = "") -> bytes:
    return PAGE.replace("{message}", html.escape(message)).encode("utf-8")


class SignInRoutes(JsonHandler):
    """The API handler's side of signing in: `/signin`, `/signout`, and what another device
    that has not signed in is answered. `api` is the `ApiServer`."""

    def _signed_in(self, api: Any) -> bool:
        token = session_of(self.headers.get("Cookie"), api.https)
        return token is not None and api.sessions.valid(token)

    def _refuse_unsigned(self, api: Any, method: str, path: str) -> None:
        """Another device that has not signed in: the page sends it to the sign-in page,
        the API says to sign in; the token does not count from another machine."""
        if not path.startswith("/api") and method in ("GET", "HEAD"):
            self._drain()
            self._send(303, b"", "text/plain; charset=utf-8", {"Location": "/signin"})
            return
        why = (
            "the API token works only on the computer that runs the service; "
            if self.headers.get("Authorization")
            else ""
        )
        raise HttpError(401, f"{why}sign in first: open /signin on this address")

    def _signin(self, api: Any, method: str, path: str) -> None:
        address = self.client_address[0]
        if path == "/signout":
            if method != "POST":
                raise HttpError(405, "sign out with POST /signout", {"Allow": "POST"})
            token = session_of(self.headers.get("Cookie"), api.https)
            if token:
                api.sessions.end(token)
            self._drain()
            cookie = session_cookie("", api.https, max_age=0)
            self._send(303, b"", "text/plain", {"Location": "/signin", "Set-Cookie": cookie})
            return
        if method in ("GET", "HEAD"):
            return self._send(200, page(), "text/html; charset=utf-8")
        if method != "POST":
            raise HttpError(405, f"{method} is not allowed on /signin", {"Allow": "GET, POST"})
        wait = api.failures.retry_after(address)
        if wait:
            log.warning("refused a sign-in from %s: too many wrong passwords", address)
            self._send(
                429,
                page(f"Too many wrong passwords: try again in {wait // 60 + 1} minutes."),
                "text/html; charset=utf-8",
                {"Retry-After": str(wait)},
            )
            return
        if not api.password_hash:
            raise HttpError(403, "no password is set: `stemdeck-watch password` sets one")
        password = self._form_password()
        verdict = api.password_ok(password)
        if verdict is None:
            self._send(
                503,
                page("The service is busy checking other sign-ins: try again."),
                "text/html; charset=utf-8",
                {"Retry-After": "5"},
            )
            return
        if not verdict:
            api.failures.failed(address)
            log.warning("a wrong password for the queue page from %s", address)
            self._send(401, page("Wrong password."), "text/html; charset=utf-8")
            return
        api.failures.succeeded(address)
        cookie = session_cookie(api.sessions.begin(), api.https)
        log.info("a device signed in to the queue page from %s", address)
        self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": cookie})

    def _form_password(self) -> str:
        kind = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise HttpError(415, "send the password as a form (application/x-www-form-urlencoded)")
        length = self._unread
        if not 0 <= length <= MAX_FORM:
            raise HttpError(413, f"the sign-in form may have at most {MAX_FORM} bytes")
        try:
            raw = self.rfile.read(length) if length else b""
        except OSError:
            raise HttpError(400, "the sign-in form did not arrive") from None
        self._unread = 0
        fields = parse_qsl(raw.decode("utf-8", errors="replace"), keep_blank_values=True)
        return next((value for name, value in fields if name == "password"), "")

    def _authorize(self, api: Any) -> None:
        challenge = {"WWW-Authenticate": 'Bearer realm="stemdeck-watch"'}
        header = self.headers.get("Authorization")
        if not header:
            raise HttpError(
                401,
                "missing token: send 'Authorization: Bearer <token>' with the "
                "token from api.token in the service's state folder",
                challenge,
            )
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not api.token_ok(token.strip()):
            raise HttpError(
                401,
                "wrong token: the service makes a new one at every start; read "
                "api.token in its state folder again",
                challenge,
            )
