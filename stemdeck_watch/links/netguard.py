"""Every connection a link makes: to public addresses only, bounded in time and size, and
stopped at once on a cancel.

A link file is untrusted input, and what it fetches is published into a folder that syncs back
to whoever dropped it: a link to `http://192.168.1.1/` or to a cloud metadata address would
copy the local network into the outbox. yt-dlp's extraction and download run inside its own
code, so the guard sits in the connection layer it uses: a yt-dlp request handler
(links/linkhandler.py) whose connections resolve the host once, check every address it
resolved to (after each redirect too: every hop opens its own connection) and connect to the
checked address itself, so a second DNS answer cannot swap in another one.

The same handler bounds what a link costs: each response is read through a counter that stops
a web page at `links.max_page_bytes` (a download at `links.max_filesize`); a watchdog ends the
fetch once it has waited for the site longer than `links.page_timeout` while reading pages or
`links.timeout` in all; and a cancel or a deadline shuts every socket of the fetch down, which
wakes a read blocked on a server that sends a byte now and then.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from stemdeck_watch.links.linkhandler import Bounded, GuardedRH


class Stop(enum.Enum):
    CANCELLED = "cancelled"
    PAGE_TIMEOUT = "page_timeout"
    TIMEOUT = "timeout"
    PAGE_SIZE = "page_size"
    FILE_SIZE = "file_size"
    REFUSED = "refused"  # a private address; `detail` says which
    EXTERNAL = "external"  # a stream only an external program (ffmpeg) would download
    SCHEME = "scheme"  # a redirect to something else than http(s); `detail` is the scheme


class Stopped(Exception):
    """The guard ended the fetch; raised through yt-dlp's code, and remembered by the guard
    because yt-dlp may wrap it on the way out."""

    def __init__(self, why: Stop, detail: str = ""):
        super().__init__(f"{why.value}: {detail}" if detail else why.value)
        self.why = why
        self.detail = detail


class Resolver:
    """Host names to addresses, and which addresses count as public. The seam tests replace
    (a test must never resolve a real name nor connect beyond loopback)."""

    def addresses(self, host: str, port: int) -> list[str]:
        found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in found))

    def is_public(self, address: str) -> bool:
        return is_public_address(address)


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_public_address(address: str) -> bool:
    """Whether an address is on the public internet: not loopback, private, link-local,
    shared (CGNAT), multicast, reserved or unspecified, also when an IPv4 address is embedded
    in an IPv6 one (mapped, 6to4, NAT64)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = (
            ip.ipv4_mapped
            or ip.sixtofour
            or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None)
        )
        if embedded is not None:
            return is_public_address(str(embedded))
    return ip.is_global and not (
        ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_private
    )


def kind_of(address: str) -> str:
    """What a refused address is, in words."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "not an address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    for test, words in (
        ("is_loopback", "this machine (loopback)"),
        ("is_link_local", "a link-local address"),
        ("is_multicast", "a multicast address"),
        ("is_unspecified", "an unspecified address"),
        ("is_private", "a private address"),
    ):
        if getattr(ip, test):
            return words
    if ip in ipaddress.ip_network("100.64.0.0/10"):
        return "a shared (carrier-grade NAT) address"
    return "not a public address"


def connect_socket(sock: socket.socket, address: tuple[Any, ...]) -> None:
    """Connect to an address the guard checked (the one place a link's connection is made)."""
    sock.connect(address)


class Guard:
    """The limits of one link's fetch; a context manager around it (its watchdog thread)."""

    def __init__(
        self,
        *,
        allow_private: bool,
        page_bytes: int,
        file_bytes: int | None,
        page_timeout: float,
        timeout: float | None,
        resolver: Resolver | None = None,
    ):
        self.allow_private = allow_private
        self.resolver = resolver or Resolver()
        self._page_bytes, self._file_bytes = page_bytes, file_bytes
        self._page_timeout, self._timeout = page_timeout, timeout
        self._cond = threading.Condition()
        # each open socket of the fetch, with a duplicate of it: shutting the duplicate down
        # ends the connection, and wakes a read blocked on it, whoever holds the socket
        self._socks: list[tuple[socket.socket, socket.socket]] = []
        # responses still open: closed when the fetch ends, so that none is left to the
        # garbage collector (yt-dlp leaves some unread, e.g. the probe of a direct file)
        self._responses: list[Bounded] = []
        self._stopped: Stopped | None = None
        self._closed = False
        self._downloading = False
        # the deadlines count the time spent waiting for the site (connecting, sending,
        # reading), not yt-dlp's own work between requests: matching a page against its
        # thousands of extractors takes seconds, and minutes on a busy machine
        self._waited = self._page_waited = 0.0
        self._busy, self._busy_since = 0, 0.0
        self._watchdog = threading.Thread(target=self._watch, name="link-deadline", daemon=True)

    def __enter__(self) -> Guard:
        self._watchdog.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        with self._cond:
            self._closed = True
            socks, self._socks = self._socks, []
            responses, self._responses = self._responses, []
            self._cond.notify_all()
        for response in responses:
            response.close()
        for _sock, dup in socks:
            dup.close()
        self._watchdog.join()

    def opened(self, response: Bounded) -> None:
        with self._cond:
            self._responses = [r for r in self._responses if not r.closed]
            self._responses.append(response)

    @property
    def stopped(self) -> Stopped | None:
        return self._stopped

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around every call that waits for the site: its time counts against the deadlines."""
        with self._cond:
            if self._busy == 0:
                self._busy_since = time.monotonic()
                self._cond.notify_all()
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                if self._busy == 0:
                    spent = time.monotonic() - self._busy_since
                    self._waited += spent
                    if not self._downloading:
                        self._page_waited += spent

    def downloading(self) -> None:
        """The pages are read and the download begins: only `links.timeout` and
        `links.max_filesize` apply from now on."""
        with self._cond:
            self._downloading = True
            self._cond.notify_all()

    def _left(self) -> tuple[float, Stop]:
        """Seconds of waiting left (under the lock), and what running out of them means."""
        now = time.monotonic() - self._busy_since if self._busy else 0.0
        left = [(float("inf"), Stop.TIMEOUT)]
        if self._timeout:
            left.append((self._timeout - self._waited - now, Stop.TIMEOUT))
        if not self._downloading:
            left.append((self._page_timeout - self._page_waited - now, Stop.PAGE_TIMEOUT))
        return min(left, key=lambda item: item[0])

    @property
    def cap(self) -> tuple[int | None, Stop]:
        """The most bytes one response may hold now, and what exceeding it means."""
        if self._downloading:
            return self._file_bytes, Stop.FILE_SIZE
        return self._page_bytes, Stop.PAGE_SIZE

    def stop(self, why: Stop, detail: str = "") -> Stopped:
        """End the fetch: every socket is shut down, every later read or connection raises.
        The first reason stays."""
        with self._cond:
            if self._stopped is None:
                self._stopped = Stopped(why, detail)
            socks = list(self._socks)
            self._cond.notify_all()
        for _sock, dup in socks:
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return self._stopped

    def cancel(self) -> None:
        self.stop(Stop.CANCELLED)

    def check(self) -> None:
        if self._stopped is not None:
            raise self._stopped

    def _watch(self) -> None:
        with self._cond:
            while not self._closed and self._stopped is None:
                left, late = self._left()
                if left <= 0:
                    break
                # while nothing waits for the site, no time runs out: sleep until it does
                self._cond.wait(min(left, 3600.0) if self._busy else None)
            else:
                return
        self.stop(late)

    def track(self, sock: socket.socket) -> None:
        """Keep `sock` stoppable (a raw socket while it connects, then the connection's own,
        TLS-wrapped, socket); forget the sockets closed meanwhile, so that a stream of many
        requests does not hold a descriptor for each."""
        with self._cond:
            if self._stopped is None and not self._closed:
                kept = []
                for owner, dup in self._socks:
                    if owner.fileno() == -1:  # closed, or handed over to a TLS socket
                        dup.close()
                    else:
                        kept.append((owner, dup))
                if all(owner is not sock for owner, _dup in kept):
                    kept.append((sock, sock.dup()))
                self._socks = kept
                return
        raise self._stopped or Stopped(Stop.CANCELLED)

    # ------------------------------------------------------------ connections

    def check_host(self, host: str, port: int) -> list[str]:
        """The addresses of `host`, every one of them checked; Stopped (REFUSED) if any is not
        public and private addresses are not allowed."""
        self.check()
        addresses = self.resolver.addresses(host, port)
        if not addresses:
            raise OSError(f"{host} has no address")
        if not self.allow_private:
            for address in addresses:
                if not self.resolver.is_public(address):
                    shown = address if host.strip("[]") == address else f"{host} ({address})"
                    raise self.stop(Stop.REFUSED, f"{shown} is {kind_of(address)}")
        self.check()
        return addresses

    def connect(
        self,
        address: tuple[str, int],
        timeout: float | None = None,
        source_address: tuple[str, int] | None = None,
        *,
        checked: bool = True,
    ) -> socket.socket:
        """http.client's `_create_connection`: resolve once, check, connect to the checked
        address. `checked=False` for a connection to the user's own proxy (the target was
        checked by name before)."""
        host, port = address
        addresses = self.check_host(host, port) if checked else self.resolver.addresses(host, port)
        error: OSError | None = None
        for ip in addresses:
            sock = socket.socket(
                socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM
            )
            try:
                self.track(sock)  # before connecting: a stop interrupts the connect too
                if isinstance(timeout, (int, float)):  # else http.client's "default"
                    sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                connect_socket(sock, (ip, port))
                self.check()
                return sock
            except OSError as exc:
                sock.close()
                self.check()
                error = exc
            except BaseException:
                sock.close()
                raise
        assert error is not None
        raise error

    def handler(self, **kwargs: Any) -> GuardedRH:
        """yt-dlp's request handler for this fetch (YoutubeDL.build_request_director)."""
        from stemdeck_watch.links.linkhandler import GuardedRH

        return GuardedRH(guard=self, **kwargs)
