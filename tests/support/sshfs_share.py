"""A real network share on this machine: a private sshd on a free loopback port, reached with
sshfs, that a test can take away and bring back the ways a NAS does.

- `unmount()` / `mount()`: the share is unmounted (lazily, as a desktop does when the network
  drops) and mounted again; meanwhile the mount point is an empty local folder.
- `kill_server()` / `start_server()`: sshd and its connections end; the mount stays and answers
  EIO until sshfs (`-o reconnect`) reaches the server again.
- `freeze()` / `thaw()`: the link stops carrying bytes (a proxy between sshfs and sshd holds
  them), so every call on the share blocks, as on a share that is only slow.

Nothing outside the test's folder is touched: the server's host key, the client key and its
`authorized_keys` are throwaway files there; the server listens on 127.0.0.1 only. Where FUSE or
sshfs is missing, `require()` skips the test with the reason, except under `CI=true`, where it
fails: CI installs both (.ci/run).
"""

from __future__ import annotations

import getpass
import os
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSHFS_OPTIONS = (
    "reconnect,ServerAliveInterval=2,ServerAliveCountMax=2,cache=no,"
    "StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,LogLevel=ERROR"
)


def missing() -> str | None:
    """Why a share cannot be mounted here, or None."""
    for tool in ("sshfs", "ssh-keygen", "fusermount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install sshfs openssh-server)"
    if not os.path.exists(SSHD):
        return "sshd is not installed (apt-get install openssh-server)"
    if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is missing or not usable by this user"
    return None


def require() -> None:
    """Skip the calling test where no share can be mounted (fail under CI=true)."""
    why = missing()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"a real sshfs share is needed under CI: {why}")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children first found first."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


class _Proxy:
    """Carries bytes between sshfs and sshd; `frozen` holds them (a link that stalls)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.frozen = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="share-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, None)
        pairs: dict[socket.socket, socket.socket] = {}
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(0.1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self.listener:
                        client, _addr = self.listener.accept()
                        try:
                            server = socket.create_connection(("127.0.0.1", self.target_port))
                        except OSError:
                            client.close()
                            continue
                        pairs[client], pairs[server] = server, client
                        selector.register(client, selectors.EVENT_READ, None)
                        selector.register(server, selectors.EVENT_READ, None)
                        continue
                    if self.frozen.is_set():
                        continue
                    other = pairs.get(sock)
                    try:
                        data = sock.recv(65536)
                        if data and other is not None:
                            other.sendall(data)
                    except OSError:
                        data = b""
                    if not data:
                        for end in (sock, other):
                            if end is not None and end in pairs:
                                selector.unregister(end)
                                pairs.pop(end, None)
                                end.close()
                if self.frozen.is_set():
                    self._stop.wait(0.05)
        finally:
            for sock in list(pairs):
                sock.close()
            selector.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()


class Share:
    """A folder `export` on a private sshd, mounted at `mount_point` with sshfs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.export = root / "export"
        self.mount_point = root / "mnt"
        self.export.mkdir(parents=True, exist_ok=True)
        self.mount_point.mkdir(parents=True, exist_ok=True)
        self.keys = root / "keys"
        self.keys.mkdir(exist_ok=True)
        self.port = free_port()
        self._sshd: subprocess.Popen[bytes] | None = None
        self._proxy: _Proxy | None = None
        self._setup()

    def _setup(self) -> None:
        for name in ("host_key", "client_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.keys / name)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        shutil.copy(self.keys / "client_key.pub", self.keys / "authorized_keys")
        self.config = self.keys / "sshd_config"
        self.config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.keys / 'host_key'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    f"AuthorizedKeysFile {self.keys / 'authorized_keys'}",
                    "UsePAM no",
                    f"PidFile {self.keys / 'sshd.pid'}",
                    "Subsystem sftp internal-sftp",
                    "StrictModes no",
                    "",
                ]
            )
        )
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder

    # ------------------------------------------------------------ the server

    def start_server(self) -> None:
        self._sshd = subprocess.Popen(
            [SSHD, "-D", "-f", str(self.config), "-E", str(self.root / "sshd.log")],
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                if self._sshd.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sshd did not start: "
                        f"{(self.root / 'sshd.log').read_text(errors='replace')}"
                    ) from None
                time.sleep(0.05)

    def kill_server(self) -> None:
        """sshd and every connection it serves end at once (the NAS is switched off)."""
        if self._sshd is None:
            return
        for pid in [*descendants(self._sshd.pid), self._sshd.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._sshd.wait(10)
        self._sshd = None

    # ------------------------------------------------------------ the mount

    def mount(self) -> None:
        if self._proxy is None:
            self._proxy = _Proxy(self.port)
        user = getpass.getuser()
        subprocess.run(
            [
                "sshfs",
                f"{user}@127.0.0.1:{self.export}",
                str(self.mount_point),
                "-p",
                str(self._proxy.port),
                "-o",
                f"IdentityFile={self.keys / 'client_key'},{SSHFS_OPTIONS}",
            ],
            check=True,
            timeout=30,
        )
        deadline = time.monotonic() + 10
        while not os.path.ismount(self.mount_point):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mount_point} did not become a mount")
            time.sleep(0.05)

    def unmount(self) -> None:
        """Lazily, as a desktop does when the network goes: the mount point is an empty
        local folder at once, whatever still holds files open on the share."""
        subprocess.run(
            ["fusermount", "-u", "-z", str(self.mount_point)],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )

    def wait_answering(self, timeout: float = 30.0) -> None:
        """Until the mount answers again (sshfs reconnects on the next call)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.listdir(self.mount_point)
                if os.path.ismount(self.mount_point):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mount_point} did not answer again")
            time.sleep(0.1)

    def freeze(self) -> None:
        assert self._proxy is not None
        self._proxy.frozen.set()

    def thaw(self) -> None:
        assert self._proxy is not None
        self._proxy.frozen.clear()

    def __enter__(self) -> Share:
        self.start_server()
        self.mount()
        return self

    def __exit__(self, *_: object) -> None:
        if self._proxy is not None:
            self._proxy.frozen.clear()
        self.unmount()
        self.kill_server()
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
