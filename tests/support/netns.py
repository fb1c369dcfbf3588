"""A network of the test's own: a network namespace and a veth pair with addresses in
10.247.X.0/30 that exist only at the pair's two ends, on this machine, so a connection made
from one end reaches the other as another device would, and nothing is routed anywhere else.
Making one needs root and `ip`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess
import threading
from typing import Any, Callable, Iterator

CLONE_NEWNET = 0x40000000
IP_TIMEOUT = 10.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT)


@contextlib.contextmanager
def private_link() -> Iterator[tuple[str, str, str]]:
    """(namespace, this end's address, the namespace end's address), removed on exit."""
    tag = secrets.token_hex(3)
    namespace, here, there = f"sdw-{tag}", f"sdwa{tag}", f"sdwb{tag}"
    subnet = f"10.247.{secrets.randbelow(250) + 1}"
    ip("netns", "add", namespace)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", namespace)
        ip("addr", "add", f"{subnet}.1/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", namespace, "addr", "add", f"{subnet}.2/30", "dev", there)
        ip("-n", namespace, "link", "set", there, "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        yield namespace, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=IP_TIMEOUT)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=IP_TIMEOUT)


def inside(namespace: str, call: Callable[[], Any]) -> Any:
    """`call()` on a thread that entered `namespace`: the sockets it makes, and the threads it
    starts, live there; this thread stays where it is."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns into the test's namespace failed")
            finally:
                os.close(fd)
            result["value"] = call()
        except BaseException as exc:  # handed to the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="in-namespace")
    thread.start()
    thread.join(timeout=120)
    if thread.is_alive():
        raise AssertionError("the call in the test's namespace did not end within 120 s")
    if "error" in result:
        raise result["error"]
    return result["value"]
