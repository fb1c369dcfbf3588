"""The CLI's side of the local API: find the service, send one request, read the answer.

Standard library only (urllib) and nothing heavy: `stemdeck-watch pause` must answer in a
fraction of a second, so this module never imports torch, numpy or PyAV. Proxies from the
environment are ignored: a request for 127.0.0.1 must never leave the machine.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from stemdeck_watch.ui.web import discovery
from stemdeck_watch.core.errors import StemdeckError
from stemdeck_watch.core.lock import running_pid

TIMEOUT = 15.0


class ServiceNotRunning(StemdeckError):
    """No service answers for this state folder; the message says how to start one."""


class ApiError(StemdeckError):
    """The service refused the request; the message is the service's own."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def not_running(state_dir: Path) -> ServiceNotRunning:
    return ServiceNotRunning(
        f"the service is not running (state folder {state_dir}); start it with `stemdeck-watch run`"
    )


class Client:
    """One running service, found through its discovery file."""

    def __init__(self, found: discovery.Discovery, state_dir: Path):
        self.found = found
        self.state_dir = state_dir
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if found.scheme == "https":
            from stemdeck_watch.ui.web.tls import client_context

            handlers.append(urllib.request.HTTPSHandler(context=client_context(Path(found.cert))))
        self._opener = urllib.request.build_opener(*handlers)

    @classmethod
    def connect(cls, state_dir: Path) -> Client:
        """The service using `state_dir`; ServiceNotRunning if there is none."""
        pid = running_pid(state_dir)
        found = discovery.read(state_dir)
        if pid is None:
            raise not_running(state_dir)
        if found is None or found.pid != pid:
            raise ServiceNotRunning(
                f"the service (pid {pid}) is running but its local API is not (state folder "
                f"{state_dir}): api.enabled is false, or the API could not start — its log says "
                f"why"
            )
        return cls(found, state_dir)

    def page_link(self) -> tuple[str, float]:
        """A one-time address of the queue page and for how many seconds it works: what a
        browser is started with, so its command line (visible to every local user) never
        holds the token."""
        reply = self.post("/api/page-code")
        return str(reply["url"]), float(reply["expires_in"])

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.request("POST", path, body or {})

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.found.url.rstrip("/") + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.found.token}",
                "Accept": "application/json",
                **({"Content-Type": "application/json"} if data is not None else {}),
            },
        )
        try:
            with self._opener.open(request, timeout=TIMEOUT) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            with exc:
                raw = exc.read()
            try:
                message = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                message = f"the service answered {exc.code} {exc.reason}"
            raise ApiError(str(message), exc.code) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionRefusedError):
                raise not_running(self.state_dir) from None
            raise ApiError(
                f"could not reach the service at {self.found.url}: {exc.reason}", 0
            ) from None
        except (TimeoutError, ConnectionError) as exc:
            raise ApiError(f"the service at {self.found.url} did not answer: {exc}", 0) from None


def job_path(ref: str, action: str | None = None) -> str:
    """`/api/jobs/<ref>[/action]`, the ref quoted whole (a song name may hold a slash)."""
    return f"/api/jobs/{quote(ref, safe='')}" + (f"/{action}" if action else "")
