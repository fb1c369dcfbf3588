"""How the CLI (and the page launcher) find the running service: `<state>/api.json` + token.

The port is picked at start (`api.port = 0`), so it has to be written down somewhere the CLI
can read it: `api.json` names the port, the pid, the host and the URL (with the certificate to
trust under HTTPS, and where other devices reach the page, for `status`); the bearer token sits in
`api.token`, readable by the user only (0600) and fresh at every start, so a token that leaked
(a screenshot, a shell history) is dead after the next restart. Both are written atomically
(temp file + os.replace): a CLI reading at the wrong moment sees the old file or the new one,
never half of one. At shutdown they are removed only if they are still ours — a second service
that took over the state dir must not lose its discovery file to the first one's cleanup.

Kept free of heavy imports: the CLI imports this.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from pathlib import Path
from typing import Any

API_FILE = "api.json"
TOKEN_FILE = "api.token"


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What a client needs to talk to the service."""

    host: str
    port: int
    pid: int
    token: str
    scheme: str = "http"
    cert: str = ""  # under HTTPS: the certificate the CLI trusts (exactly that one)
    page: dict[str, Any] = dataclasses.field(default_factory=dict)  # `ApiServer.reach()`

    @property
    def url(self) -> str:
        return base_url(self.host, self.port, self.scheme)


def base_url(host: str, port: int, scheme: str = "http") -> str:
    """`http://127.0.0.1:8765/`; an IPv6 literal gets its brackets."""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def publish(
    state_dir: Path,
    host: str,
    port: int,
    pid: int,
    token: str,
    *,
    scheme: str = "http",
    cert: str = "",
    page: dict[str, Any] | None = None,
) -> Discovery:
    """Write the token (0600) first, then `api.json`, both atomically: whoever sees the new
    `api.json` also finds the matching token."""
    state_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(state_dir / TOKEN_FILE, token + "\n", 0o600)
    found = Discovery(host, port, pid, token, scheme, cert, page or {})
    info = {"host": host, "port": port, "pid": pid, "url": found.url, "cert": cert}
    info["page"] = found.page
    _write_atomic(state_dir / API_FILE, json.dumps(info, indent=2) + "\n", 0o644)
    return found


def withdraw(state_dir: Path, mine: Discovery) -> None:
    """Remove `api.json` and `api.token` if they still describe `mine`."""
    current = read(state_dir)
    if current is None or current.pid != mine.pid or current.port != mine.port:
        return
    if current.token == mine.token:
        _unlink(state_dir / TOKEN_FILE)
    _unlink(state_dir / API_FILE)


def read(state_dir: Path) -> Discovery | None:
    """The discovery file and token, or None if there is none (or it is unreadable)."""
    try:
        info = json.loads((state_dir / API_FILE).read_text(encoding="utf-8"))
        token = (state_dir / TOKEN_FILE).read_text(encoding="utf-8").strip()
        host, port, pid = str(info["host"]), int(info["port"]), int(info["pid"])
        scheme = "https" if str(info.get("url", "")).startswith("https:") else "http"
        cert, page = str(info.get("cert") or ""), info.get("page") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Discovery(host, port, pid, token, scheme, cert, page if isinstance(page, dict) else {})


def _write_atomic(path: Path, text: str, mode: int) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # created with its final mode: the token is never readable by others, not even briefly
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)  # the umask may have taken bits away from the public file
        os.replace(temp, path)
    except BaseException:
        _unlink(temp)
        raise


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
