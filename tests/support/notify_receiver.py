"""A loopback HTTP receiver for apprise's `json://127.0.0.1:PORT/`: it records every posted
notification (`{"title", "message", "type", "version"}`) with the time it arrived. Used by the
notification tests and benchmarks/bench_notify.py. Also `closed_port()`: a port nothing listens
on (a dead target)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, port: int = 0) -> None:
        self._cond = threading.Condition()
        self.messages: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                body["received_at"] = time.monotonic()
                with receiver._cond:
                    receiver.messages.append(body)
                    receiver._cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"json://127.0.0.1:{self.port}/"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="test-receiver", daemon=True
        )

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()

    def wait(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """At least `count` messages (all of them), or AssertionError after `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.messages) >= count, timeout):
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {count} "
                    f"notification(s); got {self.messages!r}"
                )
            return list(self.messages)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._cond:
            return list(self.messages)


def closed_port() -> int:
    """A loopback port with nothing listening (bound once, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
